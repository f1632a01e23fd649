"""One run per workdir: `hold(workdir)` takes WORKDIR/.maxlm-lock for the life of the process.

A second `maxlm.train` on the workdir of a live run (a launcher retry while the old job still
runs, a SLURM requeue race, enter pressed twice) would train beside it: the two collide in orbax's
tmp directories, lose checkpoints and write every step twice into `metrics.jsonl`. The lock makes
the second one stop first, with exit 2 naming the holder, before it writes anything.

A local (or NFS) workdir uses `fcntl.flock`: the kernel releases it when the holding process dies
however it dies (SIGKILL, a lost node's lease), so a later run takes over a dead run's lock
safely and no stale lock ever needs removing by hand. The file's text (host, pid, start time)
only names the holder in the message. On a multi-process job process 0 alone takes the lock and
every process learns the answer, so they stop or go on together.

A `gs://` workdir is not locked: object stores have no advisory locks (a lease object with a
heartbeat is what it would need), and maxlm says so with a warning.
"""

from __future__ import annotations

import datetime
import fcntl
import os
import socket

import jax
import numpy as np

from maxlm import console, paths
from maxlm.errors import ConfigError

LOCK_NAME = ".maxlm-lock"
_held: list = []  # the open lock files of this process: the lock lives as long as they do


def hold(workdir: str) -> None:
    """Takes the workdir's lock for this process's life, or raises ConfigError naming the run
    that holds it (every process of a job raises together)."""
    holder = None
    if jax.process_index() == 0:
        holder = _take(workdir)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        failed = multihost_utils.broadcast_one_to_all(np.int32(holder is not None))
        if int(failed) and holder is None:
            holder = "another run (process 0 says so)"
    if holder is not None:
        raise ConfigError(f"the workdir {workdir} is in use by {holder}: one run per workdir. Wait for it "
                          "to end or stop it (a run killed or lost releases the lock), or use another --workdir")


def _take(workdir: str) -> str | None:
    """None once this process holds the lock, else who holds it."""
    if paths.is_remote(workdir):
        console.warn(f"{workdir} is not locked against a second run (object stores have no file locks): "
                     "make sure one job at a time uses it")
        return None
    directory = os.path.abspath(os.path.expanduser(workdir))
    os.makedirs(directory, exist_ok=True)
    handle = open(os.path.join(directory, LOCK_NAME), "a+")  # noqa: SIM115 - held open on purpose
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        return holder
    handle.seek(0)
    handle.truncate()
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    handle.write(f"host {socket.gethostname()}, pid {os.getpid()}, started {started}\n")
    handle.flush()
    _held.append(handle)
    return None
