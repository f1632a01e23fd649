"""Unrolled layers whose weight gradients are done before the layer below starts its backward.

    x, _ = backward_order.call_in_order(layer, x, *other_inputs)   # layer: a Flax module

Forward, exactly `layer(x, ...)`. Backward, the layer's input gradient is released only once its
weight gradients are done: one optimization barrier holds both. The layer below, recomputation
included, starts from that input gradient, so one barrier per layer orders the whole pass.

Why: left free, libtpu's scheduler (default flags) puts every layer's weight-gradient matmuls,
with their FSDP reduce-scatters, at the end of the backward pass, next to the optimizer that reads
them. Each layer's [B, L, F] MLP gradients and a layout copy then stay live across all the layers
below it: most of the step's memory (Llama 3 8B on a v5p-64, remat full: 91.8 GB of temp planned,
15.0 GB with the barrier; docs/performance.md#compiled-for-v5p-no-tpu). The numbers are the same
either way: the barrier only orders. A scanned stack needs none of this, since each loop
iteration finishes its own layer's gradients.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp


def call(layer, *args):
    """The layer, left free."""
    return layer(*args)


def _forward(layer, *args):
    return nn.vjp(call, layer, *args)


def _backward(vjp_fn, cotangent):
    param_grads, *input_grads = vjp_fn(cotangent)
    # Only float gradients pass the barrier (integer inputs, positions and segment ids, get
    # float0 ones). The weight gradients pass in the compute dtype, as the reduce-scatter made
    # them, and are returned unbarriered: holding their float32 casts instead made XLA keep those
    # (Llama 3.2 1B on a v5p-8: 5.8 GB more bytes accessed a step, against 2.7 GB this way).
    leaves, treedef = jax.tree.flatten(input_grads)
    tied = [i for i, g in enumerate(leaves) if jnp.issubdtype(g.dtype, jnp.inexact)]
    compute_dtype = jax.tree.leaves(cotangent)[0].dtype  # the layer output's gradient
    weights_done = jax.tree.map(lambda g: g.astype(compute_dtype), param_grads)
    _, released = jax.lax.optimization_barrier((weights_done, [leaves[i] for i in tied]))
    for i, g in zip(tied, released):
        leaves[i] = g
    return (param_grads, *jax.tree.unflatten(treedef, leaves))


call_in_order = nn.custom_vjp(call, forward_fn=_forward, backward_fn=_backward)
