"""What every layer module uses: its parameters, its weight matmuls, and attention over the heads
by the context-parallel strategy the mesh and config choose.

    w = param(module, "wq", normal(std), (D, H, Dh), ("embed", "heads", "head_dim"))
    y = weight_matmul(cfg, "bld,dhk->blhk", x, w, compute_dtype(cfg))
    out_BLHDh = attend_heads(cfg, q_BLHDh, k_BSKDh, v_BSKDh, mask_B1LS, segment_ids_BL, initializing)

Grouped-query attention (transformer.py `Attention`) and multi-head latent attention (mla.py)
differ in how they make queries, keys and values and share everything after.
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from maxlm.model import attention
from maxlm.model.kernels import fp8
from maxlm.model.parallel import ring_attention, ulysses, zigzag

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def compute_dtype(model_cfg):
    """`model.dtype` as a jnp dtype: what activations and matmuls run in (params stay float32)."""
    return _DTYPES[model_cfg.dtype]


def normal(std: float):
    return nn.initializers.normal(stddev=std)


def param(module: nn.Module, name: str, init, shape, axes):
    """A float32 parameter of `module` with the logical `axes` (maxlm/config/mesh_axes.py's rules shard them)."""
    return module.param(name, nn.with_logical_partitioning(init, axes), shape, jnp.float32)


def constrain(x, axes):
    return nn.with_logical_constraint(x, axes)


def weight_matmul(cfg, spec: str, x, w, dtype):
    """A layer's weight matmul: float8 operands with `model.fp8` (see maxlm/model/kernels/fp8.py), else `dtype`."""
    if cfg.fp8:
        return fp8.fp8_einsum(spec, x, w, dtype)
    return jnp.einsum(spec, x, w.astype(dtype))


def bias(module: nn.Module, name: str, shape, axes, dtype):
    """A projection's bias (zeros at init), in the compute dtype."""
    return param(module, name, nn.initializers.zeros, shape, axes).astype(dtype)


def attend_heads(cfg, q_BLHDh, k_BSKDh, v_BSKDh, mask_B1LS, segment_ids_BL, initializing: bool):
    """Causal, per-document attention [B, L, H, Dv] of RoPE'd queries and keys over values whose
    head dim Dv may differ from theirs (multi-head latent attention's), with `model.attention`'s
    backend, by the strategy across `mesh.sequence`: the ring, Ulysses or the all-gather.
    `initializing`: init traces a 1 x 8 dummy batch that the mesh cannot split and a splash
    kernel cannot tile; the plain path traces the same parameters."""
    dtype = compute_dtype(cfg)
    kv_axes = ("batch", "length", "kv_heads", "head_dim")
    if ring_attention.active(cfg) and not initializing:  # the ring strategy: keys and values stay split, blocks travel
        k_BSKDh, v_BSKDh = constrain(k_BSKDh, kv_axes), constrain(v_BSKDh, kv_axes)
        n, length = zigzag.shards(cfg), q_BLHDh.shape[1]
        token_index_L = jnp.asarray(zigzag.token_order(length, n) if n else np.arange(length), jnp.int32)
        kernel = ring_attention.block_kernel(cfg, dtype, length)  # splash, cuDNN, or None: XLA einsums
        return ring_attention.ring_attention(q_BLHDh, k_BSKDh, v_BSKDh, segment_ids_BL, token_index_L, kernel,
                                             attention.row_window(cfg.sliding_window, length), cfg.attn_logit_softcap)
    backend = "xla" if initializing else cfg.attention
    blocks = (cfg.splash_block_q, cfg.splash_block_kv)
    if ulysses.applies(cfg, *q_BLHDh.shape[:2]) and not initializing:
        # Ulysses: keys and values stay split like the queries; an all-to-all regroups all three
        # by heads around attention (maxlm/model/parallel/ulysses.py).
        k_BSKDh, v_BSKDh = constrain(k_BSKDh, kv_axes), constrain(v_BSKDh, kv_axes)
        return ulysses.attend(backend, q_BLHDh, k_BSKDh, v_BSKDh, segment_ids_BL, blocks, cfg.sliding_window,
                              cfg.attn_logit_softcap)
    # Sequence parallelism, the all-gather strategy: queries stay split along the length (mesh
    # axis `sequence`), keys and values are gathered whole (length None), so each device
    # attends its query rows to every key. RoPE ran before the gather, on each token's own
    # position. Without a sequence axis these constraints change nothing.
    gathered = ("batch", None, "kv_heads", "head_dim")
    k_BSKDh, v_BSKDh = constrain(k_BSKDh, gathered), constrain(v_BSKDh, gathered)
    return attention.attend(backend, q_BLHDh, k_BSKDh, v_BSKDh, mask_B1LS, segment_ids_BL, blocks,
                            cfg.sliding_window, cfg.attn_logit_softcap)
