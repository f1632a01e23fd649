"""Mesh sweep for Llama 3.2 1B on a v5p-64 slice (32 chips): how to split 32 devices.

    python launch/tpu.py --name=sweep --zone=us-east5-a --accelerator=v5p-64 -- ...   (run on the pod)
    python launch/sweep.py configs/sweeps/v5p_64.py --workdir=/mnt/shared/sweeps/v5p_64 [--plan]
"""


def get_config():
    return {
        "base": "configs/llama_1b.py",
        "devices": 32,
        "steps": 10,
        "overrides": {"seq_len": 4096, "model.logits_chunk_size": 1024},
        "grid": {
            "mesh": [(1, 32, 1), (2, 16, 1), (1, 16, 2), (1, 8, 4), (4, 8, 1)],
            "batch_size": [256, 512],
            "model.remat": ["full", "save_dots"],
        },
    }
