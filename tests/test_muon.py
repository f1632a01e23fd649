"""Muon (optim.name=muon): which parameters it takes, its update against optax's, per matrix of a
stack, on a sharded mesh against one device, its state's shardings (ZeRO-1 too), and a tiny.py
run that learns, whose checkpoints verify and that another optim.name may not resume. The bitwise
resume through the CLI is test_optim.py's zero1 test (muon case)."""

import functools
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from maxlm import config as config_lib, model
from maxlm.checkpoint import __main__ as checkpoint_command
from maxlm.observe import flops
from maxlm.optim import muon, optimizers as optim
from maxlm.runtime.errors import ConfigError
from maxlm.sharding import mesh as mesh_lib, state as state_lib
from maxlm.train import loop
from tests.helpers import (
    ROOT,
    TEST_PEAK_FLOPS_PER_SEC,
    command_env,
    load_config,
    saved_state,
    train_rows,
    with_overrides,
)

MUON = {"name": "muon", "warmup_steps": 0, "schedule": "constant", "lr": 1e-3}


def muon_cfg(name="tiny", num_devices=1, **optim_overrides):
    cfg = load_config(name)
    cfg.optim.update({**MUON, **optim_overrides})
    return config_lib.resolve(cfg, num_devices)


def dims_of(cfg):
    """{keystr path: (reduction axes, output axes) or None} of the model's parameters."""
    dims = muon.dimension_numbers_tree(model.param_logical_specs(cfg.model))
    flat, _ = jax.tree_util.tree_flatten_with_path(dims, is_leaf=lambda x: x is None or isinstance(
        x, optax.contrib.MuonDimensionNumbers))
    return {jax.tree_util.keystr(p): None if d is None else (d.reduction_axis, d.output_axis) for p, d in flat}


# ----------------------------------------------------------------------------- the split


def test_matrices_get_muon_and_embeddings_head_norms_and_biases_adamw():
    """By logical axis names: `layers` and `experts` are batch axes, heads·head_dim is one dim;
    two dims left is a matrix, unless a `vocab` or `positions` axis makes it an embedding."""
    dims = dims_of(muon_cfg())
    assert dims["['layers']['attn']['wq']"] == ((1,), (2, 3))  # [L, embed | heads, head_dim]
    assert dims["['layers']['attn']['wk']"] == ((1,), (2, 3))  # [L, embed | kv_heads, head_dim]
    assert dims["['layers']['attn']['wo']"] == ((1, 2), (3,))  # [L, heads, head_dim | embed]
    assert dims["['layers']['mlp']['w_up']"] == ((1,), (2,)) and dims["['layers']['mlp']['w_down']"] == ((1,), (2,))
    for adamw in ("['embed']", "['head']", "['final_norm']['scale']", "['layers']['attn_norm']['scale']"):
        assert dims[adamw] is None, adamw

    moe = dims_of(muon_cfg("deepseek_v3_tiny"))  # [L, E, in, out] experts, MLA, a router, MTP
    assert moe["['layers']['mlp']['w_gate']"] == ((2,), (3,)) and moe["['layers']['mlp']['w_down']"] == ((2,), (3,))
    assert moe["['layers']['attn']['wkv_b']"] == ((1,), (2, 3))  # [L, latent | heads, head_dim]
    assert moe["['layers']['mlp']['router']"] == ((1,), (2,)) and moe["['mtp_0']['proj']"] == ((0,), (1,))
    assert moe["['layers']['mlp']['router_bias']"] is None and moe["['layers']['attn']['kv_a_norm']['scale']"] is None

    cfg = load_config("tiny")
    cfg.model.update(scan_layers=False, use_bias=True, qk_norm="full", norm="layernorm", positions="learned")
    flat = dims_of(config_lib.resolve(cfg, 1))  # unscanned: no batch axis; biases and full qk-norm scales are [heads, head_dim]
    assert flat["['layer_0']['attn']['wq']"] == ((0,), (1, 2)) and flat["['layer_1']['attn']['wo']"] == ((0, 1), (2,))
    for adamw in ("['pos_embed']", "['layer_0']['attn']['bq']", "['layer_0']['attn']['q_norm']['scale']",
                  "['final_norm']['bias']", "['layer_0']['mlp']['b_up']"):
        assert flat[adamw] is None, adamw


@pytest.mark.parametrize("name, overrides", [
    ("tiny", {}), ("tiny", {"scan_layers": False, "use_bias": True, "qk_norm": "full", "positions": "learned"}),
    ("moe_tiny", {}), ("deepseek_v3_tiny", {})])
def test_muon_takes_exactly_the_decayed_matrices_but_the_embeddings(name, overrides):
    """The logical-name rule agrees with weight_decay_mask's (by path and rank): Muon's parameters
    are the matrices AdamW decays, without the token embedding, head and position table."""
    cfg = load_config(name)
    cfg.model.update(overrides)
    cfg = config_lib.resolve(cfg, 1)
    shapes = jax.eval_shape(lambda: model.init_params(cfg.model, jax.random.key(0)))
    specs = model.param_logical_specs(cfg.model)
    flat = lambda tree: {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_flatten_with_path(  # noqa: E731
        tree, is_leaf=model.is_spec)[0]}
    labels, decayed, names = flat(muon.labels(specs)), flat(optim.weight_decay_mask(shapes)), flat(specs)
    embeddings = {k for k, spec in names.items() if {"vocab", "positions"} & set(spec)}
    assert {k for k, v in labels.items() if v == "muon"} == {k for k, v in decayed.items() if v} - embeddings
    assert embeddings


# ----------------------------------------------------------------------------- the update


def random_tree(shapes, seed):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda s: jnp.asarray(rng.normal(size=s), jnp.float32), shapes,
                        is_leaf=lambda x: isinstance(x, tuple))


SHAPES = {"layers": {"w": (2, 32, 48), "wo": (2, 4, 8, 32)}, "embed": (40, 32), "scale": (32,)}
SPECS = {"layers": {"w": P("layers", "embed", "mlp"), "wo": P("layers", "heads", "head_dim", "embed")},
         "embed": P("vocab", "embed"), "scale": P("embed")}


@pytest.mark.parametrize("rms", [0.2, 0.0])
def test_the_update_is_optax_contrib_muon_on_matrices_and_maxlm_adamw_on_the_rest(rms):
    """Three steps: the matrices' updates are optax.contrib.muon's bit for bit (its momentum and
    Newton-Schulz, the consistent-RMS or width scaling, the decay); the rest optax.adamw's with
    maxlm's decay mask, at optim.muon_adam_lr's schedule (optax's muon would decay the norms and
    use Nesterov Adam)."""
    cfg = muon_cfg(weight_decay=0.1, muon_consistent_rms=rms, muon_adam_lr=3e-3, schedule="cosine", warmup_steps=1)
    tx = optim.make_optimizer(cfg, param_specs=SPECS)
    reference = optax.chain(optax.clip_by_global_norm(cfg.optim.clip_norm), optax.contrib.muon(
        optim.learning_rate_schedule(cfg), beta=0.95, weight_decay=0.1, consistent_rms=rms or None,
        muon_weight_dimension_numbers=muon.dimension_numbers_tree(SPECS)))
    adam = optax.chain(optax.clip_by_global_norm(cfg.optim.clip_norm), optax.adamw(
        optim.learning_rate_schedule(cfg, 3e-3), b1=0.9, b2=0.95, weight_decay=0.1, mask=optim.weight_decay_mask))
    params = random_tree(SHAPES, 0)
    txs = (tx, reference, adam)
    states = [t.init(params) for t in txs]
    updates = [jax.jit(t.update) for t in txs]
    for step in range(3):
        grads = random_tree(SHAPES, step + 1)
        (ours, states[0]), (theirs, states[1]), (adams, states[2]) = (
            update(grads, s, params) for update, s in zip(updates, states))
        for key in ("w", "wo"):
            np.testing.assert_array_equal(ours["layers"][key], theirs["layers"][key], err_msg=f"{key} {step}")
        for key in ("embed", "scale"):
            np.testing.assert_array_equal(ours[key], adams[key], err_msg=f"{key} {step}")
        params = optax.apply_updates(params, ours)
    assert not np.array_equal(theirs["scale"], adams["scale"])  # optax.contrib.muon's own Adam differs


def test_newton_schulz_runs_per_matrix_of_a_stack_and_on_heads_times_head_dim():
    """A [L, E, in, out] stack's update is each [in, out] matrix's own; a [L, embed, heads,
    head_dim] projection's is that of the [embed, heads·head_dim] matrix."""
    cfg = muon_cfg(weight_decay=0.0)
    stack = {"w": P("layers", "experts", "embed", "mlp"), "wq": P("layers", "embed", "heads", "head_dim")}
    one = {"w": P("embed", "mlp"), "wq": P("embed", "mlp")}
    grads = random_tree({"w": (2, 3, 16, 24), "wq": (2, 16, 4, 8)}, 0)
    tx = optim.make_optimizer(cfg, param_specs=stack)
    together = jax.jit(lambda g: tx.update(g, tx.init(g), g)[0])(grads)
    alone = optim.make_optimizer(cfg, param_specs=one)
    alone_update = jax.jit(lambda g: alone.update(g, alone.init(g), g)[0])
    for layer in range(2):
        for expert in range(3):
            u = alone_update({"w": grads["w"][layer, expert], "wq": grads["wq"][layer].reshape(16, 32)})
            np.testing.assert_allclose(together["w"][layer, expert], u["w"], rtol=1e-5, atol=1e-8)
        np.testing.assert_allclose(together["wq"][layer].reshape(16, 32), u["wq"], rtol=1e-5, atol=1e-8)
    # orthogonalised: the singular values of the direction are near 1 (Newton-Schulz's ~[0.7, 1.2])
    direction = np.asarray(u["w"]) / (cfg.optim.lr * 0.2 * np.sqrt(24))
    s = np.linalg.svd(-direction, compute_uv=False)
    assert 0.5 < s.min() and s.max() < 1.5, s


@functools.cache
def sharded_updates(num_devices: int, mesh: tuple = (1, 1, 1), zero1: bool = False):
    """Three updates of tiny.py's Muon on `num_devices` devices, mesh (data, fsdp, tensor), from
    the same gradients (the third twice the first...), and the final optimizer state's specs."""
    cfg = load_config("tiny")
    cfg.optim.update(MUON)
    cfg.optim.shard_state_over_data = zero1
    cfg.mesh.update(dict(zip(("data", "fsdp", "tensor"), mesh)))
    cfg = config_lib.resolve(cfg, num_devices)
    tx, rules = optim.make_optimizer(cfg), mesh_lib.rules_of(cfg.mesh)
    devices = jax.devices()[:num_devices]
    state, shardings = state_lib.create_sharded_state(cfg, tx, mesh_lib.make_mesh(cfg.mesh, devices), rules,
                                                      jax.random.key(0))
    shapes = jax.tree.map(lambda x: x.shape, state["params"])
    grads = jax.tree.map(jax.device_put, random_tree(shapes, 0), shardings["params"])
    update = jax.jit(tx.update, out_shardings=(shardings["params"], shardings["opt_state"]))
    opt_state, out = state["opt_state"], []
    for step in range(3):
        u, opt_state = update(jax.tree.map(lambda x, k=step: x * (k + 1), grads), opt_state, state["params"])
        out.append(jax.device_get(u))
    return out, mesh_lib.describe(opt_state)


@pytest.mark.parametrize("mesh, zero1", [((1, 4, 2), False), ((2, 2, 2), True)],
                         ids=["fsdp4_tensor2", "data2_fsdp2_tensor2_zero1"])
def test_the_sharded_update_equals_one_devices(mesh, zero1):
    """tiny.py's parameters and Muon's momentum sharded over 8 devices (fsdp x tensor, and with
    ZeRO-1 over data too): three updates from the same gradients equal one device's within 1e-5
    (of the update over lr, whose entries are ~0.5), so the Newton-Schulz products GSPMD splits
    over the shards sum to the whole matrix's."""
    one, _ = sharded_updates(1)
    many, specs = sharded_updates(8, mesh, zero1)
    momentum = specs["[1].inner_states['muon'].inner_state[0].mu['layers']['attn']['wq']"]
    assert "fsdp" in momentum and "tensor" in momentum and ("data" in momentum) == zero1, momentum
    for a, b in zip(one, many):
        for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)):
            np.testing.assert_allclose(y / 1e-3, x / 1e-3, rtol=0, atol=1e-5, err_msg=jax.tree_util.keystr(path))


# ----------------------------------------------------------------------------- state and log


def test_state_shards_like_the_parameters_and_with_zero1_over_data():
    """The momentum of each matrix and AdamW's moments of the others take their parameter's specs
    (the placeholders of the other part hold nothing); ZeRO-1 adds `data` to each; the
    Newton-Schulz coefficients and counts are replicated."""
    cfg = load_config("tiny")
    cfg.optim.update(name="muon", shard_state_over_data=True)
    cfg.mesh.update(data=2, fsdp=4, tensor=1)
    cfg = config_lib.resolve(cfg, jax.device_count())
    tx, mesh, rules = optim.make_optimizer(cfg), mesh_lib.make_mesh(cfg.mesh), mesh_lib.rules_of(cfg.mesh)
    shapes = state_lib.abstract_state(cfg, tx)
    state = state_lib.abstract_state(cfg, tx, state_lib.shardings(cfg, tx, mesh, rules, shapes))
    specs = {k.removeprefix("['opt_state'][1].inner_states"): v for k, v in mesh_lib.describe(state).items()
             if k.startswith("['opt_state']")}
    zero1 = "('fsdp', 'sequence', 'data')"
    assert specs["['muon'].inner_state[0].mu['layers']['mlp']['w_up']"] == f"P('stage', {zero1}, 'tensor')"
    assert specs["['muon'].inner_state[0].mu['layers']['attn']['wo']"] == f"P('stage', 'tensor', None, {zero1})"
    assert specs["['adamw'].inner_state[0].nu['embed']"] == f"P('tensor', {zero1})"
    assert specs["['muon'].inner_state[0].ns_coeffs"] == "P()" and specs["['muon'].inner_state[0].count"] == "P()"
    muon_moments = {k for k in specs if k.startswith("['muon'].inner_state[0].mu")}
    adam_moments = {k for k in specs if k.startswith("['adamw'].inner_state[0].mu")}
    assert len(muon_moments) == 7 and len(adam_moments) == 5  # each parameter's moment in one part only


def test_the_log_line_names_muons_settings_and_the_split():
    line = optim.describe(muon_cfg(muon_adam_lr=3e-3))
    assert line.startswith("muon (momentum 0.95, Nesterov, 5 Newton-Schulz steps, update RMS "
                           "0.2·sqrt(max(fan_in, fan_out))) on 7 matrices (73,728 weights); adamw (lr 0.003) "
                           "on 5 others (2 embedding/head, 3 norm/bias: 34,112 weights)"), line
    assert "sqrt(max(1, fan_out/fan_in))" in optim.describe(muon_cfg(muon_consistent_rms=0.0, muon_nesterov=False))


@pytest.mark.parametrize("overrides, message", [
    ({"optim.muon_momentum": 1.0}, "optim.muon_momentum must be in [0, 1), got 1.0"),
    ({"optim.muon_ns_steps": 0}, "optim.muon_ns_steps must be a positive int, got 0"),
    ({"optim.muon_consistent_rms": -0.2}, "optim.muon_consistent_rms must be a finite number >= 0, got -0.2"),
    ({"optim.muon_adam_lr": -1e-3}, "optim.muon_adam_lr must be a finite number >= 0"),
])
def test_config_rejects(overrides, message):
    with pytest.raises(ConfigError) as info:
        config_lib.resolve(with_overrides(load_config("tiny"), {"optim.name": "muon", **overrides}), 8)
    assert message in str(info.value)


# ----------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def muon_run(tmp_path_factory, data_dirs):
    """tiny.py, 20 steps of Muon on mesh (data 2, fsdp 4) with ZeRO-1, checkpoints at 10 and 20."""
    workdir = tmp_path_factory.mktemp("muon")
    train_zero1(data_dirs, workdir)
    return workdir


def train_zero1(data_dirs, workdir):
    settings = {**data_dirs, "optim.name": "muon", "mesh.data": 2, "mesh.fsdp": 4,
                "optim.shard_state_over_data": True, "eval.every_steps": 0, "metrics.tensorboard": False}
    with pytest.MonkeyPatch.context() as patch:  # the commands tests start take this peak, unprobed
        patch.setenv(flops.PEAK_ENV, TEST_PEAK_FLOPS_PER_SEC)
        loop.train_and_evaluate(config_lib.resolve(with_overrides(load_config("tiny"), settings), jax.device_count()),
                                str(workdir))


def test_tiny_learns_with_muon_on_a_zero1_mesh(muon_run):
    rows = train_rows(muon_run)
    assert rows[20]["loss"] < rows[5]["loss"] - 0.5, rows  # 5.36 -> 3.87 on 2026-12-05
    assert checkpoint_command.main(["verify", str(muon_run)]) == 0


def test_another_optimizer_may_not_resume_it_and_exits_2(muon_run, data_dirs, tmp_path):
    adamw = config_lib.resolve(with_overrides(load_config("tiny"), data_dirs), jax.device_count())
    with pytest.raises(ConfigError, match="optim.name='adamw', but the checkpoint .* holds 'muon' optimizer state"):
        loop.check_start(adamw, str(muon_run))
    workdir = tmp_path / "copy"
    shutil.copytree(muon_run, workdir)
    result = subprocess.run(
        [sys.executable, "-m", "maxlm.train", "--config=configs/tiny.py", f"--workdir={workdir}", "--config.steps=30",
         *(f"--config.{k}={v}" for k, v in data_dirs.items())],
        cwd=ROOT, env=command_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "holds 'muon' optimizer state" in result.stderr, result.stderr[-3000:]


def test_a_resume_replays_the_last_steps_bit_for_bit(muon_run, data_dirs, tmp_path):
    """Without its last checkpoint, the run resumes from step 10 and trains steps 11-20 to the same
    losses and the same state (Muon's momentum, AdamW's moments) bit for bit. (Through the CLI:
    test_optim.py's test_train_resume_is_bitwise_on_a_zero1_mesh[muon].)"""
    resumed = tmp_path / "resumed"
    shutil.copytree(muon_run, resumed)
    shutil.rmtree(resumed / "checkpoints" / "20")
    (resumed / "metrics.jsonl").write_text("")
    train_zero1(data_dirs, resumed)
    first, again = train_rows(muon_run), train_rows(resumed)
    assert sorted(again) == [15, 20] and [again[s]["loss"] for s in again] == [first[s]["loss"] for s in again]
    for a, b in zip(jax.tree.leaves(saved_state(muon_run, 20)), jax.tree.leaves(saved_state(resumed, 20))):
        np.testing.assert_array_equal(a, b)
