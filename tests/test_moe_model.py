"""The mixture-of-experts layers in the Transformer: both layer layouts alike, the router losses in
the objective, the parameter and FLOP counts, the KV-cache decoding, training and an exact resume,
and the bad configs refused (the layer's own math: tests/test_moe.py)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxlm import config as config_lib, generate as gen, model
from maxlm.model import moe
from maxlm.model.moe import router_bias
from maxlm.observe import flops
from maxlm.runtime.errors import ConfigError
from maxlm.train import loop
from tests.helpers import load_config, losses, saved_state, train_rows, with_overrides

MOE = {"model.num_experts": 4, "model.experts_per_token": 2, "model.first_dense_layers": 1, "model.num_layers": 3,
       "model.router_z_loss": 1e-3, "model.init_std": 0.2, "model.vocab_size": 64}


def moe_config(**overrides):
    return config_lib.resolve(with_overrides(load_config("tiny"), {**MOE, **overrides}), jax.device_count())


def batch_of(tokens):
    return {"inputs": tokens, "targets": tokens, "segment_ids": jnp.ones_like(tokens),
            "positions": jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)}


def test_both_layouts_hold_the_same_layers_and_give_the_same_objective_with_the_router_losses():
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, 64, (2, 16)), jnp.int32)
    results = {}
    for scan in (True, False):
        cfg = moe_config(**{"model.scan_layers": scan})
        params = model.init_params(cfg.model, jax.random.key(0))
        assert sum(x.size for x in jax.tree.leaves(params)) == model.count_params(cfg.model)
        specs = model.param_logical_specs(cfg.model)
        assert jax.tree.structure(specs, is_leaf=model.is_spec) == jax.tree.structure(params)
        results[scan] = (params, jax.jit(functools.partial(model.loss_fn, cfg.model))(params, batch_of(tokens)))
    (scanned, (loss, aux)), (unrolled, (loss_u, _)) = results[True], results[False]
    assert sorted(scanned) == ["dense_layers", "embed", "final_norm", "head", "layers"]
    assert "router" in unrolled["layer_1"]["mlp"] and "router" not in unrolled["layer_0"]["mlp"]
    assert jax.tree.all(jax.tree.map(np.array_equal, model.unstack_layers(scanned), unrolled))
    assert jax.tree.all(jax.tree.map(np.array_equal, model.stack_layers(unrolled), scanned))
    assert float(loss) == pytest.approx(float(loss_u), abs=1e-6)
    # the objective is the cross-entropy plus the router losses averaged over the two MoE layers
    cfg = moe_config()
    _, stats = model.forward(cfg.model, scanned, batch_of(tokens))
    assert stats["aux_loss"].shape == (2,) and stats["load_E"].shape == (2, 4)
    router = 0.01 * stats["aux_loss"].mean() + 1e-3 * stats["z_loss"].mean()
    assert float(loss) == pytest.approx(float(aux["cross_entropy"] + router), rel=1e-6)


def test_active_parameters_and_flops_count_the_routed_experts_only():
    cfg = moe_config(**{"model.shared_experts": 1})
    m = cfg.model
    D, E, F = m.d_model, m.num_experts, m.expert_mlp_dim
    assert F == m.mlp_dim  # expert_mlp_dim 0 means mlp_dim
    unused = 2 * (E - m.experts_per_token) * 3 * D * F  # two MoE layers, 2 of 4 experts idle
    assert model.count_params(m) - model.active_params(m) == unused
    dense = with_overrides(load_config("tiny"), {"model.num_layers": 3, "model.vocab_size": 64})
    dense = config_lib.resolve(dense, jax.device_count()).model
    extra = 2 * 2 * (D * E + 3 * D * F * (m.experts_per_token + m.shared_experts - 1))  # per token, 2 layers
    assert flops.forward_flops_breakdown(m, 64)["mlp"] == flops.forward_flops_breakdown(dense, 64)["mlp"] + extra


def test_cached_decoding_equals_the_whole_sequence():
    cfg = moe_config()
    params = model.init_params(cfg.model, jax.random.key(1))
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, 64, (2, 10)), jnp.int32)
    expected = jax.jit(functools.partial(model.apply, cfg.model))(params, batch_of(tokens))
    logits, cache = jax.jit(functools.partial(gen.prefill, cfg.model, max_len=10))(params, tokens[:, :4])
    np.testing.assert_allclose(logits, expected[:, :4], atol=1e-5, rtol=0)
    decode = jax.jit(functools.partial(gen.decode_step, cfg.model))
    for t in range(4, 10):
        position = jnp.full((2,), t, jnp.int32)
        logits, cache = decode(params, tokens[:, t], position, cache)
        np.testing.assert_allclose(logits, expected[:, t], atol=1e-5, rtol=0)


@pytest.mark.ci
@pytest.mark.slow
def test_an_moe_model_trains_on_8_devices_and_resumes_exactly_balancing_bias_included(tmp_path, data_dirs):
    overrides = {**data_dirs, "eval.every_steps": 5, "log_every_steps": 1, "checkpoint.every_steps": 5,
                 "metrics.tensorboard": False, "model.vocab_size": 264, "model.init_std": 0.02,
                 "model.load_balance": "bias", "model.bias_update_rate": 0.01}
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    loop.train_and_evaluate(moe_config(**overrides, steps=10), str(whole))
    loop.train_and_evaluate(moe_config(**overrides, steps=5), str(resumed))
    loop.train_and_evaluate(moe_config(**overrides, steps=10), str(resumed))
    got, want = losses(resumed), losses(whole)
    assert got == want and sorted(got) == list(range(1, 11))
    assert want[10] < want[1]
    cfg = moe_config(**overrides)
    bias = {run: np.asarray(router_bias.layer_biases(cfg.model, saved_state(run, 10)["params"])) for run in (whole, resumed)}
    np.testing.assert_array_equal(bias[resumed], bias[whole])
    assert np.ptp(bias[whole], axis=-1).min() > 0  # it did move, in both MoE layers
    row = train_rows(whole)[10]  # the router's numbers, in metrics.jsonl and TensorBoard alike
    assert row["moe_load_max"] >= 1.0 and row["moe_dropped"] == 0.0 and row["moe_aux_loss"] >= 1.0
    assert row["moe_z_loss"] > 0 and row["moe_bias_spread"] == pytest.approx(np.ptp(bias[whole], axis=-1).max())
    assert row["moe_load_max"] == max(row[f"moe/layer_0{i}/load_max"] for i in (1, 2)) and "moe/layer_00/load_max" not in row


@pytest.mark.parametrize(("overrides", "message"), [
    ({"model.experts_per_token": 5}, r"model.experts_per_token=5 is more than model.num_experts=4"),
    ({"model.first_dense_layers": 3}, r"model.first_dense_layers=3 leaves no MoE layer"),
    ({"model.router_groups": 3}, r"model.router_groups=3 must divide model.num_experts=4"),
    ({"model.router_groups": 2, "model.router_topk_groups": 0}, r"model.router_topk_groups=0 must be in \[1"),
    ({"model.router": "top1"}, r"model.router"),
    ({"model.capacity_factor": -1.0}, r"model.capacity_factor"),
    ({"model.load_balance": "bias", "model.bias_update_rate": 0.0}, r"model.bias_update_rate"),
])
def test_bad_moe_configs_are_refused_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        moe_config(**overrides)


def test_a_dense_model_is_unchanged():
    cfg = config_lib.resolve(load_config("tiny"), jax.device_count())
    params = model.init_params(cfg.model, jax.random.key(0))
    assert sorted(params) == ["embed", "final_norm", "head", "layers"] and "router" not in params["layers"]["mlp"]
    assert model.layer_groups(cfg.model) == [("layers", cfg.model.num_layers, False)]
    assert model.active_params(cfg.model) == model.count_params(cfg.model)
    assert moe.ROUTERS == ("softmax", "sigmoid")
