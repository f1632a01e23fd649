"""The token-embedding lookup tokens_BL → x_BLD, with its backward pass written out.

Forward: the float32 table is cast to the compute dtype before it is gathered whole on every
device (ZeRO-3 all-gathers it as it would any weight), so the gathered copy is half float32's size;
taking rows commutes with the cast, so the embeddings are the same bits.

Backward: the table's gradient is the sum of each token's gradient into its row. Left to JAX, it
is a scatter-add into a whole float32 [V, D] zero table on every device (2 GB for Llama 3 8B),
reduced over the batch's devices. Here the rows are summed a block of rows at a time, each block
reduced to the table's fsdp sharding before the next starts, so a device holds one float32 block
(at most GRAD_BLOCK_BYTES) instead of the whole table. The sum stays float32: MaxText gathers
from a bfloat16 copy and sums repeated tokens in bfloat16.
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

GRAD_BLOCK_BYTES = 256 * 2**20  # a float32 block of the table's gradient, per device


def lookup(table_VD: jax.Array, tokens_BL: jax.Array, dtype) -> jax.Array:
    """Rows of `table_VD` for `tokens_BL`, [B, L, D] in `dtype`."""
    return _lookup(jnp.dtype(dtype), GRAD_BLOCK_BYTES, table_VD, tokens_BL)


def grad_blocks(vocab: int, d_model: int, itemsize: int, block_bytes: int) -> int:
    """How many row blocks the gradient is summed in: the fewest whose blocks fit `block_bytes`."""
    return max(1, math.ceil(vocab * d_model * itemsize / block_bytes))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _lookup(dtype, block_bytes, table_VD, tokens_BL):
    del block_bytes
    whole_VD = nn.with_logical_constraint(table_VD.astype(dtype), ("vocab", "act_embed"))
    return jnp.take(whole_VD, tokens_BL, axis=0)


def _lookup_fwd(dtype, block_bytes, table_VD, tokens_BL):
    # The table is a parameter, alive through the step anyway: keeping it costs nothing.
    return _lookup(dtype, block_bytes, table_VD, tokens_BL), (table_VD, tokens_BL)


def _lookup_bwd(dtype, block_bytes, residuals, g_BLD):
    table_VD, tokens_BL = residuals
    V, D = table_VD.shape
    blocks = grad_blocks(V, D, table_VD.dtype.itemsize, block_bytes)
    rows = -(-V // blocks)
    ids_N, g_ND = tokens_BL.reshape(-1), g_BLD.reshape(-1, D)

    def block_grad(first_row):
        local_N = ids_N - first_row
        local_N = jnp.where((local_N >= 0) & (local_N < rows), local_N, rows)  # `rows`: dropped
        block_RD = jnp.zeros((rows, D), table_VD.dtype).at[local_N].add(
            g_ND.astype(table_VD.dtype), mode="drop")
        # Reduced over the batch's devices into the fsdp sharding here, block by block.
        return nn.with_logical_constraint(block_RD, (None, "embed"))

    if blocks == 1:
        grad_VD = block_grad(0)
    else:
        grad_VD = jax.lax.map(block_grad, jnp.arange(blocks) * rows).reshape(blocks * rows, D)[:V]
    grad_VD = nn.with_logical_constraint(grad_VD, ("vocab", "embed"))
    return grad_VD, None  # token ids are integers: no cotangent


_lookup.defvjp(_lookup_fwd, _lookup_bwd)
