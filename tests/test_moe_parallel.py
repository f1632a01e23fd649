"""Expert parallelism (`mesh.expert`, maxlm/model/moe/expert_parallel.py): an MoE model trained on 8
fake CPU devices with its experts split over the expert axis gives the 1-device losses, dropless
(both token dispatches: all-gather, and ragged all-to-all, emulated on CPU) and with capacity,
alone and with fsdp, tensor, sequence, accumulation and remat; the compiled step really exchanges
the tokens; each device holds its share of the experts; the config errors. The ragged
all-to-all's emulation against its documented semantics: tests/test_ragged_exchange.py."""

import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from maxlm import config as config_lib, model
from maxlm.model.moe import expert_parallel
from maxlm.runtime.errors import ConfigError
from maxlm.sharding import mesh as mesh_lib
from tests.helpers import (
    ROOT,
    command_env,
    load_config,
    metrics_rows,
    packed_batch,
    saved_state,
    synthetic_batch,
    train_metrics,
    train_rows,
    with_overrides,
)
from tests.test_moe import assert_the_layer_on_a_mesh_equals

STEPS = 20
E = 8
MOE = {"model.num_experts": E, "model.experts_per_token": 2, "model.first_dense_layers": 0, "model.num_layers": 1,
       "model.expert_mlp_dim": 32, "model.vocab_size": 96, "model.init_std": 0.1, "seq_len": 16, "batch_size": 8}
CAPACITY = 1.0  # C = ceil(1.0 · 16 · 2 / 8) = 4 slots per expert and sequence: some drop


def moe_config(num_devices=8, **overrides):
    cfg = with_overrides(load_config("tiny"), {**MOE, **overrides})
    if num_devices == 1:
        cfg.mesh.fsdp = 1
    return config_lib.resolve(cfg, num_devices)


def run(cfg, steps, devices=None):
    """(losses, dropped fractions, final state) of `steps` steps on the synthetic batches."""
    rows, state = train_metrics(cfg, steps, synthetic_batch(cfg), devices)
    return np.array([row["loss"] for row in rows]), np.array([row["moe_dropped"] for row in rows]), state


# the capacity run is in CI only (make test-ci): make test keeps within its 12 minutes
@pytest.fixture(scope="module", params=[0.0, pytest.param(CAPACITY, marks=pytest.mark.ci)], ids=["dropless", "capacity"])
def one_device(request):
    """The 1-device run (no expert axis: the layer's unsplit path) of both compute modes."""
    factor = request.param
    losses, dropped, _ = run(moe_config(1, **{"model.capacity_factor": factor}), STEPS, jax.devices()[:1])
    return factor, losses, dropped


def test_expert_parallel_losses_equal_one_device(one_device):
    factor, want, want_dropped = one_device
    cfg = moe_config(**{"mesh.expert": 4, "mesh.data": 2, "mesh.fsdp": 1, "model.capacity_factor": factor})
    losses, dropped, state = run(cfg, STEPS)
    np.testing.assert_allclose(losses, want, rtol=1e-4)
    np.testing.assert_allclose(dropped, want_dropped, atol=1e-6)  # the queues are per sequence: the same drops
    assert (dropped > 0).all() if factor else (dropped == 0).all()
    assert want[-1] < want[0]  # it learns: the comparison is over moving weights and routing
    # each device holds E/4 experts' weights, whole: [layers, E/4, D, F]
    w_gate = state["params"]["layers"]["mlp"]["w_gate"]
    m = cfg.model
    assert {s.data.shape for s in w_gate.addressable_shards} == {(1, E // 4, m.d_model, m.expert_mlp_dim)}
    assert w_gate.sharding.spec[1] == "expert"


@pytest.mark.ci  # 14 s; make test keeps the layer's equality below
@pytest.mark.parametrize("one_device", [0.0], indirect=True, ids=["dropless"])  # capacity has one dispatch
def test_the_ragged_all_to_all_dispatch_trains_as_one_device(one_device):
    _, want, _ = one_device
    cfg = moe_config(**{"mesh.expert": 4, "mesh.data": 2, "mesh.fsdp": 1, "model.expert_dispatch": "ragged_all_to_all"})
    losses, dropped, _ = run(cfg, STEPS)
    np.testing.assert_allclose(losses, want, rtol=1e-4)


@pytest.mark.parametrize("backend,axes", [
    ("tiled", {"expert": 4, "data": 2}),
    ("tiled", {"expert": 2, "tensor": 2, "data": 2}),  # each device a slice of the hidden units, psum'd
    ("tiled", {"expert": 2, "fsdp": 2, "sequence": 2}),  # a row's tokens on two devices
    pytest.param("megablox_interpret", {"expert": 4, "data": 2}, marks=pytest.mark.ci),  # spare rows unwritten
    pytest.param("ragged_dot", {"expert": 8}, marks=pytest.mark.ci),  # one expert a device
], ids=["tiled-expert4_data2", "tiled-expert2_tensor2_data2", "tiled-expert2_fsdp2_sequence2",
        "megablox-expert4_data2", "ragged_dot-expert8"])
def test_the_ragged_all_to_all_layer_equals_the_all_gather_one(backend, axes):
    assert_the_layer_on_a_mesh_equals(axes, "expert_dispatch", "ragged_all_to_all", "all_gather",
                                      grouped_matmul=backend)


def test_auto_dispatches_with_ragged_all_to_all_on_gpus_and_tpus():
    assert expert_parallel.dispatch_backend("auto") == "all_gather"  # this CPU
    assert expert_parallel.dispatch_backend("auto", "cpu") == "all_gather"
    assert expert_parallel.dispatch_backend("auto", "gpu") == "ragged_all_to_all"
    assert expert_parallel.dispatch_backend("auto", "tpu") == "ragged_all_to_all"
    assert expert_parallel.dispatch_backend("ragged_all_to_all", "cpu") == "ragged_all_to_all"


# (data, fsdp, expert, sequence, tensor, knobs): expert with each other axis
COMPOSITIONS = [
    (1, 2, 2, 1, 2, {}),
    (1, 1, 4, 2, 1, {"optim.grad_accum_steps": 2, "model.remat": "full"}),
]


@pytest.mark.ci  # 8 compiles: a minute or two on 2 cores
@pytest.mark.parametrize("shape", COMPOSITIONS, ids=["fsdp2_expert2_tensor2", "expert4_sequence2_accum_remat"])
def test_expert_parallel_composes_with_the_other_axes(shape, one_device):
    data, fsdp, expert, sequence, tensor, knobs = shape
    factor, want, want_dropped = one_device
    mesh = {"mesh.data": data, "mesh.fsdp": fsdp, "mesh.expert": expert, "mesh.sequence": sequence,
            "mesh.tensor": tensor}
    if knobs:  # accumulation splits the batch: the reference is the same split on 1 device
        want, want_dropped, _ = run(moe_config(1, **knobs, **{"model.capacity_factor": factor}), 3, jax.devices()[:1])
    losses, dropped, _ = run(moe_config(**mesh, **knobs, **{"model.capacity_factor": factor}), 3)
    np.testing.assert_allclose(losses, want[:3], rtol=1e-4)
    np.testing.assert_allclose(dropped, want_dropped[:3], atol=1e-6)


def collective(hlo: str, op: str, shape: str) -> bool:
    """Whether the HLO text has an `op` (all-to-all, ...) of a `shape` array ("f32[64,64]")."""
    return any(f" {op}(" in line and f"{shape}{{" in line.split(f" {op}(")[0] for line in hlo.splitlines())


@pytest.mark.parametrize("factor", [0.0, CAPACITY], ids=["dropless", "capacity"])
def test_the_compiled_layer_sends_the_tokens_to_their_experts(factor):
    cfg = moe_config(**{"mesh.expert": 4, "mesh.data": 2, "mesh.fsdp": 1, "model.capacity_factor": factor})
    rules = mesh_lib.rules_of(cfg.mesh)
    mesh = mesh_lib.make_mesh(cfg.mesh)
    shardings = mesh_lib.logical_to_shardings(model.param_logical_specs(cfg.model), mesh, rules)
    params = jax.eval_shape(lambda: model.init_params(cfg.model, jax.random.key(0)))
    batch = packed_batch(cfg.batch_size, cfg.seq_len, cfg.model.vocab_size)
    with mesh_lib.activate(mesh, rules):
        hidden = jax.jit(lambda p, b: model.hidden_states(cfg.model, p, b), in_shardings=(shardings, None))
        hlo = hidden.lower(params, mesh_lib.global_batch(batch, mesh, rules)).compile().as_text()
    D, tokens = cfg.model.d_model, cfg.seq_len  # one row of 16 tokens a device
    if factor:  # each device's [B=1, E, C=4, D] buffers go out in 4 parts of [1, E/4, C, D], one a device
        assert collective(hlo, "all-to-all", f"f32[1,{E // 4},4,{D}]")
    else:  # the 4 devices' tokens gathered, [4·16, D], and their outputs reduce-scattered back
        assert collective(hlo, "all-gather", f"f32[{4 * tokens},{D}]")
        assert collective(hlo, "reduce-scatter", f"f32[{tokens},{D}]")


@pytest.mark.ci  # three CLI runs
def test_the_cli_trains_with_expert_parallelism_and_resumes_bitwise(tmp_path, data_dirs):
    """Issue 31's command on 8 CPU devices, eval, checkpoints and TensorBoard on; a copy of the run
    without its last checkpoint resumes from the one before to the same losses and state."""
    flags = ["--config=configs/tiny.py", "--config.model.num_experts=8", "--config.mesh.expert=4",
             "--config.mesh.data=2", "--config.steps=10", "--config.checkpoint.every_steps=5",
             "--config.eval.every_steps=5", "--config.log_every_steps=1", "--config.optim.warmup_steps=2",
             *(f"--config.{k}={v}" for k, v in data_dirs.items())]

    def train(workdir):
        result = subprocess.run([sys.executable, "-m", "maxlm.train", f"--workdir={workdir}", *flags], cwd=ROOT,
                                capture_output=True, text=True, timeout=300, env=command_env(tmp_path))
        assert result.returncode == 0, result.stderr[-3000:]

    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    train(whole)
    shutil.copytree(whole, resumed)
    shutil.rmtree(resumed / "checkpoints" / "10")
    train(resumed)
    got, want = train_rows(resumed), train_rows(whole)
    assert [got[s]["loss"] for s in range(1, 11)] == [want[s]["loss"] for s in range(1, 11)]
    assert want[10]["loss"] < want[1]["loss"]
    assert [r["step"] for r in metrics_rows(whole) if "eval_loss" in r] == [5, 10]
    assert list(whole.glob("events.out.tfevents.*"))
    same = jax.tree.map(np.array_equal, saved_state(whole, 10), saved_state(resumed, 10))
    assert jax.tree.all(same)


# ----------------------------------------------------------------------------- config errors


@pytest.mark.parametrize(("overrides", "message"), [
    ({"model.num_experts": 0, "mesh.expert": 2}, r"mesh.expert=2 > 1 needs a mixture-of-experts model"),
    ({"model.num_experts": 6, "mesh.expert": 4}, r"model.num_experts=6 must be divisible by mesh.expert=4"),
    ({"mesh.expert": 8, "mesh.fsdp": 1, "batch_size": 4},
     r"batch_size=4 must be divisible by mesh.data x mesh.fsdp x mesh.expert = 1 x 1 x 8 = 8"),
    ({"mesh.expert": 4, "mesh.fsdp": 2, "optim.grad_accum_steps": 2},
     r"optim.grad_accum_steps x mesh.data x mesh.fsdp x mesh.expert = 2 x 1 x 2 x 4 = 16"),
    ({"mesh.expert": -1, "mesh.fsdp": 1, "mesh.dcn_expert": 3}, r"mesh.dcn_expert=3 must divide mesh.expert=8"),
    ({"mesh.expert": 0}, r"mesh.expert must be a positive int or -1, got 0"),
])
def test_bad_expert_parallel_configs_are_refused_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        moe_config(**overrides)


def test_the_expert_axis_fills_and_splits_the_batch():
    cfg = moe_config(**{"mesh.expert": -1, "mesh.fsdp": 2})
    assert (cfg.mesh.expert, cfg.mesh.fsdp) == (4, 2)
    mesh = mesh_lib.make_mesh(cfg.mesh)
    assert mesh.axis_names == config_lib.MESH_AXES and mesh.shape["expert"] == 4
    assert mesh_lib.batch_sharding(mesh, mesh_lib.rules_of(cfg.mesh)).spec[0] == ("data", "fsdp", "expert")
