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

A `gs://` workdir has no file locks: process 0 takes a lease instead, the object
WORKDIR/.maxlm-lock naming its holder and an expiry `LEASE_SECONDS` ahead (`Lease`). Every write
of it is conditional on the generation last read (maxlm/runtime/gcs.py): created only if absent, taken
over from a dead run only if still the expired lease read, renewed by a heartbeat thread every
third of the lease only if still ours, deleted at exit only if still ours. Of two runs racing
for it exactly one wins; a run killed or lost stops renewing and its lease can be taken once
expired (the hosts' clocks are assumed to agree to well within the lease, as NTP keeps them). A
run that finds its lease taken (it could not renew it in time, and another run has the workdir
now) must not write another byte there: `hold`'s `on_lost` hears of it, and `maxlm.train`'s
ends the process at once, exit 2.
"""

from __future__ import annotations

import atexit
import datetime
import fcntl
import json
import logging
import os
import socket
import threading
import time
import uuid

import jax
import numpy as np

from maxlm.runtime import console, gcs, paths
from maxlm.runtime.errors import ConfigError

LOCK_NAME = ".maxlm-lock"
LEASE_SECONDS = 60.0  # a gs:// lease lasts this long unrenewed: how long a dead run's blocks its rerun
LEASE_LOST_EXIT = 2  # maxlm.train's when another run takes the lease: the user's to sort out, as for the second run
log = logging.getLogger("maxlm")
_held: list = []  # this process's open lock files and leases: the lock lives as long as they do


def log_lost(message: str) -> None:
    """What a lost lease does unless the caller says otherwise (`maxlm.train` ends the run)."""
    log.error(message)


def hold(workdir: str, on_lost=log_lost) -> None:
    """Takes the workdir's lock for this process's life, or raises ConfigError naming the run
    that holds it (every process of a job raises together). `on_lost(message)`: called should
    another run take a gs:// workdir's lease from this one."""
    holder = None
    if jax.process_index() == 0:
        holder = _take(os.fspath(workdir), on_lost)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        failed = multihost_utils.broadcast_one_to_all(np.int32(holder is not None))
        if int(failed) and holder is None:
            holder = "another run (process 0 says so)"
    if holder is not None:
        raise ConfigError(f"the workdir {workdir} is in use by {holder}: one run per workdir. Wait for it "
                          "to end or stop it (a run killed or lost releases the lock), or use another --workdir")


def release() -> None:
    """Lets go of every lock and lease this process holds (exiting does it too)."""
    while _held:
        held = _held.pop()
        if isinstance(held, Lease):
            held.release()
        else:
            held.close()


def holder_text() -> str:
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    return f"host {socket.gethostname()}, pid {os.getpid()}, started {started}"


def _take(workdir: str, on_lost) -> str | None:
    """None once this process holds the lock, else who holds it."""
    if workdir.startswith("gs://"):
        lease = Lease(f"{workdir.rstrip('/')}/{LOCK_NAME}", on_lost=on_lost)
        holder = lease.take()
        if holder is None:
            _held.append(lease)
            atexit.register(lease.release)
        return holder
    if paths.is_remote(workdir):
        console.warn(f"{workdir} is not locked against a second run (maxlm leases gs:// workdirs only): "
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
    handle.write(holder_text() + "\n")
    handle.flush()
    _held.append(handle)
    return None


def describe(lease: dict | None) -> str:
    """Who holds `lease`, for the messages."""
    if lease is None:
        return "another run, or none: the lease object is gone"
    remaining = max(0.0, lease["expires"] - time.time())
    return f"{lease['holder']} (its lease expires in {remaining:.0f} s unless renewed)"


def parse_lease(body: bytes) -> dict | None:
    """The lease in an object's contents; None for anything else (which no live run wrote)."""
    try:
        lease = json.loads(body)
    except ValueError:
        return None
    ok = isinstance(lease, dict) and {"holder", "token"} <= lease.keys() and isinstance(lease.get("expires"), (int, float))
    return lease if ok else None


class Lease:
    """The lease of a gs:// workdir: the object at `url` (see the module's docstring). `seconds`:
    how long one lasts unrenewed; `on_lost(message)`: what to do if another run takes it."""

    def __init__(self, url: str, seconds: float | None = None, on_lost=log_lost):
        self.url = url
        self.seconds = LEASE_SECONDS if seconds is None else seconds
        self.on_lost = on_lost
        self.holder = holder_text()
        self.token = uuid.uuid4().hex  # tells our lease from any other, whatever the holder text says
        self.generation = None  # of the object holding our lease, while we hold it
        self._stop = threading.Event()
        self._heartbeat = None

    def read(self) -> tuple[dict | None, int]:
        """The lease found and the generation of its object (0: no object)."""
        found = gcs.read(self.url)
        if found is None:
            return None, 0
        return parse_lease(found[0]), found[1]

    def take(self) -> str | None:
        """None once this process holds the lease (renewed from now on), else who holds it."""
        return self.claim(*self.read())

    def claim(self, lease: dict | None, generation: int) -> str | None:
        """`take` once `lease` was read at `generation`: takes it, unless it is another run's live one
        or the object has changed since (another run took it first)."""
        if lease is not None and lease["token"] != self.token and lease["expires"] > time.time():
            return describe(lease)
        try:
            self.generation = gcs.write(self.url, self._contents(), if_generation=generation)
        except gcs.GenerationChanged:
            holder = self._ours_after_all()
            if holder is not None:
                return holder
        self._heartbeat = threading.Thread(target=self._beat, name="maxlm workdir lease", daemon=True)
        self._heartbeat.start()
        return None

    def renew(self) -> bool:
        """Extends the lease if it is still ours; if another run has it, calls `on_lost` and False."""
        try:
            holder = self._extend()
        except Exception as e:  # noqa: BLE001 - e.g. the service unreachable a moment: the next beat retries
            log.warning("could not renew the lease %s (%s); retrying in %.0f s", self.url, e, self.seconds / 3)
            return True
        if holder is None:
            return True
        self._stop.set()
        self.on_lost(f"this run lost the lease {self.url} to {holder}: another run has this workdir now "
                     f"(this one could not renew its lease within {self.seconds:.0f} s); stopping at once")
        return False

    def release(self) -> None:
        """Stops the renewals and deletes the lease if it is still ours."""
        self._stop.set()
        if self._heartbeat is not None and self._heartbeat is not threading.current_thread():
            self._heartbeat.join()
        if self.generation is None:
            return
        try:
            gcs.delete(self.url, if_generation=self.generation)
        except (gcs.GenerationChanged, FileNotFoundError):
            pass  # no longer ours: another run's to keep
        except Exception as e:  # noqa: BLE001 - it expires by itself
            log.warning("could not delete the lease %s (%s): it expires within %.0f s", self.url, e, self.seconds)
        self.generation = None

    def _beat(self) -> None:
        while not self._stop.wait(self.seconds / 3) and self.renew():
            pass

    def _contents(self) -> bytes:
        expires = time.time() + self.seconds
        return json.dumps({"holder": self.holder, "token": self.token, "expires": expires,
                           "expires_at": datetime.datetime.fromtimestamp(expires).astimezone().isoformat(timespec="seconds")},
                          indent=1).encode()

    def _extend(self) -> str | None:
        """Writes a later expiry if the lease is still ours: None, else who has it now."""
        try:
            self.generation = gcs.write(self.url, self._contents(), if_generation=self.generation)
            return None
        except gcs.GenerationChanged:
            return self._ours_after_all()

    def _ours_after_all(self) -> str | None:
        """After a precondition failed: None if the object holds our lease all the same (gcsfs
        retried a write of ours that had gone through), else who holds it."""
        lease, generation = self.read()
        if lease is not None and lease["token"] == self.token:
            self.generation = generation
            return None
        return describe(lease)
