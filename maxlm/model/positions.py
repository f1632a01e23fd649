"""Position encodings (`model.positions`): how the model knows where a token sits in its document.

    rope        rotary embeddings of queries and keys, inside attention (`rotary`); relative
    sinusoidal  the original Transformer's fixed sin/cos, added to the token embeddings
    learned     rows of a [max_positions, D] parameter table, added to the token embeddings

RoPE's frequencies can be scaled to extend the context (`model.rope_scaling`: `rope_frequencies`):
linear interpolation (every frequency divided by the factor: Gemma 3's global layers), Llama
3.1's rule or YaRN, as transformers' `ROPE_INIT_FUNCTIONS` computes them.

Each reads the batch's `positions`, which restart at 0 for every packed document, so a document
is encoded the same packed or alone. Shape suffixes as in model.py, plus P max positions and
F frequencies.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

SINUSOID_BASE = 10000.0  # the original Transformer's: wavelengths from 2π to 10000·2π


def rope(x_BLHDh, positions_BL, theta: float, freq_F=None, attention_factor: float = 1.0):
    """Rotary embedding, rotating pairs (i, i + Dh/2) (the Llama/NeoX half-split layout), at the
    frequencies `freq_F` (a scaling's: `rope_frequencies`) or theta's own; YaRN's
    `attention_factor` multiplies cos and sin, as transformers does."""
    half = x_BLHDh.shape[-1] // 2
    freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half) if freq_F is None else jnp.asarray(freq_F)
    angle_BL1F = (positions_BL.astype(jnp.float32)[:, :, None] * freq)[:, :, None, :]
    sin, cos = jnp.sin(angle_BL1F), jnp.cos(angle_BL1F)
    if attention_factor != 1.0:
        sin, cos = sin * attention_factor, cos * attention_factor
    # In the compute dtype, as Hugging Face's Llama and MaxText rotate: in float32, XLA stores a
    # float32 copy of every projection's queries and keys and of their gradients (three [B, L, H,
    # Dh] arrays a layer; 8% more bytes accessed than MaxText's step in a v5p plan of Llama 3.2 1B)
    dtype = x_BLHDh.dtype
    sin, cos = sin.astype(dtype), cos.astype(dtype)
    x1, x2 = jnp.split(x_BLHDh, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def rope_frequencies(model_cfg, head_dim: int) -> tuple[np.ndarray, float]:
    """(inverse frequencies [Dh/2] as float32, attention factor) of `model.rope_scaling`
    ("linear", "llama3" or "yarn"), computed once in float64 from transformers' formulas
    (modeling_rope_utils: `_compute_linear_scaling_rope_parameters`, `_compute_llama3_parameters`,
    `_compute_yarn_parameters` with its defaults: truncated correction range, attention factor
    0.1·ln(factor) + 1)."""
    m = model_cfg
    exponent_F = np.arange(0, head_dim, 2, dtype=np.float64) / head_dim
    inv_F = 1.0 / m.rope_theta ** exponent_F
    factor, original = m.rope_scaling_factor, m.rope_original_max_len
    if m.rope_scaling == "linear":  # positions / factor: every wavelength stretched alike
        return (inv_F / factor).astype(np.float32), 1.0
    if m.rope_scaling == "llama3":
        low, high = m.rope_low_freq_factor, m.rope_high_freq_factor
        wavelen_F = 2 * math.pi / inv_F
        long_F = np.where(wavelen_F > original / low, inv_F / factor, inv_F)  # long waves: interpolated
        smooth_F = (original / wavelen_F - low) / (high - low)
        medium_F = (wavelen_F >= original / high) & (wavelen_F <= original / low)
        out_F = np.where(medium_F, (1 - smooth_F) * long_F / factor + smooth_F * long_F, long_F)
        return out_F.astype(np.float32), 1.0
    if m.rope_scaling != "yarn":
        raise ValueError(f"no scaled frequencies for model.rope_scaling={m.rope_scaling!r}")

    def correction_dim(rotations):  # the dim whose wavelength fits `rotations` times in `original`
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(m.rope_theta))

    low = max(math.floor(correction_dim(m.rope_beta_fast)), 0)
    high = min(math.ceil(correction_dim(m.rope_beta_slow)), head_dim - 1)
    high = high + 0.001 if low == high else high  # transformers': no division by zero
    ramp_F = np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    out_F = inv_F / factor * ramp_F + inv_F * (1 - ramp_F)  # interpolated above `high`, kept below `low`
    return out_F.astype(np.float32), 0.1 * math.log(factor) + 1.0


def rotary(model_cfg, x_BLHDh, positions_BL):
    """Queries or keys rotated by RoPE when `model.positions` is rope; the absolute encodings
    were added to the embeddings (`add_positions`), so they leave them as they are."""
    if model_cfg.positions != "rope":
        return x_BLHDh
    if model_cfg.rope_scaling == "none":  # theta's frequencies, computed as ever (bitwise)
        return rope(x_BLHDh, positions_BL, model_cfg.rope_theta)
    freq_F, attention_factor = rope_frequencies(model_cfg, x_BLHDh.shape[-1])
    return rope(x_BLHDh, positions_BL, model_cfg.rope_theta, freq_F, attention_factor)


def sinusoidal(positions_BL, d_model: int):
    """The original Transformer's fixed encoding [B, L, D], float32 ("Attention Is All You Need",
    3.5): PE[p, 2i] = sin(p / base^(2i/D)), PE[p, 2i+1] = cos(p / base^(2i/D))."""
    freq_F = SINUSOID_BASE ** (-jnp.arange(0, d_model, 2, dtype=jnp.float32) / d_model)
    angle_BLF = positions_BL.astype(jnp.float32)[..., None] * freq_F
    pairs_BLF2 = jnp.stack([jnp.sin(angle_BLF), jnp.cos(angle_BLF)], axis=-1)
    return pairs_BLF2.reshape(*positions_BL.shape, d_model)


def learned(table_PD, positions_BL, dtype):
    """Rows of the learned table [B, L, D] in `dtype`, gathered as model.embed gathers token
    rows: from the table with its embed dim whole (a gather out of an fsdp-sharded dim has no
    efficient SPMD partitioning)."""
    table_PD = nn.with_logical_constraint(table_PD, ("positions", "act_embed"))
    return jnp.take(table_PD, positions_BL, axis=0).astype(dtype)


def add_positions(model_cfg, x_BLD, positions_BL, table_PD=None):
    """Token embeddings [B, L, D] plus the absolute encoding of each token's position: the fixed
    sinusoid, or rows of the learned table `table_PD`. RoPE works inside attention: x unchanged."""
    if model_cfg.positions == "sinusoidal":
        pe_BLD = sinusoidal(positions_BL, model_cfg.d_model).astype(x_BLD.dtype)
    elif model_cfg.positions == "learned":
        pe_BLD = learned(table_PD, positions_BL, x_BLD.dtype)
    else:
        return x_BLD
    return nn.with_logical_constraint(x_BLD + pe_BLD, ("batch", "length", "act_embed"))
