"""Llama 3.2 1B (Meta, 2024): 1,235,814,400 parameters.

16 layers, d_model 2048, 32 query heads and 8 kv heads of 64, SwiGLU 8192, vocabulary 128,256,
tied embeddings, RoPE theta 500,000, no RoPE scaling at this length (configs/llama_1b_64k_h100x8.py
adds Llama 3's for 64k tokens).

As shipped (batch 512 × 2048: 1M tokens a step) it fits one v5p-8's 4 chips: full
rematerialisation and the loss's logits 512 positions at a time (89 GiB per chip, planned with
`python -m maxlm.bench plan --config=configs/llama_1b.py --target=v5p-8`; checked in CI). The
presets (llama_1b_v5p8.py, llama_1b_h100x8.py, ...) lay it out faster for their hardware.
"""

from maxlm.config import defaults


def get_config():
    c = defaults()
    c.name = "llama_1b"
    c.steps = 100000
    c.batch_size = 512
    c.seq_len = 2048
    c.model.num_layers = 16
    c.model.d_model = 2048
    c.model.num_heads = 32
    c.model.num_kv_heads = 8
    c.model.mlp_dim = 8192
    c.model.vocab_size = 128256
    c.model.tie_embeddings = True
    c.model.rope_theta = 500000.0
    c.model.dtype = "bfloat16"
    c.model.remat = "full"
    c.model.logits_chunk_size = 512
    c.optim.lr = 3e-4
    c.optim.warmup_steps = 2000
    c.checkpoint.every_steps = 1000
    c.eval.every_steps = 1000
    return c
