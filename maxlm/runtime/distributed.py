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

from maxlm.runtime import paths
from maxlm.runtime.errors import ConfigError


def initialize() -> bool:
    """Calls jax.distributed.initialize when a launcher asked for it; True if it did.

    Afterwards only process 0 logs progress: the others keep warnings and errors, so N processes
    don't print every line N times.
    """
    address = os.environ.get("JAX_COORDINATOR_ADDRESS")
    auto = os.environ.get("MAXLM_DISTRIBUTED") == "auto" and not address
    if not (auto or address):
        return False
    if os.environ.get("JAX_PLATFORMS", "").startswith("cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if auto:  # TPU pod, SLURM or Open MPI: JAX finds its peers
        # a job shape the GPUs cannot be split for raises ConfigError: exit 2, one line
        jax.distributed.initialize(local_device_ids=slurm_local_device_ids(os.environ))
    else:
        jax.distributed.initialize(
            coordinator_address=address,
            num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
            process_id=int(os.environ["JAX_PROCESS_ID"]),
        )
    _quiet_unless_first()
    return True


def slurm_local_device_ids(env, gpu_count=None) -> list[int] | None:
    """The GPUs this SLURM task drives (`local_device_ids` of jax.distributed.initialize).

    JAX's own SLURM detection gives every task `[SLURM_LOCALID]`: one GPU per task, so the usual
    one task per node would drive 1 of its 8 GPUs. Here the GPUs the task sees are split evenly
    among the tasks on its node: one task per node drives them all, one task per GPU drives its
    own. GPUs SLURM already bound to the task (`--gpus-per-task`, `--gpu-bind`: it sees fewer than
    the node's `SLURM_GPUS_ON_NODE`) are all its own. None outside SLURM or where no GPU is known
    (CPU, TPU): JAX decides. `gpu_count()` counts the GPUs when CUDA_VISIBLE_DEVICES is unset.
    """
    if "SLURM_JOB_ID" not in env or "SLURM_LOCALID" not in env:
        return None
    visible = env.get("CUDA_VISIBLE_DEVICES")
    count = len(visible.split(",")) if visible else (gpu_count or _nvidia_gpu_count)()
    if not count:
        return None
    on_node = int(env.get("SLURM_GPUS_ON_NODE", count))
    tasks = _tasks_on_node(env)
    if count < on_node or tasks == 1:  # bound to this task, or the node's only task
        return list(range(count))
    if count % tasks:
        raise ConfigError(f"{tasks} SLURM tasks on this node cannot share its {count} GPUs evenly; "
                          "run one task per node (--ntasks-per-node=1) or one per GPU")
    per_task, local = count // tasks, int(env["SLURM_LOCALID"])
    return list(range(local * per_task, (local + 1) * per_task))


def _tasks_on_node(env) -> int:
    """This node's task count from SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE ("8(x2),4":
    8 on each of the first two nodes, 4 on the third), indexed by SLURM_NODEID."""
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or "1"
    counts = []
    for part in spec.split(","):
        tasks, _, repeat = part.partition("(x")
        counts += [int(tasks)] * int(repeat.rstrip(")") or 1)
    return counts[min(int(env.get("SLURM_NODEID", 0)), len(counts) - 1)]


def _nvidia_gpu_count() -> int:
    """GPUs `nvidia-smi -L` lists (0 without nvidia-smi)."""
    import shutil
    import subprocess

    if not shutil.which("nvidia-smi"):
        return 0
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60).stdout
    return sum(line.startswith("GPU ") for line in out.splitlines())


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
        if not existed and not paths.is_remote(workdir):
            # made for the probe: the run's lock makes it again (and removes it if the run is
            # refused), so a refused run leaves nothing. (On gs:// there is no directory to remove,
            # and gcsfs's rmdir of a bucket's root would delete the bucket.)
            directory.rmdir()
    if not seen.all():
        blind = ", ".join(str(p) for p in np.flatnonzero(seen == 0))
        raise ConfigError(
            f"--workdir={workdir} is not shared by the job's processes: process(es) {blind} cannot "
            "read what process 0 wrote there (a node-local path on a multi-node job?); give every "
            "process the same directory: a shared filesystem or a gs:// URL")
