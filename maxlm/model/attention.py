"""Attention: the packed causal mask and the three backends `model.attention` chooses from.

    out_BLHDh = attend(backend, q_BLHDh, k_BSKDh, v_BSKDh, mask_B1LS, segment_ids_BL)

  xla    `xla_attention`: einsums over grouped-query heads, softmax in float32; runs anywhere and
         is the only one the all-gather strategy partitions along the sequence.
  cudnn  cuDNN's fused flash attention (NVIDIA GPUs, 16-bit compute; `cudnn_attention`, below).
  splash the Pallas splash-attention kernel for TPUs (`splash_attention`, below).
`attention_backend` resolves "auto" from the platform being compiled for and the dtype.

cuDNN runs in its causal mode, so the kernel skips the tiles above the diagonal (half the FLOPs at
long sequence); documents (packing) go in as an additive bias made once per step
(`document_bias`). cuDNN's packed-segment layout (per-row sequence offsets, no [L, S] array) is
not used: JAX's binding gives it float32 softmax statistics of [B × max segments, H, L], and with
no cap on documents per row that bound is L, which compiled for 8×H100 doubled the 1B preset's
peak memory (docs/gpus.md).

Splash has the same semantics as `xla_attention` with `attention_mask`: causal, only within a document
(`segment_ids`; 0 = padding, which attends to earlier padding, so no softmax row is ever empty),
grouped-query heads, softmax in float32. Splash ("sparse flash") attention
(`jax.experimental.pallas.ops.tpu.splash_attention`) never writes the [L, S] scores to HBM and
skips the key blocks the causal mask hides entirely (about half of them).

What the kernel does and does not do (read from its source):
- it does not scale the scores: q is multiplied by 1/sqrt(Dh) here, before the kernel;
- its layout is [heads, length, head_dim] for one sequence: we transpose and vmap over batch;
- grouped-query attention is native: the "MHA" kernel takes k/v with K heads and reads kv head
  h // (H/K) for query head h, forward and backward (dk, dv accumulate over the group), so k/v are
  never repeated in memory. That is the grouping `xla_attention` uses (head h = kv_head·G + g);
- the mask is a static causal `MultiHeadMask` and'ed with `SegmentIds(q=ids, kv=ids)`;
- block sizes must be multiples of 128 (the TPU's lane width) and divide the sequence, hence
  `block_size` below and the checks in `config.resolve`; `model.splash_block_q` and
  `model.splash_block_kv` choose the query and key/value tiles (0: `block_size`), the same for
  the forward pass and both backward kernels;
- its forward kernel writes the log-sum-exp residual 128 lanes wide and its VJP keeps lane 0:
  `_residuals_made_in_forward` has XLA cut it at the forward kernel, not after the MLP.

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
from jax.experimental.pallas.ops.tpu.splash_attention import (
    splash_attention_kernel as splash_kernel,
    splash_attention_mask as splash_mask,
)
from jax.sharding import PartitionSpec

from maxlm.model.kernels import cudnn
from maxlm.model.parallel import pipeline

LANES = 128  # a splash block is a multiple of this
BLOCK_SIZES = (512, 256, 128)  # tried largest first; 512 is MaxText's default on v5e/v5p


def attention_mask(segment_ids_BL, window: int = 0):
    """[B, 1, L, S] booleans: causal, and only within the same document (segment); with a
    `window` > 0, only the query's own token and the window - 1 before it (`model.sliding_window`).

    Under sequence parallelism the rows (queries) are split like the tokens and the columns (keys)
    are whole: each device compares its own tokens' segment ids with all of the row's."""
    segment_ids_BS = nn.with_logical_constraint(segment_ids_BL, ("batch", None))  # the keys' ids, gathered
    return nn.with_logical_constraint(causal_mask(segment_ids_BL, segment_ids_BS, window),
                                      ("batch", None, "length", None))


def causal_mask(segment_ids_BL, segment_ids_BS, window: int = 0):
    """`attention_mask`'s booleans [B, 1, L, S] from the segment ids of the same rows twice: as
    the queries' [B, L] and as the keys' [B, S] (L = S), each with its own sharding."""
    length = segment_ids_BL.shape[1]
    causal_LS = jnp.tril(jnp.ones((length, length), dtype=bool))
    if window:
        causal_LS &= jnp.triu(causal_LS, -(window - 1))  # i - window < j <= i
    same_doc_BLS = segment_ids_BL[:, :, None] == segment_ids_BS[:, None, :]
    return (causal_LS[None] & same_doc_BLS)[:, None]


def soft_cap(x, cap: float):
    """cap·tanh(x / cap), bounded by ±cap (Gemma 2's soft caps); `x` itself when cap is 0."""
    return cap * jnp.tanh(x / cap) if cap else x


def cache_mask(positions_BT, num_slots: int, window: int = 0):
    """[B, T, S] booleans of a KV cache whose slot is the position: each new token sees the slots
    up to its own, and with a `window` > 0 only its own and the window - 1 before it."""
    slots_S = jnp.arange(num_slots)
    mask_BTS = slots_S[None, None, :] <= positions_BT[:, :, None]
    if window:
        mask_BTS &= slots_S[None, None, :] > positions_BT[:, :, None] - window
    return mask_BTS


def row_window(window: int, seq_len: int) -> int:
    """`window`, or 0 (none) where it spans the whole row: a window of at least `seq_len` tokens
    hides no key, and the kernels then run plain causal attention (a checkpoint's window, such as
    Mistral 7B v0.1's 4096, at seq_len 4096)."""
    return window if window < seq_len else 0


def band_block(seq_len: int, window: int) -> int:
    """The key block of `banded_attention` for a sliding `window` over `seq_len` tokens: the
    smallest block of at least `window` tokens that divides the length into 4 or more (each query
    block then reads itself and the block before, at most half the keys); 0 where none does, or
    without a window: the dense mask."""
    if not window:
        return 0
    return next((b for b in range(window, seq_len // 4 + 1) if seq_len % b == 0), 0)


def banded_mask(segment_ids_BL, window: int, block: int):
    """`banded_attention`'s mask [B, 1, L, 2·block]: for each query, which keys of its own block
    and the block before (in that order) it sees: causal, within the window, the same document
    (block 0 has no block before: those keys are never seen)."""
    B, L = segment_ids_BL.shape
    n = L // block
    q_NQ = jnp.arange(L).reshape(n, block)
    k_NS = jnp.concatenate([q_NQ - block, q_NQ], axis=1)  # the block before, then the query's own
    seen_NQS = (k_NS[:, None, :] >= 0) & (k_NS[:, None, :] <= q_NQ[:, :, None]) \
        & (q_NQ[:, :, None] - k_NS[:, None, :] < window)
    seg_BNQ = segment_ids_BL.reshape(B, n, block)
    seg_BNS = jnp.concatenate([jnp.roll(seg_BNQ, 1, axis=1), seg_BNQ], axis=2)
    same_doc_BNQS = seg_BNQ[..., :, None] == seg_BNS[..., None, :]
    return (seen_NQS[None] & same_doc_BNQS).reshape(B, 1, L, 2 * block)


def banded_attention(q_BLHDh, k_BSKDh, v_BSKDh, mask_B1LS, softcap: float = 0.0):
    """`xla_attention` for a sliding window, computing only what the window can see: the queries
    in blocks of b (`mask_B1LS` from `banded_mask`: [B, 1, L, 2b]), each block attending to its own
    keys and the block before, so the scores are [.., L, 2b] instead of [.., L, L] (a window of 512
    over 4096 tokens: a quarter of them). The same numbers as the dense mask's up to summation
    order."""
    B, L, H, Dh = q_BLHDh.shape
    K, Dv, b = k_BSKDh.shape[2], v_BSKDh.shape[-1], mask_B1LS.shape[-1] // 2
    n = L // b
    q_BNKGQDh = (q_BLHDh * jnp.asarray(1 / math.sqrt(Dh), q_BLHDh.dtype)).reshape(B, n, b, K, H // K, Dh) \
        .transpose(0, 1, 3, 4, 2, 5)

    def with_block_before(x_BSKD):  # [B, n, K, 2b, D]: block j-1 (zeros for j = 0) then block j
        x_BNKQD = x_BSKD.reshape(B, n, b, K, x_BSKD.shape[-1]).transpose(0, 1, 3, 2, 4)
        before = jnp.concatenate([jnp.zeros_like(x_BNKQD[:, :1]), x_BNKQD[:, :-1]], axis=1)
        return jnp.concatenate([before, x_BNKQD], axis=3)

    k_BNKSDh, v_BNKSDv = with_block_before(k_BSKDh), with_block_before(v_BSKDh)
    scores = soft_cap(jnp.einsum("bnkgqd,bnksd->bnkgqs", q_BNKGQDh, k_BNKSDh).astype(jnp.float32), softcap)
    mask_BN11QS = mask_B1LS.reshape(B, n, 1, 1, b, 2 * b)
    scores = jnp.where(mask_BN11QS, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(q_BLHDh.dtype)
    out_BNKGQDv = jnp.einsum("bnkgqs,bnksd->bnkgqd", probs, v_BNKSDv)
    return out_BNKGQDv.transpose(0, 1, 4, 2, 3, 5).reshape(B, L, H, Dv)


def xla_attention(q_BLHDh, k_BSKDh, v_BSKDh, mask_B1LS, softcap: float = 0.0):
    """Plain einsum attention with grouped-query heads; softmax in float32; with a `softcap` > 0,
    the scaled scores are capped to softcap·tanh(scores / softcap) first (Gemma 2's
    `model.attn_logit_softcap`).

    q is scaled before the matmul ([B, L, H, Dh] is far smaller than the [.., L, S] scores), and
    the small q/k/v arrays are put heads-major first, so every [.., L, S] array comes out of its
    matmul in the order softmax and the next matmul read it: no transpose copy of an L×S array
    (on CPU those copies took a fifth of the step at seq 1024).
    """
    B, L, H, Dh = q_BLHDh.shape
    K, Dv = k_BSKDh.shape[2], v_BSKDh.shape[-1]  # Dv: the values' head dim (multi-head latent attention's may differ)
    q_BLHDh = q_BLHDh * jnp.asarray(1 / math.sqrt(Dh), q_BLHDh.dtype)
    q_BKGLDh = q_BLHDh.reshape(B, L, K, H // K, Dh).transpose(0, 2, 3, 1, 4)
    k_BKSDh, v_BKSDh = k_BSKDh.transpose(0, 2, 1, 3), v_BSKDh.transpose(0, 2, 1, 3)
    scores_BKGLS = soft_cap(jnp.einsum("bkgld,bksd->bkgls", q_BKGLDh, k_BKSDh).astype(jnp.float32), softcap)
    # Every row keeps at least its diagonal, so the softmax never sees an all-masked row.
    scores_BKGLS = jnp.where(mask_B1LS[:, :, None], scores_BKGLS, jnp.finfo(jnp.float32).min)
    probs_BKGLS = jax.nn.softmax(scores_BKGLS, axis=-1).astype(q_BLHDh.dtype)
    out_BKGLDh = jnp.einsum("bkgls,bksd->bkgld", probs_BKGLS, v_BKSDh)
    return out_BKGLDh.transpose(0, 3, 1, 2, 4).reshape(B, L, H, Dv)


# Tests only, never in config.ATTENTION: the splash kernel run by the Pallas interpreter on any
# backend (slow), so the model's splash path can be checked on CPU.
SPLASH_INTERPRET = "splash_interpret"
SPLASH = ("splash", SPLASH_INTERPRET)


def target_platform() -> str:
    """The platform being compiled for: that of the active mesh's devices, which may be GPUs or
    TPUs that exist only as a topology (a plan compiled from another machine, maxlm/bench/targets),
    else JAX's default backend."""
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    platform = device.platform if device is not None else jax.default_backend()
    return "gpu" if platform in ("cuda", "rocm") else platform


# The widest head JAX's cuDNN binding takes on every GPU (128; 256 on Hopper and later,
# which it asks of the local GPU, so a compile for an absent H100 cannot use it).
CUDNN_HEAD_DIM = 128


def attention_backend(name: str, dtype, seq_len: int | None = None, platform: str | None = None,
                      softcap: float = 0.0, head_dim: int = 0) -> str:
    """Resolves `model.attention` for `platform` (default: `target_platform()`): "auto" is the
    Pallas splash kernel on TPUs (when `seq_len`, if given, suits it: a multiple of 128), cuDNN's
    fused attention on NVIDIA GPUs with 16-bit compute (it has no float32 kernel), no score
    `softcap` (it has no soft cap) and a `head_dim` (if given) of at most CUDNN_HEAD_DIM, the
    plain XLA path otherwise."""
    platform = platform or target_platform()
    if name == "auto":
        if platform == "tpu":
            return "splash" if seq_len is None or seq_len % LANES == 0 else "xla"
        cudnn_fits = jnp.dtype(dtype).itemsize == 2 and not softcap and head_dim <= CUDNN_HEAD_DIM
        return "cudnn" if platform == "gpu" and cudnn_fits else "xla"
    if name == "cudnn" and platform != "gpu":
        raise ValueError(f"model.attention='cudnn' needs an NVIDIA GPU, not {platform}")
    if name == "splash" and platform != "tpu":
        raise ValueError(f"model.attention='splash' needs a TPU, not {platform}")
    return name


def document_mask(backend: str, segment_ids_BL, dtype, window: int = 0):
    """What `attend` takes as `mask_B1LS` for the resolved `backend`, made once per step; the
    sliding `window` is in XLA's mask (banded where `band_block` finds a block), and in the
    kernels' own masks (`attend`)."""
    if backend in SPLASH:
        return None  # masks inside the kernel, from the segment ids
    if backend == "cudnn":
        return document_bias(segment_ids_BL, dtype)
    window = row_window(window, segment_ids_BL.shape[1])
    if block := band_block(segment_ids_BL.shape[1], window):
        return nn.with_logical_constraint(banded_mask(segment_ids_BL, window, block), ("batch", None, "length", None))
    return attention_mask(segment_ids_BL, window)


def attend(backend: str, q_BLHDh, k_BSKDh, v_BSKDh, mask_B1LS, segment_ids_BL=None,
           splash_blocks: tuple[int, int] = (0, 0), window: int = 0, softcap: float = 0.0):
    """Attention with the named backend and its form of the documents (`document_mask`): the
    [B, 1, L, S] mask for xla, the `document_bias` for cudnn, `segment_ids_BL` for splash (with
    its (query, key/value) tiles, `splash_blocks`; 0 = `block_size`). A sliding `window` (> 0)
    goes to the kernels, which skip the tiles it hides; XLA's mask holds it already (banded:
    `banded_attention` computes only the blocks it can see). A score `softcap` (> 0) goes to XLA
    and splash (config.resolve refuses it with cuDNN)."""
    backend = attention_backend(backend, q_BLHDh.dtype, q_BLHDh.shape[1], softcap=softcap, head_dim=q_BLHDh.shape[-1])
    window = row_window(window, q_BLHDh.shape[1])
    if backend == "cudnn":
        return cudnn_attention(q_BLHDh, k_BSKDh, v_BSKDh, mask_B1LS, window)
    if backend in SPLASH:
        if segment_ids_BL is None:
            raise ValueError("splash attention needs segment_ids_BL")
        return splash_attention(q_BLHDh, k_BSKDh, v_BSKDh, segment_ids_BL, block_q=splash_blocks[0],
                                block_kv=splash_blocks[1], interpret=backend == SPLASH_INTERPRET, window=window,
                                softcap=softcap)
    if band_block(q_BLHDh.shape[1], window):
        return banded_attention(q_BLHDh, k_BSKDh, v_BSKDh, mask_B1LS, softcap)
    return xla_attention(q_BLHDh, k_BSKDh, v_BSKDh, mask_B1LS, softcap)


# ----------------------------------------------------------------------------- cuDNN


def document_bias(segment_ids_BL, dtype, segment_ids_BS=None):
    """cuDNN's document mask: [B, 1, L, S] additive bias, 0 within a document and a large negative
    across (the causal part is the kernel's own causal mode). Built once per step, outside the
    layers, so a scanned stack shares it instead of saving one per layer. The keys' ids
    `segment_ids_BS` default to the queries' (a ring block passes its own)."""
    # cuDNN mishandles the difference of two -inf-like values; JAX's own binding uses these.
    blocked = {jnp.dtype(jnp.bfloat16): -2.0**41, jnp.dtype(jnp.float16): -2.0**15}.get(jnp.dtype(dtype))
    if blocked is None:
        raise ValueError(f"model.attention='cudnn' needs 16-bit compute (model.dtype), not {dtype}")
    segment_ids_BS = segment_ids_BL if segment_ids_BS is None else segment_ids_BS
    same_doc_BLS = segment_ids_BL[:, :, None] == segment_ids_BS[:, None, :]
    return jnp.where(same_doc_BLS, 0, blocked).astype(dtype)[:, None]


def cudnn_attention(q_BLHDh, k_BSKDh, v_BSKDh, bias_B1LS, window: int = 0):
    """cuDNN's fused flash attention in causal mode (within a sliding `window` of tokens when > 0),
    documents from `document_bias`; grouped-query heads are native. In a pipeline, whose stages
    run under vmap, the same kernel through maxlm/model/kernels/cudnn.py: JAX's own batching rule cannot
    batch a bias shared by the heads."""
    if pipeline.pipeline_stages() > 1:
        return cudnn.attention(q_BLHDh, k_BSKDh, v_BSKDh, bias_B1LS, window)
    return jax.nn.dot_product_attention(q_BLHDh, k_BSKDh, v_BSKDh, bias=bias_B1LS, is_causal=True,
                                        local_window_size=(window - 1, 0) if window else None,
                                        implementation="cudnn")


# ----------------------------------------------------------------------------- splash


def block_size(seq_len: int) -> int:
    """The largest of BLOCK_SIZES dividing `seq_len` (the same for q and kv, forward and backward)."""
    for block in BLOCK_SIZES:
        if seq_len % block == 0:
            return block
    raise ValueError(f"splash attention needs a sequence length divisible by {LANES}, got {seq_len}")


def splash_tiles(seq_len: int, block_q: int = 0, block_kv: int = 0) -> tuple[int, int]:
    """The (query, key/value) tiles splash uses for `seq_len`: the given ones, 0 = `block_size`."""
    return block_q or block_size(seq_len), block_kv or block_size(seq_len)


def make_kernel(num_heads: int, seq_len: int, block_q: int, block_kv: int, interpret: bool = False,
                window: int = 0, softcap: float = 0.0):
    """A causal splash kernel for `num_heads` query heads of `seq_len` tokens (one sequence), with
    query tiles of `block_q` and key/value tiles of `block_kv` tokens; with a `window` > 0, each
    query sees its own token and the window - 1 before it (the kernel skips the tiles outside);
    with a `softcap` > 0, the kernel caps the scores as `xla_attention` does."""
    shape = (seq_len, seq_len)
    causal = splash_mask.LocalMask(shape, window_size=(window - 1, 0), offset=0) if window else \
        splash_mask.CausalMask(shape)
    mask = splash_mask.MultiHeadMask(tuple(causal for _ in range(num_heads)))
    return splash_kernel.make_splash_mha(
        mask, block_sizes=splash_block_sizes(block_q, block_kv), head_shards=1, q_seq_shards=1, interpret=interpret,
        attn_logits_soft_cap=softcap or None)


def splash_block_sizes(block_q: int, block_kv: int):
    """Splash's tiles: `block_q` query and `block_kv` key/value tokens, the same for the forward
    pass and both backward kernels."""
    return splash_kernel.BlockSizes(
        block_q=block_q, block_kv=block_kv, block_kv_compute=block_kv,
        block_q_dkv=block_q, block_kv_dkv=block_kv, block_kv_dkv_compute=block_kv,
        block_q_dq=block_q, block_kv_dq=block_kv,
    )


def splash_local(q_BLHDh, k_BSKDh, v_BSKDh, segment_ids_BL, *, block_q, block_kv, interpret, window=0, softcap=0.0):
    """The kernel on one device's shard (or the whole arrays without a mesh)."""
    _, L, H, Dh = q_BLHDh.shape
    kernel = make_kernel(H, L, block_q, block_kv, interpret, window, softcap)
    q_BHLDh = jnp.swapaxes(q_BLHDh * (1.0 / math.sqrt(Dh)), 1, 2)  # the kernel does not scale
    k_BKSDh = jnp.swapaxes(k_BSKDh, 1, 2)
    v_BKSDh = jnp.swapaxes(v_BSKDh, 1, 2)

    def one_sequence(kernel, q_HLDh, k_KSDh, v_KSDh, segment_ids_L):
        return kernel(q_HLDh, k_KSDh, v_KSDh, splash_kernel.SegmentIds(q=segment_ids_L, kv=segment_ids_L))

    # The kernel (a pytree: its mask tables are arrays made in this trace) goes in as an argument:
    # closed over, the pipeline's vmap would trace the custom VJP after this trace ended (a leak).
    attend_all = jax.vmap(one_sequence, in_axes=(None, 0, 0, 0, 0))
    out_BHLDh = _residuals_made_in_forward(attend_all)(kernel, q_BHLDh, k_BKSDh, v_BKSDh, segment_ids_BL)
    return jnp.swapaxes(out_BHLDh, 1, 2)


def _residuals_made_in_forward(fn):
    """`fn` with its own VJP, except that the residuals are made where the forward pass runs.

    Why: splash's forward kernel writes the log-sum-exp 128 lanes wide, float32 [B, H, L, 128], and
    its VJP keeps lane 0 of it. XLA scheduled that slice late, so the wide array (512 MiB a layer
    on the Llama 3 8B v5p-64 plan) stayed live from the forward kernel (run again in the backward
    pass with remat) through the layer's MLP, raising peak memory. One optimization barrier over
    the output and the residuals makes whatever reads the output wait for the slice; a barrier
    over the residuals alone changed nothing (it orders only what reads the residuals).
    """

    def forward(*args):
        return jax.lax.optimization_barrier(jax.vjp(fn, *args))

    def backward(vjp_fn, cotangent):
        return vjp_fn(cotangent)

    wrapped = jax.custom_vjp(fn)
    wrapped.defvjp(forward, backward)
    return wrapped


def splash_attention(q_BLHDh, k_BSKDh, v_BSKDh, segment_ids_BL, *, block_q: int = 0, block_kv: int = 0,
                     interpret: bool = False, window: int = 0, softcap: float = 0.0):
    """Causal, per-document attention [B, L, H, Dh] with the splash kernel.

    `block_q`, `block_kv`: the kernel's query and key/value tiles (0: `block_size(L)`).
    `interpret=True` runs the kernel in the Pallas interpreter on any backend (slow; for tests).
    `window` > 0: a sliding window of that many tokens (`model.sliding_window`); `softcap` > 0:
    the scores capped (`model.attn_logit_softcap`).
    """
    block_q, block_kv = splash_tiles(q_BLHDh.shape[1], block_q, block_kv)
    local = functools.partial(splash_local, block_q=block_q, block_kv=block_kv, interpret=interpret, window=window,
                              softcap=softcap)
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
