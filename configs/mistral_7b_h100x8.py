"""Mistral 7B (Mistral AI, Mistral-7B-v0.1): 7,241,732,096 parameters, on one host of 8 H100 80GB GPUs.

32 layers, d_model 4096, 32 query heads and 8 kv heads of 128, SwiGLU 14336, vocabulary 32,000,
untied embeddings, RoPE theta 10,000, and its 4096-token sliding window on every layer
(`model.sliding_window`), which cuDNN's kernel skips outside of: at 8192 tokens a row, attention
does 3/4 of full causal attention's work.

Batch 256 × 8192 (2M tokens a step, accumulated in 8 microbatches: 4 rows per GPU at a time),
FSDP over the 8 GPUs, full rematerialisation, the loss's logits 512 positions at a time. CI
compiles it for the real GPU (tests/test_gpu_plan.py):

    python -m maxlm.bench plan --config=configs/mistral_7b_h100x8.py --target=h100x8

docs/models.md#presets records the planned memory.
"""

from maxlm.config import defaults


def get_config():
    c = defaults()
    c.name = "mistral_7b_h100x8"
    c.platform = "gpu"
    c.num_devices = 8
    c.steps = 100000
    c.batch_size = 256
    c.seq_len = 8192
    c.mesh.data = 1
    c.mesh.fsdp = 8
    c.model.num_layers = 32
    c.model.d_model = 4096
    c.model.num_heads = 32
    c.model.num_kv_heads = 8
    c.model.mlp_dim = 14336
    c.model.vocab_size = 32000
    c.model.rope_theta = 10000.0
    c.model.sliding_window = 4096
    c.model.dtype = "bfloat16"
    c.model.remat = "full"
    c.model.logits_chunk_size = 512
    c.optim.lr = 3e-4
    c.optim.warmup_steps = 2000
    c.optim.grad_accum_steps = 8
    c.checkpoint.every_steps = 1000
    c.eval.every_steps = 1000
    return c
