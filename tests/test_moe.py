"""The mixture-of-experts layer (maxlm/model/moe/): routing against a plain numpy router, the
dropless and capacity paths against the every-expert reference and a numpy loop (outputs and
gradients), the dropped slots against a numpy queue, the layer's params and specs, param counts."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import linen as nn
from jax.sharding import PartitionSpec

from maxlm import config as config_lib
from maxlm.model import moe
from maxlm.sharding import mesh as mesh_lib

T, D, E, K, F = 16, 8, 8, 2, 16
F32 = jnp.float32
ROUTERS = pytest.mark.parametrize("router", ["softmax", "sigmoid"])


def assert_close(got, want, tol=1e-6):
    """|got - want| <= tol, relative to want's largest entry where that exceeds 1 (float32 sums in
    another order differ in their last bits)."""
    want = np.asarray(want, np.float64)
    err = np.abs(np.asarray(got, np.float64) - want).max()
    assert err <= tol * max(1.0, np.abs(want).max()), (err, np.abs(want).max())


def moe_cfg(**overrides):
    """The default model config, tiny, with the MoE keys (config.py does not declare them yet)."""
    m = ml_collections.ConfigDict(config_lib.defaults().model.to_dict())
    keys = {"d_model": D, "num_heads": 2, "head_dim": 4, "num_layers": 2, "num_experts": E,
            "experts_per_token": K, "expert_mlp_dim": F, "shared_experts": 0, "router": "softmax",
            "router_renormalize": True, "router_scale": 1.0, "router_groups": 0, "router_topk_groups": 0,
            "load_balance": "aux_loss", "load_balance_weight": 0.01, "router_z_loss": 0.001,
            "capacity_factor": 0.0}
    for key, value in {**keys, **overrides}.items():
        setattr(m, key, value)
    return m


def assert_the_layer_on_a_mesh_equals(axes: dict, key: str, value, reference, **overrides):
    """The MoE layer on an 8-device mesh of `axes` (the rest 1) with model `key` = `value` gives its
    outputs and its weights' and tokens' gradients with `key` = `reference`, within 1e-5, on a
    skewed routing (init_std 0.5: some experts get many slots, some none)."""
    cfg = config_lib.defaults()
    cfg.mesh.fsdp = 1
    for axis, size in axes.items():
        cfg.mesh[axis] = size
    mesh, rules = mesh_lib.make_mesh(cfg.mesh), mesh_lib.rules_of(cfg.mesh)
    x_BLD = jax.random.normal(jax.random.key(1), (8, 4, D))
    layer_cfg = moe_cfg(init_std=0.5, **overrides)
    params = nn.unbox(moe.MoE(layer_cfg).init(jax.random.key(0), x_BLD))["params"]

    def loss(setting, params, x_BLD):
        layer_cfg[key] = setting
        out_BLD, _ = moe.MoE(layer_cfg).apply({"params": params}, x_BLD)
        return jnp.sum(jnp.square(out_BLD)), out_BLD

    with mesh_lib.activate(mesh, rules):
        run = lambda setting: jax.jit(jax.value_and_grad(  # noqa: E731
            lambda p, x: loss(setting, p, x), (0, 1), has_aux=True))(params, x_BLD)
        (_, got), grads = run(value)
        (_, want), want_grads = run(reference)
    assert np.abs(want).max() > 0.5
    assert_close(got, want, 1e-5)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        assert_close(g, w, 1e-5)


def random_inputs(seed=0, tokens=T):
    keys = jax.random.split(jax.random.key(seed), 5)
    x_TD = jax.random.normal(keys[0], (tokens, D), F32)
    router_DE = jax.random.normal(keys[1], (D, E), F32)
    w_gate = 0.5 * jax.random.normal(keys[2], (E, D, F), F32)
    w_up = 0.5 * jax.random.normal(keys[3], (E, D, F), F32)
    w_down = 0.5 * jax.random.normal(keys[4], (E, F, D), F32)
    return x_TD, router_DE, (w_gate, w_up, w_down)


# ----------------------------------------------------------------------------- numpy ground truth


def np_route(cfg, logits, bias):
    """Top-k experts and gates, one token at a time, in float64."""
    logits = np.asarray(logits, np.float64)
    n_tokens, n_experts = logits.shape
    if cfg.router == "softmax":
        scores = np.exp(logits - logits.max(-1, keepdims=True))
        scores /= scores.sum(-1, keepdims=True)
    else:
        scores = 1 / (1 + np.exp(-logits))
    experts = np.zeros((n_tokens, cfg.experts_per_token), np.int64)
    gates = np.zeros((n_tokens, cfg.experts_per_token))
    for t in range(n_tokens):
        select = scores[t] + np.asarray(bias, np.float64)
        if cfg.router_groups:
            per = n_experts // cfg.router_groups
            group_scores = [np.sort(select[g * per:(g + 1) * per])[-2:].sum() for g in range(cfg.router_groups)]
            best = np.argsort(-np.array(group_scores), kind="stable")[:cfg.router_topk_groups]
            select = np.array([s if e // per in best else -np.inf for e, s in enumerate(select)])
        experts[t] = np.argsort(-select, kind="stable")[:cfg.experts_per_token]
        g = scores[t, experts[t]]
        if cfg.router == "sigmoid" or cfg.router_renormalize:
            g = g / g.sum()
        gates[t] = g * cfg.router_scale
    return experts, gates, scores


def np_moe(x, experts, gates, weights, kept=None):
    """Σ_k gate·SwiGLU_expert(x) token by token, in float64; slots with kept=False add nothing."""
    x = np.asarray(x, np.float64)
    w_gate, w_up, w_down = (np.asarray(w, np.float64) for w in weights)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(experts.shape[1]):
            if kept is not None and not kept[t, k]:
                continue
            e = experts[t, k]
            g = x[t] @ w_gate[e]
            out[t] += gates[t, k] * ((g / (1 + np.exp(-g))) * (x[t] @ w_up[e])) @ w_down[e]
    return out


def np_kept(experts_BLK, num_experts, capacity):
    """Which slots fit: each sequence has its own queues, every token's first choice in token
    order, then the second..."""
    kept = np.zeros(experts_BLK.shape, bool)
    for b, experts in enumerate(experts_BLK):
        taken = np.zeros(num_experts, np.int64)
        for k in range(experts.shape[1]):
            for t in range(experts.shape[0]):
                kept[b, t, k] = taken[experts[t, k]] < capacity
                taken[experts[t, k]] += 1
    return kept


# ----------------------------------------------------------------------------- routing


@pytest.mark.parametrize("router,renormalize,scale", [("softmax", True, 1.0), ("softmax", False, 1.0),
                                                      ("sigmoid", True, 2.5), ("softmax", True, 16.0)])
def test_route_matches_numpy(router, renormalize, scale):
    cfg = moe_cfg(router=router, router_renormalize=renormalize, router_scale=scale)
    logits = jax.random.normal(jax.random.key(1), (T, E), F32)
    experts, gates, _ = moe.route(cfg, logits, jnp.zeros(E))
    want_experts, want_gates, _ = np_route(cfg, logits, np.zeros(E))
    assert experts.dtype == jnp.int32 and gates.dtype == jnp.float32
    np.testing.assert_array_equal(experts, want_experts)
    np.testing.assert_allclose(gates, want_gates, atol=1e-6)
    sums = np.asarray(gates).sum(-1)
    if renormalize:
        np.testing.assert_allclose(sums, scale, rtol=1e-6)
    else:
        assert (sums < 1).all()  # softmax mass outside the top k is lost


def test_group_limited_routing_picks_only_from_the_best_groups():
    cfg = moe_cfg(router="sigmoid", router_groups=4, router_topk_groups=2)
    logits = jax.random.normal(jax.random.key(2), (64, E), F32)
    bias = 0.1 * jax.random.normal(jax.random.key(3), (E,), F32)
    experts, gates, _ = moe.route(cfg, logits, bias)
    want_experts, want_gates, scores = np_route(cfg, logits, bias)
    np.testing.assert_array_equal(experts, want_experts)
    np.testing.assert_allclose(gates, want_gates, atol=1e-6)
    # a group's score: its two best (score + bias); the chosen experts lie in the two best groups
    select = scores + np.asarray(bias)
    group_scores = np.sort(select.reshape(64, 4, 2), axis=-1).sum(-1)
    best_TG = np.argsort(-group_scores, axis=-1)[:, :2]
    assert all(set(np.asarray(experts[t]) // 2) <= set(best_TG[t]) for t in range(64))
    ungrouped, _, _ = moe.route(moe_cfg(router="sigmoid"), logits, bias)
    assert (np.asarray(ungrouped) != np.asarray(experts)).any()  # the limit did change some choices


def test_sigmoid_bias_changes_selection_not_gates():
    cfg = moe_cfg(router="sigmoid")
    logits = jax.random.normal(jax.random.key(4), (T, E), F32)
    bias = jnp.array([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.5])
    unbiased, _, _ = moe.route(cfg, logits, jnp.zeros(E))
    experts, gates, _ = moe.route(cfg, logits, bias)
    assert (np.asarray(experts) != np.asarray(unbiased)).any()
    assert (np.asarray(experts) >= 6).sum() > (np.asarray(unbiased) >= 6).sum()
    chosen = np.take_along_axis(1 / (1 + np.exp(-np.asarray(logits, np.float64))), np.asarray(experts), -1)
    np.testing.assert_allclose(gates, chosen / chosen.sum(-1, keepdims=True), atol=1e-6)  # no bias in them


@ROUTERS
def test_aux_loss_is_one_for_perfectly_uniform_routing(router):
    # token t's logits are one vector rotated by t: over E tokens every expert sees every logit
    # once (uniform mean probability) and is chosen K times (uniform load)
    logits = jnp.stack([jnp.roll(jnp.arange(E, dtype=F32) * 0.3, t) for t in range(E)])
    _, _, stats = moe.route(moe_cfg(router=router), logits, jnp.zeros(E))
    np.testing.assert_allclose(stats["aux_loss"], 1.0, rtol=1e-6)
    np.testing.assert_allclose(stats["load_E"], np.ones(E), rtol=1e-6)


@ROUTERS
def test_aux_loss_z_loss_and_load_match_numpy(router):
    cfg = moe_cfg(router=router)
    logits = 2 * jax.random.normal(jax.random.key(5), (T, E), F32) + jnp.arange(E, dtype=F32) * 0.5  # skewed
    _, _, stats = moe.route(cfg, logits, jnp.zeros(E))
    experts, _, scores = np_route(cfg, logits, np.zeros(E))
    probs = scores / scores.sum(-1, keepdims=True)
    f = np.bincount(experts.reshape(-1), minlength=E) / (T * K)
    np.testing.assert_allclose(stats["aux_loss"], E * np.sum(f * probs.mean(0)), rtol=1e-6)
    assert stats["aux_loss"] > 1.1  # skewed routing is penalised
    np.testing.assert_allclose(stats["load_E"], f * E, rtol=1e-6)
    np.testing.assert_allclose(stats["probs_E"], probs.mean(0), rtol=1e-6)
    lse = np.log(np.exp(np.asarray(logits, np.float64)).sum(-1))
    np.testing.assert_allclose(stats["z_loss"], np.mean(lse**2), rtol=1e-6)


@ROUTERS
def test_the_microbatches_statistics_combine_into_the_whole_batchs(router):
    """The pipeline's combination: each statistic averaged over equal microbatches, aux_loss
    recomputed from the averaged load and probabilities, gives the whole batch's statistics."""
    cfg = moe_cfg(router=router)
    logits = 2 * jax.random.normal(jax.random.key(7), (T, E), F32) + jnp.arange(E, dtype=F32) * 0.5
    want = moe.route(cfg, logits, jnp.zeros(E))[2]
    parts = [moe.route(cfg, part, jnp.zeros(E))[2] for part in jnp.split(logits, 2)]
    mean = jax.tree.map(lambda *a: sum(a) / len(a), *parts)
    assert abs(float(mean["aux_loss"]) - float(want["aux_loss"])) > 1e-3  # a mean of products is not it
    for name, value in moe.whole_batch_stats(mean).items():
        np.testing.assert_allclose(value, want[name], rtol=1e-6, err_msg=name)


def test_router_loss_weights_aux_loss_only_when_asked():
    stats = {"aux_loss": jnp.float32(2.0), "z_loss": jnp.float32(3.0)}
    cfg = moe_cfg(load_balance_weight=0.1, router_z_loss=0.01)
    np.testing.assert_allclose(moe.router_loss(cfg, stats), 0.1 * 2 + 0.01 * 3, rtol=1e-6)
    cfg.load_balance = "bias"
    np.testing.assert_allclose(moe.router_loss(cfg, stats), 0.01 * 3, rtol=1e-6)


def test_updated_bias_moves_towards_the_mean_load():
    bias = jnp.array([0.0, 0.1, -0.2, 0.0])
    load = jnp.array([2.0, 1.0, 0.5, 0.5])  # mean 1: overloaded, balanced, underloaded x2
    np.testing.assert_allclose(moe.updated_bias(bias, load, 0.001), [-0.001, 0.1, -0.199, 0.001], atol=1e-8)


# ----------------------------------------------------------------------------- the experts


def routed(cfg, x_TD, router_DE, bias):
    experts, gates, _ = moe.route(cfg, x_TD @ router_DE, bias)
    return experts, gates


def test_reference_matches_a_numpy_loop():
    x_TD, router_DE, weights = random_inputs()
    experts, gates = routed(moe_cfg(), x_TD, router_DE, jnp.zeros(E))
    out = moe.reference(x_TD, experts, gates, *weights, F32)
    np.testing.assert_allclose(out, np_moe(x_TD, np.asarray(experts), np.asarray(gates), weights), atol=1e-5)


@ROUTERS
def test_dropless_equals_reference_outputs_and_gradients(router):
    cfg = moe_cfg(router=router)
    x_TD, router_DE, weights = random_inputs(seed=1)
    bias = jnp.zeros(E).at[jnp.array([1, 4])].set(-10.0)  # experts 1 and 4 get no tokens

    def loss(combine, x_TD, router_DE, *weights):
        experts, gates = routed(cfg, x_TD, router_DE, bias)
        return jnp.sum(jnp.square(combine(x_TD, experts, gates, *weights, F32)))

    experts, gates = routed(cfg, x_TD, router_DE, bias)
    assert not np.isin(np.asarray(experts), [1, 4]).any()
    out = moe.dropless(x_TD, experts, gates, *weights, F32)
    assert_close(out, moe.reference(x_TD, experts, gates, *weights, F32))
    np.testing.assert_allclose(out, np_moe(x_TD, np.asarray(experts), np.asarray(gates), weights), atol=1e-5)
    argnums = tuple(range(1, 6))  # x, the router (through the gates), w_gate, w_up, w_down
    got = jax.grad(loss, argnums)(moe.dropless, x_TD, router_DE, *weights)
    want = jax.grad(loss, argnums)(moe.reference, x_TD, router_DE, *weights)
    for g, w in zip(got, want, strict=True):
        assert_close(g, w)
    assert np.abs(got[2][1]).max() == 0 and np.abs(got[2][0]).max() > 0  # an idle expert learns nothing


def test_dropless_in_bfloat16_is_close_to_float32():
    x_TD, router_DE, weights = random_inputs(seed=2)
    experts, gates = routed(moe_cfg(), x_TD, router_DE, jnp.zeros(E))
    out = moe.dropless(x_TD, experts, gates, *weights, jnp.bfloat16)
    assert out.dtype == jnp.bfloat16
    want = moe.reference(x_TD, experts, gates, *weights, F32)
    np.testing.assert_allclose(out.astype(F32), want, atol=0.05 * float(jnp.abs(want).max()))


def as_rows(*arrays, rows=2):
    """[T, ...] arrays as [rows, T/rows, ...]: sequences, each with its own capacity queues."""
    return tuple(a.reshape(rows, -1, *a.shape[1:]) for a in arrays)


def test_with_capacity_large_enough_equals_reference():
    x_TD, router_DE, weights = random_inputs(seed=3)
    experts, gates = routed(moe_cfg(), x_TD, router_DE, jnp.zeros(E))
    out, dropped = moe.with_capacity(*as_rows(x_TD, experts, gates), *weights, T * K // 2, F32)
    assert_close(out.reshape(T, D), moe.reference(x_TD, experts, gates, *weights, F32))
    assert float(dropped) == 0.0


def test_with_capacity_drops_the_slots_beyond_capacity_in_each_sequences_queue_order():
    x_TD, router_DE, weights = random_inputs(seed=4)
    bias = jnp.zeros(E).at[0].set(1.0)  # everyone's first choice: expert 0 overflows
    experts, gates = routed(moe_cfg(), x_TD, router_DE, bias)
    capacity = 2
    x_BLD, experts_BLK, gates_BLK = as_rows(x_TD, experts, gates)
    kept = np_kept(np.asarray(experts_BLK), E, capacity)
    assert 0 < (~kept).sum() and (~kept[..., 1]).any() and (~kept[..., 0]).any()
    # one queue over both rows (twice the capacity) would keep other slots: the row decides alone
    assert (np_kept(np.asarray(experts)[None], E, 2 * capacity)[0] != kept.reshape(T, K)).any()
    positions = moe.dispatch_positions(experts_BLK, E)
    np.testing.assert_array_equal(np.asarray(positions) < capacity, kept)
    out, dropped = moe.with_capacity(x_BLD, experts_BLK, gates_BLK, *weights, capacity, F32)
    out, kept = out.reshape(T, D), kept.reshape(T, K)
    np.testing.assert_allclose(dropped, (~kept).mean(), rtol=1e-6)
    np.testing.assert_allclose(out, np_moe(x_TD, np.asarray(experts), np.asarray(gates), weights, kept), atol=1e-5)
    ungated = np.where(kept, np.asarray(gates), 0.0)  # dropping = gating to 0, checked the other way
    assert_close(out, moe.reference(x_TD, experts, jnp.asarray(ungated, F32), *weights, F32))


def test_capacity_formula():
    assert moe.capacity(moe_cfg(capacity_factor=1.25), 100) == 32  # ceil(1.25 * 100 * 2 / 8) = ceil(31.25)
    assert moe.capacity(moe_cfg(capacity_factor=1.0), 16) == 4


# ----------------------------------------------------------------------------- the layer


def init_layer(cfg, x_BLD):
    return moe.MoE(cfg).init(jax.random.key(0), x_BLD)


def test_layer_params_shapes_and_logical_specs():
    cfg = moe_cfg(shared_experts=2, load_balance="bias")  # router_bias exists for load_balance=bias
    x_BLD = jnp.zeros((2, 4, D), F32)
    boxed = jax.eval_shape(lambda: init_layer(cfg, x_BLD))
    specs = nn.get_partition_spec(boxed)
    want = {
        "router": ((D, E), ("embed", None)),
        "w_gate": ((E, D, F), ("experts", "embed", "mlp")),
        "w_up": ((E, D, F), ("experts", "embed", "mlp")),
        "w_down": ((E, F, D), ("experts", "mlp", "embed")),
        "shared_gate": ((D, 2 * F), ("embed", "mlp")),
        "shared_up": ((D, 2 * F), ("embed", "mlp")),
        "shared_down": ((2 * F, D), ("mlp", "embed")),
        "router_bias": ((E,), (None,)),
    }
    params = nn.unbox(boxed["params"])
    assert {k: v.shape for k, v in params.items()} == {k: shape for k, (shape, _) in want.items()}
    assert specs["params"] == {k: PartitionSpec(*axes) for k, (_, axes) in want.items()}
    assert set(specs) == {"params"}  # the bias is a param: apply(params, x) stays pure
    assert "shared_gate" not in jax.eval_shape(lambda: init_layer(moe_cfg(), x_BLD))["params"]


def test_layer_init_std():
    cfg = moe_cfg(d_model=64, expert_mlp_dim=64, num_layers=8, init_std=0.1, load_balance="bias")
    variables = init_layer(cfg, jnp.zeros((1, 4, 64), F32))
    params = nn.unbox(variables["params"])
    assert abs(float(params["w_up"].std()) - 0.1) < 0.005
    assert abs(float(params["w_down"].std()) - 0.1 / 4) < 0.002  # init_std / sqrt(2 · num_layers)
    np.testing.assert_array_equal(params["router_bias"], np.zeros(E))


@pytest.mark.parametrize("capacity_factor", [0.0, 100.0])
def test_layer_equals_reference_on_its_own_params(capacity_factor):
    # init_std 0.5: outputs of order 1, so that a tolerance of 1e-6 means something
    cfg = moe_cfg(shared_experts=1, capacity_factor=capacity_factor, router="sigmoid", init_std=0.5,
                  load_balance="bias")
    x_BLD = jax.random.normal(jax.random.key(6), (2, 8, D), F32)
    variables = nn.unbox(init_layer(cfg, x_BLD))
    variables["params"]["router_bias"] = jnp.linspace(-0.3, 0.3, E)
    out_BLD, stats = jax.jit(moe.MoE(cfg).apply)(variables, x_BLD)
    p = variables["params"]
    x_TD = np.asarray(x_BLD, np.float64).reshape(16, D)
    experts, gates, _ = np_route(cfg, x_TD @ np.asarray(p["router"], np.float64), p["router_bias"])
    want = np_moe(x_TD, experts, gates, (p["w_gate"], p["w_up"], p["w_down"]))
    want += np_moe(x_TD, np.zeros((16, 1), int), np.ones((16, 1)),  # the shared expert: always on, gate 1
                   (p["shared_gate"][None], p["shared_up"][None], p["shared_down"][None]))
    assert np.abs(want).max() > 0.5
    assert_close(out_BLD.reshape(16, D), want)
    assert out_BLD.shape == x_BLD.shape and float(stats["dropped"]) == 0.0
    assert set(stats) == {"aux_loss", "z_loss", "load_E", "probs_E", "dropped"}


def test_layer_with_small_capacity_reports_drops():
    cfg = moe_cfg(capacity_factor=0.5)
    x_BLD = jax.random.normal(jax.random.key(7), (2, 8, D), F32)
    variables = nn.unbox(init_layer(cfg, x_BLD))
    _, stats = jax.jit(moe.MoE(cfg).apply)(variables, x_BLD)
    assert float(stats["dropped"]) >= 0.5  # capacity for half the slots at most


@pytest.mark.parametrize("shared,balance", [(0, "aux_loss"), (2, "aux_loss"), (0, "bias")])
def test_param_counts_match_the_tree(shared, balance):
    cfg = moe_cfg(shared_experts=shared, load_balance=balance)
    params = jax.eval_shape(lambda: init_layer(cfg, jnp.zeros((1, 4, D), F32)))["params"]
    sizes = {k: int(np.prod(v.shape)) for k, v in nn.unbox(params).items()}
    assert sum(sizes.values()) == moe.expert_params(cfg)
    per_expert = sum(sizes[k] for k in ("w_gate", "w_up", "w_down")) // E
    assert moe.active_params(cfg) == sum(sizes.values()) - (E - K) * per_expert


def test_without_bias_balancing_the_layer_has_no_bias():
    """Only load_balance=bias selects with a bias (the training step's to update): otherwise
    selection is the router's alone."""
    variables = moe.MoE(moe_cfg()).init(jax.random.key(0), jnp.zeros((1, 4, D), F32))
    assert set(variables) == {"params"} and "router_bias" not in variables["params"]

