"""Multi-process bootstrap (a no-op for one process). Two ways in:

    JAX_COORDINATOR_ADDRESS=host:port  JAX_NUM_PROCESSES=N  JAX_PROCESS_ID=i   (explicit)
    MAXLM_DISTRIBUTED=auto                                                      (cluster detection)

launch/local.py sets the explicit ones. launch/tpu.py and launch/slurm.sbatch set `auto`, and
`jax.distributed.initialize()` then reads the cluster itself: the TPU pod's metadata, SLURM's
SLURM_* variables, or Open MPI's OMPI_* ones. Each process then sees every process's devices in
`jax.devices()`. On CPU the cross-process collectives use gloo. Must run before anything touches a
JAX backend.

`check_same_program` then makes sure every process runs the same config on the same packages,
and `check_shared_workdir` that every process sees the same workdir: the checkpoints and every
decision about them depend on it.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import secrets

import jax
import numpy as np

from maxlm.runtime import paths, processes
from maxlm.runtime.errors import ConfigError

# The packages whose versions decide what a step computes and how a checkpoint is written.
PROGRAM_PACKAGES = ("maxlm", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "grain")


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


def program_fingerprint(settings: dict) -> dict[str, str]:
    """`settings` (a resolved config, flattened to dotted keys) and PROGRAM_PACKAGES' versions
    (`version.NAME`), each value as JSON text: what check_same_program compares."""
    def version(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    values = {**settings, **{f"version.{name}": version(name) for name in PROGRAM_PACKAGES}}
    return {key: json.dumps(value, sort_keys=True, default=str) for key, value in values.items()}


def check_same_program(settings: dict) -> None:
    """Raises ConfigError (exit 2) on every process of the job, with the same line, unless every
    process runs the same program: `program_fingerprint(settings)` equal to process 0's. Else each
    process would apply its own config to its own shards (another learning rate, say) and the job
    would train on, or hang where their programs part. Two collectives, before anything compiles;
    single-process runs skip it."""
    if jax.process_count() == 1:
        return
    mine = program_fingerprint(settings)
    first = json.loads(processes.from_process_0(lambda: json.dumps(mine, sort_keys=True).encode()))
    keys = sorted(first)  # process 0's, the same on every process (so is the table's shape)
    # which keys differ from process 0's on each process, and whether it has keys process 0 lacks:
    # a [processes, keys + 1] table every process holds
    row = [mine.get(k) != first[k] for k in keys] + [bool(mine.keys() - first.keys())]
    differs = processes.allgather(np.array(row, np.int32)).reshape(jax.process_count(), len(keys) + 1)
    if not differs.any():
        return
    named = [f"{keys[k]} (process 0: {first[keys[k]]})" if k < len(keys) else "keys process 0 does not have"
             for k in np.flatnonzero(differs.any(0))]
    shown = ", ".join(named[:8]) + (f" and {len(named) - 8} more" if len(named) > 8 else "")
    who = ", ".join(str(p) for p in np.flatnonzero(differs.any(1)))
    raise ConfigError(f"the job's processes do not run the same program: process(es) {who} differ from process 0 "
                      f"in {shown}; give every process the same config file, flags and packages")


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
