"""Multi-process bootstrap (a no-op for one process). Two ways in:

    JAX_COORDINATOR_ADDRESS=host:port  JAX_NUM_PROCESSES=N  JAX_PROCESS_ID=i   (explicit)
    MAXLM_DISTRIBUTED=auto                                                      (cluster detection)

launch/local.py sets the explicit ones. launch/tpu.py and launch/slurm.sbatch set `auto`, and
`jax.distributed.initialize()` then reads the cluster itself: the TPU pod's metadata, SLURM's
SLURM_* variables, or Open MPI's OMPI_* ones. Each process then sees every process's devices in
`jax.devices()`. On CPU the cross-process collectives use gloo. Must run before anything touches a
JAX backend.
"""

from __future__ import annotations

import logging
import os

import jax


def initialize() -> bool:
    """Calls jax.distributed.initialize when a launcher asked for it; True if it did.

    Afterwards only process 0 logs progress: the others keep warnings and errors, so N processes
    don't print every line N times.
    """
    address = os.environ.get("JAX_COORDINATOR_ADDRESS")
    if os.environ.get("MAXLM_DISTRIBUTED") == "auto" and not address:
        jax.distributed.initialize()  # TPU pod, SLURM or Open MPI: JAX finds its peers
        _quiet_unless_first()
        return True
    if not address:
        return False
    if os.environ.get("JAX_PLATFORMS", "").startswith("cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=address,
        num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
        process_id=int(os.environ["JAX_PROCESS_ID"]),
    )
    _quiet_unless_first()
    return True


def _quiet_unless_first() -> None:
    if jax.process_index() != 0:
        logging.getLogger("maxlm").setLevel(logging.WARNING)
