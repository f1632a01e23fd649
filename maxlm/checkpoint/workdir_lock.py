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
# what taking a local lock wrote, so a refused run can undo it (`abandon`): the lock file, its
# text and (atime, mtime) in ns before (None: it was not there), and the directories made for it,
# deepest first
_made: list[tuple[str, tuple[str, tuple[int, int]] | None, list[str]]] = []


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


def abandon() -> None:
    """Undoes `hold` for a run refused before it wrote anything else (exit 2): lets go of the lock
    and leaves the workdir as it was: a lock file this process created is removed (one that was
    there gets its previous text back), and the directories made for it are removed while empty.
    A refused run then leaves no trace of itself; a rerun of the same command finds what the first
    attempt found."""
    made, _made[:] = list(_made), []
    for lock_path, previous, _ in made:
        if previous is None:
            _remove(lock_path, os.unlink)
        else:  # a previous run's: its text and times back, as if this run had never started
            with open(lock_path, "w") as f:
                f.write(previous[0])
            os.utime(lock_path, ns=previous[1])
    release()  # after the unlink: no other run can take the lock on a file about to vanish
    for _, _, directories in made:
        for directory in directories:
            _remove(directory, os.rmdir)  # only while empty: another run may have written since


def _remove(path: str, how) -> None:
    try:
        how(path)
    except OSError:  # gone already, or not empty: nothing of ours to undo there
        pass


def _text_and_times(path: str) -> tuple[str, tuple[int, int]]:
    st = os.stat(path)
    with open(path) as f:
        return f.read(), (st.st_atime_ns, st.st_mtime_ns)


def _missing(directory: str) -> list[str]:
    """The directories `os.makedirs(directory)` would create, deepest first."""
    out = []
    while directory and not os.path.lexists(directory):
        out.append(directory)
        parent = os.path.dirname(directory)
        directory = parent if parent != directory else ""
    return out


def _open_lock_file(workdir: str, directory: str):
    """(the open lock file, its text and times before or None if new, the directories made for it); a
    ConfigError (exit 2, one line) for a workdir that cannot be one: a file, or a path where no
    directory can be made or written."""
    if os.path.lexists(directory) and not os.path.isdir(directory):
        raise ConfigError(f"the workdir {workdir} is not a directory: give --workdir a directory (new or existing)")
    made = _missing(directory)
    lock_path = os.path.join(directory, LOCK_NAME)
    try:
        os.makedirs(directory, exist_ok=True)
        previous = _text_and_times(lock_path) if os.path.exists(lock_path) else None
        handle = open(lock_path, "a+")  # noqa: SIM115 - held open on purpose
    except OSError as e:
        for path in made:
            _remove(path, os.rmdir)
        raise ConfigError(f"cannot use {workdir} as the workdir: {e.strerror or e} "
                          f"({e.filename or directory}): give --workdir a directory this run can create and write") from e
    return handle, previous, made


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
    handle, previous, made = _open_lock_file(workdir, directory)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        return holder
    _made.append((handle.name, previous, made))
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
