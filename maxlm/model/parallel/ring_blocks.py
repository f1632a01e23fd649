"""A fused kernel on one ring block: what `ring_attention` runs per block when `model.attention`
resolves to splash (TPUs) or cuDNN (NVIDIA GPUs); XLA einsums are ring_attention.py's own.

    out_bHLDh, lse_bHL = forward(kernel, relation, q_bHLDh, k_bKSDh, v_bKSDh, seg_q_bL, seg_k_bS)
    dq_bHLDh, dk_bKSDh, dv_bKSDh = backward(kernel, relation, q, k, v, seg_q, seg_k, out, lse, dout)

A block's place relative to this device's queries (`relation`: EARLIER, SAME or LATER, from the
tokens' original indices) fixes which part of it is visible, so every part has a static mask,
causal or full, and `lax.switch` picks the call:

  in order (no load balancing)   EARLIER: all of it (full mask)  SAME: causal  LATER: nothing
  zig-zag (chunks early, late)   EARLIER: its early chunk, to all the queries (full mask)
                                 SAME: causal (early before late, so causal on the block's order)
                                 LATER: all of it, to the late chunk of the queries (full mask)

Documents are splash's segment ids, or for cuDNN an additive bias made from the two blocks'
segment ids (`attention.document_bias`), as each kernel takes them without the ring.

The forward kernels return each part's normalised output and log-sum-exp (splash's
`save_residuals`, cuDNN's `return_residual`); the ring merges them. The backward pass must use
the *whole* row's output and log-sum-exp (flash attention's backward: P = exp(S − lse),
dS = P ∘ (dP − rowsum(dO ∘ O))), which neither kernel's public VJP takes, as each recomputes its
own part's. So `backward` calls the kernels' backward rules with those residuals: splash's
`splash_attention_kernel._splash_attention_bwd` (private) and `cudnn.backward`.
Splash is checked against `xla_attention` by tests/test_ring_attention.py in the Pallas
interpreter; cuDNN is compiled for H100s in CI and checked against `xla_attention` only on a GPU
(tests/test_cudnn.py).

A row whose document has no token in a part gets the mask value (splash: about −2.4e38; cuDNN:
the bias, −2^41) as its log-sum-exp there: weight exp(mask − lse) = 0 in the merge and in the
backward pass.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import (
    splash_attention_kernel as splash_kernel,
    splash_attention_mask as splash_mask,
)

from maxlm.model import attention
from maxlm.model.kernels import cudnn

EARLIER, SAME, LATER = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class BlockKernel:
    """How the ring's blocks run: `name` (`splash`, the tests' interpreted splash, or `cudnn`),
    `zigzag` (the tokens are in `zigzag.token_order`), splash's query and key/value tiles (0:
    `attention.block_size` of the smallest part)."""
    name: str
    zigzag: bool
    block_q: int = 0
    block_kv: int = 0

    def tiles(self, block_len: int) -> tuple[int, int]:
        """Splash's tiles for a ring block of `block_len` tokens: they must divide its smallest
        part (half a block under zig-zag)."""
        return attention.splash_tiles(block_len // 2 if self.zigzag else block_len, self.block_q, self.block_kv)


def relation(index_L, index_S) -> jax.Array:
    """Where a block (its tokens' original indices `index_S`) lies against this device's rows
    (`index_L`): EARLIER, SAME or LATER, from the first tokens' indices (in order and in zig-zag
    alike)."""
    return jnp.where(index_S[0] < index_L[0], EARLIER, jnp.where(index_S[0] == index_L[0], SAME, LATER))


def _parts(kernel: BlockKernel, relation: int, length: int):
    """(query slice, key slice, causal) of a block that this device's queries see, or None."""
    whole, half = slice(0, length), length // 2
    if relation == SAME:
        return whole, whole, True
    if not kernel.zigzag:
        return (whole, whole, False) if relation == EARLIER else None
    return (whole, slice(0, half), False) if relation == EARLIER else (slice(half, length), whole, False)


def forward(kernel: BlockKernel, relation, q_bHLDh, k_bKSDh, v_bKSDh, seg_q_bL, seg_k_bS):
    """(out [b, H, L, Dh] float32, normalised over this block; log-sum-exp [b, H, L]) of the
    (scaled) queries attending to one block."""
    b, H, L, Dh = q_bHLDh.shape
    part_forward = _cudnn_forward if kernel.name == "cudnn" else _splash_forward

    def branch(rel):
        def run():
            out_bHLDh = jnp.zeros((b, H, L, Dh), jnp.float32)
            lse_bHL = jnp.full((b, H, L), -jnp.inf, jnp.float32)
            parts = _parts(kernel, rel, L)
            if parts is None:
                return out_bHLDh, lse_bHL
            rows, cols, causal = parts
            out, lse = part_forward(kernel, causal, L, q_bHLDh[:, :, rows], k_bKSDh[:, :, cols], v_bKSDh[:, :, cols],
                                    seg_q_bL[:, rows], seg_k_bS[:, cols])
            return (out_bHLDh.at[:, :, rows].set(out.astype(jnp.float32)),
                    lse_bHL.at[:, :, rows].set(lse.astype(jnp.float32)))
        return run

    return jax.lax.switch(relation, [branch(rel) for rel in (EARLIER, SAME, LATER)])


def merge(acc, block_out_bHLDh, block_lse_bHL):
    """The (out, lse) of two normalised softmaxes over disjoint keys: the running one `acc` and a
    block's. Starts from (0, -inf); a block that sees nothing is (0, -inf) too."""
    out_bHLDh, lse_bHL = acc
    new_lse = jnp.logaddexp(lse_bHL, block_lse_bHL)
    out_bHLDh = (out_bHLDh * jnp.exp(lse_bHL - new_lse)[..., None]
                 + block_out_bHLDh * jnp.exp(block_lse_bHL - new_lse)[..., None])
    return out_bHLDh, new_lse


def backward(kernel: BlockKernel, relation, q_bHLDh, k_bKSDh, v_bKSDh, seg_q_bL, seg_k_bS, out_bHLDh, lse_bHL,
             dout_bHLDh):
    """(dq, dk, dv) in float32 of one block's share of the attention, from the whole rows' output
    and log-sum-exp (the ring's residuals) and the output's cotangent."""
    L = q_bHLDh.shape[2]
    part_backward = _cudnn_backward if kernel.name == "cudnn" else _splash_backward

    def branch(rel):
        def run():
            dq = jnp.zeros(q_bHLDh.shape, jnp.float32)
            dk, dv = jnp.zeros(k_bKSDh.shape, jnp.float32), jnp.zeros(v_bKSDh.shape, jnp.float32)
            parts = _parts(kernel, rel, L)
            if parts is None:
                return dq, dk, dv
            rows, cols, causal = parts
            part_dq, part_dk, part_dv = part_backward(
                kernel, causal, L, q_bHLDh[:, :, rows], k_bKSDh[:, :, cols], v_bKSDh[:, :, cols], seg_q_bL[:, rows],
                seg_k_bS[:, cols], out_bHLDh[:, :, rows], lse_bHL[:, :, rows], dout_bHLDh[:, :, rows])
            return (dq.at[:, :, rows].set(part_dq.astype(jnp.float32)),
                    dk.at[:, :, cols].set(part_dk.astype(jnp.float32)),
                    dv.at[:, :, cols].set(part_dv.astype(jnp.float32)))
        return run

    return jax.lax.switch(relation, [branch(rel) for rel in (EARLIER, SAME, LATER)])


# ----------------------------------------------------------------------------- splash


def _splash(kernel: BlockKernel, causal: bool, heads: int, q_len: int, kv_len: int, block_len: int):
    shape = (q_len, kv_len)
    mask = splash_mask.CausalMask(shape) if causal else splash_mask.FullMask(shape)
    tiles = kernel.tiles(block_len)  # they divide every part of a block
    return splash_kernel.make_splash_mha(
        splash_mask.MultiHeadMask(tuple(mask for _ in range(heads))),
        block_sizes=attention.splash_block_sizes(*tiles), head_shards=1, q_seq_shards=1,
        save_residuals=True, interpret=kernel.name == attention.SPLASH_INTERPRET)


def _splash_forward(kernel, causal, block_len, q_bHLDh, k_bKSDh, v_bKSDh, seg_q_bL, seg_k_bS):
    splash = _splash(kernel, causal, q_bHLDh.shape[1], q_bHLDh.shape[2], k_bKSDh.shape[2], block_len)

    def one_sequence(q, k, v, seg_q, seg_k):  # splash's layout is one sequence's [H, L, Dh]
        out, (lse,) = splash(q, k, v, splash_kernel.SegmentIds(q=seg_q, kv=seg_k))
        return out, lse

    return jax.vmap(one_sequence)(q_bHLDh, k_bKSDh, v_bKSDh, seg_q_bL, seg_k_bS)


def _splash_backward(kernel, causal, block_len, q_bHLDh, k_bKSDh, v_bKSDh, seg_q_bL, seg_k_bS, out_bHLDh, lse_bHL,
                     dout_bHLDh):
    splash = _splash(kernel, causal, q_bHLDh.shape[1], q_bHLDh.shape[2], k_bKSDh.shape[2], block_len)
    options = splash.kwargs

    def one_sequence(q, k, v, seg_q, seg_k, out, lse, dout):
        residuals = (q, k, v, splash_kernel.SegmentIds(q=seg_q, kv=seg_k), None, out, lse,
                     splash.dq_mask_info, splash.dkv_mask_info)
        grads = splash_kernel._splash_attention_bwd(
            False, options["mask_value"], options["is_mqa"], options["block_sizes"], None,
            options["mask_function"], options["attn_logits_soft_cap"], options["interpret"], residuals, dout)
        return grads[3:6]  # (dq, dk, dv); the rest are the mask infos', segment ids' and sinks'

    return jax.vmap(one_sequence)(q_bHLDh, k_bKSDh, v_bKSDh, seg_q_bL, seg_k_bS, out_bHLDh.astype(q_bHLDh.dtype),
                                  lse_bHL, dout_bHLDh.astype(q_bHLDh.dtype))


# ----------------------------------------------------------------------------- cuDNN


def _cudnn_forward(kernel, causal, block_len, q_bHLDh, k_bKSDh, v_bKSDh, seg_q_bL, seg_k_bS):
    bias = attention.document_bias(seg_q_bL, q_bHLDh.dtype, seg_k_bS)
    return cudnn.forward(q_bHLDh, k_bKSDh, v_bKSDh, bias, **_cudnn_options(causal))


def _cudnn_backward(kernel, causal, block_len, q_bHLDh, k_bKSDh, v_bKSDh, seg_q_bL, seg_k_bS, out_bHLDh, lse_bHL, dout_bHLDh):
    bias = attention.document_bias(seg_q_bL, q_bHLDh.dtype, seg_k_bS)
    return cudnn.backward(q_bHLDh, k_bKSDh, v_bKSDh, bias, out_bHLDh, lse_bHL, dout_bHLDh, **_cudnn_options(causal))


def _cudnn_options(causal: bool) -> dict:
    """A part's mask, in the BNTH layout; q comes in scaled by the ring, so the kernel's scale is 1."""
    return dict(causal=causal, scale=1.0, layout="BNTH")
