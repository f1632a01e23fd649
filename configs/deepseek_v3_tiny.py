"""DeepSeek-V3's block, small enough to train on a CPU in a few minutes.

configs/quickstart.py's shape (4 layers, d_model 128, 4 heads, byte tokens, the built-in corpus)
with DeepSeek-V3's pieces at a small scale:
- multi-head latent attention (`model.attention_kind=mla`): queries through a 64-wide bottleneck,
  keys and values from a 32-wide latent, 32 + 16 query/key dims a head (16 with RoPE), 32 value
  dims; the generation cache holds the latent (48 numbers a token and layer);
- the first layer dense, the other three mixtures of 8 experts (2 a token, each a quarter of the
  dense MLP) plus one shared expert, routed by sigmoid scores within the best 2 of 4 groups, the
  chosen gates normalised and scaled by 2.5 (DeepSeek-V3's `routed_scaling_factor`), balanced by
  the auxiliary-loss-free selection bias (`model.load_balance=bias`), moved 0.01 a step: DeepSeek's
  0.001 suits its 14.8T tokens, and left the busiest expert with 3.8 times the mean load after
  these 150 steps, against 1.3 at 0.01;
- one multi-token prediction module (weight 0.3).

It exports as transformers' DeepseekV3ForCausalLM (without the MTP module, as transformers runs
it). 150 steps of 16 × 128 tokens; docs/models.md#presets records its loss and time.
"""

import os

from maxlm.config import load_file


def get_config():
    c = load_file(os.path.join(os.path.dirname(__file__), "quickstart.py"))
    c.name = "deepseek_v3_tiny"
    c.steps = 150
    c.batch_size = 16
    c.model.num_kv_heads = 4
    c.model.attention_kind = "mla"
    c.model.q_lora_rank = 64
    c.model.kv_lora_rank = 32
    c.model.qk_nope_head_dim = 32
    c.model.qk_rope_head_dim = 16
    c.model.v_head_dim = 32
    c.model.norm_eps = 1e-6
    c.model.num_experts = 8
    c.model.experts_per_token = 2
    c.model.expert_mlp_dim = 96
    c.model.shared_experts = 1
    c.model.first_dense_layers = 1
    c.model.router = "sigmoid"
    c.model.router_scale = 2.5
    c.model.router_groups = 4
    c.model.router_topk_groups = 2
    c.model.load_balance = "bias"
    c.model.bias_update_rate = 0.01
    c.model.mtp_depth = 1
    return c
