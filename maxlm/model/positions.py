"""Position encodings (`model.positions`): how the model knows where a token sits in its document.

    rope        rotary embeddings of queries and keys, inside attention (`rotary`); relative
    sinusoidal  the original Transformer's fixed sin/cos, added to the token embeddings
    learned     rows of a [max_positions, D] parameter table, added to the token embeddings

Each reads the batch's `positions`, which restart at 0 for every packed document, so a document
is encoded the same packed or alone. Shape suffixes as in model.py, plus P max positions and
F frequencies.
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

SINUSOID_BASE = 10000.0  # the original Transformer's: wavelengths from 2π to 10000·2π


def rope(x_BLHDh, positions_BL, theta: float):
    """Rotary embedding, rotating pairs (i, i + Dh/2) (the Llama/NeoX half-split layout)."""
    half = x_BLHDh.shape[-1] // 2
    freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle_BL1F = (positions_BL.astype(jnp.float32)[:, :, None] * freq)[:, :, None, :]
    # In the compute dtype, as Hugging Face's Llama and MaxText rotate: in float32, XLA stores a
    # float32 copy of every projection's queries and keys and of their gradients (three [B, L, H,
    # Dh] arrays a layer; 8% more bytes accessed than MaxText's step in a v5p plan of Llama 3.2 1B)
    dtype = x_BLHDh.dtype
    sin, cos = jnp.sin(angle_BL1F).astype(dtype), jnp.cos(angle_BL1F).astype(dtype)
    x1, x2 = jnp.split(x_BLHDh, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def rotary(model_cfg, x_BLHDh, positions_BL):
    """Queries or keys rotated by RoPE when `model.positions` is rope; the absolute encodings
    were added to the embeddings (`add_positions`), so they leave them as they are."""
    if model_cfg.positions != "rope":
        return x_BLHDh
    return rope(x_BLHDh, positions_BL, model_cfg.rope_theta)


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
