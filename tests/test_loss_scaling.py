"""float16 compute with dynamic loss scaling (maxlm/optim/loss_scale.py): the forward at init, the
step's skip / halve / grow rules, the bad-step machinery at the minimum scale, precision against
float32 and bfloat16, gradient accumulation, checkpoints and an exact resume."""

import math
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from maxlm import config as config_lib, model
from maxlm.checkpoint import __main__ as checkpoint_command, compatibility, store as checkpoint
from maxlm.data import make_dataset
from maxlm.model import attention
from maxlm.optim import loss_scale, optimizers as optim
from maxlm.sharding import mesh as mesh_lib, state as state_lib
from maxlm.train import loop, step as step_lib
from tests.helpers import metrics_rows, packed_batch, saved_state, tiny, train_losses, train_rows

FP16 = {"model.dtype": "float16"}


def host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


# ----------------------------------------------------------------------------- config and state


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"optim.loss_scale_init": 0.0}, "optim.loss_scale_init must be a positive finite number, got 0.0"),
        ({"optim.loss_scale_init": math.inf}, "optim.loss_scale_init must be a positive finite number, got inf"),
        ({"optim.loss_scale_min": -1.0}, "optim.loss_scale_min must be a positive finite number, got -1.0"),
        ({"optim.loss_scale_init": 0.5}, "optim.loss_scale_init=0.5 is below optim.loss_scale_min=1;"),
        ({"optim.loss_scale_init": 1024.0, "optim.loss_scale_min": 4096.0},
         "optim.loss_scale_init=1024 is below optim.loss_scale_min=4096;"),
        ({"optim.loss_scale_growth_interval": 0},
         "optim.loss_scale_growth_interval must be a positive int (good steps before the loss scale doubles), got 0"),
        ({"model.dtype": "half"}, "model.dtype must be one of ('float32', 'bfloat16', 'float16'), got 'half'"),
        ({"optim.mu_dtype": "float16"}, "optim.mu_dtype must be one of ('float32', 'bfloat16')"),
    ],
)
def test_config_errors(overrides, message):
    with pytest.raises(config_lib.ConfigError) as info:
        tiny(**{**FP16, **overrides})
    assert message in str(info.value)


def test_loss_scale_is_in_the_state_only_with_float16():
    """float16: a float32 scale at optim.loss_scale_init plus int32 counters, replicated like the
    other scalars; float32 and bfloat16 states (and so their checkpoints) are unchanged."""
    for dtype in ("float32", "bfloat16"):
        cfg = tiny(**{"model.dtype": dtype})
        assert set(state_lib.abstract_state(cfg, optim.make_optimizer(cfg))) == {
            "step", "params", "opt_state", "skipped_steps", "bad_streak"}
    cfg = tiny(mesh=(2, 2, 2), **FP16)
    tx = optim.make_optimizer(cfg)
    mesh = mesh_lib.make_mesh(cfg.mesh)
    shapes = state_lib.abstract_state(cfg, tx)
    shardings = state_lib.shardings(cfg, tx, mesh, mesh_lib.rules_of(cfg.mesh), shapes)
    dtypes = {"loss_scale": jnp.float32, "good_steps": jnp.int32, "overflow_steps": jnp.int32}
    for key, dtype in dtypes.items():
        assert shapes[key].shape == () and shapes[key].dtype == dtype
        assert shardings[key].spec == jax.sharding.PartitionSpec() and shardings[key].is_fully_replicated
    assert {x.dtype for x in jax.tree.leaves(shapes["params"])} == {jnp.dtype(jnp.float32)}
    assert {x.dtype for x in jax.tree.leaves(shapes["opt_state"])} <= {jnp.dtype(jnp.float32), jnp.dtype(jnp.int32)}


# ----------------------------------------------------------------------------- the forward pass


def test_float16_forward_at_init_stays_in_range():
    """configs/tiny.py at init on a full 8 x 64 batch: the float16 hidden states (final-normed)
    stay far inside float16's range (|h| < 65504) and are finite; logits are float32. (The loss
    and the scaled gradients: test_scaling_keeps_float16_gradients_and_accumulation_matches.)"""
    cfg = tiny(mesh=(1, 1, 1), **FP16)
    batch = {k: jnp.asarray(v) for k, v in packed_batch(8, 64, 264).items()}
    params = model.init_params(cfg.model, jax.random.key(0))
    h = jax.jit(lambda p, b: model.hidden_states(cfg.model, p, b))(params, batch)
    assert h.dtype == jnp.float16 and bool(jnp.isfinite(h).all())
    assert float(jnp.abs(h).max()) < 100  # measured ~3.8: RMS-normed, then the norm scale (1)
    assert jax.eval_shape(lambda p, b: model.apply(cfg.model, p, b), params, batch).dtype == jnp.float32


def test_float16_attention_masks_with_a_float32_fill():
    """Scores are float32 before the mask's fill (float32's min, which float16 could not hold), so
    a masked key gets exactly zero weight in float16 too: a huge value at a future (masked)
    position leaves the output unchanged, and every output is finite."""
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 8, 2, 16)), jnp.float16) for _ in range(3))
    mask = attention.attention_mask(jnp.ones((1, 8), jnp.int32))
    out = attention.xla_attention(q, k, v, mask)
    assert out.dtype == jnp.float16 and bool(jnp.isfinite(out).all())
    poisoned = attention.xla_attention(q, k, v.at[:, 7].set(60000.0), mask)
    np.testing.assert_array_equal(np.asarray(poisoned[:, :7]), np.asarray(out[:, :7]))
    ref = attention.xla_attention(*(x.astype(jnp.float32) for x in (q, k, v)), mask)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref), atol=5e-3)


def test_scaling_keeps_float16_gradients_and_accumulation_matches():
    """One batch at init, unsharded. The float16 loss (float32 logits) is float32's within 1e-3
    (one float16 rounding is <= 2^-11 ≈ 4.9e-4 relative; the mean over 512 tokens only shrinks
    it). Unscaled (scale 1) float16 gradients lose their small values to zero (measured: 2.4% off
    float32, max-normalized); at the default 2^15 they are finite and within 0.3% (measured 0.13%;
    ~0.05% per rounding). With 4 microbatches, each scaled, the gradients equal the 1-microbatch
    ones within 2e-3 (measured 5e-4: both float16 computations, summed in another order). At 2^30
    the float16 backward overflows: non-finite, for the step to skip."""
    cfg32, cfg16 = tiny(mesh=(1, 1, 1)), tiny(mesh=(1, 1, 1), **FP16)
    accum = tiny(mesh=(1, 1, 1), **FP16, **{"optim.grad_accum_steps": 4})
    batch = {k: jnp.asarray(v) for k, v in packed_batch(8, 64, 264, seed=1).items()}
    params = model.init_params(cfg32.model, jax.random.key(0))
    (loss32, _), want = jax.jit(lambda p, b: step_lib.loss_and_grads(cfg32, p, b))(params, batch)
    grads16 = jax.jit(lambda p, b, s: step_lib.loss_and_grads(cfg16, p, b, s))
    grads_accum = jax.jit(lambda p, b, s: step_lib.loss_and_grads(accum, p, b, s))

    def err(got, ref):
        return max(float(jnp.abs(a - b).max() / jnp.abs(b).max())
                   for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)))

    (_, _), unscaled = grads16(params, batch, jnp.float32(1.0))
    (loss, aux), scaled = grads16(params, batch, jnp.float32(2.0**15))
    (loss_a, aux_a), scaled_accum = grads_accum(params, batch, jnp.float32(2.0**15))
    assert loss.dtype == jnp.float32
    np.testing.assert_allclose(float(loss), float(loss32), rtol=1e-3)
    assert err(scaled, want) < 3e-3 and err(unscaled, want) > 5 * err(scaled, want)
    assert err(scaled_accum, scaled) < 2e-3
    np.testing.assert_allclose(float(loss_a), float(loss), rtol=1e-5)  # the loss is unscaled
    assert float(aux_a["num_tokens"]) == float(aux["num_tokens"])
    (_, _), overflowed = grads16(params, batch, jnp.float32(2.0**30))
    (_, _), overflowed_accum = grads_accum(params, batch, jnp.float32(2.0**30))
    assert not math.isfinite(float(optax.tree.norm(overflowed)))
    assert not math.isfinite(float(optax.tree.norm(overflowed_accum)))


# ----------------------------------------------------------------------------- the step's rules


def without_schedule_count(opt_state):
    is_schedule = lambda x: isinstance(x, optax.ScaleByScheduleState)  # noqa: E731
    return jax.tree.map(lambda x: None if is_schedule(x) else x, opt_state, is_leaf=is_schedule)


def test_overflow_skips_halves_and_only_the_minimum_counts_as_bad():
    """Jitted float16 steps with injected non-finite gradients (what an overflow gives), growth
    interval 2 and minimum 2^13, from 2^15."""
    cfg = tiny(**FP16, **{"optim.loss_scale_growth_interval": 2, "optim.loss_scale_min": 2.0**13})
    rules, mesh = mesh_lib.rules_of(cfg.mesh), mesh_lib.make_mesh(cfg.mesh)
    tx = optim.make_optimizer(cfg)
    state, shardings = state_lib.create_sharded_state(cfg, tx, mesh, rules, jax.random.key(0))
    train_fn = step_lib.make_train_step(cfg, tx, mesh, rules, shardings, inject_nan=True)
    counters = ("loss_scale", "good_steps", "overflow_steps", "bad_streak", "skipped_steps")

    def step(overflow: bool):
        nonlocal state
        before = host(state)  # the step donates `state`
        batch = mesh_lib.global_batch(packed_batch(8, 64, 264, seed=int(before["step"])), mesh, rules)
        with mesh_lib.activate(mesh, rules):
            state, metrics = train_fn(state, batch, np.float32(1.0), np.bool_(overflow))
        after = host(state)
        # the schedule's count follows the step, skipped or not (maxlm/train/step.py); the rest stays
        unchanged = all(np.array_equal(a, b) for a, b in zip(
            jax.tree.leaves((before["params"], without_schedule_count(before["opt_state"]))),
            jax.tree.leaves((after["params"], without_schedule_count(after["opt_state"])))))
        assert float(metrics["loss_scale"]) == float(before["loss_scale"])  # the scale it used
        assert after["step"] == before["step"] + 1
        return unchanged, tuple(float(after[k]) for k in counters)

    # (loss_scale, good_steps, overflow_steps, bad_streak, skipped_steps) after each step
    assert step(False) == (False, (2.0**15, 1, 0, 0, 0))
    assert step(False) == (False, (2.0**16, 0, 0, 0, 0))  # 2 good steps: doubled
    assert step(True) == (True, (2.0**15, 0, 1, 0, 0))  # overflow: skipped bitwise, halved
    assert step(False) == (False, (2.0**15, 1, 1, 0, 0))
    assert step(True) == (True, (2.0**14, 0, 2, 0, 0))  # the good-step count restarts
    assert step(True) == (True, (2.0**13, 0, 3, 0, 0))  # down to the minimum
    assert step(True) == (True, (2.0**13, 0, 3, 1, 1))  # at the minimum: a bad step
    assert step(True) == (True, (2.0**13, 0, 3, 2, 2))
    assert step(False) == (False, (2.0**13, 1, 3, 0, 2))  # a good step ends the bad streak


# ----------------------------------------------------------------------------- precision


STEPS = 8
MESH = (2, 2, 2)


@pytest.fixture(scope="module")
def corpus_losses(data_dirs):
    """Losses of 8 steps on the built-in corpus (mesh 2x2x2) for float32, bfloat16, float16."""
    cfg = tiny(mesh=MESH, **data_dirs)
    data = make_dataset(cfg, "train")

    def run(**overrides):
        return train_losses(tiny(mesh=MESH, **data_dirs, **overrides), STEPS, lambda s: data.batch(s, 0, 1))

    return data, {dtype: run(**{"model.dtype": dtype}) for dtype in ("float32", "bfloat16", "float16")}


def test_float16_training_matches_float32_closer_than_bfloat16(corpus_losses):
    """One rounding is <= 2^-11 ≈ 4.9e-4 relative in float16, 2^-8 ≈ 3.9e-3 in bfloat16; the loss
    averages 512 tokens' roughly independent errors, ~u/sqrt(512): ~2e-5 (float16), ~2e-4
    (bfloat16). Over 8 steps (measured on this CPU, over 10 steps: 8e-6 and 6e-5) we allow 1e-4
    and 1e-3, and float16 must be the closer of the two, as its 3 extra bits predict. The CPU keeps
    some float16 intermediates in float32 (XLA's excess precision), so this bounds the GPU's error
    from below, not above."""
    _, runs = corpus_losses
    (f32, _), (bf16, _), (f16, state) = runs["float32"], runs["bfloat16"], runs["float16"]
    assert f32[-1] < f32[0] - 0.5  # real text: it learns
    np.testing.assert_allclose(f16, f32, rtol=1e-4)
    np.testing.assert_allclose(bf16, f32, rtol=1e-3)
    assert np.abs(f16 - f32).mean() < np.abs(bf16 - f32).mean()
    assert float(state["loss_scale"]) == 2.0**15 and int(state["overflow_steps"]) == 0
    assert int(state["good_steps"]) == STEPS


def test_float16_grad_accumulation_equals_the_large_batch_step(corpus_losses):
    """2 microbatches, each scaled, on the 2x2x2 mesh == one batch: losses within 1e-4 relative
    over 8 steps (measured: 1.2e-5 over 10), the same scale and counters."""
    data, runs = corpus_losses
    losses, state = train_losses(tiny(mesh=MESH, **FP16, **{"optim.grad_accum_steps": 2}), STEPS,
                                 lambda s: data.batch(s, 0, 1))
    want, want_state = runs["float16"]
    np.testing.assert_allclose(losses, want, rtol=1e-4)
    for key in ("loss_scale", "good_steps", "overflow_steps"):
        assert float(state[key]) == float(want_state[key])


# ----------------------------------------------------------------------------- checkpoints


def test_checkpoints_without_the_loss_scale_restore_both_ways(tmp_path, capsys):
    """A float32 checkpoint (no loss scale: also what checkpoints from before it existed hold)
    resumed by a float16 run: everything else restored, the scale from the run's own state, with a
    warning. A float16 checkpoint restored by a float32 run: the scale is not read. (A float32
    run's state is a float16 run's without the loss-scale entries: parameters are float32 in both.)"""
    cfg = tiny(**FP16, **{"optim.loss_scale_init": 512.0})
    tx, mesh = optim.make_optimizer(cfg), mesh_lib.make_mesh(cfg.mesh)
    state16, shardings = state_lib.create_sharded_state(cfg, tx, mesh, mesh_lib.rules_of(cfg.mesh), jax.random.key(1))
    abstract16 = state_lib.abstract_state(cfg, tx, shardings)
    no_scale = lambda tree: {k: v for k, v in tree.items() if k not in loss_scale.STATE_KEYS}
    state32, abstract32 = no_scale(state16), no_scale(abstract16)
    assert set(state32) == set(state_lib.abstract_state(tiny(), tx))
    for name, state in (("f32", state32), ("f16", state16)):
        ckpt = checkpoint.Checkpointer(str(tmp_path / name), cfg.checkpoint)
        ckpt.save(0, state, {"seed": 1}, cfg.to_dict())
        ckpt.close()

    restored, _ = checkpoint.Checkpointer(str(tmp_path / "f32"), cfg.checkpoint).restore_latest(abstract16)
    assert set(restored) == set(state32)
    fresh = {**jax.tree.map(jnp.zeros_like, state32), **{k: state16[k] for k in loss_scale.STATE_KEYS}}
    merged = state_lib.with_missing_from(restored, fresh, "DIR")
    assert "the checkpoint of step 0 in DIR has no loss scale (written without float16 compute): " \
           "using 512" in capsys.readouterr().err
    assert set(merged) == set(state16) and float(merged["loss_scale"]) == 512.0
    for a, b in zip(jax.tree.leaves(merged["params"]), jax.tree.leaves(state16["params"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # from the checkpoint

    restored, _ = checkpoint.restore_state(str(tmp_path / "f16" / "checkpoints" / "0"), abstract32)
    assert set(restored) == set(state32)
    assert compatibility.verify_one(str(tmp_path / "f16" / "checkpoints" / "0")) is None


# ----------------------------------------------------------------------------- through the loop


LOOP = {"eval.every_steps": 0, "log_every_steps": 1, "metrics.tensorboard": False,
        "checkpoint.every_steps": 5, **FP16}


@pytest.fixture(scope="module")
def growing_run(tmp_path_factory, data_dirs):
    """20 float16 steps from scale 256, doubling every 4 good steps, an overflow injected at step
    13; checkpoints every 5."""
    workdir = tmp_path_factory.mktemp("fp16")
    cfg = tiny(**data_dirs, **LOOP, **{"optim.loss_scale_init": 256.0,
                                       "optim.loss_scale_growth_interval": 4, "debug.nan_at_step": 12})
    loop.train_and_evaluate(cfg, str(workdir))
    return cfg, workdir


@pytest.mark.slow
def test_loop_grows_and_halves_the_scale_and_reports_it(growing_run):
    _, workdir = growing_run
    rows = train_rows(workdir)
    used = {1: 256, 5: 512, 9: 1024, 13: 2048, 14: 1024, 18: 2048}  # from this step on
    scale = 0
    for step in range(1, 21):
        scale = used.get(step, scale)
        assert rows[step]["loss_scale"] == scale, step
        assert rows[step]["overflow_steps"] == (step >= 13)
        assert rows[step]["bad_streak"] == rows[step]["skipped_steps"] == 0  # not a bad step
        assert math.isfinite(rows[step]["loss"])
    assert not math.isfinite(float(rows[13]["grad_norm"]))  # written as "nan"
    assert rows[13]["param_norm"] == rows[12]["param_norm"]  # skipped
    assert rows[14]["param_norm"] != rows[13]["param_norm"]  # and training goes on
    assert rows[20]["loss"] < rows[1]["loss"] - 0.5
    saved = saved_state(workdir, 15)  # the scale, its counter and the overflow count are saved
    assert (float(saved["loss_scale"]), int(saved["good_steps"]), int(saved["overflow_steps"])) == (1024.0, 2, 1)
    assert checkpoint_command.main(["verify", str(workdir)]) == 0


@pytest.mark.slow
def test_resume_restores_the_scale_exactly(growing_run, tmp_path):
    """Resumed from step 15 (scale 1024, 2 of 4 good steps): it doubles after step 17 again, and
    losses, scales and the final state equal the uninterrupted run's bit for bit."""
    cfg, workdir = growing_run
    resumed = tmp_path / "resumed"
    shutil.copytree(workdir, resumed)
    shutil.rmtree(resumed / "checkpoints" / "20")
    (resumed / "metrics.jsonl").write_text("")
    assert loop.train_and_evaluate(cfg, str(resumed))["step"] == 20
    got, want = train_rows(resumed), train_rows(workdir)
    assert sorted(got) == list(range(16, 21))
    for step in got:
        for key in ("loss", "loss_scale", "param_norm", "overflow_steps", "grad_norm"):
            assert got[step][key] == want[step][key], (step, key)
    a, b = saved_state(resumed, 20), saved_state(workdir, 20)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y)
    assert float(a["loss_scale"]) == 2048.0 and int(a["good_steps"]) == 3


@pytest.mark.slow
@pytest.mark.ci  # make test keeps within its 12 minutes (CI runs it: make test-ci)
def test_non_finite_at_the_minimum_scale_is_a_bad_step(tmp_path, data_dirs, capsys):
    """From scale 4 (minimum 1), steps 12-16 non-finite: 12 and 13 are overflows (4 → 2 → 1),
    14-16 at the minimum are bad steps, and the third restores the last checkpoint (step 10, scale
    4); the replay is clean and the run finishes."""
    cfg = tiny(**data_dirs, **LOOP, **{"optim.loss_scale_init": 4.0, "optim.loss_scale_min": 1.0,
                                       "debug.nan_at_step": 11, "debug.nan_steps": 5})
    last = loop.train_and_evaluate(cfg, str(tmp_path))
    assert "3 consecutive non-finite steps up to step 16: restored step 10" in capsys.readouterr().err
    first = {}
    for row in metrics_rows(tmp_path):
        first.setdefault(row["step"], row)
    got = [tuple(first[s][k] for k in ("loss_scale", "overflow_steps", "bad_streak", "skipped_steps"))
           for s in range(11, 17)]
    assert got == [(4, 0, 0, 0), (4, 1, 0, 0), (2, 2, 0, 0), (1, 2, 1, 1), (1, 2, 2, 2), (1, 2, 3, 3)]
    replay = train_rows(tmp_path)
    assert [replay[s]["loss_scale"] for s in range(11, 21)] == [4] * 10  # restored with step 10
    assert last["step"] == 20 and last["overflow_steps"] == last["skipped_steps"] == 0
    assert math.isfinite(last["loss"])
