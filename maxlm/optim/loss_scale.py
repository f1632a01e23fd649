"""Dynamic loss scaling, on when `model.dtype` is float16 (and off otherwise).

float16 keeps 11 significant bits (bfloat16 8, float32 24) but only 5 exponent bits: values below
2^-14 ≈ 6e-5 lose precision, below 2^-24 ≈ 6e-8 flush to zero, and above 65504 overflow to inf. A
language model's backward pass carries small values (the loss is a mean over every token of the
batch), so unscaled float16 gradients lose their tail to zero. The step therefore differentiates
`objective × loss_scale` (each microbatch's, with gradient accumulation), which lifts the float16
cotangents by the scale, and divides the float32 gradients by it again (`step.loss_and_grads`).

The scale adapts: a step whose gradients come back non-finite overflowed. Its update is skipped
(parameters and optimizer state unchanged), the scale halves (not below `optim.loss_scale_min`)
and the good-step counter restarts; after `optim.loss_scale_growth_interval` consecutive applied
steps the scale doubles. An overflow is counted in `overflow_steps`, *not* as a bad step
(`skipped_steps`, `bad_streak`, which restore the last checkpoint): the scale handles it. Only at
the minimum scale, where halving cannot help, is a non-finite step a bad step like any other.

The scale needs no ceiling: it can only grow until the float16 backward overflows (~65504 over
the largest cotangent), far below float32's range.

The scale, the good-step counter and the overflow count live in the train state (replicated
scalars), so checkpoints carry them and a resume continues exactly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Train-state entries, present only when loss scaling is on.
STATE_KEYS = ("loss_scale", "good_steps", "overflow_steps")


def enabled(cfg) -> bool:
    return cfg.model.dtype == "float16"


def init(optim_cfg) -> dict:
    zero = jnp.zeros((), jnp.int32)
    return {"loss_scale": jnp.asarray(optim_cfg.loss_scale_init, jnp.float32),
            "good_steps": zero, "overflow_steps": zero}


def value_and_scaled_grad(loss_fn, loss_scale):
    """`jax.value_and_grad(loss_fn, has_aux=True)`, but differentiating `loss × loss_scale`:
    ((loss, aux), scaled gradients), the loss itself unscaled."""

    def scaled(params, batch):
        loss, aux = loss_fn(params, batch)
        return loss * loss_scale, (loss, aux)

    grad_fn = jax.value_and_grad(scaled, has_aux=True)

    def fn(params, batch):
        (_, (loss, aux)), grads = grad_fn(params, batch)
        return (loss, aux), grads

    return fn


def unscale(grads, loss_scale):
    """Gradients of `objective × loss_scale` → gradients of the objective, in float32."""
    return jax.tree.map(lambda g: g.astype(jnp.float32) / loss_scale, grads)


def overflowed(optim_cfg, state, grads_finite) -> jax.Array:
    """Non-finite gradients while the scale can still fall: an overflow the scale handles (the
    update is skipped, but it is not a bad step)."""
    return ~grads_finite & (state["loss_scale"] > optim_cfg.loss_scale_min)


def update(optim_cfg, state, grads_finite, applied) -> dict:
    """The next {loss_scale, good_steps, overflow_steps} after a step whose gradients were finite
    or not (`grads_finite`) and whose update was `applied` or skipped."""
    scale = state["loss_scale"]
    good_steps = jnp.where(applied, state["good_steps"] + 1, 0)
    grow = good_steps >= optim_cfg.loss_scale_growth_interval
    halved = jnp.maximum(scale / 2, jnp.float32(optim_cfg.loss_scale_min))
    return {
        "loss_scale": jnp.where(grads_finite, jnp.where(grow, scale * 2, scale), halved),
        "good_steps": jnp.where(grow, 0, good_steps),
        "overflow_steps": state["overflow_steps"]
        + overflowed(optim_cfg, state, grads_finite).astype(jnp.int32),
    }
