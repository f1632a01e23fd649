"""Speed and memory knobs: gradient accumulation, ZeRO-1, bfloat16 first moments, `bench plan`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxlm import config as config_lib
from maxlm.bench import plan as plan_lib
from maxlm.sharding import mesh as mesh_lib, state as state_lib
from maxlm.train import loop, step as step_lib
from tests.helpers import packed_batch, tiny, train_losses


def padded_batch(cfg, seed=0):
    """A packed batch whose rows hold very different numbers of real tokens, so microbatches do
    too: averaging microbatch means (instead of weighting by tokens) would be visibly wrong."""
    batch = packed_batch(cfg.batch_size, cfg.seq_len, cfg.model.vocab_size, seed=seed)
    for row in range(cfg.batch_size):
        keep = cfg.seq_len * (row + 1) // (cfg.batch_size + 1) if row % 3 else cfg.seq_len
        batch["segment_ids"][row, keep:] = 0
    return batch


def run(cfg, steps):
    return train_losses(cfg, steps, lambda step: padded_batch(cfg, step))


STEPS = 3


@pytest.fixture(scope="module")
def reference():
    """Plain float32 Adam, one big batch, on a (2,2,2) mesh: (losses, final state)."""
    return run(tiny(mesh=(2, 2, 2)), STEPS)


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"optim.grad_accum_steps": 3},
         "batch_size=8 must be divisible by optim.grad_accum_steps x mesh.data x mesh.fsdp x mesh.expert = 3 x 2 x 2 x 1 = 12"),
        ({"optim.grad_accum_steps": 4},
         "batch_size=8 must be divisible by optim.grad_accum_steps x mesh.data x mesh.fsdp x mesh.expert = 4 x 2 x 2 x 1 = 16"),
        ({"optim.grad_accum_steps": 0}, "optim.grad_accum_steps must be a positive int, got 0"),
        ({"optim.mu_dtype": "float16"}, "optim.mu_dtype must be one of"),
    ],
)
def test_config_rejects(overrides, message):
    with pytest.raises(config_lib.ConfigError, match=message.replace("(", r"\(")):
        tiny(overrides, mesh=(2, 2, 2))


# ----------------------------------------------------------------------------- gradient accumulation


def test_grad_accum_equals_the_large_batch_step(reference):
    """2 microbatches on a (2,2,2) mesh == one big batch over 3 steps: losses, updated params and
    Adam moments within 1e-5 relative (float32), with padding spread unevenly over microbatches."""
    batch = padded_batch(tiny(mesh=(2, 2, 2)))
    counts = [(batch["segment_ids"][i::2] > 0).sum() for i in range(2)]
    assert counts[0] != counts[1]  # the microbatches really carry different token counts
    losses, state = run(tiny(mesh=(2, 2, 2), optim=dict(grad_accum_steps=2)), STEPS)
    np.testing.assert_allclose(losses, reference[0], rtol=1e-5)
    # atol: Adam divides by sqrt(v), so a coordinate whose gradient is ~0 turns float32 rounding
    # differences of the summation order into update differences of up to ~lr·1e-4 (3e-7 here).
    for a, b in zip(jax.tree.leaves(reference[1]), jax.tree.leaves(state)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)


def test_grad_accum_gradients_directly():
    """`loss_and_grads` with 4 microbatches vs 1, unsharded: gradients within 1e-5 relative."""
    cfg, accum = tiny(mesh=(1, 1, 1)), tiny(mesh=(1, 1, 1), optim=dict(grad_accum_steps=4))  # 2 rows per microbatch
    batch = {k: jnp.asarray(v) for k, v in padded_batch(cfg, seed=1).items()}
    params = loop.model.init_params(cfg.model, jax.random.key(0))
    (loss_a, aux_a), grads_a = jax.jit(lambda p, b: step_lib.loss_and_grads(cfg, p, b))(params, batch)
    (loss_b, aux_b), grads_b = jax.jit(lambda p, b: step_lib.loss_and_grads(accum, p, b))(params, batch)
    np.testing.assert_allclose(float(loss_b), float(loss_a), rtol=1e-5)
    np.testing.assert_allclose(float(aux_b["cross_entropy"]), float(aux_a["cross_entropy"]), rtol=1e-5)
    assert float(aux_b["num_tokens"]) == float(aux_a["num_tokens"])
    for a, b in zip(jax.tree.leaves(grads_a), jax.tree.leaves(grads_b)):
        scale = float(jnp.abs(a).max())
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-5 * scale)


# ----------------------------------------------------------------------------- ZeRO-1


def test_zero1_shards_moments_over_data_and_keeps_the_numbers(reference):
    losses, state = run(tiny(mesh=(2, 2, 2), optim=dict(shard_state_over_data=True)), STEPS)
    np.testing.assert_allclose(losses, reference[0], rtol=1e-5)
    specs = mesh_lib.describe(state)
    params = {k: v for k, v in specs.items() if k.startswith("['params']")}
    moments = {k: v for k, v in specs.items() if ".mu[" in k or ".nu[" in k}
    assert params and not any("data" in v for v in params.values())
    assert len(moments) == 2 * len(params)
    # every moment gains `data`: on its embed dim when it divides (wq: D=64 over fsdp×data = 4)
    assert all("data" in v for v in moments.values()), moments
    wq = "['layers']['attn']['wq']"
    assert specs[f"['params']{wq}"] == "P('stage', ('fsdp', 'sequence'), 'tensor', None)"
    assert {v for k, v in moments.items() if k.endswith(wq)} == {"P('stage', ('fsdp', 'sequence', 'data'), 'tensor', None)"}


def test_zero1_falls_back_to_another_dim():
    spec = jax.sharding.PartitionSpec
    sizes = {"data": 2, "fsdp": 4, "tensor": 1}
    # embed = 4: 4 % (4·2) != 0, so the next dim that divides (the scanned layers axis) takes data
    assert state_lib.add_data_axis((2, 4, 6), spec(None, "fsdp"), spec("layers", "embed", "mlp"), sizes) \
        == spec("data", "fsdp", None)
    # nothing divides: unchanged
    assert state_lib.add_data_axis((3,), spec("fsdp"), spec("embed"), sizes) == spec("fsdp")


# ----------------------------------------------------------------------------- bfloat16 first moment


def test_bfloat16_first_moment(reference):
    """mu stored in bfloat16 (8 significant bits: each element rounded by <= 2^-9 = 0.2% of
    itself) changes each Adam update by at most about that fraction; over 3 small-lr steps the
    loss moves by ~1e-3 of itself, so the losses agree far inside 1e-4 relative (measured: ~1e-6).
    The parameters do differ (the knob is live); nu and the parameters stay float32."""
    losses, state = run(tiny(mesh=(2, 2, 2), optim=dict(mu_dtype="bfloat16")), STEPS)
    adam = state["opt_state"][1][0]
    assert {x.dtype for x in jax.tree.leaves(adam.mu)} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(adam.nu)} == {jnp.dtype(jnp.float32)}
    assert {x.dtype for x in jax.tree.leaves(state["params"])} == {jnp.dtype(jnp.float32)}
    np.testing.assert_allclose(losses, reference[0], rtol=1e-4)
    ref_params, params = jax.tree.leaves(reference[1]["params"]), jax.tree.leaves(state["params"])
    assert any(not np.array_equal(a, b) for a, b in zip(ref_params, params))
    for a, b in zip(ref_params, params):  # each update off by <= ~0.4%: params within lr·0.4%·steps
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=STEPS * 3e-3 * 4e-3)


# ----------------------------------------------------------------------------- memory plan


def test_plan_reports_memory():
    def plan(remat="none", mesh=(8, 1, 1), **optim_overrides):
        return plan_lib.plan(tiny(mesh=mesh, model=dict(remat=remat), optim=optim_overrides))

    none, full, zero1 = plan("none"), plan("full"), plan("none", shard_state_over_data=True)
    assert {"params", "opt_state", "batch", "temp", "peak"} <= set(none["bytes_per_device"])
    assert {"remat", "mesh", "dtype", "fits", "device_memory_bytes"} <= set(none)
    assert none["remat"] == "none" and none["mesh"] == {"stage": 1, "data": 8, "fsdp": 1, "expert": 1, "sequence": 1, "tensor": 1}
    cfg = tiny(devices=8)
    n_params = loop.model.count_params(cfg.model)
    assert none["bytes_per_device"]["params"] == 4 * n_params  # replicated over data
    assert full["bytes_per_device"]["temp"] < none["bytes_per_device"]["temp"]
    # XLA's own counts; full remat recomputes the forward pass: more FLOPs for less memory
    assert full["xla_cost"]["flops"] > none["xla_cost"]["flops"] > 0
    assert none["xla_cost"]["bytes_accessed"] > 0
    assert zero1["bytes_per_device"]["opt_state"] < none["bytes_per_device"]["opt_state"] / 4
    assert zero1["bytes_per_device"]["params"] == none["bytes_per_device"]["params"]


def plan_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("maxlm: plan ")]


@pytest.mark.slow  # a subprocess
def test_bench_plan_prints_its_compile_phase_on_stderr_and_only_json_on_stdout(tmp_path):
    import json
    import subprocess
    import sys

    from tests.helpers import ROOT, command_env

    done = subprocess.run([sys.executable, "-m", "maxlm.bench", "plan", "--config=configs/tiny.py"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env=command_env(tmp_path, devices=None, MAXLM_PROGRESS_SECONDS="0.1"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout)["benchmark"] == "plan"  # stdout: the JSON alone
    lines = plan_lines(done.stderr)
    assert lines and all(line.startswith("maxlm: plan compile: elapsed ") for line in lines), done.stderr[-3000:]
    assert lines[-1].endswith(", done")
