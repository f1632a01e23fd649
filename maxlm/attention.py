"""Splash attention: the Pallas flash-attention kernel for TPUs (`model.attention="splash"`).

    out_BLHDh = splash_attention(q_BLHDh, k_BSKDh, v_BSKDh, segment_ids_BL)

Same semantics as `model.xla_attention` with `model.attention_mask`: causal, only within a document
(`segment_ids`; 0 = padding, which attends to earlier padding, so no softmax row is ever empty),
grouped-query heads, softmax in float32. Splash ("sparse flash") attention
(`jax.experimental.pallas.ops.tpu.splash_attention`) never writes the [L, S] scores to HBM and
skips the key blocks the causal mask hides entirely (about half of them).

What the kernel does and does not do (read from its source, jax 0.10):
- it does not scale the scores: q is multiplied by 1/sqrt(Dh) here, before the kernel;
- its layout is [heads, length, head_dim] for one sequence: we transpose and vmap over batch;
- grouped-query attention is native: the "MHA" kernel takes k/v with K heads and reads kv head
  h // (H/K) for query head h, forward and backward (dk, dv accumulate over the group), so k/v are
  never repeated in memory. That is the grouping `xla_attention` uses (head h = kv_head·G + g);
- the mask is a static causal `MultiHeadMask` and'ed with `SegmentIds(q=ids, kv=ids)`;
- block sizes must be multiples of 128 (the TPU's lane width) and divide the sequence, hence
  `block_size` below and the seq_len check in `config.resolve`.

A Pallas call cannot be partitioned by GSPMD, so under a mesh the kernel runs inside
`jax.shard_map`: batch split over the mesh axes of the `batch` rule, heads over those of the
`heads` rule (kv heads follow: the config makes them divisible by the same axes), length and head
dim whole on each device.
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash_kernel
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask
from jax.sharding import PartitionSpec

LANES = 128  # a splash block is a multiple of this
BLOCK_SIZES = (512, 256, 128)  # tried largest first; 512 is MaxText's default on v5e/v5p


def block_size(seq_len: int) -> int:
    """The largest of BLOCK_SIZES dividing `seq_len` (the same for q and kv, forward and backward)."""
    for block in BLOCK_SIZES:
        if seq_len % block == 0:
            return block
    raise ValueError(f"splash attention needs a sequence length divisible by {LANES}, got {seq_len}")


def make_kernel(num_heads: int, seq_len: int, block: int, interpret: bool = False):
    """A causal splash kernel for `num_heads` query heads of `seq_len` tokens (one sequence)."""
    causal = splash_mask.CausalMask((seq_len, seq_len))
    mask = splash_mask.MultiHeadMask(tuple(causal for _ in range(num_heads)))
    sizes = splash_kernel.BlockSizes(
        block_q=block, block_kv=block, block_kv_compute=block,
        block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
        block_q_dq=block, block_kv_dq=block,
    )
    return splash_kernel.make_splash_mha(
        mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret
    )


def _splash_local(q_BLHDh, k_BSKDh, v_BSKDh, segment_ids_BL, *, block, interpret):
    """The kernel on one device's shard (or the whole arrays without a mesh)."""
    _, L, H, Dh = q_BLHDh.shape
    kernel = make_kernel(H, L, block, interpret)
    q_BHLDh = jnp.swapaxes(q_BLHDh * (1.0 / math.sqrt(Dh)), 1, 2)  # the kernel does not scale
    k_BKSDh = jnp.swapaxes(k_BSKDh, 1, 2)
    v_BKSDh = jnp.swapaxes(v_BSKDh, 1, 2)

    def one_sequence(q_HLDh, k_KSDh, v_KSDh, segment_ids_L):
        return kernel(q_HLDh, k_KSDh, v_KSDh, splash_kernel.SegmentIds(q=segment_ids_L, kv=segment_ids_L))

    out_BHLDh = jax.vmap(one_sequence)(q_BHLDh, k_BKSDh, v_BKSDh, segment_ids_BL)
    return jnp.swapaxes(out_BHLDh, 1, 2)


def splash_attention(q_BLHDh, k_BSKDh, v_BSKDh, segment_ids_BL, *, block: int | None = None,
                     interpret: bool = False):
    """Causal, per-document attention [B, L, H, Dh] with the splash kernel.

    `block`: the kernel's tile (default `block_size(L)`). `interpret=True` runs the kernel in the
    Pallas interpreter on any backend (slow; for tests).
    """
    local = functools.partial(
        _splash_local, block=block or block_size(q_BLHDh.shape[1]), interpret=interpret
    )
    if jax.sharding.get_abstract_mesh().empty:
        return local(q_BLHDh, k_BSKDh, v_BSKDh, segment_ids_BL)
    # The axes the active logical rules give batch and heads (none without rules: replicated).
    batch, _, heads, _ = nn.logical_to_mesh_axes(("batch", "length", "heads", "head_dim"))
    spec_BLHDh = PartitionSpec(batch, None, heads, None)
    return jax.shard_map(
        local,
        in_specs=(spec_BLHDh, spec_BLHDh, spec_BLHDh, PartitionSpec(batch, None)),
        out_specs=spec_BLHDh,
        check_vma=False,  # pallas_call outputs carry no varying-axes type; the specs say it all
    )(q_BLHDh, k_BSKDh, v_BSKDh, segment_ids_BL)
