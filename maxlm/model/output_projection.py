"""The output projection x_BLD → logits_BLV, with its backward pass written out.

JAX's own transpose of `einsum("bld,dv->blv")` asks XLA for the weight gradient as
dot(g_BLV, x_BLD) → [V, D] and then transposes it to the weight's [D, V]. XLA:CPU lays that out by
transposing the [B, L, V] gradient (the largest array of the step) before the matmul and the
[V, D] result after it, in untiled copies: a tenth of the train step of a 20M-parameter model with
a 32k vocabulary (docs/performance.md#side-by-side-with-maxtext). Asking for the gradient in the
weight's own layout, einsum("bld,blv->dv"), leaves XLA only the small [B, L, D] operand to
transpose. Same products and sums, in the order a matmul takes them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def project(weight_spec: str, x_BLD: jax.Array, w: jax.Array) -> jax.Array:
    """einsum(f"bld,{weight_spec}->blv", x_BLD, w): weight_spec is "dv" ([D, V] head) or "vd"
    (the [V, D] embedding, tied); both operands in the compute dtype."""
    return jnp.einsum(f"bld,{weight_spec}->blv", x_BLD, w)


def _project_fwd(weight_spec, x_BLD, w):
    return project(weight_spec, x_BLD, w), (x_BLD, w)


def _project_bwd(weight_spec, residuals, g_BLV):
    x_BLD, w = residuals
    dx_BLD = jnp.einsum(f"blv,{weight_spec}->bld", g_BLV, w)
    dw = jnp.einsum(f"bld,blv->{weight_spec}", x_BLD, g_BLV)
    return dx_BLD.astype(x_BLD.dtype), dw.astype(w.dtype)


project.defvjp(_project_fwd, _project_bwd)
