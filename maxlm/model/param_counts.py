"""Parameter counts in closed form, from the model config alone (the tests check them against the
initialised pytree): every parameter, and those one token's forward pass uses.

    count_params(model_cfg), active_params(model_cfg)
"""

from __future__ import annotations

from maxlm.model import mla, moe, mtp
from maxlm.model.norms import norms_around


def count_params(model_cfg) -> int:
    """Closed-form parameter count (checked against the real pytree in the tests)."""
    m = model_cfg
    D, H, K, Dh, F, V = m.d_model, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim, m.vocab_size
    qk_norms = {"none": 0, "per_head": 2 * Dh, "full": (H + K) * Dh}[m.qk_norm]
    norm = D * (2 if m.norm == "layernorm" else 1)  # a LayerNorm has a bias beside its scale
    block_norms = norm * sum(norms_around(m)) * 2  # before and/or after each of the two sublayers
    biases = (H + 2 * K) * Dh * (m.use_bias or m.qkv_bias) + D * m.use_bias
    attention = mla.attention_params(m) if m.attention_kind == "mla" else D * H * Dh + 2 * D * K * Dh + H * Dh * D
    attention_and_norms = attention + block_norms + qk_norms + biases
    matrices = 2 if m.mlp_activation == "gelu" else 3  # (gate,) up, down
    mlp = matrices * D * F + ((matrices - 1) * F + D) * m.use_bias
    dense = moe.dense_layers(m)
    layers = dense * (attention_and_norms + mlp) + (m.num_layers - dense) * (attention_and_norms + moe.expert_params(m))
    head = 0 if m.tie_embeddings else D * V
    position_table = m.max_positions * D if m.positions == "learned" else 0
    # dense blocks, and each module's projection and two norms
    mtp_modules = m.mtp_depth * (attention_and_norms + mlp + 2 * norm) + mtp.module_params(m) - m.mtp_depth * 2 * D
    return V * D + position_table + layers + norm + head + mtp_modules


def active_params(model_cfg) -> int:
    """The parameters one token's forward pass uses: `count_params`, less the experts an MoE
    layer does not route it to (all of them for a dense model)."""
    moe_layers = model_cfg.num_layers - moe.dense_layers(model_cfg)
    if not moe_layers:
        return count_params(model_cfg)
    return count_params(model_cfg) - moe_layers * (moe.expert_params(model_cfg) - moe.active_params(model_cfg))
