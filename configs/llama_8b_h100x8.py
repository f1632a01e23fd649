"""Llama 3 8B (configs/llama_8b.py) on one host of 8 H100 80GB GPUs (or H200s).

Same model, batch (512 × 8192 = 4M tokens per step) and optimizer; what changes is the layout of
the step, so that it fits: FSDP over the 8 GPUs, full rematerialisation (each layer keeps only its
input), the loss's logits computed 512 positions at a time, and the batch accumulated in 8
microbatches (8 rows of 8192 tokens per GPU at a time). CI compiles it for the real GPU
(tests/test_gpu_plan.py):

    python -m maxlm.bench plan --config=configs/llama_8b_h100x8.py --target=h100x8

docs/gpus.md shows the arithmetic and the planned figures.
"""

import os

from maxlm.config import load_file


def get_config():
    c = load_file(os.path.join(os.path.dirname(__file__), "llama_8b.py"))
    c.name = "llama_8b_h100x8"
    c.platform = "gpu"
    c.num_devices = 8
    c.mesh.data = 1
    c.mesh.fsdp = 8
    c.model.remat = "full"
    c.model.logits_chunk_size = 512
    c.optim.grad_accum_steps = 8
    return c
