"""The host-local checkpoint tier: frequent saves to each host's own disk, with a copy of a
neighbour's shards, restored from there or from a peer.

`checkpoint.local_dir` (`{process}` in it becomes the process index: several processes on one
machine, or one shared filesystem) holds, in a folder RUN named after the workdir (`local_root`),

    LOCAL/RUN/STEP/p{K}/data.bin     process K's shards of the train state (maxlm/checkpoint/host_shards.py)
    LOCAL/RUN/STEP/p{K}/index.json   their layout, CRC-32, the step's meta and config
    LOCAL/RUN/STEP/p{K}.damaged      a marker: that copy failed a check and is not used again

Each process writes its own shards (K = its index) and, in a multi-process run, a replica of the
next process's (K = index + 1 mod count), sent to it over the job's collectives at save time. A
save blocks the loop while the shards are copied to the host and the replica is exchanged; a
background thread writes `p{K}.tmp/` and renames it when complete (fsynced first).

Restore (`restore`) gathers what every process holds, and every process takes the same decision
from it: the newest step for which each process's shards exist somewhere, read from the process's
own copy or, where that is missing or damaged, sent by the peer holding the replica. A copy that
fails its check (CRC, layout, readability) is marked damaged on every process's word, and the
decision is taken again. A step saved with another layout (mesh, device or process count, model)
is not used. Orbax's emergency managers (orbax.checkpoint.experimental.emergency) restore a whole
replica of the state broadcast from another slice: they need the state replicated over a replica
axis of at least two slices, which an fsdp-sharded state has not; hence this tier.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import threading
from typing import Any, Callable

import jax
import numpy as np

from maxlm.checkpoint import host_shards
from maxlm.runtime import console, processes

log = logging.getLogger("maxlm")

DAMAGED = ".damaged"
TMP = ".tmp"


def local_root(template: str, workdir: str) -> str:
    """This process's local tier for `workdir`: a folder of `checkpoint.local_dir` named after the
    workdir (its last name and a hash of its full path), so that another run given the same
    local_dir never resumes from this one's saves."""
    base = os.path.abspath(os.path.expanduser(template.replace("{process}", str(jax.process_index()))))
    full = workdir if "://" in workdir else os.path.abspath(os.path.expanduser(workdir))
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", os.path.basename(full.rstrip("/")) or "run")
    return os.path.join(base, f"{name}-{hashlib.sha256(full.encode()).hexdigest()[:12]}")


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalTier:
    """One process's host-local checkpoints (see the module docstring); every method that restores
    or saves is a collective in a multi-process run: call it on every process at the same point."""

    def __init__(self, checkpoint_cfg, workdir: str):
        self.cfg = checkpoint_cfg
        self.root = local_root(checkpoint_cfg.local_dir, workdir)
        os.makedirs(self.root, exist_ok=True)
        self._thread: threading.Thread | None = None
        self._failure: str | None = None  # why the last background write failed
        self.unusable: set[tuple[int, int]] = set()  # (step, owner) copies of another layout
        self._buffers: list = [None, None]  # host memory of this process's shards and its neighbour's
        for step_dir in self._step_dirs():
            for name in os.listdir(step_dir):
                if name.endswith(TMP):
                    console.warn(f"ignoring incomplete local checkpoint {os.path.join(step_dir, name)} "
                                 "(interrupted write; removed)")
                    shutil.rmtree(os.path.join(step_dir, name), ignore_errors=True)

    # -- what is held

    def _step_dirs(self) -> list[str]:
        return [os.path.join(self.root, n) for n in os.listdir(self.root) if n.isdigit()]

    def held(self) -> dict[int, dict[int, str]]:
        """{step: {owner: path}} of this process's committed, unmarked copies."""
        found: dict[int, dict[int, str]] = {}
        for step_dir in self._step_dirs():
            names = set(os.listdir(step_dir))
            for name in names:
                if name.startswith("p") and name[1:].isdigit() and name + DAMAGED not in names:
                    found.setdefault(int(os.path.basename(step_dir)), {})[int(name[1:])] = os.path.join(step_dir, name)
        return found

    def steps(self) -> list[int]:
        return sorted(s for s, owners in self.held().items() if jax.process_index() in owners)

    # -- saving

    def save(self, step: int, state, meta: dict, config_dict: dict) -> None:
        """Copies this process's shards to the host, exchanges the neighbour's replica, and writes
        both in the background; returns once the copies are on the host."""
        self.wait()
        self.prune()
        me, count = jax.process_index(), jax.process_count()
        entries = host_shards.layout(state, me)
        # the host buffers of the previous save are free again (its write is done): reused
        buffer = self._buffers[0] = host_shards.pack(state, entries, out=self._buffers[0])
        copies = [(me, buffer, entries)]
        if count > 1:  # each process sends its shards to the one before it, and keeps the next one's
            neighbour = (me + 1) % count
            theirs = host_shards.layout(state, neighbour)
            replica = self._buffers[1] = host_shards.send(
                buffer, [(p, (p - 1) % count) for p in range(count)], host_shards.total_bytes(theirs),
                out=self._buffers[1])
            copies.append((neighbour, replica, theirs))
        meta = dict(meta, step=step, kind="local")
        self._thread = threading.Thread(target=self._write_all, args=(step, copies, meta, config_dict),
                                        name=f"maxlm-local-save-{step}", daemon=True)
        self._thread.start()

    def _write_all(self, step: int, copies, meta: dict, config_dict: dict) -> None:
        try:
            for owner, buffer, entries in copies:
                self._write(step, owner, buffer, entries, meta, config_dict)
        # a full or lost local disk, or anything else: the persistent tier still holds the run, and
        # wait() says why on the run's thread (an exception here would end only this thread, unseen)
        except Exception as e:
            why = (e.strerror or str(e)) if isinstance(e, OSError) else f"{type(e).__name__}: {e}"
            self._failure = f"{why} ({os.path.join(self.root, str(step))})"
            shutil.rmtree(os.path.join(self.root, str(step)), ignore_errors=True)

    def _write(self, step: int, owner: int, buffer, entries, meta: dict, config_dict: dict) -> None:
        step_dir = os.path.join(self.root, str(step))
        final = os.path.join(step_dir, f"p{owner}")
        tmp = final + TMP
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        with open(os.path.join(tmp, "data.bin"), "wb") as f:
            f.write(memoryview(buffer))
            f.flush()
            os.fsync(f.fileno())
        index = {"step": step, "owner": owner, "process_count": jax.process_count(),
                 "bytes": len(buffer), "crc32": host_shards.checksum(buffer),
                 "entries": [list(e) for e in entries], "meta": meta, "config": config_dict}
        with open(os.path.join(tmp, "index.json"), "w") as f:
            json.dump(index, f)
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(final):  # a copy of this step marked damaged, now saved again
            shutil.rmtree(final)
        with contextlib.suppress(FileNotFoundError):
            os.remove(final + DAMAGED)
        os.rename(tmp, final)
        _fsync_dir(step_dir)

    def wait(self) -> None:
        """Waits for the background write; a failure is one warning (the run goes on: the
        persistent tier holds it, and the next local save tries again)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._failure is not None:
            console.warn(f"local checkpoint not written: {self._failure}; the persistent tier is unaffected")
            self._failure = None

    def prune(self, newer_than: int | None = None) -> None:
        """Keeps the newest `local_max_to_keep` steps of this process's own copies (and the
        replicas saved with them); with `newer_than`, removes the steps above it instead."""
        steps = sorted(int(os.path.basename(d)) for d in self._step_dirs())
        if newer_than is not None:
            drop = [s for s in steps if s > newer_than]
        else:
            own = self.steps()
            keep = set(own[-self.cfg.local_max_to_keep:])
            drop = [s for s in steps if s not in keep and (not own or s < own[-1])]
        for step in drop:
            shutil.rmtree(os.path.join(self.root, str(step)), ignore_errors=True)

    def close(self) -> None:
        self.wait()
        self.prune()

    # -- restoring

    def _everyone_holds(self) -> list[tuple[int, int, int]]:
        """[(holder, step, owner)] of every process's copies, the same list on every process."""
        mine = np.array([(jax.process_index(), s, o) for s, owners in self.held().items() for o in owners
                         if (s, o) not in self.unusable], np.int64).reshape(-1, 3)
        if jax.process_count() == 1:
            return [tuple(int(x) for x in row) for row in mine]
        longest = int(processes.allgather(np.array([len(mine)], np.int64)).max())
        padded = np.full((longest, 3), -1, np.int64)
        padded[:len(mine)] = mine
        rows = processes.allgather(padded).reshape(-1, 3)
        return sorted({tuple(int(x) for x in row) for row in rows if row[0] >= 0})

    @staticmethod
    def plan(holdings, count: int, below: int | None, at_least: int) -> tuple[int, dict[int, int]] | None:
        """(step, {owner: holder}) of the newest step in [at_least, below) of which every process's
        shards are held somewhere, each read from its owner where it holds them; else None."""
        by_step: dict[int, dict[int, set[int]]] = {}
        for holder, step, owner in holdings:
            by_step.setdefault(step, {}).setdefault(owner, set()).add(holder)
        for step in sorted(by_step, reverse=True):
            if step < at_least or (below is not None and step >= below):
                continue
            owners = by_step[step]
            if all(p in owners for p in range(count)):
                return step, {p: p if p in owners[p] else min(owners[p]) for p in range(count)}
        return None

    def restore(self, abstract, check: Callable[[Any, int], str | None], below: int | None = None,
                at_least: int = 0) -> tuple[Any, dict] | None:
        """(state, meta) of the newest usable local step in [at_least, below), or None; the same
        step on every process. `check(state, step)`: why a restored state is not that step's (the
        persistent tier's check, agreed by every process), or None."""
        self.wait()
        me, count = jax.process_index(), jax.process_count()
        while True:
            holdings = self._everyone_holds()
            decided = self.plan(holdings, count, below, at_least)
            if decided is None:
                _explain_fallback(holdings, count, below, at_least)
                return None
            step, source = decided
            # what this process reads: its own copy, and the replicas it sends to their owners
            mine = self.held().get(step, {})
            reads = {owner: mine[owner] for owner, holder in source.items() if holder == me}
            read, problems = {}, {}
            for owner, path in reads.items():
                try:
                    read[owner] = self._read(path, step, owner, abstract)
                except OtherLayout as e:  # not damage: another run's shape; left as it is, not used
                    self.unusable.add((step, owner))
                    problems[owner] = None
                    log.info("local checkpoint %s not used: %s", path, e)
                except (OSError, ValueError, KeyError) as e:
                    problems[owner] = f"{type(e).__name__}: {e}"
            if self._mark_agreed(step, problems):
                continue
            moved = {owner: holder for owner, holder in source.items() if holder != owner}
            for owner, holder in moved.items():
                log.info("process %d has no usable copy of its shards of local step %d: process %d sends its replica",
                         owner, step, holder)
                if me == owner:
                    console.warn(f"this process holds no usable copy of its shards of local step {step}: "
                                 f"restoring them from process {holder}'s replica")
            layout = host_shards.layout(abstract, me)
            buffer = read[me][0] if me in read else None
            for pairs in _rounds(moved):
                sent = next((read[o][0] for o, h in pairs if h == me), None)
                got = host_shards.send(sent, [(h, o) for o, h in pairs], host_shards.total_bytes(layout))
                if any(o == me for o, _ in pairs):
                    buffer = got
            meta = _shared_meta(read, source)
            state = host_shards.unpack(buffer, layout, abstract)
            problem = check(state, step)
            if problem is None:
                tier = "its own copies" if not moved else f"its own copies and {len(moved)} peer replica(s)"
                log.info("restored local step %d from %s (%s)", step, tier, self.root)
                return state, meta
            self._mark_agreed(step, {o: problem for o in reads}, everyone=True)

    def _read(self, path: str, step: int, owner: int, abstract):
        """(buffer, meta) of the copy at `path`; ValueError when it is not the copy wanted."""
        with open(os.path.join(path, "index.json")) as f:
            index = json.load(f)
        expected = [list(e) for e in host_shards.layout(abstract, owner)]
        if index["step"] != step or index["owner"] != owner:
            raise ValueError(f"holds step {index['step']} of process {index['owner']}")
        if json.loads(json.dumps(expected)) != index["entries"]:
            raise OtherLayout("saved with another layout of the state (the mesh, the device or process count, "
                              "or the model differs)")
        buffer = np.fromfile(os.path.join(path, "data.bin"), np.uint8)
        if len(buffer) != index["bytes"] or host_shards.checksum(buffer) != index["crc32"]:
            raise ValueError(f"data.bin fails its check ({len(buffer)} bytes of {index['bytes']}, CRC-32)")
        return buffer, index["meta"]

    def _mark_agreed(self, step: int, problems: dict[int, str], everyone: bool = False) -> bool:
        """Marks this process's failed copies of `step` damaged; whether any process had one."""
        for owner, problem in problems.items():
            if problem is None:
                continue
            path = os.path.join(self.root, str(step), f"p{owner}")
            console.warn(f"skipping local checkpoint {path}: {problem}; marked {path}{DAMAGED}")
            with open(path + DAMAGED, "w") as f:
                f.write(problem + "\n")
        if everyone:
            return True
        flag = np.array([bool(problems)], np.int64)
        flags = flag if jax.process_count() == 1 else processes.allgather(flag).reshape(-1)
        if flags.any():
            log.info("local step %d: a copy could not be used on process(es) %s; deciding again without it",
                     step, ", ".join(str(p) for p in np.flatnonzero(flags)))
        return bool(flags.any())


class OtherLayout(ValueError):
    """A local copy saved with another layout of the state than this run's."""


def _explain_fallback(holdings, count: int, below: int | None, at_least: int) -> None:
    """Says why no local step newer than the persistent tier's is restored, when there is one."""
    owners: dict[int, set[int]] = {}
    for _, step, owner in holdings:
        if step >= at_least and (below is None or step < below):
            owners.setdefault(step, set()).add(owner)
    if owners:
        step = max(owners)
        missing = ", ".join(str(p) for p in range(count) if p not in owners[step])
        console.warn(f"local step {step} is not restored: no process holds a usable copy of the shards of "
                     f"process(es) {missing} (their disks lost or their copies damaged or of another layout); "
                     "every process falls back to the persistent tier")


def _rounds(moved: dict[int, int]) -> list[list[tuple[int, int]]]:
    """`moved` ({owner: holder}) in rounds where each process sends and receives at most once."""
    rounds: list[list[tuple[int, int]]] = []
    for owner, holder in sorted(moved.items()):
        for pairs in rounds:
            if all(h != holder for _, h in pairs):
                pairs.append((owner, holder))
                break
        else:
            rounds.append([(owner, holder)])
    return rounds


def _shared_meta(read: dict, source: dict[int, int]) -> dict:
    """The step's meta (the same in every copy), from the lowest process that read a copy."""
    me = jax.process_index()
    mine = json.dumps(next(iter(read.values()))[1]).encode() if read else b""
    if jax.process_count() == 1:
        return json.loads(mine)
    from jax.experimental import multihost_utils

    first = min(source.values())
    length = int(processes.allgather(np.array([len(mine)], np.int64)).reshape(-1)[first])
    payload = np.zeros(length, np.uint8)
    if me == first:
        payload[:] = np.frombuffer(mine, np.uint8)
    shared = np.asarray(multihost_utils.broadcast_one_to_all(payload, is_source=me == first))
    return json.loads(shared.tobytes())


