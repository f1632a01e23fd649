"""The optimizers and schedules: lr values at known steps and each schedule's formula, batch
scaling, the weight-decay mask, clipping, each optimizer's updates computed by hand and its state's
sharding, and the config's rules for them."""

import math
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec

from maxlm import config as config_lib, model
from maxlm.checkpoint import __main__ as checkpoint_command
from maxlm.optim import optimizers as optim
from maxlm.sharding import mesh as mesh_lib, state as state_lib
from maxlm.train import loop
from tests.helpers import ROOT, command_env, load_config, saved_state, tiny, train_rows, with_overrides


def run_cfg(num_devices=1, **optim_overrides):
    """tiny.py for 1000 steps, peak lr 1e-3 after 100 warmup steps, floor 1e-4; resolved."""
    return tiny(steps=1000, devices=num_devices,
                optim={"lr": 1e-3, "warmup_steps": 100, "min_lr_ratio": 0.1, "decay_steps": 0, **optim_overrides})


def lr_at(cfg, step):
    return float(optim.learning_rate_schedule(cfg)(jnp.int32(step)))  # an int32 step, as in the state


WARMUP = [(0, 0.0), (50, 0.5e-3), (100, 1e-3)]  # the linear warmup every schedule starts with


@pytest.mark.parametrize(
    "overrides, points",
    [
        pytest.param({}, [(550, 1e-4 + 0.5 * 0.9e-3),  # cosine midpoint: floor + half the range
                          (1000, 1e-4), (5000, 1e-4)],  # floor = lr·min_lr_ratio, constant after
                     id="cosine"),
        pytest.param({"decay_steps": 550}, [(325, 1e-4 + 0.5 * 0.9e-3), (550, 1e-4)], id="cosine_decay_steps"),
        pytest.param({"schedule": "linear"}, [(550, 1e-3 - 0.5 * 0.9e-3), (1000, 1e-4), (5000, 1e-4)],
                     id="linear"),
        pytest.param({"schedule": "polynomial", "power": 2.0},
                     [(325, 1e-4 + 0.9e-3 * 0.75**2), (550, 1e-4 + 0.9e-3 * 0.5**2), (1000, 1e-4)],
                     id="polynomial"),
        pytest.param({"schedule": "step", "boundaries": (400, 800), "decay_factor": 0.1},
                     [(399, 1e-3), (400, 1e-4), (799, 1e-4), (800, 1e-5), (5000, 1e-5)], id="step"),
        # the last 20% of 1000 steps: stable until 800, then linear to the floor at 1000
        pytest.param({"schedule": "wsd", "decay_fraction": 0.2},
                     [(500, 1e-3), (800, 1e-3), (900, 1e-3 - 0.5 * 0.9e-3), (1000, 1e-4), (5000, 1e-4)],
                     id="wsd"),
        pytest.param({"schedule": "constant"}, [(550, 1e-3), (5000, 1e-3)], id="constant"),
        pytest.param({"schedule": "inverse_sqrt"}, [(400, 0.5e-3), (1600, 0.25e-3), (10000, 1e-4)],
                     id="inverse_sqrt"),  # peak·sqrt(100 / step)
    ],
)
def test_schedule_at_known_steps(overrides, points):
    cfg = run_cfg(**overrides)
    for step, expected in WARMUP + points:
        np.testing.assert_allclose(lr_at(cfg, step), expected, rtol=1e-5, atol=1e-9, err_msg=f"step {step}")


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_no_warmup_starts_at_the_peak(schedule):
    cfg = run_cfg(warmup_steps=0, schedule=schedule)
    assert lr_at(cfg, 0) == pytest.approx(1e-3, rel=1e-6)


def closed_form_lr(schedule, step, decay_steps=1000, power=2.0, boundaries=(400, 800), decay_fraction=0.2):
    """`run_cfg`'s schedules by their formulas, in float64: peak 1e-3 after a linear warmup from 0
    over 100 steps, then down to the floor 1e-4 by `decay_steps` (the run's 1000 steps by default)."""
    peak, floor, warmup = 1e-3, 1e-4, 100
    if step < warmup:
        return peak * step / warmup
    done = min(step - warmup, decay_steps - warmup) / (decay_steps - warmup)  # of the decay, in [0, 1]
    if schedule == "cosine":
        return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * done))
    if schedule == "linear":
        return peak - (peak - floor) * done
    if schedule == "polynomial":
        return floor + (peak - floor) * (1 - done) ** power
    if schedule == "step":
        return peak * 0.1 ** sum(step >= b for b in boundaries)
    if schedule == "wsd":  # stable, then linear over the last decay_fraction of decay_steps
        start = decay_steps - decay_fraction * decay_steps
        return peak - (peak - floor) * min(max(step - start, 0) / (decay_steps - start), 1)
    if schedule == "constant":
        return peak
    assert schedule == "inverse_sqrt"
    return peak * math.sqrt(warmup / step)


@pytest.mark.parametrize("schedule, overrides", [
    ("cosine", {}), ("cosine", {"decay_steps": 550}), ("linear", {}), ("polynomial", {"power": 2.0}),
    ("step", {"boundaries": (400, 800), "decay_factor": 0.1}), ("wsd", {"decay_fraction": 0.2}), ("constant", {}),
    ("inverse_sqrt", {}),
], ids=["cosine", "cosine_decay_steps", "linear", "polynomial", "step", "wsd", "constant", "inverse_sqrt"])
def test_each_schedule_is_its_formula_at_every_step(schedule, overrides):
    """The jitted schedule, at every 7th step to 1400 and on each side of every phase's edges,
    equals its formula computed here in float64 (to float32's rounding)."""
    cfg = run_cfg(schedule=schedule, **overrides)
    edges = [100, 325, 400, 550, 800, 1000]
    steps = sorted({*range(0, 1400, 7), *(e + d for e in edges for d in (-1, 0, 1))})
    got = np.asarray(jax.jit(jax.vmap(optim.learning_rate_schedule(cfg)))(jnp.asarray(steps, jnp.int32)))
    decay = {"decay_steps": overrides["decay_steps"]} if "decay_steps" in overrides else {}
    expected = [closed_form_lr(schedule, step, **decay) for step in steps]
    np.testing.assert_allclose(got, expected, rtol=2e-6, atol=1e-12)


@pytest.mark.parametrize("scaling, factor", [("none", 1.0), ("sqrt", 2.0), ("linear", 4.0)])
def test_lr_batch_scaling(scaling, factor):
    """batch_size 32 with a reference batch of 8: the peak scales by (32/8)^(1/2 or 1); the config
    keeps optim.lr."""
    cfg = load_config("tiny")
    cfg.batch_size = 32
    cfg.optim.update(lr=1e-3, lr_batch_scaling=scaling, lr_reference_batch=8, warmup_steps=0,
                     schedule="constant")
    cfg = config_lib.resolve(cfg, 1)
    assert cfg.optim.lr == 1e-3
    assert optim.peak_lr(cfg) == pytest.approx(1e-3 * factor, rel=1e-12)
    assert lr_at(cfg, 5) == pytest.approx(1e-3 * factor, rel=1e-6)
    if scaling != "none":
        assert f"= optim.lr 0.001 x (32 / 8)^{0.5 if scaling == 'sqrt' else 1}" in optim.describe(cfg)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"optim.name": "sgd"}, "optim.name must be one of ('adamw', 'lion', 'adafactor', 'muon'), got 'sgd'"),
        ({"optim.schedule": "exp"}, "optim.schedule must be one of"),
        ({"optim.lr_batch_scaling": "cubic"}, "optim.lr_batch_scaling must be one of"),
        ({"optim.lr_batch_scaling": "sqrt"},
         "optim.lr_batch_scaling='sqrt' needs optim.lr_reference_batch > 0 (the batch size optim.lr was "
         "tuned at), got 0"),
        ({"optim.lr_reference_batch": -8}, "optim.lr_reference_batch must be an int >= 0, got -8"),
        ({"optim.power": 0.0}, "optim.power must be a positive finite number, got 0.0"),
        ({"optim.decay_factor": 1.5}, "optim.decay_factor must be in (0, 1), got 1.5"),
        ({"optim.decay_fraction": 0.0}, "optim.decay_fraction must be in (0, 1], got 0.0"),
        ({"optim.decay_fraction": 1.2}, "optim.decay_fraction must be in (0, 1], got 1.2"),
        ({"optim.name": "adafactor", "optim.mu_dtype": "bfloat16"},
         "optim.mu_dtype='bfloat16' has no effect with optim.name='adafactor'"),
        ({"optim.schedule": "step"}, "optim.boundaries must be strictly increasing ints in "
                                     "(optim.warmup_steps, steps) = (5, 20) for optim.schedule='step', got ()"),
        ({"optim.schedule": "step", "optim.boundaries": (10, 10)}, "got (10, 10)"),
        ({"optim.schedule": "step", "optim.boundaries": (12, 8)}, "got (12, 8)"),
        ({"optim.schedule": "step", "optim.boundaries": (5, 10)}, "got (5, 10)"),  # inside the warmup
        ({"optim.schedule": "step", "optim.boundaries": (10, 20)}, "got (10, 20)"),  # not before steps
        ({"optim.schedule": "step", "optim.boundaries": (10.5,)}, "got (10.5,)"),
        ({"optim.boundaries": (10,)}, "optim.boundaries=(10,) is read by optim.schedule='step' only, "
                                      "got optim.schedule='cosine'"),
        ({"optim.schedule": "inverse_sqrt", "optim.warmup_steps": 0}, "needs optim.warmup_steps > 0"),
        ({"optim.schedule": "wsd", "optim.decay_fraction": 0.01},
         "optim.decay_fraction=0.01 of optim.decay_steps=20 is less than one step"),
        ({"optim.schedule": "wsd", "optim.decay_fraction": 0.9},
         "decays over the last optim.decay_fraction=0.9 of optim.decay_steps=20 (from step 2), which "
         "starts before the warmup (optim.warmup_steps=5) ends"),
    ],
)
def test_config_rejects(overrides, message):
    with pytest.raises(config_lib.ConfigError) as info:
        config_lib.resolve(with_overrides(load_config("tiny"), overrides), 8)
    assert message in str(info.value)


# ----------------------------------------------------------------------------- the update rules

# the logical specs of the tests' own parameters, which Muon splits by: `w` a matrix (Muon's),
# `embed` a token embedding and `scale` a norm scale (AdamW's); the other optimizers ignore them
SPECS = {"w": PartitionSpec("embed", "mlp"), "scale": PartitionSpec("embed"), "embed": PartitionSpec("vocab", "embed")}


@pytest.mark.parametrize("scan", [False, True])
def test_weight_decay_skips_norms_and_biases(scan):
    """Also the qk-norms' scales, [heads, head_dim] with model.qk_norm=full, LayerNorm's biases
    and the projections' (the query's, key's and value's [heads, head_dim])."""
    cfg = config_lib.resolve(load_config("tiny"), 1)
    cfg.model.scan_layers, cfg.model.qk_norm, cfg.model.norm, cfg.model.use_bias = scan, "full", "layernorm", True
    params = model.init_params(cfg.model, jax.random.key(0))
    mask = optim.weight_decay_mask(params)
    layer = mask["layers"] if scan else mask["layer_0"]
    assert layer["attn"]["wq"] and layer["mlp"]["w_down"] and mask["embed"] and mask["head"]
    assert not layer["attn_norm"]["scale"] and not mask["final_norm"]["scale"] and not mask["final_norm"]["bias"]
    assert not layer["attn"]["q_norm"]["scale"] and not layer["attn"]["k_norm"]["scale"]
    assert not any(layer["attn"][b] for b in ("bq", "bk", "bv", "bo")) and not layer["mlp"]["b_up"]


@pytest.mark.parametrize("name", config_lib.OPTIMIZERS)
def test_decay_is_decoupled_lr_scaled_and_skips_norm_scales(name):
    """With zero gradients the update is the decay alone: -lr·weight_decay·w on matrices (AdamW's
    rule for all four: Adafactor's decay is not optax.adafactor's unscaled one; Muon's matrix and
    its AdamW part's), 0 on vectors."""
    cfg = run_cfg(name=name, weight_decay=0.5, warmup_steps=0, schedule="constant", clip_norm=0.0)
    tx = optim.make_optimizer(cfg, param_specs=SPECS)
    params = {"w": jnp.full((256, 128), 2.0), "scale": jnp.ones((256,)),  # w: factored by adafactor
              "embed": jnp.full((64, 32), 2.0)}  # muon: AdamW's
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = tx.update(zeros, tx.init(params), params)
    np.testing.assert_allclose(np.asarray(updates["w"]), -1e-3 * 0.5 * 2.0, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(updates["embed"]), -1e-3 * 0.5 * 2.0, rtol=1e-6)
    assert float(jnp.abs(updates["scale"]).sum()) == 0.0


def two_steps(name, params, grads, **overrides):
    """maxlm's optimizer `name` (constant lr 1e-3, weight decay 0.1, no clipping: run_cfg) applied
    to `grads[0]` then `grads[1]` from `params`: the two updates, as float64 arrays."""
    cfg = run_cfg(name=name, warmup_steps=0, schedule="constant", clip_norm=0.0, weight_decay=0.1, **overrides)
    tx = optim.make_optimizer(cfg, param_specs=SPECS)
    params = {k: jnp.asarray(v, jnp.float32) for k, v in params.items()}
    state, updates = tx.init(params), []
    for g in grads:
        update, state = tx.update({k: jnp.asarray(v, jnp.float32) for k, v in g.items()}, state, params)
        updates.append({k: np.asarray(v, np.float64) for k, v in update.items()})
        params = optax.apply_updates(params, update)
    return updates


def small_problem(seed=0):
    """A [8, 16] matrix (decayed) and a [16] norm scale (not), and two random gradients for them."""
    rng = np.random.default_rng(seed)
    params = {"w": rng.normal(size=(8, 16)).astype(np.float32),
              "scale": (1 + 0.1 * rng.normal(size=16)).astype(np.float32)}
    grads = [{k: rng.normal(size=v.shape).astype(np.float32) for k, v in params.items()} for _ in range(2)]
    return params, grads


def as_float64(tree):
    return {k: np.asarray(v, np.float64) for k, v in tree.items()}


@pytest.mark.parametrize("mu_dtype", ["float32", "bfloat16"])
def test_two_adamw_steps_are_the_hand_computed_updates(mu_dtype):
    """Adam's rule by hand (b1 0.9, b2 0.95, eps 1e-8; bias-corrected moments), plus the decoupled
    decay lr·0.1·w on the matrix only, times -lr; the second step from the updated parameters and
    the first moment as stored: with optim.mu_dtype=bfloat16, rounded to bfloat16 (the update it
    was computed in is made from the unrounded one), and its decay b1·m computed in bfloat16: b1
    and the product rounded to it."""
    params, grads = small_problem()
    got = two_steps("adamw", params, grads, mu_dtype=mu_dtype, b1=0.9, b2=0.95, eps=1e-8)
    lr, b1, b2, eps, wd = 1e-3, 0.9, 0.95, 1e-8, 0.1
    bf16 = lambda x: np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)  # noqa: E731
    decayed = (lambda m: bf16(bf16(b1) * m)) if mu_dtype == "bfloat16" else (lambda m: b1 * m)
    w, mu, nu = as_float64(params), {k: 0.0 for k in params}, {k: 0.0 for k in params}
    for t, g in enumerate(map(as_float64, grads), start=1):
        for k in params:
            mu[k] = decayed(mu[k]) + (1 - b1) * g[k]
            nu[k] = b2 * nu[k] + (1 - b2) * g[k] ** 2
            adam = (mu[k] / (1 - b1**t)) / (np.sqrt(nu[k] / (1 - b2**t)) + eps)
            update = -lr * (adam + (wd * w[k] if k == "w" else 0))
            np.testing.assert_allclose(got[t - 1][k], update, rtol=2e-5, atol=1e-10, err_msg=f"step {t}, {k}")
            w[k] = w[k] + update
            if mu_dtype == "bfloat16":
                mu[k] = bf16(mu[k])


def test_two_lion_steps_are_the_hand_computed_updates():
    """Lion by hand (b1 0.9, b2 0.99): the sign of (1 - b1)·g + b1·m, the moment m then moved to
    g at b2, plus the decoupled decay on the matrix, times -lr (b1 and b2 swapped flip some of
    the second step's signs)."""
    params, grads = small_problem(1)
    got = two_steps("lion", params, grads, b1=0.9, b2=0.99)
    lr, b1, b2, wd = 1e-3, 0.9, 0.99, 0.1
    w, m = as_float64(params), {k: 0.0 for k in params}
    for t, g in enumerate(map(as_float64, grads), start=1):
        for k in params:
            update = -lr * (np.sign((1 - b1) * g[k] + b1 * m[k]) + (wd * w[k] if k == "w" else 0))
            np.testing.assert_allclose(got[t - 1][k], update, rtol=1e-5, atol=1e-10, err_msg=f"step {t}, {k}")
            m[k], w[k] = b2 * m[k] + (1 - b2) * g[k], w[k] + update


def test_two_adafactor_steps_are_the_hand_computed_updates():
    """Adafactor by hand: the second moment v of g² + 1e-30 decays at 1 - t^-0.8 (0 at the first
    step); for a matrix whose two dims are both >= 128 it is kept as its row means R and column
    means C, read back as R_i·C_j / mean(R) (a [4, 8] matrix and a vector keep it whole). The
    update g / sqrt(v) is scaled down to RMS 1 where above, takes the decoupled decay on the
    matrices, and is multiplied by -lr."""
    rng = np.random.default_rng(2)
    params = {"w": rng.normal(size=(256, 128)), "small": rng.normal(size=(4, 8)),
              "scale": 1 + 0.1 * rng.normal(size=128)}
    grads = [{k: rng.normal(size=v.shape) * rng.uniform(0.1, 10, size=v.shape) for k, v in params.items()}
             for _ in range(2)]
    params, grads = {k: v.astype(np.float32) for k, v in params.items()}, [
        {k: v.astype(np.float32) for k, v in g.items()} for g in grads]
    got = two_steps("adafactor", params, grads)
    lr, wd = 1e-3, 0.1
    w = as_float64(params)
    v = {"w": (0.0, 0.0), "small": 0.0, "scale": 0.0}
    for t, g in enumerate(map(as_float64, grads), start=1):
        beta = 1 - t**-0.8
        for k in params:
            g2 = g[k] ** 2 + 1e-30
            if k == "w":
                rows, cols = (beta * old + (1 - beta) * new for old, new in zip(v[k], (g2.mean(1), g2.mean(0))))
                v[k] = (rows, cols)
                second = rows[:, None] * cols[None, :] / rows.mean()
            else:
                v[k] = second = beta * v[k] + (1 - beta) * g2
            update = g[k] / np.sqrt(second)
            update = update / max(1.0, np.sqrt(np.mean(update**2)))
            update = -lr * (update + (wd * w[k] if k != "scale" else 0))
            np.testing.assert_allclose(got[t - 1][k], update, rtol=2e-5, atol=1e-10, err_msg=f"step {t}, {k}")
            w[k] = w[k] + update


@pytest.mark.parametrize("name", config_lib.OPTIMIZERS)
def test_the_chain_clips_the_gradient_to_clip_norm_before_the_update_rule(name):
    """optim.clip_norm=0.25: over two steps, a gradient of global norm 10 (clipped to 0.25) then
    one of norm 0.1 (left as it is), the updates of maxlm's chain are those of the same optimizer
    without clipping fed the gradients clipped by hand. The second update tells: the moments
    remember how large the first gradient was, so dropping the clip, clipping the update instead
    of the gradient, or clipping to another norm changes it."""
    settings = dict(name=name, warmup_steps=0, schedule="constant")
    tx = optim.make_optimizer(run_cfg(clip_norm=0.25, **settings), param_specs=SPECS)
    unclipped = optim.make_optimizer(run_cfg(clip_norm=0.0, **settings), param_specs=SPECS)
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(256, 128)), jnp.float32),  # adafactor factors it
              "scale": jnp.ones((128,)), "embed": jnp.asarray(rng.normal(size=(64, 32)), jnp.float32)}

    def gradient(norm):
        g = {k: rng.normal(size=v.shape) for k, v in params.items()}
        total = np.sqrt(sum(np.sum(x**2) for x in g.values()))
        return {k: jnp.asarray(x * norm / total, jnp.float32) for k, x in g.items()}

    grads = [gradient(10.0), gradient(0.1)]
    by_hand = [jax.tree.map(lambda x: x * 0.25 / 10.0, grads[0]), grads[1]]
    state, reference_state = tx.init(params), unclipped.init(params)
    for step, (g, g_clipped) in enumerate(zip(grads, by_hand)):
        updates, state = tx.update(g, state, params)
        expected, reference_state = unclipped.update(g_clipped, reference_state, params)
        for key in params:
            np.testing.assert_allclose(np.asarray(updates[key]), np.asarray(expected[key]), rtol=1e-5, atol=1e-9,
                                       err_msg=f"step {step}, {key}")


# ----------------------------------------------------------------------------- sharded state


def sharded_state(name, data=1, zero1=False, create=False):
    """The optimizer state of a tiny model whose matrices Adafactor factors (d_model 128, mlp 256)
    on 8 devices (fsdp = 8 / data, tensor = 1): ({path: mesh PartitionSpec}, the state). The
    state's ShapeDtypeStructs, with their shardings; with `create`, the arrays themselves."""
    cfg = tiny(model=dict(d_model=128, mlp_dim=256), optim=dict(name=name, shard_state_over_data=zero1),
               **{"mesh.data": data, "mesh.fsdp": -1, "mesh.tensor": 1})
    tx, mesh, rules = optim.make_optimizer(cfg), mesh_lib.make_mesh(cfg.mesh), mesh_lib.rules_of(cfg.mesh)
    if create:
        state, _ = state_lib.create_sharded_state(cfg, tx, mesh, rules, jax.random.key(0))
    else:
        state = state_lib.abstract_state(cfg, tx, state_lib.shardings(cfg, tx, mesh, rules,
                                                                      state_lib.abstract_state(cfg, tx)))
    specs = {k: v for k, v in mesh_lib.describe(state).items() if not k.startswith("['params']")}
    assert not any("data" in v for k, v in mesh_lib.describe(state).items() if k.startswith("['params']"))
    return specs, state


W_UP = "['layers']['mlp']['w_up']"  # [layers, embed, mlp] = [2, 128, 256]
EMBED = "['embed']"  # [vocab, embed] = [264, 128]
WQ = "['layers']['attn']['wq']"  # [layers, embed, heads, head_dim] = [2, 128, 4, 32]: not factored


@pytest.mark.parametrize("name, moments", [("adamw", ("mu", "nu")), ("lion", ("mu",))])
def test_moments_follow_their_parameter(name, moments):
    specs, _ = sharded_state(name)
    for moment in moments:
        assert specs[f"['opt_state'][1][0].{moment}{W_UP}"] == "P('stage', ('fsdp', 'sequence'), 'tensor')"
        assert specs[f"['opt_state'][1][0].{moment}{EMBED}"] == "P('tensor', ('fsdp', 'sequence'))"
    zero1, _ = sharded_state(name, data=2, zero1=True)
    for moment in moments:  # ZeRO-1: the embed dim also over data (parameters: not, sharded_state checks)
        assert zero1[f"['opt_state'][1][0].{moment}{W_UP}"] == "P('stage', ('fsdp', 'sequence', 'data'), 'tensor')"


def test_adafactor_factored_moments_drop_the_averaged_dim():
    """v_row (averaged over the largest dim) and v_col (over the second largest) take their
    parameter's spec without that dim; placeholders are replicated; ZeRO-1 adds `data` to them."""
    specs, state = sharded_state("adafactor", create=True)
    at = lambda field, path: specs[f"['opt_state'][1][0].{field}{path}"]  # noqa: E731
    assert at("v_row", W_UP) == "P('stage', ('fsdp', 'sequence'))" and at("v_col", W_UP) == "P('stage', 'tensor')"
    assert at("v_row", EMBED) == "P(('fsdp', 'sequence'),)" and at("v_col", EMBED) == "P('tensor',)"
    assert at("v", W_UP) == at("v", EMBED) == "P()"  # placeholders
    assert at("v", WQ) == "P('stage', ('fsdp', 'sequence'), 'tensor', None)" and at("v_row", WQ) == "P()"
    assert at("count", "") == "P()"
    v_row = state["opt_state"][1][0].v_row["layers"]["mlp"]["w_up"]
    assert v_row.shape == (2, 128) and v_row.addressable_shards[0].data.shape == (2, 16)  # 1/8 each

    zero1, _ = sharded_state("adafactor", data=2, zero1=True)
    at = lambda field, path: zero1[f"['opt_state'][1][0].{field}{path}"]  # noqa: E731
    assert at("v_row", W_UP) == "P('stage', ('fsdp', 'sequence', 'data'))"  # its embed dim, 128 over 4 x 2
    assert at("v_col", EMBED) == "P(('tensor', 'data'),)"  # no embed dim: the first that divides
    assert at("v", WQ) == "P('stage', ('fsdp', 'sequence', 'data'), 'tensor', None)"
    assert at("v", W_UP) == "P()"  # a (1,) placeholder stays replicated


# ----------------------------------------------------------------------------- end to end


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [
    # Lion's usual settings: lr and weight decay 10x AdamW's other way, b2 0.99; a batch-scaled peak
    pytest.param({"optim.name": "lion", "optim.lr": 3e-4, "optim.weight_decay": 1.0, "optim.b2": 0.99,
                  "optim.schedule": "wsd", "optim.lr_batch_scaling": "sqrt", "optim.lr_reference_batch": 2},
                 id="lion", marks=pytest.mark.ci),
    pytest.param({"optim.name": "adafactor", "optim.schedule": "inverse_sqrt", "model.d_model": 128,
                  "model.mlp_dim": 256}, id="adafactor", marks=pytest.mark.ci),  # matrices it factors
    # Muon's momentum (and its AdamW part's first moment) in bfloat16, the AdamW part at its own lr
    pytest.param({"optim.name": "muon", "optim.mu_dtype": "bfloat16", "optim.muon_adam_lr": 1e-3},
                 id="muon", marks=pytest.mark.ci),
])
def test_train_resume_is_bitwise_on_a_zero1_mesh(overrides, tmp_path, data_dirs):
    """tiny.py with each new optimizer on mesh (data 2, fsdp 4) with ZeRO-1 learns; dropping its
    last checkpoint and rerunning replays steps 11-20 bit for bit, optimizer state included; its
    checkpoints verify; and a start with another optim.name is refused before anything compiles.

    Loaded from a compilation cache, this mesh's train step deadlocked in XLA:CPU's collectives
    (the 8 fake devices entered the scan's all-gathers and the ones outside it in different orders
    until XLA aborted: "Termination timeout"); a compiled one never did, so maxlm turns the cache
    off on several CPU devices and the suite has none (docs/testing.md)."""
    settings = {**data_dirs, **overrides, "mesh.data": 2, "mesh.fsdp": 4, "optim.shard_state_over_data": True,
                "eval.every_steps": 0, "metrics.tensorboard": False}
    cfg = config_lib.resolve(with_overrides(load_config("tiny"), settings), jax.device_count())

    def run(workdir):
        result = subprocess.run(
            [sys.executable, "-m", "maxlm.train", "--config=configs/tiny.py", f"--workdir={workdir}",
             *(f"--config.{k}={v}" for k, v in settings.items())],
            cwd=ROOT, env=command_env(tmp_path), capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]

    full = tmp_path / "full"
    run(full)
    first = train_rows(full)
    assert first[20]["loss"] < first[5]["loss"] - 0.5, first  # it learns
    assert first[5]["lr"] == pytest.approx(lr_at(cfg, 4), rel=1e-6)  # the rate step 5 used
    assert checkpoint_command.main(["verify", str(full)]) == 0

    resumed = tmp_path / "resumed"
    shutil.copytree(full, resumed)
    shutil.rmtree(resumed / "checkpoints" / "20")
    (resumed / "metrics.jsonl").write_text("")
    run(resumed)
    again = train_rows(resumed)
    assert sorted(again) == [15, 20] and [again[s]["loss"] for s in again] == [first[s]["loss"] for s in again]
    for a, b in zip(jax.tree.leaves(saved_state(full, 20)), jax.tree.leaves(saved_state(resumed, 20))):
        np.testing.assert_array_equal(a, b)

    other = config_lib.resolve(with_overrides(load_config("tiny"), data_dirs), jax.device_count())
    with pytest.raises(ValueError, match=f"optim.name='adamw', but the checkpoint .* holds "
                                         f"'{cfg.optim.name}' optimizer state"):
        loop.check_start(other, str(full))
