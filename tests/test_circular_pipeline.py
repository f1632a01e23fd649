"""Circular pipelines (`model.pipeline_repeats` = R > 1, maxlm/model/parallel/pipeline.py): the schedule
runs every layer once per microbatch in layer order, each stage on its own chunks; the model
gives the unpipelined loss and gradients with data, fsdp and remat; the bubble shrinks to
(S - 1)/(R·M + S - 1); the combinations it cannot run are refused; the CLI trains and resumes."""

import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxlm import config as config_lib, model
from maxlm.model.parallel import pipeline
from maxlm.sharding import mesh as mesh_lib
from tests.helpers import ROOT, command_env, load_config, packed_batch, saved_state, train_rows, with_overrides


def toy_layer(x_bLD, p, offset_b):
    """A layer that does not commute with its neighbours: the order of the layers, the microbatch's
    side input and its statistic (the mean of its output) all show in the result."""
    y_bLD = jnp.tanh(x_bLD @ p["w"] + p["b"] + offset_b[:, None, None])
    return y_bLD, {"mean": y_bLD.mean()}


def sequential(params, x_MbLD, offset_Mb):
    """Each microbatch through the N layers in order: (out [M, ...], per-layer mean statistic [N])."""
    per_microbatch = jax.vmap(lambda x, o: jax.lax.scan(lambda x, p: toy_layer(x, p, o), x, params))
    out_MbLD, stats = per_microbatch(x_MbLD, offset_Mb)
    return out_MbLD, stats["mean"].mean(axis=0)


# (stages, repeats, microbatches, layers)
SCHEDULES = [(2, 2, 2, 4), (3, 2, 4, 6), (2, 3, 5, 6), (2, 1, 3, 4)]


@pytest.mark.parametrize(("S", "R", "M", "N"), SCHEDULES, ids=lambda v: str(v))
def test_the_schedule_runs_each_layer_once_per_microbatch_in_order(S, R, M, N):
    """Outputs, layer statistics and gradients of `pipeline.run` (no mesh: the same schedule
    unpartitioned) are the layers applied in order to each microbatch."""
    rng = np.random.default_rng(0)
    D = 4
    params = {"w": jnp.asarray(rng.normal(size=(N, D, D)) / 2, jnp.float32),
              "b": jnp.asarray(rng.normal(size=(N, D)), jnp.float32)}
    specs = {"w": jax.sharding.PartitionSpec("layers", None, None), "b": jax.sharding.PartitionSpec("layers", None)}
    x_MbLD = jnp.asarray(rng.normal(size=(M, 2, 3, D)), jnp.float32)
    offset_Mb = jnp.asarray(rng.normal(size=(M, 2)), jnp.float32)

    def piped(params, x_MbLD):
        out, stats = pipeline.run(toy_layer, params, specs, x_MbLD, (offset_Mb,), S, R)
        return out, stats["mean"]

    out, stats = jax.jit(piped)(params, x_MbLD)
    want_out, want_stats = sequential(params, x_MbLD, offset_Mb)
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(stats, want_stats, rtol=1e-5, atol=1e-6)
    objective = lambda f: lambda p: sum(jnp.sum(a * a) for a in f(p, x_MbLD))  # noqa: E731
    grads = jax.jit(jax.grad(objective(piped)))(params)
    want_grads = jax.grad(objective(lambda p, x: sequential(p, x, offset_Mb)))(params)
    for key in params:
        np.testing.assert_allclose(grads[key], want_grads[key], rtol=1e-4, atol=1e-6, err_msg=key)


def mesh_config(mesh: dict, **overrides):
    cfg = load_config("tiny")
    cfg.mesh.update(mesh)
    cfg.seq_len = 16
    cfg.model.update(num_layers=4, vocab_size=96, mlp_dim=64, pipeline_microbatches=2, pipeline_repeats=2)
    return config_lib.resolve(with_overrides(cfg, overrides), jax.device_count())


def loss_and_grads(cfg, params, batch, mesh=None):
    fn = jax.value_and_grad(lambda p, b: model.loss_fn(cfg.model, p, b)[0])
    if mesh is None:
        return (*jax.jit(fn)(params, batch), "")
    rules = mesh_lib.rules_of(cfg.mesh)
    shardings = mesh_lib.logical_to_shardings(model.param_logical_specs(cfg.model), mesh, rules)
    with mesh_lib.activate(mesh, rules):
        args = jax.device_put(params, shardings), mesh_lib.global_batch(batch, mesh, rules)
        compiled = jax.jit(fn, in_shardings=(shardings, mesh_lib.batch_sharding(mesh, rules))).lower(*args).compile()
        loss, grads = compiled(*args)
    return loss, grads, compiled.as_text()


@pytest.mark.parametrize(("mesh", "knobs"), [
    ({"stage": 2, "data": 4, "fsdp": 1}, {}),
    ({"stage": 2, "data": 2, "fsdp": 2}, {"model.remat": "full", "model.pipeline_microbatches": 4, "batch_size": 16}),
], ids=["stage2_data4", "stage2_data2_fsdp2_remat"])
def test_circular_pipeline_equals_unpipelined(mesh, knobs):
    """2 stages x 2 repeats of 1 layer: the loss within 1e-5 and the gradients within 1e-4 relative
    of the model without a pipeline."""
    cfg = mesh_config(mesh, **knobs)
    params = model.init_params(cfg.model, jax.random.key(0))
    batch = {k: jnp.asarray(v) for k, v in packed_batch(cfg.batch_size, cfg.seq_len, cfg.model.vocab_size).items()}
    want_loss, want_grads, _ = loss_and_grads(cfg, params, batch)  # no mesh: no pipeline
    loss, grads, hlo = loss_and_grads(cfg, params, batch, mesh_lib.make_mesh(cfg.mesh))
    assert "collective-permute" in hlo  # the stages pass their microbatches on
    # the chunks move to their stages, and the gradients back, by all-to-alls, not by gathering
    # the layers on every device (fsdp's own gathers aside)
    assert " all-to-all(" in hlo and (mesh["fsdp"] > 1 or " all-gather(" not in hlo)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(want_grads)[0], jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))


def test_the_bubble_shrinks_with_the_repeats():
    assert model.bubble_fraction(2, 2) == pytest.approx(1 / 3)  # GPipe
    assert model.bubble_fraction(2, 2, 2) == pytest.approx(1 / 5)
    assert model.bubble_fraction(4, 8, 4) == pytest.approx(3 / 35)


@pytest.mark.parametrize(("mesh", "overrides", "message"), [
    ({"stage": 1, "data": 8}, {}, r"model.pipeline_repeats=2 > 1 needs mesh.stage > 1"),
    ({"stage": 2, "data": 4}, {"model.num_layers": 6},
     r"model.num_layers=6 must be divisible by mesh.stage x model.pipeline_repeats = 2 x 2 = 4"),
    ({"stage": 2, "data": 4}, {"model.num_experts": 4, "model.first_dense_layers": 2},
     r"model.first_dense_layers=2 must be divisible by mesh.stage x model.pipeline_repeats = 2 x 2 = 4"),
    ({"stage": 2, "data": 4}, {"model.pipeline_microbatches": 1},
     r"model.pipeline_microbatches=1 must be >= mesh.stage=2 with model.pipeline_repeats=2"),
])
def test_combinations_the_circular_pipeline_cannot_run_are_refused(mesh, overrides, message):
    with pytest.raises(config_lib.ConfigError, match=message):
        mesh_config({"fsdp": 1, **mesh}, **overrides)


@pytest.mark.ci  # three CLI runs
def test_the_cli_trains_a_circular_pipeline_resumes_bitwise_and_may_change_the_repeats(tmp_path, data_dirs):
    """2 stages x 2 repeats x 4 data devices with eval and checkpoints: a copy of the run without its
    last checkpoint resumes to the same losses and state; the checkpoint does not depend on R, so
    another copy resumes with GPipe (R = 1) to the same losses within float rounding."""
    flags = ["--config=configs/tiny.py", "--config.mesh.stage=2", "--config.mesh.data=4", "--config.steps=6",
             "--config.model.num_layers=4", "--config.model.pipeline_microbatches=2",
             "--config.checkpoint.every_steps=3", "--config.eval.every_steps=3", "--config.log_every_steps=1",
             "--config.optim.warmup_steps=2", *(f"--config.{k}={v}" for k, v in data_dirs.items())]

    def train(workdir, repeats):
        result = subprocess.run([sys.executable, "-m", "maxlm.train", f"--workdir={workdir}", *flags,
                                 f"--config.model.pipeline_repeats={repeats}"], cwd=ROOT,
                                capture_output=True, text=True, timeout=300, env=command_env(tmp_path))
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stdout + result.stderr

    whole = tmp_path / "whole"
    log = train(whole, 2)
    assert "pipeline 2 stages x 2 layers, 2 microbatches, bubble 20.0% (circular" in log
    assert "Involuntary full rematerialization" not in log
    for name, repeats in (("resumed", 2), ("gpipe", 1)):
        shutil.copytree(whole, tmp_path / name)
        shutil.rmtree(tmp_path / name / "checkpoints" / "6")
        train(tmp_path / name, repeats)
    want, resumed, gpipe = (train_rows(tmp_path / name) for name in ("whole", "resumed", "gpipe"))
    assert [resumed[s]["loss"] for s in (4, 5, 6)] == [want[s]["loss"] for s in (4, 5, 6)]
    assert jax.tree.all(jax.tree.map(np.array_equal, saved_state(whole, 6), saved_state(tmp_path / "resumed", 6)))
    np.testing.assert_allclose([gpipe[s]["loss"] for s in (4, 5, 6)], [want[s]["loss"] for s in (4, 5, 6)], rtol=1e-5)
    assert want[6]["loss"] < want[1]["loss"]
