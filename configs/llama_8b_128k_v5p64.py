"""Llama 3 8B (configs/llama_8b.py) at 128k tokens on a v5p-64 (32 chips on 8 hosts): the
long-context phase of configs/llama_8b_v5p64.py, ring attention with splash per block.

Each sequence of 131,072 tokens is split over the 4 chips of a host (`mesh.sequence=4`: the
devices splitting a row belong to one process), zig-zag ordered so the causal work is even;
keys and values go round the ring in blocks, never gathered. FSDP over the 8 hosts, one sequence
each: a batch of 8 rows, 1M tokens a step. Llama 3.1's RoPE scaling (factor 8 from an 8192-token
original length), as for its 128k extension: run it on the 8k preset's workdir with
`--config.data.resume_position=tokens` to extend that model's context (docs/checkpoints.md,
"Extending the context").
CI compiles it for the slice with libtpu and checks it fits (tests/test_tpu_plan.py):

    python -m maxlm.bench plan --config=configs/llama_8b_128k_v5p64.py --target=v5p-64

docs/long-context.md records the planned memory per chip for each context-parallel strategy.
"""

import os

from maxlm.config import load_file


def get_config():
    c = load_file(os.path.join(os.path.dirname(__file__), "llama_8b_v5p64.py"))
    c.name = "llama_8b_128k_v5p64"
    c.seq_len = 131072
    c.batch_size = 8
    c.mesh.fsdp = 8
    c.mesh.sequence = 4
    c.model.context_parallel = "ring"
    c.model.context_load_balance = True
    c.model.rope_scaling = "llama3"  # Llama 3.1's published values
    c.model.rope_scaling_factor = 8.0
    c.model.rope_original_max_len = 8192
    c.model.rope_low_freq_factor = 1.0
    c.model.rope_high_freq_factor = 4.0
    return c
