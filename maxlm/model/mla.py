"""Multi-head latent attention (DeepSeek-V2/V3; `model.attention_kind=mla`).

Keys and values come from one small latent per token instead of per-head projections, and RoPE
goes on a few separate dimensions, so that what a KV cache must hold is the latent:

    q      = W_qb · RMSNorm(W_qa · x)              [H, N + R]   (or W_q · x when q_lora_rank = 0)
    c, k_r = W_kva · x                             [C], [R]     (c: the latent, k_r: one RoPE key)
    k, v   = W_kvb · RMSNorm(c)                    [H, N], [H, V]
    scores = (q_n · k_n + RoPE(q_r) · RoPE(k_r)) / sqrt(N + R)

with N = `qk_nope_head_dim`, R = `qk_rope_head_dim`, V = `v_head_dim`, C = `kv_lora_rank`, the
query bottleneck `q_lora_rank` (transformers' names). Training expands the latent into H keys and
values and attends as any layer does (`weights.attend_heads`, values of their own width).
Generation caches c and RoPE(k_r), [S, C + R] per layer instead of [S, 2·K·Dh] (DeepSeek-V3:
576 numbers a token against 32,768 for its 128 heads), and folds W_kvb into the query and the
output (`decode_attention`): q_n · k_n = (W_kvb_k^T q_n) · c, and the values' sum is W_kvb_v
times the probabilities' sum of c.

The latent dims have the logical axis `latent`, sharded like `embed` (fsdp) where a matrix has
no `embed` dim (W_qb, W_kvb), whole where it has (the rules use a mesh axis once per array).
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from maxlm.model import attention, positions
from maxlm.model.norms import RMSNorm
from maxlm.model.weights import attend_heads, compute_dtype, constrain, normal, param, weight_matmul

LATENT_NORM_EPS = 1e-6  # DeepSeek's q_a_layernorm and kv_a_layernorm (whatever rms_norm_eps is)


def _latent_norm(cfg, dtype, name: str | None = None) -> RMSNorm:
    return RMSNorm(LATENT_NORM_EPS, dtype, ("latent",), cfg.norm_plus_one, name=name)


def queries(cfg, p: dict, x_BLD, positions_BL, q_norm):
    """(q_nope [B, L, H, N], RoPE'd q_rope [B, L, H, R]) of the layer's params `p` (arrays);
    `q_norm` normalises the query latent."""
    dtype = compute_dtype(cfg)
    if cfg.q_lora_rank:
        q_latent_BLQ = q_norm(weight_matmul(cfg, "bld,dq->blq", x_BLD, p["wq_a"], dtype))
        q_BLHDq = weight_matmul(cfg, "blq,qhk->blhk", q_latent_BLQ, p["wq_b"], dtype)
    else:
        q_BLHDq = weight_matmul(cfg, "bld,dhk->blhk", x_BLD, p["wq"], dtype)
    q_BLHDq = checkpoint_name(q_BLHDq, "q_proj")
    q_nope, q_rope = jnp.split(q_BLHDq, [cfg.qk_nope_head_dim], axis=-1)
    return q_nope, positions.rotary(cfg, q_rope, positions_BL)


def latents(cfg, p: dict, x_BLD, positions_BL, kv_norm):
    """(the normed latent c [B, L, C], the RoPE'd shared key k_rope [B, L, R]): what the cache holds."""
    dtype = compute_dtype(cfg)
    kv_BLCR = checkpoint_name(weight_matmul(cfg, "bld,dc->blc", x_BLD, p["wkv_a"], dtype), "k_proj")
    c_BLC, k_rope_BLR = jnp.split(kv_BLCR, [cfg.kv_lora_rank], axis=-1)
    k_rope_BLR = positions.rotary(cfg, k_rope_BLR[:, :, None, :], positions_BL)[:, :, 0, :]
    return kv_norm(c_BLC), k_rope_BLR


class LatentAttention(nn.Module):
    """`transformer.Attention`'s place in a block for `model.attention_kind=mla`."""
    cfg: Any

    @nn.compact
    def __call__(self, x_BLD, positions_BL, mask_B1LS, segment_ids_BL):
        cfg = self.cfg
        dtype = compute_dtype(cfg)
        D, H, N, R, V = cfg.d_model, cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        C, Q = cfg.kv_lora_rank, cfg.q_lora_rank
        std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.num_layers)
        p = {}
        if Q:
            p["wq_a"] = param(self, "wq_a", normal(std), (D, Q), ("embed", "latent"))
            q_norm = _latent_norm(cfg, dtype, name="q_a_norm")
            p["wq_b"] = param(self, "wq_b", normal(std), (Q, H, N + R), ("latent", "heads", "head_dim"))
        else:
            p["wq"], q_norm = param(self, "wq", normal(std), (D, H, N + R), ("embed", "heads", "head_dim")), None
        p["wkv_a"] = param(self, "wkv_a", normal(std), (D, C + R), ("embed", "latent"))
        kv_norm = _latent_norm(cfg, dtype, name="kv_a_norm")
        wkv_b_CHE = param(self, "wkv_b", normal(std), (C, H, N + V), ("latent", "heads", "head_dim"))
        wo_HVD = param(self, "wo", normal(out_std), (H, V, D), ("heads", "head_dim", "embed"))

        q_nope, q_rope = queries(cfg, p, x_BLD, positions_BL, q_norm)
        c_BSC, k_rope_BSR = latents(cfg, p, x_BLD, positions_BL, kv_norm)
        kv_BSHE = weight_matmul(cfg, "bsc,che->bshe", c_BSC, wkv_b_CHE, dtype)
        k_nope, v_BSHV = jnp.split(kv_BSHE, [N], axis=-1)
        q_BLHDq = constrain(jnp.concatenate([q_nope, q_rope], axis=-1), ("batch", "length", "heads", "head_dim"))
        k_rope_BSHR = jnp.broadcast_to(k_rope_BSR[:, :, None, :], (*k_nope.shape[:3], R))
        k_BSHDq = jnp.concatenate([k_nope, k_rope_BSHR], axis=-1)
        v_BSHV = checkpoint_name(v_BSHV, "v_proj")
        out_BLHV = attend_heads(cfg, q_BLHDq, k_BSHDq, v_BSHV, mask_B1LS, segment_ids_BL, self.is_initializing())
        return checkpoint_name(weight_matmul(cfg, "blhv,hvd->bld", out_BLHV, wo_HVD, dtype), "attn_out")


# ----------------------------------------------------------------------------- generation


def init_cache(model_cfg, batch_size: int, max_len: int, layers: tuple[int, ...] = ()) -> dict:
    """Zeroed latents for `max_len` positions: {"c": [*layers, B, S, C], "k_rope": [*layers, B, S, R]}."""
    dtype = compute_dtype(model_cfg)
    return {"c": jnp.zeros((*layers, batch_size, max_len, model_cfg.kv_lora_rank), dtype),
            "k_rope": jnp.zeros((*layers, batch_size, max_len, model_cfg.qk_rope_head_dim), dtype)}


def decode_attention(model_cfg, p: dict, x_BTD, positions_BT, cache: dict):
    """`LatentAttention` for T new tokens whose latents go into the cache at slot = position, each
    attending to the slots up to its own (and within `model.sliding_window`), without expanding
    the cache: the query is folded into latent space and the output out of it. Returns
    ([B, T, D], the cache)."""
    cfg, dtype = model_cfg, compute_dtype(model_cfg)
    N = cfg.qk_nope_head_dim
    q_norm = (lambda x: _latent_norm(cfg, dtype).apply({"params": p["q_a_norm"]}, x)) if cfg.q_lora_rank else None
    kv_norm = lambda x: _latent_norm(cfg, dtype).apply({"params": p["kv_a_norm"]}, x)  # noqa: E731
    q_nope_BTHN, q_rope_BTHR = queries(cfg, p, x_BTD, positions_BT, q_norm)
    c_BTC, k_rope_BTR = latents(cfg, p, x_BTD, positions_BT, kv_norm)
    rows_BT = jnp.broadcast_to(jnp.arange(x_BTD.shape[0])[:, None], positions_BT.shape)
    c_BSC = cache["c"].at[rows_BT, positions_BT].set(c_BTC)
    k_rope_BSR = cache["k_rope"].at[rows_BT, positions_BT].set(k_rope_BTR)
    wkv_b_CHE = p["wkv_b"].astype(dtype)
    w_k_CHN, w_v_CHV = wkv_b_CHE[..., :N], wkv_b_CHE[..., N:]
    q_latent_BTHC = jnp.einsum("bthn,chn->bthc", q_nope_BTHN, w_k_CHN)
    scale = 1 / math.sqrt(N + cfg.qk_rope_head_dim)
    scores_BHTS = (jnp.einsum("bthc,bsc->bhts", q_latent_BTHC, c_BSC)
                   + jnp.einsum("bthr,bsr->bhts", q_rope_BTHR, k_rope_BSR)).astype(jnp.float32) * scale
    scores_BHTS = attention.soft_cap(scores_BHTS, cfg.attn_logit_softcap)
    mask_BTS = attention.cache_mask(positions_BT, c_BSC.shape[1], cfg.sliding_window)
    scores_BHTS = jnp.where(mask_BTS[:, None], scores_BHTS, jnp.finfo(jnp.float32).min)
    probs_BHTS = jax.nn.softmax(scores_BHTS, axis=-1).astype(dtype)
    out_BTHV = jnp.einsum("bthc,chv->bthv", jnp.einsum("bhts,bsc->bthc", probs_BHTS, c_BSC), w_v_CHV)
    out_BTD = weight_matmul(cfg, "blhv,hvd->bld", out_BTHV, p["wo"], dtype)
    return out_BTD, {"c": c_BSC, "k_rope": k_rope_BSR}


def attention_params(model_cfg) -> int:
    """One layer's latent attention parameters, its two latent norms included."""
    m = model_cfg
    D, H, N, R, V, C, Q = (m.d_model, m.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim,
                           m.kv_lora_rank, m.q_lora_rank)
    queries = D * Q + Q + Q * H * (N + R) if Q else D * H * (N + R)
    return queries + D * (C + R) + C + C * H * (N + V) + H * V * D
