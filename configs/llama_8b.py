"""Llama 3 8B (Meta, 2024): 8,030,261,248 parameters.

32 layers, d_model 4096, 32 query heads and 8 kv heads of 128, SwiGLU 14336, vocabulary 128,256,
untied embeddings, RoPE theta 500,000.
"""

from maxlm.config import defaults


def get_config():
    c = defaults()
    c.name = "llama_8b"
    c.steps = 100000
    c.batch_size = 512
    c.seq_len = 8192
    c.model.num_layers = 32
    c.model.d_model = 4096
    c.model.num_heads = 32
    c.model.num_kv_heads = 8
    c.model.mlp_dim = 14336
    c.model.vocab_size = 128256
    c.model.rope_theta = 500000.0
    c.model.dtype = "bfloat16"
    c.optim.lr = 3e-4
    c.optim.warmup_steps = 2000
    c.checkpoint.every_steps = 1000
    c.eval.every_steps = 1000
    return c
