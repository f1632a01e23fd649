"""Mesh sweep for this machine: `tiny.py` on 8 fake CPU devices.

    python launch/sweep.py configs/sweeps/cpu8.py --workdir=runs/sweep_cpu8
"""


def get_config():
    return {
        "base": "configs/tiny.py",
        "devices": 8,  # the device count the points are validated for
        "fake_cpu_devices": True,  # run on 8 fake CPU devices (--xla_force_host_platform_device_count)
        "steps": 5,  # timed steps per point (after 2 warm-up steps)
        "overrides": {"model.num_heads": 8, "model.num_kv_heads": 4},  # heads divisible by tensor
        # Every combination of these values is one point; "mesh" is (data, fsdp, tensor), or
        # (data, fsdp, sequence, tensor) (sequence parallelism), or (stage, data, fsdp, sequence,
        # tensor) (pipeline: tiny's 2 layers on 2 stages, model.pipeline_microbatches from the base).
        "grid": {
            "mesh": [(8, 1, 1), (1, 8, 1), (2, 2, 2), (1, 2, 4), (2, 1, 4), (1, 1, 8),
                     (2, 1, 4, 1), (1, 2, 2, 2), (2, 4, 1, 1, 1)],
            "batch_size": [8, 16],
        },
    }
