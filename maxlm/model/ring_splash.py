"""The splash kernel on one ring block (TPU): what `ring_attention` runs per block when
`model.attention` resolves to splash.

    out_bHLDh, lse_bHL = forward(spec, relation, q_bHLDh, k_bKSDh, v_bKSDh, seg_q_bL, seg_k_bS)
    dq_bHLDh, dk_bKSDh, dv_bKSDh = backward(spec, relation, q, k, v, seg_q, seg_k, out, lse, dout)

A block's place relative to this device's queries (`relation`: EARLIER, SAME or LATER, from the
tokens' original indices) fixes which part of it is visible, so every part is a static splash
mask and `lax.switch` picks the kernel:

  in order (no load balancing)   EARLIER: all of it (full mask)  SAME: causal  LATER: nothing
  zig-zag (chunks early, late)   EARLIER: its early chunk, to all the queries (full mask)
                                 SAME: causal (early before late, so causal on the block's order)
                                 LATER: all of it, to the late chunk of the queries (full mask)

Documents are splash's segment ids, as in `attention.splash_attention`.

The forward kernel returns each block's normalised output and log-sum-exp (`save_residuals`);
the ring merges them. The backward pass must use the *whole* row's output and log-sum-exp (flash
attention's backward: P = exp(S − lse), dS = P ∘ (dP − rowsum(dO ∘ O))), which splash's public
VJP cannot take, as it recomputes its own block's. So `backward` calls the kernel's backward rule,
`splash_attention_kernel._splash_attention_bwd`, with those residuals: a private function of
jax (checked against `xla_attention` by tests/test_ring_attention.py, in the Pallas interpreter).

A row whose document has no token in a block gets splash's mask value (about −2.4e38) as its
log-sum-exp there: weight exp(−2.4e38 − lse) = 0 in the merge and in the backward pass.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash_kernel, splash_attention_mask as splash_mask

from maxlm.model import attention

EARLIER, SAME, LATER = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class SplashBlocks:
    """How the ring's blocks run splash: `zigzag` (the tokens are in `zigzag.token_order`), the
    query and key/value tiles (0: `attention.block_size` of the smallest part), the Pallas
    interpreter (tests)."""
    zigzag: bool
    block_q: int = 0
    block_kv: int = 0
    interpret: bool = False

    def tiles(self, block_len: int) -> tuple[int, int]:
        """The tiles for a ring block of `block_len` tokens: they must divide its smallest part
        (half a block under zig-zag)."""
        return attention.splash_tiles(block_len // 2 if self.zigzag else block_len, self.block_q, self.block_kv)


def _kernel(spec: SplashBlocks, causal: bool, heads: int, q_len: int, kv_len: int, tiles):
    shape = (q_len, kv_len)
    mask = splash_mask.CausalMask(shape) if causal else splash_mask.FullMask(shape)
    return splash_kernel.make_splash_mha(
        splash_mask.MultiHeadMask(tuple(mask for _ in range(heads))),
        block_sizes=attention.splash_block_sizes(*tiles), head_shards=1, q_seq_shards=1,
        save_residuals=True, interpret=spec.interpret)


def _parts(spec: SplashBlocks, relation: int, length: int):
    """(query slice, key slice, causal) of a block that this device's queries see, or None."""
    whole, half = slice(0, length), length // 2
    if relation == SAME:
        return whole, whole, True
    if not spec.zigzag:
        return (whole, whole, False) if relation == EARLIER else None
    return (whole, slice(0, half), False) if relation == EARLIER else (slice(half, length), whole, False)


def forward(spec: SplashBlocks, relation, q_bHLDh, k_bKSDh, v_bKSDh, seg_q_bL, seg_k_bS, tiles):
    """(out [b, H, L, Dh] float32, normalised over this block; log-sum-exp [b, H, L]) of the
    (scaled) queries attending to one block."""
    b, H, L, Dh = q_bHLDh.shape

    def branch(rel):
        def run():
            out_bHLDh = jnp.zeros((b, H, L, Dh), jnp.float32)
            lse_bHL = jnp.full((b, H, L), -jnp.inf, jnp.float32)
            parts = _parts(spec, rel, L)
            if parts is None:
                return out_bHLDh, lse_bHL
            rows, cols, causal = parts
            q = q_bHLDh[:, :, rows]
            kernel = _kernel(spec, causal, H, q.shape[2], k_bKSDh[:, :, cols].shape[2], tiles)

            def one_sequence(q, k, v, seg_q, seg_k):
                out, (lse,) = kernel(q, k, v, splash_kernel.SegmentIds(q=seg_q, kv=seg_k))
                return out, lse

            out, lse = jax.vmap(one_sequence)(q, k_bKSDh[:, :, cols], v_bKSDh[:, :, cols], seg_q_bL[:, rows],
                                             seg_k_bS[:, cols])
            return out_bHLDh.at[:, :, rows].set(out.astype(jnp.float32)), lse_bHL.at[:, :, rows].set(lse)
        return run

    return jax.lax.switch(relation, [branch(rel) for rel in (EARLIER, SAME, LATER)])


def backward(spec: SplashBlocks, relation, q_bHLDh, k_bKSDh, v_bKSDh, seg_q_bL, seg_k_bS, out_bHLDh, lse_bHL,
             dout_bHLDh, tiles):
    """(dq, dk, dv) in float32 of one block's share of the attention, from the whole rows' output
    and log-sum-exp (the ring's residuals) and the output's cotangent."""
    b, H, L, _ = q_bHLDh.shape

    def branch(rel):
        def run():
            dq = jnp.zeros(q_bHLDh.shape, jnp.float32)
            dk, dv = jnp.zeros(k_bKSDh.shape, jnp.float32), jnp.zeros(v_bKSDh.shape, jnp.float32)
            parts = _parts(spec, rel, L)
            if parts is None:
                return dq, dk, dv
            rows, cols, causal = parts
            k, v = k_bKSDh[:, :, cols], v_bKSDh[:, :, cols]
            kernel = _kernel(spec, causal, H, q_bHLDh[:, :, rows].shape[2], k.shape[2], tiles)
            options = kernel.kwargs

            def one_sequence(q, k, v, seg_q, seg_k, out, lse, dout):
                residuals = (q, k, v, splash_kernel.SegmentIds(q=seg_q, kv=seg_k), None, out, lse,
                             kernel.dq_mask_info, kernel.dkv_mask_info)
                grads = splash_kernel._splash_attention_bwd(
                    False, options["mask_value"], options["is_mqa"], options["block_sizes"], None,
                    options["mask_function"], options["attn_logits_soft_cap"], options["interpret"], residuals, dout)
                return grads[3:6]  # (dq, dk, dv); the rest are the mask infos', segment ids' and sinks'

            part_dq, part_dk, part_dv = jax.vmap(one_sequence)(
                q_bHLDh[:, :, rows], k, v, seg_q_bL[:, rows], seg_k_bS[:, cols], out_bHLDh[:, :, rows],
                lse_bHL[:, :, rows], dout_bHLDh[:, :, rows])
            return (dq.at[:, :, rows].set(part_dq.astype(jnp.float32)),
                    dk.at[:, :, cols].set(part_dk.astype(jnp.float32)),
                    dv.at[:, :, cols].set(part_dv.astype(jnp.float32)))
        return run

    return jax.lax.switch(relation, [branch(rel) for rel in (EARLIER, SAME, LATER)])
