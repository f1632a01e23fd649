"""Hardware to compile for without having it: `python -m maxlm.bench plan --target=NAME`.

A target's devices exist only as a topology: JAX's CUDA plugin describes NVIDIA GPU hosts
(`gpu.py`: h100x8, h200x8, h100x16, ...) and libtpu describes Cloud TPU slices (`tpu.py`: v5p-8,
v5p-64, v5e-16, v6e-8, ...). A mesh built over them and `jit(...).lower(...).compile()` run the
target's real compiler on any machine, with its buffer assignment (`memory_analysis()`), its
library calls and its kernels; nothing executes. JAX itself must run on the CPU for this:
`prepare()` says so before JAX starts.
"""

from __future__ import annotations

import os

from maxlm.bench.targets import gpu, tpu
from maxlm.bench.targets.target import Target

__all__ = ["NAMES", "Target", "load", "prepare"]

NAMES = (*gpu.NAMES, *tpu.NAMES)  # examples, for messages and --help


def prepare() -> None:
    """Call before JAX starts: the machine's own devices are CPUs (or whatever it has, unused); the
    target's exist only as a topology, and there is no CUDA driver whose version to check."""
    import jax

    os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
    jax.config.update("jax_platforms", "cpu")


def load(name: str, num_slices: int = 1) -> Target:
    """The named target's devices; ConfigError (one line) when it is unknown or its compiler is
    not installed. `num_slices` > 1: that many TPU slices joined over the data-center network."""
    if name.startswith("v"):
        return tpu.load(name, num_slices)
    if num_slices != 1:
        from maxlm.runtime.errors import ConfigError

        raise ConfigError(f"--num_slices is for TPU targets; {name} is one GPU target (GPUxN sizes it)")
    return gpu.load(name)
