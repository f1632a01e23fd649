"""Sequence (`mesh.sequence`) and pipeline (`mesh.stage`) parallelism: the same numbers as without
them, activations really split along the length, and the config errors."""

import math
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from maxlm import config as config_lib, model
from maxlm.sharding import mesh as mesh_lib
from tests.helpers import ROOT, command_env, fake_devices, load_config, metrics_rows, packed_batch, synthetic_losses

STEPS = 3


def mesh_config(data, fsdp, sequence, tensor, stage=1, **overrides):
    cfg = load_config("tiny")
    cfg.mesh.update(stage=stage, data=data, fsdp=fsdp, sequence=sequence, tensor=tensor)
    # heads divisible by tensor=4, layers by stage=4
    cfg.model.update(num_heads=8, num_kv_heads=4, d_model=64, num_layers=4)
    config_lib.apply_overrides(cfg, overrides)
    return config_lib.resolve(cfg, jax.device_count())


def run(cfg, steps=STEPS):
    """Losses of `steps` train steps on fixed synthetic batches; also returns the final state."""
    return synthetic_losses(cfg, steps)


@pytest.fixture(scope="module")
def reference_losses():
    return run(mesh_config(8, 1, 1, 1))[0]


# (data, fsdp, sequence, tensor): sequence 8 alone, 4 with data, 2 with fsdp and tensor
SEQUENCE_MESHES = [(1, 1, 8, 1), (2, 1, 4, 1), (1, 2, 2, 2)]


@pytest.mark.parametrize("shape", SEQUENCE_MESHES, ids=lambda s: "x".join(map(str, s)))
def test_sequence_parallel_losses_equal_unsharded(shape, reference_losses):
    losses, _ = run(mesh_config(*shape))
    np.testing.assert_allclose(losses, reference_losses, rtol=1e-4)


@pytest.mark.ci
def test_sequence_parallel_with_accumulation_remat_and_chunked_logits():
    knobs = {"optim.grad_accum_steps": 2, "model.remat": "full", "model.logits_chunk_size": 16}
    expected, _ = run(mesh_config(1, 4, 1, 2, **knobs))
    losses, _ = run(mesh_config(1, 2, 2, 2, **knobs))
    np.testing.assert_allclose(losses, expected, rtol=1e-4)


def _loss_and_grads(cfg, params, batch):
    return jax.value_and_grad(lambda p: model.loss_fn(cfg.model, p, batch)[0])(params)


# (stage, data, fsdp, sequence, tensor, pipeline microbatches)
# (with fsdp: test_gradients_equal_unsharded's stage4 cases, and the ci test below)
PIPELINE_MESHES = [(2, 4, 1, 1, 1, 2), (4, 2, 1, 1, 1, 4), (2, 1, 1, 2, 2, 4)]


@pytest.mark.parametrize("shape", PIPELINE_MESHES, ids=lambda s: "x".join(map(str, s[:5])) + f"_m{s[5]}")
def test_pipeline_losses_equal_unpipelined(shape, reference_losses):
    stage, data, fsdp, sequence, tensor, micro = shape
    losses, _ = run(mesh_config(data, fsdp, sequence, tensor, stage, **{"model.pipeline_microbatches": micro}))
    np.testing.assert_allclose(losses, reference_losses, rtol=1e-4)


@pytest.mark.ci
def test_pipeline_with_remat_and_accumulation():
    knobs = {"optim.grad_accum_steps": 2, "model.remat": "save_dots", "model.pipeline_microbatches": 2}
    expected, _ = run(mesh_config(1, 4, 1, 2, **knobs))
    losses, _ = run(mesh_config(1, 2, 1, 2, 2, **knobs))
    np.testing.assert_allclose(losses, expected, rtol=1e-4)


@pytest.mark.parametrize("shape, positions", [((2, 1, 4, 1, 1), "rope"), ((1, 2, 1, 1, 4), "rope"),
                                             ((1, 2, 1, 1, 4), "learned")],
                         ids=["sequence4", "stage4", "stage4_learned"])
def test_gradients_equal_unsharded(shape, positions):
    """The unsharded loss and gradients, with a learned position table too (which the pipeline
    adds to its embeddings itself)."""
    cfg = mesh_config(*shape, **{"model.pipeline_microbatches": 2, "model.positions": positions})
    params = model.init_params(cfg.model, jax.random.key(0))
    batch = {k: jnp.asarray(v) for k, v in packed_batch(cfg.batch_size, cfg.seq_len, cfg.model.vocab_size).items()}
    loss, grads = jax.jit(lambda p, b: _loss_and_grads(cfg, p, b))(params, batch)  # no mesh

    rules = mesh_lib.rules_of(cfg.mesh)
    mesh = mesh_lib.make_mesh(cfg.mesh)
    param_shardings = mesh_lib.logical_to_shardings(model.param_logical_specs(cfg.model), mesh, rules)
    with mesh_lib.activate(mesh, rules):
        sharded_loss, sharded_grads = jax.jit(
            lambda p, b: _loss_and_grads(cfg, p, b),
            in_shardings=(param_shardings, mesh_lib.batch_sharding(mesh, rules)),
        )(jax.device_put(params, param_shardings), mesh_lib.global_batch(batch, mesh, rules))
    np.testing.assert_allclose(float(sharded_loss), float(loss), rtol=1e-5)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(sharded_grads)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-6,
                                   err_msg=jax.tree_util.keystr(path))


def test_activations_and_batch_are_split_along_the_length():
    cfg = mesh_config(2, 1, 4, 1)
    rules = mesh_lib.rules_of(cfg.mesh)
    mesh = mesh_lib.make_mesh(cfg.mesh)
    assert mesh_lib.batch_sharding(mesh, rules).spec == PartitionSpec(("data", "fsdp", "expert"), "sequence")
    params = model.init_params(cfg.model, jax.random.key(0))
    batch = packed_batch(cfg.batch_size, cfg.seq_len, cfg.model.vocab_size)
    with mesh_lib.activate(mesh, rules):
        hidden = jax.jit(lambda p, b: model.hidden_states(cfg.model, p, b))
        global_batch = mesh_lib.global_batch(batch, mesh, rules)
        x_BLD = hidden(params, global_batch)
        hlo = hidden.lower(params, global_batch).compile().as_text()
    assert global_batch["positions"].addressable_shards[0].data.shape == (cfg.batch_size // 2, cfg.seq_len // 4)
    # the residual stream out of the last layer: each device holds B/data rows x L/sequence positions
    assert x_BLD.addressable_shards[0].data.shape == (cfg.batch_size // 2, cfg.seq_len // 4, cfg.model.d_model)
    assert "all-gather" in hlo  # keys and values gathered along the sequence for attention
    # and per device, the [B, L, D] activations inside the layers are [B/2, L/4, D]
    assert f"f32[{cfg.batch_size // 2},{cfg.seq_len // 4},{cfg.model.d_model}]" in hlo


def test_pipeline_stages_hold_their_layers_and_pass_activations_on():
    cfg = mesh_config(4, 1, 1, 1, stage=2, **{"model.pipeline_microbatches": 2})
    rules = mesh_lib.rules_of(cfg.mesh)
    mesh = mesh_lib.make_mesh(cfg.mesh)
    shardings = mesh_lib.logical_to_shardings(model.param_logical_specs(cfg.model), mesh, rules)
    params = jax.device_put(model.init_params(cfg.model, jax.random.key(0)), shardings)
    wq = params["layers"]["attn"]["wq"]  # [layers, D, H, Dh]: each stage holds its half of the layers
    assert wq.addressable_shards[0].data.shape[0] == cfg.model.num_layers // 2
    batch = packed_batch(cfg.batch_size, cfg.seq_len, cfg.model.vocab_size)
    with mesh_lib.activate(mesh, rules):
        hidden = jax.jit(lambda p, b: model.hidden_states(cfg.model, p, b))
        hlo = hidden.lower(params, mesh_lib.global_batch(batch, mesh, rules)).compile().as_text()
    assert "collective-permute" in hlo  # the buffer's shift from stage to stage


# ----------------------------------------------------------------------------- config errors


def test_sequence_config_errors():
    cfg = load_config("tiny")
    cfg.mesh.update(data=1, fsdp=-1, sequence=3)
    with pytest.raises(config_lib.ConfigError, match="mesh.fsdp=-1 cannot be filled"):
        config_lib.resolve(cfg, 8)
    cfg.mesh.update(sequence=8, fsdp=1)
    cfg.seq_len = 60
    with pytest.raises(config_lib.ConfigError, match="seq_len=60 must be divisible by mesh.sequence=8"):
        config_lib.resolve(cfg, 8)
    cfg.seq_len = 128  # a length splash could tile
    for backend in ("cudnn", "splash"):
        cfg.model.attention = backend
        with pytest.raises(config_lib.ConfigError, match=f"model.attention='{backend}' does not support mesh.sequence=8"):
            config_lib.resolve(cfg, 8)
    cfg.model.attention = "auto"
    assert config_lib.resolve(cfg, 8).model.attention == "xla"  # what auto means with sequence > 1
    cfg.mesh.update(sequence=1, fsdp=-1)
    assert config_lib.resolve(cfg, 8).model.attention == "auto"


def test_pipeline_config_errors():
    cfg = load_config("tiny")  # 2 layers, batch 8
    cfg.mesh.update(stage=4, data=2, fsdp=1)
    with pytest.raises(config_lib.ConfigError, match="model.num_layers=2 must be divisible by mesh.stage=4"):
        config_lib.resolve(cfg, 8)
    cfg.mesh.update(stage=2, data=4)
    cfg.model.pipeline_microbatches = 4
    with pytest.raises(config_lib.ConfigError, match="= 1 x 4 x 4 x 1 x 1 = 16"):
        config_lib.resolve(cfg, 8)
    cfg.model.pipeline_microbatches = 0
    with pytest.raises(config_lib.ConfigError, match="model.pipeline_microbatches must be a positive int"):
        config_lib.resolve(cfg, 8)
    cfg.model.pipeline_microbatches = 2
    cfg.model.scan_layers = False
    with pytest.raises(config_lib.ConfigError, match="needs model.scan_layers=True"):
        config_lib.resolve(cfg, 8)
    cfg.model.scan_layers = True
    for kernel in ("cudnn", "auto"):  # every backend runs under the pipeline's vmap (splash: tests/test_kernels.py)
        cfg.model.attention = kernel
        assert config_lib.resolve(cfg, 8).model.attention == kernel
    assert model.bubble_fraction(2, 2) == pytest.approx(1 / 3)


def test_sequence_axis_must_lie_within_a_process():
    devices = np.array(fake_devices(2, 4), dtype=object)
    # (stage, data, fsdp, expert, sequence, tensor) = (1, 2, 1, 1, 4, 1): each process holds one data row, whole
    grid = devices.reshape(1, 2, 1, 1, 4, 1)
    mesh_lib.check_sequence_local(grid, config_lib.MESH_AXES)
    parts = [mesh_lib.grid_batch_parts(grid, config_lib.MESH_AXES, ("data", "fsdp"), p) for p in (0, 1)]
    assert parts == [((0,), 2), ((1,), 2)]
    # (1, 1, 8, 1): one sequence split over both processes
    with pytest.raises(config_lib.ConfigError, match="mesh.sequence=8 spans processes"):
        mesh_lib.check_sequence_local(devices.reshape(1, 1, 1, 1, 8, 1), config_lib.MESH_AXES)
    # (4, 1, 2, 1) laid out with the sequence axis across processes
    with pytest.raises(config_lib.ConfigError, match="mesh.sequence=2 spans processes"):
        mesh_lib.check_sequence_local(devices.reshape(2, 4).T.reshape(1, 4, 1, 1, 2, 1), config_lib.MESH_AXES)


def test_a_sequence_axis_the_topology_lays_across_processes_gets_each_process_a_block():
    """4 processes x 4 devices, fsdp 4 x sequence 4: `process_local_grid` splits fsdp over the
    processes and keeps each sequence group in one (make_mesh falls back to it when the physical
    layout put the sequence axis across hosts)."""
    devices = fake_devices(4, 4)
    grid = mesh_lib.process_local_grid((1, 1, 4, 1, 4, 1), devices)
    mesh_lib.check_sequence_local(grid, config_lib.MESH_AXES)
    assert sorted(d.id for d in grid.flat) == list(range(16))
    assert mesh_lib.process_local_grid((1, 1, 1, 1, 16, 1), devices) is None  # no outer axis to split


# (stage, data, fsdp, sequence, tensor): every axis above 1, each in a mix with others.
CLI_MESHES = [(1, 1, 4, 2, 1), pytest.param((2, 2, 1, 2, 1), marks=pytest.mark.ci),
              pytest.param((2, 1, 2, 1, 2), marks=pytest.mark.ci)]


@pytest.mark.slow
@pytest.mark.parametrize("shape", CLI_MESHES, ids=["1x1x4x2x1", "2x2x1x2x1", "2x1x2x1x2"])
def test_every_parallelism_trains_through_the_cli_with_the_defaults(shape, tmp_path, data_dirs):
    """`python -m maxlm.train` as a user runs it, the defaults on (eval, checkpoint, TensorBoard,
    maxlm's XLA flags): the sequence-parallel eval step once crashed only there, since the loss
    equivalence tests above run the train step alone."""
    stage, data, fsdp, sequence, tensor = shape
    workdir = tmp_path / "run"
    flags = [f"--config.mesh.{axis}={size}" for axis, size in
             zip(("stage", "data", "fsdp", "sequence", "tensor"), shape)]
    result = subprocess.run(
        [sys.executable, "-m", "maxlm.train", "--config=configs/tiny.py", f"--workdir={workdir}",
         "--config.steps=2", "--config.optim.warmup_steps=1", *flags,
         f"--config.model.pipeline_microbatches={2 if stage > 1 else 1}",
         *(f"--config.{k}={v}" for k, v in data_dirs.items())],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=command_env(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    rows = metrics_rows(workdir)
    train_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train_rows] == [2] and math.isfinite(train_rows[0]["loss"])
    assert [r["step"] for r in rows if "eval_loss" in r] == [2]
    assert (workdir / "checkpoints" / "2").is_dir()
