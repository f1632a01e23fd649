"""Gemma 3 12B (Google, gemma-3-12b-pt, text): 11,766,034,176 parameters, on one host of 8 H100 80GB GPUs.

48 layers, d_model 3840, 16 query heads and 8 kv heads of 256, GeGLU 15360, vocabulary 262,208,
tied embeddings, RMSNorm eps 1e-6, and Gemma 3's block as configs/gemma3_1b.py has it: five local
layers (1024-token window, RoPE base 10,000) to one global (base 1,000,000). Gemma 3 has no 7-8B
model; this is the size next above. The published model's global layers also stretch RoPE
linearly by 8 for its 128K context (`model.rope_scaling=linear`), an extension after pretraining
that a preset for pretraining leaves out.

Batch 256 × 8192 (2M tokens a step, accumulated in 32 microbatches: 1 row per GPU at a time),
FSDP over the 8 GPUs, full rematerialisation, the loss's logits 512 positions at a time. Its heads
are 256 wide, more than JAX's cuDNN binding takes off a Hopper GPU, so `auto` runs XLA attention
(the masks hide the window; the scores are all computed). CI compiles it for the real GPU
(tests/test_gpu_plan.py):

    python -m maxlm.bench plan --config=configs/gemma3_12b_h100x8.py --target=h100x8

docs/models.md#presets records the planned memory.
"""

import os

from maxlm.config import load_file


def get_config():
    c = load_file(os.path.join(os.path.dirname(__file__), "gemma3_1b.py"))
    c.name = "gemma3_12b_h100x8"
    c.platform = "gpu"
    c.num_devices = 8
    c.batch_size = 256
    c.seq_len = 8192
    c.mesh.data = 1
    c.mesh.fsdp = 8
    c.model.num_layers = 48
    c.model.d_model = 3840
    c.model.num_heads = 16
    c.model.num_kv_heads = 8
    c.model.mlp_dim = 15360
    c.model.vocab_size = 262208
    c.model.sliding_window = 1024
    c.optim.grad_accum_steps = 32
    return c
