"""Llama 3.2 1B (configs/llama_1b.py) on a v5p-64 (32 chips on 8 hosts):
seq 4096, batch 256, bfloat16, splash attention.

FSDP over every chip, activations rematerialised except each layer's two output projections, the
loss's logits computed 512 positions at a time.
CI compiles it for the slice with libtpu and checks it fits (tests/test_tpu_plan.py):

    python -m maxlm.bench plan --config=configs/llama_1b_v5p64.py --target=v5p-64

docs/tpus.md records the planned memory and the estimated step time.
"""

import os

from maxlm.config import load_file


def get_config():
    c = load_file(os.path.join(os.path.dirname(__file__), "llama_1b.py"))
    c.name = "llama_1b_v5p64"
    c.platform = "tpu"
    c.num_devices = 32
    c.seq_len = 4096
    c.batch_size = 256
    c.mesh.data = 1
    c.mesh.fsdp = 32
    c.model.attention = "splash"
    c.model.remat = "save_out_proj"
    c.model.logits_chunk_size = 512
    return c
