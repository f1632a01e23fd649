"""Qwen3 0.6B (Alibaba, Qwen3-0.6B-Base): 596,049,920 parameters (440,467,456 without the embedding).

28 layers, d_model 1024, 16 query heads and 8 kv heads of 128 (wider than d_model / heads),
SwiGLU 3072, vocabulary 151,936, tied embeddings, RoPE theta 1,000,000, RMSNorm eps 1e-6, and
Qwen3's qk-norm: each head's queries and keys RMS-normed before RoPE (`model.qk_norm=per_head`).
It exports as transformers' Qwen3ForCausalLM, and `checkpoint.init_from_hf` starts from the
published weights (docs/huggingface.md; docs/models.md lists the families).

Batch 256 × 4096 (1M tokens a step), full rematerialisation and the loss's logits 512 positions
at a time, as the other presets of this size.
"""

from maxlm.config import defaults


def get_config():
    c = defaults()
    c.name = "qwen3_0p6b"
    c.steps = 100000
    c.batch_size = 256
    c.seq_len = 4096
    c.model.num_layers = 28
    c.model.d_model = 1024
    c.model.num_heads = 16
    c.model.num_kv_heads = 8
    c.model.head_dim = 128
    c.model.mlp_dim = 3072
    c.model.vocab_size = 151936
    c.model.tie_embeddings = True
    c.model.rope_theta = 1000000.0
    c.model.norm_eps = 1e-6
    c.model.qk_norm = "per_head"
    c.model.dtype = "bfloat16"
    c.model.remat = "full"
    c.model.logits_chunk_size = 512
    c.optim.lr = 3e-4
    c.optim.warmup_steps = 2000
    c.checkpoint.every_steps = 1000
    c.eval.every_steps = 1000
    return c
