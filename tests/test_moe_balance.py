"""DeepSeek-V3's auxiliary-loss-free balancing (`model.load_balance=bias`, maxlm/model/moe/router_bias.py)
in the training step: the bias moves against each layer's load, only on applied steps and never
by the optimizer, alike in both layer layouts, and it balances a skewed router; the per-layer
router metrics and their console line (maxlm/observe/router_metrics.py). The bitwise resume with
the bias: tests/test_moe_model.py."""

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from maxlm import config as config_lib, model
from maxlm.model.moe import router_bias
from maxlm.observe import metrics as metrics_lib, router_metrics, step_logger
from maxlm.optim import optimizers as optim
from maxlm.train import step as step_lib
from tests.helpers import load_config, packed_batch, random_params, with_overrides

# 3 layers, the first dense: MoE layers 1 and 2; sigmoid scores, as DeepSeek-V3's; two microbatches a step
MOE = {"model.num_experts": 4, "model.experts_per_token": 2, "model.first_dense_layers": 1, "model.num_layers": 3,
       "model.router": "sigmoid", "model.init_std": 0.2, "model.vocab_size": 64, "batch_size": 4, "seq_len": 32,
       "optim.warmup_steps": 0, "optim.weight_decay": 0.1, "optim.grad_accum_steps": 2}


def moe_config(**overrides):
    return config_lib.resolve(with_overrides(load_config("tiny"), {**MOE, **overrides}), 1)


def batch(seed: int):
    return packed_batch(4, 32, 64, seed=seed)


@functools.cache
def compiled_step():
    """(cfg, tx, the jitted `train_step(state, batch, lr_scale, inject_nan)`), compiled once for the module."""
    cfg = moe_config(**{"model.load_balance": "bias", "model.bias_update_rate": 0.05})
    tx = optim.make_optimizer(cfg)
    return cfg, tx, jax.jit(functools.partial(step_lib.train_step, cfg, tx, optim.learning_rate_schedule(cfg)))


def start(tx, params):
    zero = jnp.zeros((), jnp.int32)
    return {"step": zero, "params": params, "opt_state": tx.init(params), "skipped_steps": zero, "bad_streak": zero}


def load_of(cfg, params, batch):
    """Each MoE layer's load [M, E] on `batch`, as the step sees it."""
    aux = jax.jit(functools.partial(model.loss_fn, cfg.model))(params, batch)[1]
    return np.asarray(aux["router"]["layers"]["load_E"])


def test_the_bias_moves_against_the_load_only_on_applied_steps_and_never_by_the_optimizer():
    cfg, tx, step = compiled_step()
    params = random_params(cfg.model, std=0.2)
    bias_ME = jnp.asarray([[0.3, -0.2, 0.1, 0.0], [-0.1, 0.2, 0.0, 0.4]])  # weight decay would shrink these
    params = router_bias.with_layer_biases(cfg.model, params, bias_ME)
    load_ME = load_of(cfg, params, batch(0))
    assert (load_ME != 1.0).any(axis=-1).all()  # every layer unbalanced, so every bias moves
    state, metrics = step(start(tx, params), batch(0), np.float32(1.0), jnp.bool_(False))
    new_ME = np.asarray(router_bias.layer_biases(cfg.model, state["params"]))
    # exactly b + rate·sign(1 − load): an overloaded expert's bias falls, an idle one's rises, and
    # neither AdamW's update nor its weight decay moved it (the other weights did move)
    np.testing.assert_array_equal(new_ME, np.asarray(bias_ME + np.float32(0.05) * np.sign(1.0 - load_ME)))
    assert (new_ME[load_ME > 1] < np.asarray(bias_ME)[load_ME > 1]).all()
    assert not np.array_equal(state["params"]["layers"]["mlp"]["router"], params["layers"]["mlp"]["router"])
    # the step's per-layer metrics, named by the layer's index in the model (layer 0 is dense)
    assert float(metrics["moe/layer_02/load_max"]) == pytest.approx(load_ME[1].max())
    assert float(metrics["moe/layer_01/bias_spread"]) == pytest.approx(np.ptp(new_ME[0]))
    assert float(metrics["moe_bias_spread"]) == pytest.approx(np.ptp(new_ME, axis=-1).max())
    assert {"moe/layer_01/dropped", "moe/layer_01/aux_loss", "moe/layer_02/z_loss"} <= set(metrics)
    assert not any(key.startswith("moe/layer_00/") for key in metrics)
    # a skipped (non-finite) step keeps the bias as it was
    skipped, metrics = step(state, batch(1), np.float32(1.0), jnp.bool_(True))
    assert int(metrics["applied"]) == 0
    np.testing.assert_array_equal(router_bias.layer_biases(cfg.model, skipped["params"]), new_ME)


def test_both_layer_layouts_hold_and_move_the_same_biases():
    cfg = moe_config(**{"model.load_balance": "bias"})
    unrolled_cfg = moe_config(**{"model.load_balance": "bias", "model.scan_layers": False})
    scanned = router_bias.with_layer_biases(cfg.model, random_params(cfg.model), jnp.arange(8.0).reshape(2, 4) / 10)
    unrolled = model.unstack_layers(scanned)
    assert "router_bias" not in unrolled["layer_0"]["mlp"]
    np.testing.assert_array_equal(unrolled["layer_2"]["mlp"]["router_bias"], np.float32([0.4, 0.5, 0.6, 0.7]))
    np.testing.assert_array_equal(router_bias.layer_biases(unrolled_cfg.model, unrolled),
                                  router_bias.layer_biases(cfg.model, scanned))
    load_ME = jnp.asarray([[2.0, 1.0, 0.5, 0.5], [0.0, 0.0, 2.0, 2.0]])
    moved = router_bias.rebalanced(cfg.model, scanned, scanned, load_ME)
    moved_unrolled = router_bias.rebalanced(unrolled_cfg.model, unrolled, unrolled, load_ME)
    assert jax.tree.all(jax.tree.map(np.array_equal, model.unstack_layers(moved), moved_unrolled))
    np.testing.assert_allclose(moved["layers"]["mlp"]["router_bias"],
                               [[-0.001, 0.1, 0.201, 0.301], [0.401, 0.501, 0.599, 0.699]], atol=1e-7)
    assert sum(x.size for x in jax.tree.leaves(unrolled)) == model.count_params(unrolled_cfg.model)
    specs = model.param_logical_specs(unrolled_cfg.model)
    assert jax.tree.structure(specs, is_leaf=model.is_spec) == jax.tree.structure(unrolled)
    assert specs["layer_1"]["mlp"]["router_bias"] == PartitionSpec(None)  # the router's expert dim: unsplit


def skewed(cfg, params, strength: float = 1.0):
    """Every token's embedding shares one direction, along which expert 0's router column points:
    expert 0 wins nearly every token, in every MoE layer."""
    D = cfg.model.d_model
    v_D = jax.random.normal(jax.random.key(7), (D,))
    v_D = strength * v_D / jnp.linalg.norm(v_D)
    layers = params["layers"]
    router = layers["mlp"]["router"].at[..., 0].add(v_D)
    return {**params, "embed": params["embed"] + cfg.model.init_std * np.sqrt(D) * v_D,
            "layers": {**layers, "mlp": {**layers["mlp"], "router": router}}}


def test_the_bias_balances_a_skewed_router_where_nothing_else_does():
    """load_balance=none selects as load_balance=bias does with the bias held at 0 (and neither adds
    a balancing loss), so `none` here is the same compiled step with the bias reset before each step."""
    cfg, tx, step = compiled_step()
    loads = {}
    for mode in ("none", "bias"):
        state = start(tx, skewed(cfg, random_params(cfg.model, std=0.2)))
        loads[mode] = []
        for i in range(24):  # the learning rate scaled down: the router itself stays as skewed
            if mode == "none":
                state["params"] = router_bias.with_layer_biases(cfg.model, state["params"], jnp.zeros((2, 4)))
            state, metrics = step(state, batch(i), np.float32(1e-3), jnp.bool_(False))
            loads[mode].append(float(metrics["moe_load_max"]))
    none, bias = np.array(loads["none"]), np.array(loads["bias"])
    assert none.min() > 1.7 and bias[0] > 1.7  # both start nearly all on expert 0 (2.0: every token)
    assert bias[-8:].mean() < 1.6 and bias[-8:].mean() < none[-8:].mean() - 0.3


def test_the_console_line_names_each_worst_layer(caplog):
    row = {"loss": 2.0, "moe_load_max": 1.84,
           "moe/layer_01/load_max": 1.2, "moe/layer_01/dropped": 0.003, "moe/layer_01/bias_spread": 0.012,
           "moe/layer_05/load_max": 1.84, "moe/layer_05/dropped": 0.001, "moe/layer_05/bias_spread": 0.004}
    assert router_metrics.console_line(100, row) == (
        "step    100 | moe load_max 1.84 (layer 5) | dropped 0.3% (layer 1) | bias_spread 0.012 (layer 1)")
    assert router_metrics.console_line(100, {"loss": 2.0, "moe_load_max": 1.84}) is None
    dropless = {"moe/layer_01/load_max": 1.2, "moe/layer_01/dropped": 0.0, "moe/layer_02/dropped": 0.0}
    assert router_metrics.console_line(7, dropless) == "step      7 | moe load_max 1.20 (layer 1) | dropped 0.0%"
    # the step logger prints it after the step's line, from the row it writes
    logger = step_logger.StepLogger(metrics_lib.NullWriter(), start_step=99, total_steps=200, log_every=100,
                                    tokens_per_step=8, flops_per_token=1.0, peak_flops_per_sec=1.0)
    with caplog.at_level(logging.INFO, logger="maxlm"):
        logger.step_done(100, {**row, "num_tokens": 8.0})
        logger.flush()
    assert caplog.messages[-1] == router_metrics.console_line(100, row)
