"""Causal load balancing for ring attention (`model.context_load_balance`): the zig-zag order.

Under a causal mask, a ring's device i attends to i + 1 of the n blocks: the last device does n×
the first's work while the others wait. In zig-zag (dual-chunk) order the length is cut into 2n
chunks and device i holds chunks i and 2n-1-i, an early and a late one, so every device attends
to about the same number of keys (the ring's `_block_mask` reads each token's original index,
`token_order`, so the mask stays exact).

The model's entry points reorder the batch's [B, L] arrays (`reorder`); the training loss is a
sum over tokens, so it is computed in the zig-zag order and never put back, while anything that
returns per-position values (hidden states, logits) restores the order (`restore`).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from maxlm.model.parallel import ring_attention


def shards(model_cfg) -> int:
    """The ring's size when `model.context_load_balance` reorders tokens here, else 0 (off)."""
    if not (model_cfg.context_load_balance and ring_attention.active(model_cfg)):
        return 0
    return jax.sharding.get_abstract_mesh().shape[ring_attention.ring_axis()]


def _chunk_order(n: int) -> list[int]:
    """Chunk i of the zig-zag layout is chunk `_chunk_order(n)[i]` of the sequence: 0, 2n-1, 1, 2n-2, ..."""
    return [c for i in range(n) for c in (i, 2 * n - 1 - i)]


def token_order(length: int, n: int) -> np.ndarray:
    """[L]: the original index of each position in zig-zag order over `n` devices."""
    return np.arange(length).reshape(2 * n, -1)[_chunk_order(n)].reshape(length)


def _permute_chunks(x, n: int, order, axes):
    B, L = x.shape[:2]
    chunks = x.reshape(B, 2 * n, L // (2 * n), *x.shape[2:])
    out = jnp.take(chunks, jnp.asarray(order), axis=1).reshape(x.shape)
    return nn.with_logical_constraint(out, axes)


def reorder(batch: dict, n: int) -> dict:
    """The batch's [B, L] arrays in zig-zag order over `n` devices."""
    return {k: _permute_chunks(v, n, _chunk_order(n), ("batch", "length")) for k, v in batch.items()}


def restore(x_BL_, n: int, axes):
    """`x_BL_` ([B, L, ...] in zig-zag order; logical `axes`) in the original order."""
    return _permute_chunks(x_BL_, n, np.argsort(_chunk_order(n)), axes)
