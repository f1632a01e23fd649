"""Multi-token prediction (DeepSeek-V3, arXiv 2412.19437 §2.2): `model.mtp_depth` = D modules run
in sequence after the trunk, module k predicting the token k + 1 places ahead of each position.

    h^0_i = the trunk's output at i, before the final norm
    h^k_i = Block(M_k [RMSNorm(h^{k-1}_i); RMSNorm(Emb(t_{i+k}))])            k = 1 .. D
    P^k(t_{i+k+1}) = softmax(Head(FinalNorm(h^k_i)))

h^0 is taken before the final norm, as MaxText's implementation does: it is the main model's
representation, and module 1 normalises it with its own RMSNorm (FinalNorm's scale belongs to the
main head). M_k is a [2D, D] projection. The token embedding, the final norm and the output head
are the main model's, shared. Each module's Block is a dense one (attention + SwiGLU of
`model.mlp_dim`) in MoE models too, where DeepSeek-V3's is an MoE layer: this keeps the router's
statistics and its balancing state to the trunk's layers. `Emb` is the token embedding alone
(position encodings reach the module through h^{k-1}, and RoPE in its attention).

Packed rows stay exact: `targets[i] = t_{i+1}`, so depth k reads t_{i+k} = targets[i + k - 1] and
predicts targets[i + k]; a position whose target is in another document, in padding or past the
row's end counts nothing (`depth_batch`). The module's attention uses the trunk's document mask
and positions, so a counted position only ever sees positions of its own document.

The objective adds `model.mtp_loss_weight` (λ) times the mean over depths of each depth's mean
cross-entropy (`mtp_loss`). Training only: evaluation, generation and the Hugging Face export use
the main head alone (DeepSeek-V3 also uses the modules for speculative decoding: not built).

Shape suffixes as in transformer.py.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp


class Depth(nn.Module):
    """Module k: h^{k-1} [B, L, D] and Emb(t_{i+k}) [B, L, D] → h^k [B, L, D].

    `block` and `norm` are transformer.py's Block (remat-wrapped as the trunk's layers are) and
    RMSNorm classes, passed in as MaxText passes its decoder layer: transformer.py builds this
    module, so this one cannot import it."""

    cfg: Any
    block: Any
    norm: Any

    @nn.compact
    def __call__(self, h_BLD, embeds_BLD, positions_BL, mask_B1LS, segment_ids_BL):
        cfg = self.cfg
        dtype = jnp.dtype(cfg.dtype)
        D = cfg.d_model
        init = nn.with_logical_partitioning(nn.initializers.normal(stddev=cfg.init_std), (None, "embed"))
        proj_CD = self.param("proj", init, (2 * D, D), jnp.float32)  # C = 2D: [h; e]
        both_BLC = jnp.concatenate([self.norm(cfg.norm_eps, dtype, name="hidden_norm")(h_BLD),
                                    self.norm(cfg.norm_eps, dtype, name="embed_norm")(embeds_BLD)], axis=-1)
        x_BLD = jnp.einsum("blc,cd->bld", both_BLC, proj_CD.astype(dtype))
        x_BLD = nn.with_logical_constraint(x_BLD, ("batch", "length", "act_embed"))
        return self.block(cfg, name="block")(x_BLD, positions_BL, mask_B1LS, segment_ids_BL)[0]


def ahead(x_BL, n: int):
    """x_BL[:, i + n] at column i, 0 past the row's end."""
    return jnp.pad(x_BL[:, n:], ((0, 0), (0, n)))


def input_tokens(targets_BL, k: int):
    """Depth k's input tokens: t_{i+k} = targets[i + k - 1] (0 past the row's end)."""
    return ahead(targets_BL, k - 1)


def depth_batch(batch, k: int) -> dict:
    """Depth k's {"targets": t_{i+k+1} = targets[i + k], "segment_ids"}: the batch's segment ids,
    0 (no loss, as padding) where that target is not in position i's document (another document,
    padding, past the row's end). `transformer.token_losses` reads these two keys."""
    segment_ids_BL = batch["segment_ids"]
    same_document_BL = ahead(segment_ids_BL, k) == segment_ids_BL
    return {"targets": ahead(batch["targets"], k), "segment_ids": jnp.where(same_document_BL, segment_ids_BL, 0)}


def mean_cross_entropy(per_token):
    """A depth's mean cross-entropy over the tokens it counts, of `transformer.token_losses` on its
    `depth_batch` (the plain cross-entropy: z-loss and label smoothing are the main head's)."""
    weights_BL = per_token["weights"]
    return (per_token["cross_entropy"] * weights_BL).sum() / jnp.maximum(weights_BL.sum(), 1.0)


def mtp_loss(cfg, cross_entropy_K):
    """What the modules add to the objective: λ × the mean of the depths' mean cross-entropies."""
    return cfg.mtp_loss_weight * cross_entropy_K.mean()


def metrics(cross_entropy_K) -> dict:
    """The step's metrics of the depths' mean cross-entropies [D]: `mtp_loss`, their mean, and
    with D > 1 each depth's as `mtp/loss_k` (k = 1 .. D)."""
    per_depth = {f"mtp/loss_{k + 1}": cross_entropy_K[k] for k in range(cross_entropy_K.shape[0])}
    return {"mtp_loss": cross_entropy_K.mean(), **(per_depth if len(per_depth) > 1 else {})}


def module_params(cfg) -> int:
    """The parameters of the D modules beyond their Blocks: each one's projection and two norms."""
    return cfg.mtp_depth * (2 * cfg.d_model * cfg.d_model + 2 * cfg.d_model)
