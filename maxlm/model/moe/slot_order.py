"""The dropless MoE's two permutations of its token-slots.

    inverse_N = inverse(order_N)                      # each slot's rank in the sort
    x_MD = by_expert(x_TD, order_M, inverse_N, K)     # each slot's token row, the slots in expert order
    y_ND = by_token(y_MD, order_M, inverse_N, K)      # back in token-slot order, [T·K, D]

Slot n = t·K + k is token t's k-th choice; `order_M` lists the slots in expert order (the first M
of the stable sort: all N = T·K of them, or under expert parallelism those of this device's
experts) and `inverse_N` is the sort's inverse, each slot's rank (M or more: not among them).

Both are gathers. JAX's own backward of a gather is a scatter-add into the gathered array; from
K = GATHERED_BACKWARD_FROM_K experts a token, each backward here is a gather too, as MaxText
writes its sorts': `by_expert`'s gathers the slot gradients back into token order and sums each
token's K, `by_token`'s gathers by `order_M`. Measured in v5p-64 plans of two layers
(docs/performance.md#moe-side-by-side): with 64 experts top-8 the gathers cut XLA's bytes by 9%
(358 → 324 GB); with Mixtral's top-2 they add 2% bytes and 1.6 GB of temp, so top-2 keeps JAX's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

GATHERED_BACKWARD_FROM_K = 3


def inverse(order_N):
    """The inverse permutation of `order_N`, by a scatter (no second sort)."""
    ranks_N = jnp.arange(order_N.shape[0], dtype=order_N.dtype)
    return jnp.zeros_like(order_N).at[order_N].set(ranks_N, unique_indices=True)


def by_expert(x_TD, order_M, inverse_N, K: int):
    """[M, D]: row m is the activations of slot order_M[m]'s token."""
    if K < GATHERED_BACKWARD_FROM_K:
        return x_TD[order_M // K]
    return _by_expert_gathered(x_TD, order_M, inverse_N, K)


def by_token(y_MD, order_M, inverse_N, K: int):
    """[N, D]: row n is slot n's row of y_MD (0 for a slot ranked M or later)."""
    if K < GATHERED_BACKWARD_FROM_K:
        return y_MD.at[inverse_N].get(mode="fill", fill_value=0)
    return _by_token_gathered(y_MD, order_M, inverse_N)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _by_expert_gathered(x_TD, order_M, inverse_N, K):
    return x_TD[order_M // K]


def _by_expert_fwd(x_TD, order_M, inverse_N, K):
    return _by_expert_gathered(x_TD, order_M, inverse_N, K), (order_M, inverse_N)


def _by_expert_bwd(K, residuals, g_MD):
    _, inverse_N = residuals
    T = inverse_N.shape[0] // K
    g_TKD = g_MD.at[inverse_N].get(mode="fill", fill_value=0).reshape(T, K, -1)  # slots past M: 0
    return g_TKD.sum(axis=1, dtype=jnp.float32).astype(g_MD.dtype), None, None


_by_expert_gathered.defvjp(_by_expert_fwd, _by_expert_bwd)


@jax.custom_vjp
def _by_token_gathered(y_MD, order_M, inverse_N):
    return y_MD.at[inverse_N].get(mode="fill", fill_value=0)


def _by_token_fwd(y_MD, order_M, inverse_N):
    return _by_token_gathered(y_MD, order_M, inverse_N), (order_M, inverse_N)


def _by_token_bwd(residuals, g_ND):
    order_M, _ = residuals
    return g_ND[order_M], None, None  # slot order_M[m] is the one row m went to


_by_token_gathered.defvjp(_by_token_fwd, _by_token_bwd)
