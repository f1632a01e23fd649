"""Ring attention (`model.context_parallel="ring"`): context parallelism over `mesh.sequence`
without ever holding the whole sequence's keys and values.

    out_BLHDh = ring_attention(q_BLHDh, k_BSKDh, v_BSKDh, segment_ids_BL, token_index_L)

Inside `jax.shard_map`, each of the n devices of the ring axis holds its own query block and one
key/value block of L/n tokens. n times, it attends its queries to the block it holds while that
block moves on to the next device (`jax.lax.ppermute`; the next transfer is issued before the
current block's compute, so XLA can overlap them). The softmax is online (flash attention's
running max and sum, float32), so per-device memory is O(L/n), not O(L).

The mask is `attention.attention_mask`'s (causal, within a document; padding, segment 0, attends
to earlier padding) computed from what travels with each block: its segment ids and its tokens'
indices in the original sequence (`token_index_L`: arange(L), or the zig-zag order of
maxlm/model/parallel/zigzag.py). A block wholly in a row block's future (or in other documents) is
skipped (`lax.cond`). Each device's first block is its own, which holds every row's diagonal, so
no row's running max stays at -inf and no softmax row is ever empty.

The backward pass is a ring too (`jax.custom_vjp`): the blocks go round again and their dK, dV
accumulators travel with them, arriving home after n hops; the residuals are this device's q, k,
v, output and log-sum-exp: O(L/n). Grouped-query heads as `xla_attention`: head h = kv_head·G + g.
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from maxlm.model import attention
from maxlm.model.parallel import ring_blocks

_MASKED = jnp.finfo(jnp.float32).min


def ring_axis() -> str | None:
    """The mesh axis the active logical rules split the length over, when it has size > 1."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return None
    axes = nn.logical_to_mesh_axes(("length",))[0]
    if axes is None:
        return None
    if not isinstance(axes, str):
        axes = tuple(a for a in axes if mesh.shape[a] > 1)
        if len(axes) > 1:
            raise ValueError(f"ring attention runs over one mesh axis, the rules split the length over {axes}")
        axes = axes[0] if axes else None
    return axes if axes is not None and mesh.shape[axes] > 1 else None


def active(model_cfg) -> bool:
    """Whether attention runs as a ring here: `model.context_parallel="ring"` and a length split
    over a mesh axis of size > 1 (with mesh.sequence=1 the ring is a no-op: plain attention)."""
    return model_cfg.context_parallel == "ring" and ring_axis() is not None


def block_backend(model_cfg, dtype, length: int, n: int, platform: str | None = None) -> str:
    """The kernel each ring block of a `length`-token sequence over `n` devices runs: what
    `model.attention` resolves to for a block's smallest part (L/n tokens, half that in zig-zag
    order): splash (or the tests' interpreted splash) on TPUs when it tiles by 128, cuDNN on
    NVIDIA GPUs with 16-bit compute, else "xla". XLA's blocks also where only they are written
    for the model: a sliding window, a soft cap on the scores, or values narrower than the keys
    (multi-head latent attention; `xla_only`)."""
    if xla_only(model_cfg, length):
        return "xla"
    part = length // n // (2 if model_cfg.context_load_balance else 1)
    return attention.attention_backend(model_cfg.attention, dtype, part, platform, head_dim=model_cfg.head_dim)


def xla_only(model_cfg, length: int) -> bool:
    """Whether the ring's blocks must be XLA's: the fused kernels' blocks know only whole or causal
    parts, no soft cap, and values as wide as the keys."""
    window = attention.row_window(model_cfg.sliding_window, length)
    return bool(window or model_cfg.attn_logit_softcap or model_cfg.attention_kind == "mla")


def block_kernel(model_cfg, dtype, length: int) -> ring_blocks.BlockKernel | None:
    """What `ring_attention` takes as `kernel` under the active mesh: None for XLA einsums."""
    backend = block_backend(model_cfg, dtype, length, jax.sharding.get_abstract_mesh().shape[ring_axis()])
    if backend == "xla":
        return None
    return ring_blocks.BlockKernel(backend, model_cfg.context_load_balance, model_cfg.splash_block_q,
                                   model_cfg.splash_block_kv)


def ring_attention(q_BLHDh, k_BSKDh, v_BSKDh, segment_ids_BL, token_index_L,
                   kernel: ring_blocks.BlockKernel | None = None, window: int = 0, softcap: float = 0.0):
    """Causal, per-document attention [B, L, H, Dv] as a ring over the length's mesh axis; batch and
    heads split as the active rules say (kv heads as heads: the config makes them divisible).
    Each block runs XLA einsums, or the fused `kernel` (splash, cuDNN: maxlm/model/parallel/ring_blocks.py).
    XLA's blocks also take a sliding `window` (skipping the blocks it hides entirely), a score
    `softcap` and values narrower than the keys."""
    if kernel is not None and (window or softcap or v_BSKDh.shape[-1] != q_BLHDh.shape[-1]):
        raise ValueError("the ring's fused blocks take no window, soft cap or narrower values (block_backend: xla)")
    axis = ring_axis()
    if axis is None:
        raise ValueError("ring_attention needs an active mesh whose rules split `length` over an axis of size > 1")
    n = jax.sharding.get_abstract_mesh().shape[axis]
    batch, length, heads = nn.logical_to_mesh_axes(("batch", "length", "heads"))
    spec_BLHDh = PartitionSpec(batch, length, heads, None)
    return jax.shard_map(
        functools.partial(_ring, axis, n, kernel, (window, softcap)),
        in_specs=(spec_BLHDh, spec_BLHDh, spec_BLHDh, PartitionSpec(batch, length), PartitionSpec(length)),
        out_specs=spec_BLHDh,
        check_vma=False,  # the custom VJP's outputs carry no varying-axes type; the specs say it all
    )(q_BLHDh, k_BSKDh, v_BSKDh, segment_ids_BL, token_index_L)


def _shift(axis: str, n: int, tree):
    """`tree` sent one device on along the ring (device i's goes to i + 1)."""
    return jax.lax.ppermute(tree, axis, perm=[(i, (i + 1) % n) for i in range(n)])


def _around(axis: str, n: int, block, acc, step):
    """`acc` after `step(block, acc)` on each of the n blocks as they pass this device: its own
    first, then each arriving one. The next hop is issued before a block's compute, so XLA can
    overlap the transfer with it; the last block is not sent on."""
    def hop(carry, _):
        block, acc = carry
        arriving = _shift(axis, n, block)
        return (arriving, step(block, acc)), None

    (block, acc), _ = jax.lax.scan(hop, (block, acc), None, length=n - 1)
    return step(block, acc)


def _around_with_gradients(axis: str, n: int, block, dq, dkv, step):
    """(dq, dkv) after `dq, dkv = step(block, dq, dkv)` on each of the n blocks, where dkv, the
    block's own gradient accumulators, travel with it and come home after the n-th hop."""
    def hop(carry, _):
        block, dq, dkv = carry
        arriving = _shift(axis, n, block)
        dq, dkv = step(block, dq, dkv)
        return (arriving, dq, _shift(axis, n, dkv)), None

    (block, dq, dkv), _ = jax.lax.scan(hop, (block, dq, dkv), None, length=n - 1)
    dq, dkv = step(block, dq, dkv)
    return dq, _shift(axis, n, dkv)


def _block_mask(segment_ids_bL, index_L, block, window: int = 0):
    """[b, 1, 1, L, S]: query row may see key column (causal by original index, within the sliding
    `window` when > 0, same document)."""
    _, _, segment_ids_bS, index_S = block
    causal_LS = index_S[None, :] <= index_L[:, None]
    if window:
        causal_LS &= index_L[:, None] - index_S[None, :] < window
    same_doc_bLS = segment_ids_bL[:, :, None] == segment_ids_bS[:, None, :]
    return (causal_LS[None] & same_doc_bLS)[:, None, None]


def _scores(q_bKGLDh, k_bSKDh, mask, softcap: float = 0.0):
    scores = attention.soft_cap(jnp.einsum("bkgld,bskd->bkgls", q_bKGLDh, k_bSKDh, preferred_element_type=jnp.float32),
                                softcap)
    return jnp.where(mask, scores, _MASKED)


def _heads_major(x_bLHDh, kv_heads: int):
    """[b, L, H, Dh] → [b, K, G, L, Dh]."""
    b, L, H, Dh = x_bLHDh.shape
    return x_bLHDh.reshape(b, L, kv_heads, H // kv_heads, Dh).transpose(0, 2, 3, 1, 4)


def _heads_minor(x_bKGLDh):
    b, K, G, L, Dh = x_bKGLDh.shape
    return x_bKGLDh.transpose(0, 3, 1, 2, 4).reshape(b, L, K * G, Dh)


def _forward_step(q_bKGLDh, segment_ids_bL, index_L, shape, block, acc):
    """The online softmax's accumulators (out, running max, running sum) after one more block;
    `shape` = (window, softcap) of the scores. A block the mask hides entirely (above the
    diagonal, or beyond the window) is skipped."""
    window, softcap = shape
    mask = _block_mask(segment_ids_bL, index_L, block, window)

    def attend(acc):
        out, row_max, row_sum = acc
        _, v_bSKDh, _, _ = block
        scores = _scores(q_bKGLDh, block[0], mask, softcap)
        new_max = jnp.maximum(row_max, scores.max(axis=-1))
        probs = jnp.where(mask, jnp.exp(scores - new_max[..., None]), 0.0)
        rescale = jnp.exp(row_max - new_max)
        out = out * rescale[..., None] + jnp.einsum("bkgls,bskd->bkgld", probs.astype(v_bSKDh.dtype), v_bSKDh,
                                                    preferred_element_type=jnp.float32)
        return out, new_max, row_sum * rescale + probs.sum(axis=-1)

    return jax.lax.cond(mask.any(), attend, lambda acc: acc, acc)


def _ring_forward(axis, n, shape, q_bLHDh, k_bSKDh, v_bSKDh, segment_ids_bL, index_L):
    scale = jnp.asarray(1 / math.sqrt(q_bLHDh.shape[-1]), q_bLHDh.dtype)
    q_bKGLDh = _heads_major(q_bLHDh * scale, k_bSKDh.shape[2])
    rows = q_bKGLDh.shape[:-1]
    acc = (jnp.zeros((*rows, v_bSKDh.shape[-1]), jnp.float32), jnp.full(rows, -jnp.inf), jnp.zeros(rows, jnp.float32))
    step = functools.partial(_forward_step, q_bKGLDh, segment_ids_bL, index_L, shape)

    block = (k_bSKDh, v_bSKDh, segment_ids_bL, index_L)
    out, row_max, row_sum = _around(axis, n, block, acc, step)
    out = out / row_sum[..., None]
    log_sum_exp = row_max + jnp.log(row_sum)
    out_bLHDh = _heads_minor(out).astype(q_bLHDh.dtype)
    return out_bLHDh, (q_bKGLDh, k_bSKDh, v_bSKDh, segment_ids_bL, index_L, out.astype(q_bLHDh.dtype), log_sum_exp)


def _backward_step(q_bKGLDh, dout, log_sum_exp, delta, segment_ids_bL, index_L, shape, block, dq, dkv):
    """dq and the travelling block's (dk, dv) after attending to it once more (flash backward;
    through the soft cap's tanh when there is one)."""
    window, softcap = shape
    mask = _block_mask(segment_ids_bL, index_L, block, window)

    def grads(dq_dkv):
        dq, (dk, dv) = dq_dkv
        k_bSKDh, v_bSKDh, _, _ = block
        scores = _scores(q_bKGLDh, k_bSKDh, mask, softcap)
        probs = jnp.where(mask, jnp.exp(scores - log_sum_exp[..., None]), 0.0)
        dv = dv + jnp.einsum("bkgls,bkgld->bskd", probs, dout)
        dprobs = jnp.einsum("bkgld,bskd->bkgls", dout, v_bSKDh.astype(jnp.float32))
        dscores = probs * (dprobs - delta[..., None])
        if softcap:  # d(c·tanh(s / c))/ds = 1 - tanh², tanh = the capped score / c
            dscores = dscores * (1 - jnp.square(jnp.where(mask, scores, 0.0) / softcap))
        dq = dq + jnp.einsum("bkgls,bskd->bkgld", dscores, k_bSKDh.astype(jnp.float32))
        dk = dk + jnp.einsum("bkgls,bkgld->bskd", dscores, q_bKGLDh.astype(jnp.float32))
        return dq, (dk, dv)

    return jax.lax.cond(mask.any(), grads, lambda dq_dkv: dq_dkv, (dq, dkv))


def _ring_backward(axis, n, shape, residuals, dout_bLHDh):
    q_bKGLDh, k_bSKDh, v_bSKDh, segment_ids_bL, index_L, out, log_sum_exp = residuals
    dout = _heads_major(dout_bLHDh, q_bKGLDh.shape[1]).astype(jnp.float32)
    delta = (dout * out.astype(jnp.float32)).sum(axis=-1)  # rowsum(dO ∘ O)
    step = functools.partial(_backward_step, q_bKGLDh, dout, log_sum_exp, delta, segment_ids_bL, index_L, shape)

    block = (k_bSKDh, v_bSKDh, segment_ids_bL, index_L)
    zeros_kv = (jnp.zeros(k_bSKDh.shape, jnp.float32), jnp.zeros(v_bSKDh.shape, jnp.float32))
    dq, (dk, dv) = _around_with_gradients(axis, n, block, jnp.zeros(q_bKGLDh.shape, jnp.float32), zeros_kv, step)
    dq_bLHDh = _heads_minor(dq) / math.sqrt(q_bKGLDh.shape[-1])
    return (dq_bLHDh.astype(q_bKGLDh.dtype), dk.astype(k_bSKDh.dtype), dv.astype(v_bSKDh.dtype), None, None)


# ----------------------------------------------------------------------------- fused kernels per block


def _fused_ring_forward(axis, n, kernel, q_bLHDh, k_bSKDh, v_bSKDh, segment_ids_bL, index_L):
    scale = jnp.asarray(1 / math.sqrt(q_bLHDh.shape[-1]), q_bLHDh.dtype)
    q_bHLDh = jnp.swapaxes(q_bLHDh * scale, 1, 2)  # the kernels' layout is heads-major; q comes in scaled

    def step(block, acc):
        k_bKSDh, v_bKSDh, segment_ids_bS, _ = block
        return ring_blocks.merge(acc, *ring_blocks.forward(kernel, ring_blocks.relation(index_L, block[3]), q_bHLDh, k_bKSDh,
                                                           v_bKSDh, segment_ids_bL, segment_ids_bS))

    # the first block is this device's own, where every row sees its diagonal: lse is finite after it
    acc = (jnp.zeros(q_bHLDh.shape, jnp.float32), jnp.full(q_bHLDh.shape[:-1], -jnp.inf, jnp.float32))
    block = (jnp.swapaxes(k_bSKDh, 1, 2), jnp.swapaxes(v_bSKDh, 1, 2), segment_ids_bL, index_L)
    out, lse = _around(axis, n, block, acc, step)
    out = out.astype(q_bLHDh.dtype)
    return jnp.swapaxes(out, 1, 2), (q_bHLDh, block, out, lse)


def _fused_ring_backward(axis, n, kernel, residuals, dout_bLHDh):
    q_bHLDh, block, out, lse = residuals
    index_L, segment_ids_bL = block[3], block[2]
    dout = jnp.swapaxes(dout_bLHDh, 1, 2).astype(q_bHLDh.dtype)

    def step(block, dq, dkv):
        k_bKSDh, v_bKSDh, segment_ids_bS, _ = block
        block_dq, block_dk, block_dv = ring_blocks.backward(
            kernel, ring_blocks.relation(index_L, block[3]), q_bHLDh, k_bKSDh, v_bKSDh, segment_ids_bL, segment_ids_bS, out, lse,
            dout)
        return dq + block_dq, (dkv[0] + block_dk, dkv[1] + block_dv)

    zeros_kv = jnp.zeros(block[0].shape, jnp.float32)
    dq, (dk, dv) = _around_with_gradients(axis, n, block, jnp.zeros(q_bHLDh.shape, jnp.float32),
                                          (zeros_kv, zeros_kv), step)
    dq_bLHDh = jnp.swapaxes(dq, 1, 2) / math.sqrt(q_bHLDh.shape[-1])  # through the scaling of q
    k_dtype = block[0].dtype
    return (dq_bLHDh.astype(q_bHLDh.dtype), jnp.swapaxes(dk, 1, 2).astype(k_dtype),
            jnp.swapaxes(dv, 1, 2).astype(k_dtype), None, None)


# ----------------------------------------------------------------------------- the ring's VJP


def _forward(axis, n, kernel, shape, *args):
    if kernel is None:
        return _ring_forward(axis, n, shape, *args)
    return _fused_ring_forward(axis, n, kernel, *args)


def _backward(axis, n, kernel, shape, residuals, dout_bLHDh):
    if kernel is None:
        return _ring_backward(axis, n, shape, residuals, dout_bLHDh)
    return _fused_ring_backward(axis, n, kernel, residuals, dout_bLHDh)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _ring(axis, n, kernel, shape, q_bLHDh, k_bSKDh, v_bSKDh, segment_ids_bL, index_L):
    """`shape`: (sliding window, soft cap) of the scores, XLA's blocks only (`block_backend`)."""
    return _forward(axis, n, kernel, shape, q_bLHDh, k_bSKDh, v_bSKDh, segment_ids_bL, index_L)[0]


_ring.defvjp(_forward, _backward)
