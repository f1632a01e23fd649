"""An MoE model in the pipeline (`mesh.stage` > 1, maxlm/model/parallel/pipeline.py): the dense first layers
and the MoE layers each split over the stages give the unpipelined loss, gradients and router
statistics (each microbatch's combined into the whole batch's) and the balancing bias's update,
with expert parallelism and multi-token prediction too; the shapes the pipeline cannot split are
refused."""

import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxlm import config as config_lib, model
from maxlm.model.moe import router_bias
from maxlm.observe import router_metrics
from maxlm.runtime.errors import ConfigError
from maxlm.sharding import mesh as mesh_lib
from tests.helpers import (
    ROOT,
    command_env,
    load_config,
    packed_batch,
    random_params,
    saved_state,
    train_rows,
    with_overrides,
)

# 2 dense layers then 2 MoE layers: one of each a stage with mesh.stage=2
MOE = {"model.num_experts": 4, "model.experts_per_token": 2, "model.first_dense_layers": 2, "model.num_layers": 4,
       "model.expert_mlp_dim": 32, "model.vocab_size": 96, "seq_len": 16, "batch_size": 8,
       "model.pipeline_microbatches": 2, "model.router_z_loss": 1e-3}


def moe_config(mesh: dict, **overrides):
    cfg = with_overrides(load_config("tiny"), {**MOE, **{f"mesh.{k}": v for k, v in mesh.items()}, **overrides})
    return config_lib.resolve(cfg, jax.device_count())


def loss_aux_grads(cfg, params, batch, mesh=None):
    """(loss, aux, grads) of `model.loss_fn`, jitted, and the compiled HLO text; under `mesh` (and
    its rules) when given."""
    fn = jax.value_and_grad(lambda p, b: model.loss_fn(cfg.model, p, b), has_aux=True)
    if mesh is None:
        compiled = jax.jit(fn).lower(params, batch).compile()
        (loss, aux), grads = compiled(params, batch)
        return loss, aux, grads, compiled.as_text()
    rules = mesh_lib.rules_of(cfg.mesh)
    shardings = mesh_lib.logical_to_shardings(model.param_logical_specs(cfg.model), mesh, rules)
    with mesh_lib.activate(mesh, rules):
        args = jax.device_put(params, shardings), mesh_lib.global_batch(batch, mesh, rules)
        compiled = jax.jit(fn, in_shardings=(shardings, mesh_lib.batch_sharding(mesh, rules))).lower(*args).compile()
        (loss, aux), grads = compiled(*args)
    return loss, aux, grads, compiled.as_text()


def assert_trees_close(got, want, rtol, atol):
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(want)[0], jax.tree.leaves(got), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=rtol, atol=atol,
                                   err_msg=jax.tree_util.keystr(path))


def has_collective(hlo: str, op: str) -> bool:
    return any(f" {op}(" in line for line in hlo.splitlines())


# (mesh, knobs): the pipeline with data and the balancing bias; with fsdp and the experts split over
# `expert` (a capacity: the all-to-all exchange), multi-token prediction and remat; with data and the
# experts split (dropless: the all-gather exchange)
CASES = [
    pytest.param({"stage": 2, "data": 4, "fsdp": 1}, {"model.load_balance": "bias"}, marks=pytest.mark.ci),  # 13 s
    ({"stage": 2, "data": 1, "fsdp": 2, "expert": 2},
     {"model.capacity_factor": 1.0, "model.mtp_depth": 1, "model.remat": "full", "model.pipeline_microbatches": 4,
      "batch_size": 16}),
    # the dropless exchange GPUs and TPUs use (emulated here) under the pipeline's vmap
    pytest.param({"stage": 2, "data": 2, "fsdp": 1, "expert": 2}, {"model.expert_dispatch": "ragged_all_to_all"},
                 marks=pytest.mark.ci),
    # a circular pipeline: 4 dense then 4 MoE layers, each group 2 chunks of 1 layer a stage (15 s: ci)
    pytest.param({"stage": 2, "data": 4, "fsdp": 1},
                 {"model.pipeline_repeats": 2, "model.num_layers": 8, "model.first_dense_layers": 4,
                  "model.load_balance": "bias"}, marks=pytest.mark.ci),
]
# a distinct bias for each MoE layer (up to 4)
ROUTER_BIAS = [[0.0, 0.1, -0.1, 0.05], [0.1, 0.0, 0.0, -0.1], [-0.1, 0.05, 0.1, 0.0], [0.05, -0.1, 0.0, 0.1]]


@pytest.mark.parametrize(("mesh", "knobs"), CASES, ids=["stage2_data4_bias", "stage2_fsdp2_expert2_capacity_mtp_remat",
                                                        "stage2_data2_expert2", "stage2_repeats2_data4_bias"])
def test_pipelined_moe_equals_unpipelined(mesh, knobs):
    cfg = moe_config(mesh, **knobs)
    params = random_params(cfg.model, std=0.1)
    moe_layers = cfg.model.num_layers - cfg.model.first_dense_layers
    if cfg.model.load_balance == "bias":  # a bias that changes the selection, moved by a skewed load
        params["layers"]["mlp"]["router_bias"] = jnp.asarray(ROUTER_BIAS[:moe_layers])
    batch = {k: jnp.asarray(v) for k, v in packed_batch(cfg.batch_size, cfg.seq_len, cfg.model.vocab_size).items()}
    want_loss, want_aux, want_grads, _ = loss_aux_grads(cfg, params, batch)  # no mesh: no pipeline
    loss, aux, grads, hlo = loss_aux_grads(cfg, params, batch, mesh_lib.make_mesh(cfg.mesh))
    assert has_collective(hlo, "collective-permute")  # the stages pass their microbatches on
    if mesh.get("expert", 1) > 1:  # the experts' exchange runs in the stages
        assert has_collective(hlo, "all-to-all" if cfg.model.capacity_factor else "reduce-scatter")
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
    assert_trees_close(grads, want_grads, rtol=1e-4, atol=1e-5)
    # the router's statistics, aggregate and per layer ([MoE layers, ...]), the MTP losses, the metrics
    assert aux["router"]["layers"]["load_E"].shape == (moe_layers, 4)
    assert_trees_close(aux["router"], want_aux["router"], rtol=1e-5, atol=1e-6)
    assert_trees_close(aux.get("mtp"), want_aux.get("mtp"), rtol=1e-5, atol=1e-6)
    assert_trees_close(router_metrics.of_step(cfg.model, aux["router"], params),
                       router_metrics.of_step(cfg.model, want_aux["router"], params), rtol=1e-5, atol=1e-6)
    # not a balanced router, which any way of combining the microbatches would reproduce
    assert float(want_aux["router"]["aux_loss"]) > 1.01
    if cfg.model.capacity_factor:
        assert float(want_aux["router"]["dropped"]) > 0
    if router_bias.enabled(cfg.model):  # the training step's update of the biases, from the step's load
        step_load = lambda a: a["router"]["layers"]["load_E"]  # noqa: E731
        rebalanced = [router_bias.layer_biases(cfg.model, router_bias.rebalanced(cfg.model, params, params, step_load(a)))
                      for a in (aux, want_aux)]
        assert not np.array_equal(rebalanced[1], params["layers"]["mlp"]["router_bias"])
        np.testing.assert_array_equal(*rebalanced)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"model.first_dense_layers": 1}, r"model.first_dense_layers=1 must be divisible by mesh.stage=2"),
    ({"model.first_dense_layers": 1, "model.num_layers": 3}, r"model.num_layers=3 must be divisible by mesh.stage=2"),
])
def test_layer_groups_the_stages_cannot_split_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        moe_config({"stage": 2, "data": 4, "fsdp": 1}, **overrides)


@pytest.mark.ci  # two CLI runs
def test_the_cli_trains_a_pipelined_moe_model_and_resumes_bitwise(tmp_path, data_dirs):
    """An MoE model with dense first layers on 2 stages x 4 data devices, balanced by the bias:
    a copy of the run without its last checkpoint resumes to the same losses, router metrics and state."""
    flags = ["--config=configs/tiny.py", "--config.mesh.stage=2", "--config.mesh.data=4", "--config.steps=6",
             "--config.checkpoint.every_steps=3", "--config.eval.every_steps=3", "--config.log_every_steps=1",
             "--config.optim.warmup_steps=2", "--config.model.load_balance=bias",
             *(f"--config.{k}={v}" for k, v in {**MOE, "seq_len": 64, "model.vocab_size": 264}.items()),
             *(f"--config.{k}={v}" for k, v in data_dirs.items())]

    def train(workdir):
        result = subprocess.run([sys.executable, "-m", "maxlm.train", f"--workdir={workdir}", *flags], cwd=ROOT,
                                capture_output=True, text=True, timeout=300, env=command_env(tmp_path))
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stdout + result.stderr

    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    assert "pipeline 2 stages x 2 layers" in train(whole)
    shutil.copytree(whole, resumed)
    shutil.rmtree(resumed / "checkpoints" / "6")
    train(resumed)
    got, want = train_rows(resumed), train_rows(whole)
    keys = ["loss", "moe_aux_loss", "moe/layer_03/load_max", "moe/layer_02/bias_spread"]
    assert [[got[s][k] for k in keys] for s in (4, 5, 6)] == [[want[s][k] for k in keys] for s in (4, 5, 6)]
    assert want[6]["loss"] < want[1]["loss"] and want[6]["moe/layer_02/bias_spread"] > 0
    assert jax.tree.all(jax.tree.map(np.array_equal, saved_state(whole, 6), saved_state(resumed, 6)))
