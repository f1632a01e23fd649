"""Llama 3.2 1B (configs/llama_1b.py) at 64k tokens on one host of 8 H100 80GB GPUs: the
long-context phase of configs/llama_1b_h100x8.py, ring attention with cuDNN per block.

Each sequence of 65,536 tokens is split over the 8 GPUs (`mesh.sequence=8`), zig-zag ordered so
the causal work is even; keys and values go round the ring in blocks, never gathered, and each
block runs cuDNN's fused attention. A batch of 8 rows, 512k tokens a step. Llama 3's RoPE
scaling, factor 32 over the 2048 tokens the 1B presets train at: run it on the 2k preset's
workdir with `--config.data.resume_position=tokens` to extend that model's context
(docs/checkpoints.md, "Extending the context").
CI compiles it for the GPUs and checks it fits (tests/test_gpu_plan.py):

    python -m maxlm.bench plan --config=configs/llama_1b_64k_h100x8.py --target=h100x8

docs/long-context.md records the planned memory.
"""

import os

from maxlm.config import load_file


def get_config():
    c = load_file(os.path.join(os.path.dirname(__file__), "llama_1b_h100x8.py"))
    c.name = "llama_1b_64k_h100x8"
    c.seq_len = 65536
    c.batch_size = 8
    c.mesh.fsdp = 1
    c.mesh.sequence = 8
    c.model.context_parallel = "ring"
    c.model.context_load_balance = True
    c.model.rope_scaling = "llama3"
    c.model.rope_scaling_factor = 32.0
    c.model.rope_original_max_len = 2048
    return c
