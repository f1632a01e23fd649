"""The normalisations: RMSNorm or LayerNorm (`model.norm`), and where a block puts them
(`model.norm_placement`, `model.qk_norm`).

    x_BLD = residual(x_BLD, sublayer, norm_before, norm_after)   # x + sublayer(x), normed as placed
    before, after = placed_norms(model_cfg, "attn", make)        # the norms `model.norm_placement` puts
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp


class RMSNorm(nn.Module):
    """RMSNorm over the trailing `len(axes)` dims of its input (their logical names: `axes`).
    `plus_one` (`model.norm_plus_one`, Gemma's): the parameter w starts at 0 and the norm scales by
    1 + w, so weight decay pulls the scale towards 1, not 0, and Gemma's checkpoints map as they are."""
    eps: float
    dtype: Any
    axes: tuple[str, ...] = ("embed",)
    plus_one: bool = False

    @nn.compact
    def __call__(self, x_BLD):
        n = len(self.axes)
        init = nn.initializers.zeros if self.plus_one else nn.initializers.ones
        scale_D = self.param("scale", nn.with_logical_partitioning(init, self.axes), x_BLD.shape[-n:], jnp.float32)
        x = x_BLD.astype(jnp.float32)  # the mean square in float32 even for bfloat16 compute
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=tuple(range(-n, 0)), keepdims=True) + self.eps)
        return (x * (1.0 + scale_D if self.plus_one else scale_D)).astype(self.dtype)


class LayerNorm(nn.Module):
    """LayerNorm over the last dim (logical name `axes`): centred, scaled and shifted (GPT-2's)."""
    eps: float
    dtype: Any
    axes: tuple[str, ...] = ("embed",)

    @nn.compact
    def __call__(self, x_BLD):
        shape = x_BLD.shape[-1:]
        scale_D = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, self.axes), shape, jnp.float32)
        bias_D = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, self.axes), shape, jnp.float32)
        x = x_BLD.astype(jnp.float32)  # statistics in float32 even for bfloat16 compute
        x = x - jnp.mean(x, axis=-1, keepdims=True)
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        return (x * scale_D + bias_D).astype(self.dtype)


def block_norm(model_cfg):
    """The class of the blocks' and the final norm, `model.norm` (qk-norm is always RMSNorm)."""
    if model_cfg.norm == "layernorm":
        return LayerNorm
    return functools.partial(RMSNorm, plus_one=model_cfg.norm_plus_one) if model_cfg.norm_plus_one else RMSNorm


def qk_norm(model_cfg, dtype, heads: str, name: str | None = None) -> RMSNorm:
    """The RMSNorm `model.qk_norm` puts on the queries (`heads`="heads") or keys ("kv_heads")."""
    return RMSNorm(model_cfg.norm_eps, dtype, qk_norm_axes(model_cfg, heads), model_cfg.norm_plus_one, name=name)


def residual(x_BLD, sublayer, norm_before=None, norm_after=None):
    """x + sublayer(x), with the norms `placed_norms` gives (None: none)."""
    out_BLD = sublayer(norm_before(x_BLD) if norm_before else x_BLD)
    return x_BLD + (norm_after(out_BLD) if norm_after else out_BLD)


def norms_around(model_cfg) -> tuple[bool, bool]:
    """(a norm before each sublayer, one after it) for `model.norm_placement`. A block's norms are
    `attn_norm`, `mlp_norm` before and `attn_out_norm`, `mlp_out_norm` after."""
    return model_cfg.norm_placement in ("pre", "sandwich"), model_cfg.norm_placement in ("post", "sandwich")


def placed_norms(model_cfg, sublayer: str, make) -> list:
    """[the norm before `sublayer` ("attn", "mlp"), the one after] for `residual`, each
    `make(name)` where `norms_around` puts one, else None."""
    return [make(f"{sublayer}{suffix}") if on else None for suffix, on in zip(("_norm", "_out_norm"), norms_around(model_cfg))]


def qk_norm_axes(cfg, heads: str) -> tuple[str, ...]:
    """What `model.qk_norm` normalises a query's or key's projection over (`heads`: "heads" or
    "kv_heads"): each head's head_dim (per_head: Qwen3, Gemma 3), or all heads' at once (full:
    OLMo 2, whose norm sees the whole [H·Dh] projection)."""
    return ("head_dim",) if cfg.qk_norm == "per_head" else (heads, "head_dim")
