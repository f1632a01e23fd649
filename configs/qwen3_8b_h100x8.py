"""Qwen3 8B (Alibaba, Qwen3-8B-Base): 8,190,735,360 parameters, on one host of 8 H100 80GB GPUs.

36 layers, d_model 4096, 32 query heads and 8 kv heads of 128, SwiGLU 12288, vocabulary 151,936,
untied embeddings, RoPE theta 1,000,000, RMSNorm eps 1e-6, and Qwen3's per-head qk-norm.

Batch 512 × 4096 (2M tokens a step, accumulated in 8 microbatches: 8 rows of 4096 tokens per GPU
at a time), FSDP over the 8 GPUs, full rematerialisation, the loss's logits 512 positions at a
time. CI compiles it for the real GPU (tests/test_gpu_plan.py):

    python -m maxlm.bench plan --config=configs/qwen3_8b_h100x8.py --target=h100x8

docs/models.md#presets records the planned memory.
"""

from maxlm.config import defaults


def get_config():
    c = defaults()
    c.name = "qwen3_8b_h100x8"
    c.platform = "gpu"
    c.num_devices = 8
    c.steps = 100000
    c.batch_size = 512
    c.seq_len = 4096
    c.mesh.data = 1
    c.mesh.fsdp = 8
    c.model.num_layers = 36
    c.model.d_model = 4096
    c.model.num_heads = 32
    c.model.num_kv_heads = 8
    c.model.head_dim = 128
    c.model.mlp_dim = 12288
    c.model.vocab_size = 151936
    c.model.rope_theta = 1000000.0
    c.model.norm_eps = 1e-6
    c.model.qk_norm = "per_head"
    c.model.dtype = "bfloat16"
    c.model.remat = "full"
    c.model.logits_chunk_size = 512
    c.optim.lr = 3e-4
    c.optim.warmup_steps = 2000
    c.optim.grad_accum_steps = 8
    c.checkpoint.every_steps = 1000
    c.eval.every_steps = 1000
    return c
