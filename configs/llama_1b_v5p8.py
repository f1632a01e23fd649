"""Llama 3.2 1B (configs/llama_1b.py) on one v5p-8 (4 chips, 95 GiB each):
seq 4096, batch 64, bfloat16, splash attention.

FSDP over every chip, activations rematerialised except each layer's two output projections, the
loss's logits computed 512 positions at a time.
CI compiles it for the slice with libtpu and checks it fits (tests/test_tpu_plan.py):

    python -m maxlm.bench plan --config=configs/llama_1b_v5p8.py --target=v5p-8

docs/tpus.md records the planned memory and the estimated step time.
"""

import os

from maxlm.config import load_file


def get_config():
    c = load_file(os.path.join(os.path.dirname(__file__), "llama_1b.py"))
    c.name = "llama_1b_v5p8"
    c.platform = "tpu"
    c.num_devices = 4
    c.seq_len = 4096
    c.batch_size = 64
    c.mesh.data = 1
    c.mesh.fsdp = 4
    c.model.attention = "splash"
    c.model.remat = "save_out_proj"
    c.model.logits_chunk_size = 512
    return c
