"""Mesh sweep for Llama 3.2 1B on one 8×H100/H200 host.

    python launch/sweep.py configs/sweeps/gpu8.py --workdir=runs/sweep_gpu8 [--plan]
"""


def get_config():
    return {
        "base": "configs/llama_1b.py",
        "devices": 8,
        "steps": 10,
        "overrides": {"seq_len": 4096, "model.attention": "cudnn", "model.logits_chunk_size": 1024},
        "grid": {
            "mesh": [(1, 8, 1), (2, 4, 1), (1, 4, 2), (1, 2, 4), (8, 1, 1)],
            "batch_size": [64, 128],
            "model.remat": ["full", "save_dots", "none"],
        },
    }
