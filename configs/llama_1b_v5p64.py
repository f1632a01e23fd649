"""Llama 3.2 1B on a v5p-64 (32 chips on 8 hosts): the v5p-8 preset (configs/llama_1b_v5p8.py)
with FSDP over all 32 chips and 4 times the batch, 256 × 4096 tokens (8 rows per chip, half the
v5p-8's 16). CI compiles it for the slice with libtpu and checks it fits (tests/test_tpu_plan.py):

    python -m maxlm.bench plan --config=configs/llama_1b_v5p64.py --target=v5p-64

docs/tpus.md records the planned memory and the estimated step time.
"""

import os

from maxlm.config import load_file


def get_config():
    c = load_file(os.path.join(os.path.dirname(__file__), "llama_1b_v5p8.py"))
    c.name = "llama_1b_v5p64"
    c.num_devices = 32
    c.batch_size = 256
    c.mesh.fsdp = 32
    return c
