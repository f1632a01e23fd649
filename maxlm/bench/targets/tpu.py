"""Cloud TPU slices as compile targets: `--target=v5p-64` (maxlm/bench/targets/__init__.py).

libtpu (`pip install libtpu`, what `jax[tpu]` brings; `make test` keeps a copy in
.venv/target-compilers) describes any TPU topology on a machine without TPUs:
`jax.experimental.topologies.get_topology_desc(platform="tpu", ...)` gives its devices, and
compiling over them runs libtpu's real compiler (HBM checks, Mosaic kernels such as splash
attention). Names are Cloud TPU's accelerator types: TensorCores for v4 and v5p (two per chip,
one JAX device per chip: megacore), chips for v5e and v6e.
"""

from __future__ import annotations

import os
import re

from maxlm.bench.targets.target import Target
from maxlm.runtime.errors import ConfigError

GiB = 2**30
# generation -> (topology prefix, chip config, TensorCores per chip, HBM per chip, HBM bytes/s).
# HBM and bandwidth from Cloud TPU's system architecture pages (v4, v5e, v5p, v6e).
TPUS = {
    "v4": ("v4", "megacore", 2, 32 * GiB, 1_200e9),
    "v5p": ("v5", "megacore", 2, 95 * GiB, 2_765e9),
    "v5e": ("v5e", "default", 1, 16 * GiB, 819e9),
    "v6e": ("v6e", "default", 1, 32 * GiB, 1_640e9),
}
ALIASES = {"v5litepod": "v5e"}
NAMES = ("v4-8", "v5p-8", "v5p-64", "v5e-16", "v6e-8")  # examples; any power-of-two slice works
CHIPS_PER_HOST = 4  # hosts of 2x2 chips; v5e and v6e slices of up to 8 chips are one host


def chip_grid(generation: str, chips: int) -> tuple[int, ...]:
    """The slice's chips as Cloud TPU lays them out: v4/v5p 3-D (2x2x1, 2x2x2, 2x2x4, 2x4x4,
    4x4x4, ... doubling z, y, x in turn), v5e/v6e 2-D (1x1, 2x2, 2x4, 4x4, 4x8, ...)."""
    if generation in ("v4", "v5p"):
        grid = [2, 2, 1]
        axis = 2
        while grid[0] * grid[1] * grid[2] < chips:
            grid[axis] *= 2
            axis = (axis - 1) % 3 if grid[0] * grid[1] * grid[2] > 8 else 2
        return tuple(grid)
    if chips == 1:
        return (1, 1)
    grid = [2, 2]
    while grid[0] * grid[1] < chips:
        grid[1 if grid[0] == grid[1] else 0] *= 2
    return tuple(grid)


def load(name: str, num_slices: int = 1) -> Target:
    """GENERATION-N (ConfigError, one line, for an unknown name or without libtpu)."""
    from jax.experimental import topologies

    match = re.fullmatch(r"(v4|v5p|v5e|v5litepod|v6e)-(\d+)", name)
    generation = ALIASES.get(match.group(1), match.group(1)) if match else ""
    count = int(match.group(2)) if match else 0
    prefix, chip_config, cores_per_chip, hbm, bandwidth = TPUS.get(generation, (None,) * 5)
    chips = count // cores_per_chip if prefix else 0
    valid = prefix and chips >= 1 and not count % cores_per_chip and not chips & (chips - 1)
    grid = chip_grid(generation, chips) if valid else ()
    if not grid or grid[0] * grid[1] * (grid[2] if len(grid) == 3 else 1) != chips:
        raise ConfigError(f"--target={name!r} is not a known TPU slice: v4-N or v5p-N (N TensorCores, "
                          f"8, 16, 32, ...), v5e-N or v6e-N (N chips, 1, 4, 8, 16, ...), e.g. {', '.join(NAMES)}")
    one_host = len(grid) == 2 and chips <= 8
    host_bounds = (*grid, 1) if one_host else (2, 2, 1)
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "true")  # several compiling processes (tests)
    try:
        topology = topologies.get_topology_desc(
            platform="tpu", topology_name=f"{prefix}:{'x'.join(map(str, grid))}", chip_config_name=chip_config,
            chips_per_host_bounds=host_bounds, num_slices=num_slices, wrap=(False,) * 3)
    except Exception as e:  # noqa: BLE001 - jax raises several kinds when libtpu is absent
        raise ConfigError(f"--target={name} compiles with libtpu, which this environment lacks "
                          f"(make install ACCEL=tpu): {type(e).__name__}: {e}") from e
    devices = tuple(topology.devices)
    hosts = len({d.process_index for d in devices})
    return Target(name=name, platform="tpu", devices=devices, hosts=hosts, slices=num_slices,
                  memory_bytes=hbm, usable_bytes=hbm, memory_bytes_per_sec=int(bandwidth))
