"""NVIDIA GPU hosts as compile targets: `--target=h100x8` (maxlm/bench/targets/__init__.py).

JAX's CUDA plugin compiles for an NVIDIA GPU that is not there, from XLA's description of it (a
`GpuTargetConfigProto`: the .txtpb files here, see README.md): `jax.experimental.topologies` turns
it into devices, and XLA's real GPU compiler runs over them, with its buffer assignment and its
cuDNN/cuBLAS custom calls. Nothing executes, so no CUDA driver is needed, only the plugin
(`make install ACCEL=cuda12`; `make test` keeps a copy in .venv/target-compilers).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from maxlm.bench.targets.target import Target
from maxlm.runtime.errors import ConfigError

# GPU -> XLA's description of it. A target is GPUxN: N GPUs on hosts of 8 (the HGX/DGX boards), so
# h100x8 is one host and h100x16 two, each host a process of its own as on a real cluster.
GPUS = {"h100": "h100_sxm.txtpb", "h200": "h200.txtpb"}
GPUS_PER_HOST = 8
NAMES = tuple(f"{gpu}x{GPUS_PER_HOST}" for gpu in GPUS)  # the one-host targets; any multiple of 8 works
# The share of each GPU's memory the launchers let JAX take (launch/gpu_env.sh's
# XLA_PYTHON_CLIENT_MEM_FRACTION): a plan fits when its peak is within it.
LAUNCHER_MEMORY_FRACTION = 0.90


def spec_text(filename: str) -> str:
    """The vendored description, less `collective_memory_granularity`: older jaxlibs' protos predate
    that field (it only tunes collective buffers) and rejects the whole description for it."""
    text = (Path(__file__).parent / filename).read_text()
    return "\n".join(line for line in text.splitlines() if "collective_memory_granularity" not in line)


def load(name: str) -> Target:
    """GPUxN: N GPUs on hosts of 8 (ConfigError, one line, when unknown or when JAX's CUDA plugin
    is not installed)."""
    from jax.experimental import topologies

    match = re.fullmatch(r"([a-z0-9]+)x(\d+)", name)
    if not match or match.group(1) not in GPUS or int(match.group(2)) % GPUS_PER_HOST or match.group(2) == "0":
        raise ConfigError(f"--target={name!r} is not a known target: GPUxN with GPU one of "
                          f"{', '.join(GPUS)} and N a multiple of {GPUS_PER_HOST} (e.g. {', '.join(NAMES)}), or a "
                          "TPU slice (e.g. v5p-8)")
    gpu, count = match.group(1), int(match.group(2))
    hosts = count // GPUS_PER_HOST
    text = spec_text(GPUS[gpu])
    try:
        topology = topologies.get_topology_desc(platform="cuda", target_config=text,
                                                topology=f"1x{hosts}x{GPUS_PER_HOST}")
    except Exception as e:  # noqa: BLE001 - jax raises several kinds when the plugin is absent
        raise ConfigError(f"--target={name} compiles with JAX's CUDA plugin, which this environment "
                          f"lacks (make install ACCEL=cuda12): {type(e).__name__}: {e}") from e

    def field(key: str) -> int:
        return int(re.search(rf"{key}:\s*(\d+)", text).group(1))

    memory = field("device_memory_size")
    fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", LAUNCHER_MEMORY_FRACTION))
    return Target(name=name, platform="gpu", devices=tuple(topology.devices), hosts=hosts, slices=1,
                  memory_bytes=memory, usable_bytes=int(memory * fraction),
                  memory_bytes_per_sec=field("memory_bandwidth"))

