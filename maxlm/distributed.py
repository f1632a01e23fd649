"""Multi-process bootstrap (a no-op for one process). Two ways in:

    JAX_COORDINATOR_ADDRESS=host:port  JAX_NUM_PROCESSES=N  JAX_PROCESS_ID=i   (explicit)
    MAXLM_DISTRIBUTED=auto                                                      (cluster detection)

launch/local.py sets the explicit ones. launch/tpu.py and launch/slurm.sbatch set `auto`, and
`jax.distributed.initialize()` then reads the cluster itself: the TPU pod's metadata, SLURM's
SLURM_* variables, or Open MPI's OMPI_* ones. Each process then sees every process's devices in
`jax.devices()`. On CPU the cross-process collectives use gloo. Must run before anything touches a
JAX backend.

`check_shared_workdir` then makes sure every process sees the same workdir: the checkpoints and
every decision about them depend on it.
"""

from __future__ import annotations

import logging
import os
import secrets

import jax
import numpy as np

from maxlm import paths
from maxlm.errors import ConfigError


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


def check_shared_workdir(workdir: str) -> None:
    """Raises ConfigError (exit 2) unless every process of the job sees the same `workdir`.

    Process 0 writes a random nonce there; after a barrier every process reads it back, and all
    learn who could. A node-local path on a multi-node job would give each node checkpoints of
    its own, and the job would hang at its first collective instead of failing. Single-process
    runs skip the check.
    """
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    directory = paths.workdir_path(workdir)
    probe = directory / f".maxlm-shared-check-{jax.process_count()}"
    nonce = multihost_utils.broadcast_one_to_all(np.int64(secrets.randbits(62)))
    existed = directory.exists()
    if jax.process_index() == 0:
        directory.mkdir(parents=True, exist_ok=True)
        probe.write_text(str(int(nonce)))
    multihost_utils.sync_global_devices("maxlm_workdir_probe_written")
    try:
        sees = probe.read_text().strip() == str(int(nonce))
    except OSError:
        sees = False
    seen = np.asarray(multihost_utils.process_allgather(np.int32(sees)))
    multihost_utils.sync_global_devices("maxlm_workdir_probe_read")
    if jax.process_index() == 0:
        probe.unlink()
        if not seen.all() and not existed:
            directory.rmdir()  # created for the probe: leave nothing behind
    if not seen.all():
        blind = ", ".join(str(p) for p in np.flatnonzero(seen == 0))
        raise ConfigError(
            f"--workdir={workdir} is not shared by the job's processes: process(es) {blind} cannot "
            "read what process 0 wrote there (a node-local path on a multi-node job?); give every "
            "process the same directory: a shared filesystem or a gs:// URL")
