"""DeepSeek-V3's auxiliary-loss-free load balancing over a whole model (`model.load_balance=bias`).

    params = router_bias.rebalanced(model_cfg, params, before, load_ME)   # in the training step

Each MoE layer selects its experts with the param `mlp/router_bias` [E] added to the router's
scores (maxlm/model/moe/). Scanned, the MoE layers are the `layers` group (an MoE model's dense
layers are `dense_layers`), so the biases are one [MoE layers, E] leaf; unrolled, each `layer_i`
with i ≥ first_dense_layers holds its own [E]. The optimizer never moves a bias: its gradient is
stopped in the layer, a vector takes no weight decay (optim.weight_decay_mask), and the training
step sets it from the step's starting value whatever the update did to it.

Shape suffixes: M MoE layers, E experts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from maxlm.model import moe


def enabled(model_cfg) -> bool:
    """True for an MoE model balanced by the selection bias."""
    return bool(model_cfg.num_experts) and model_cfg.load_balance == "bias"


def _unrolled_moe_layers(model_cfg) -> list[str]:
    return [f"layer_{i}" for i in range(moe.dense_layers(model_cfg), model_cfg.num_layers)]


def layer_biases(model_cfg, params) -> jax.Array:
    """The MoE layers' selection biases [M, E], bottom layer first."""
    if model_cfg.scan_layers:
        return params["layers"]["mlp"]["router_bias"]
    return jnp.stack([params[name]["mlp"]["router_bias"] for name in _unrolled_moe_layers(model_cfg)])


def with_layer_biases(model_cfg, params, bias_ME):
    """`params` with the MoE layers' biases replaced by the rows of `bias_ME` (no other leaf copied)."""

    def with_bias(layer, bias):
        return {**layer, "mlp": {**layer["mlp"], "router_bias": bias}}

    if model_cfg.scan_layers:
        return {**params, "layers": with_bias(params["layers"], bias_ME)}
    names = _unrolled_moe_layers(model_cfg)
    return {**params, **{name: with_bias(params[name], bias_ME[m]) for m, name in enumerate(names)}}


def rebalanced(model_cfg, params, before, load_ME):
    """`params` with each MoE layer's bias set to `moe.updated_bias` of its value in `before` (the
    step's starting params) on that layer's load this step, `load_ME` (slots per expert over their
    mean, as `moe.route` reports it)."""
    update = jax.vmap(moe.updated_bias, in_axes=(0, 0, None))
    return with_layer_biases(model_cfg, params, update(layer_biases(model_cfg, before), load_ME,
                                                       model_cfg.bias_update_rate))
