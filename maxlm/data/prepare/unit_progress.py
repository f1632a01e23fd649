"""Prepare's progress line across its workers (maxlm/data/prepare/build.py; the line: maxlm/runtime/progress.py).

A unit's job runs in a pool process, or on a Beam worker that may be another machine, so it
reports through the build's scratch directory, which all of them reach: `UnitReport` writes the
job's running counts to `SCRATCH/progress/PASS-K.json` at most every `WRITE_EVERY_SECONDS` (every
progress period, if shorter, on local storage) and at its end, whole (a local file is written
aside and renamed; an object store replaces an object whole). `pass_progress`, in the builder,
polls the pass's files and prints their sum. The directory goes with the scratch directory's other
files: the entry never holds it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
from pathlib import Path

from maxlm.data import sources
from maxlm.runtime import paths, progress

log = logging.getLogger(__name__)

DIRECTORY = "progress"
# A job writes its file at most this often (Cloud Storage takes about one write a second to an
# object), so reporting costs a build nothing it can measure.
WRITE_EVERY_SECONDS = 2.0
# A TFDS unit is read in this many ranges of at least TFDS_PIECE_EXAMPLES examples each, so a
# split of one unit (the built-in corpus) still shows how far it is.
TFDS_PIECES, TFDS_PIECE_EXAMPLES = 20, 100


def period() -> float:
    """This build's progress period, which its jobs carry (`job["progress"]`; 0: off, and the jobs
    write nothing): a Beam worker on another machine has not the builder's environment."""
    return progress.period_seconds()


def directory(scratch: str):
    """The progress files' directory in the scratch directory `scratch` (local, or a URL)."""
    return (paths.workdir_path(scratch) if paths.is_remote(scratch) else Path(scratch)) / DIRECTORY


def remove(scratch: str) -> None:
    """The progress files, once the passes are done (a local scratch directory becomes the entry)."""
    folder = directory(scratch)
    if paths.is_remote(scratch):
        folder.rmtree(missing_ok=True)
    else:
        shutil.rmtree(folder, ignore_errors=True)


def pieces(source: sources.Source, unit: sources.Unit) -> list[tuple[sources.Unit, float]]:
    """The unit as consecutive smaller units, each with the share of the unit read once it is:
    its files one by one (by size), or ranges of its examples. Read in order they give the unit's
    documents in its order, so the shards are the same."""
    if source.kind == "tfds":
        count = unit.stop - unit.first
        step = max(-(-count // TFDS_PIECES), TFDS_PIECE_EXAMPLES)
        return [(sources.Unit(first=i, stop=min(i + step, unit.stop)), (min(i + step, unit.stop) - unit.first) / count)
                for i in range(unit.first, unit.stop, step)]
    sizes = [Path(f).stat().st_size for f in unit.files]
    total, read = max(sum(sizes), 1), 0
    out = []
    for f, size in zip(unit.files, sizes):
        read += size
        out.append((sources.Unit(unit.root, (f,)), read / total))
    return out


class UnitReport:
    """One job's running counts (documents, tokens, the share of its unit read), written to its
    file now and then and at `finish`; nothing when the job's `progress` is off."""

    def __init__(self, job: dict, pass_name: str, index: int):
        period = job.get("progress", 0.0)
        self._path = directory(job["tmp"]) / f"{pass_name}-{index:05d}.json" if period else None
        self._remote = paths.is_remote(job["tmp"])
        local_every = min(WRITE_EVERY_SECONDS, max(period, progress.POLL_FLOOR_SECONDS))  # no faster than read
        self._every = WRITE_EVERY_SECONDS if self._remote else local_every
        self.documents: int | None = None
        self.tokens: int | None = None
        self.fraction = 0.0
        self._written = time.monotonic()  # a job quicker than one write writes once, at its end

    def document(self) -> None:
        self.documents = (self.documents or 0) + 1
        self._write_if_due()

    def reached(self, fraction: float) -> None:
        self.fraction = fraction
        self._write_if_due()

    def packed(self, tokens: int) -> None:
        self.tokens = tokens
        self._write_if_due()

    def finish(self, documents: int | None = None, tokens: int | None = None) -> None:
        """The job's end: its final counts (the packer's, which the entry's statistics sum)."""
        self.documents = documents if documents is not None else self.documents
        self.tokens = tokens if tokens is not None else self.tokens
        self._write(done=True)

    def _write_if_due(self) -> None:
        if self._path is not None and time.monotonic() - self._written >= self._every:
            self._write(done=False)

    def _write(self, done: bool) -> None:
        if self._path is None:
            return
        text = json.dumps({"done": done, "fraction": 1.0 if done else self.fraction,
                           "documents": self.documents, "tokens": self.tokens})
        try:
            if self._remote:
                self._path.write_text(text)
            else:  # aside, then renamed: a reader never sees half a file
                aside = self._path.with_name(f".{self._path.name}.{os.getpid()}")
                aside.write_text(text)
                os.replace(aside, self._path)
        except OSError as e:  # the line is a display: losing it must not fail the build
            log.warning("progress: could not write %s (%s); this job's counts stop here", self._path, e)
            self._path = None
        self._written = time.monotonic()


class _Tally:
    """The sum of one pass's progress files. A finished job's file is read once; a running job's
    last counts stand while its file cannot be read (being replaced)."""

    def __init__(self, folder, pass_name: str):
        self._folder, self._pattern = folder, f"{pass_name}-*.json"
        self._finished: dict[str, dict] = {}
        self._running: dict[str, dict] = {}

    def _listing(self) -> list:
        try:
            if str(self._folder).startswith("gs://"):  # a fresh listing, not gcsfs's cached one
                from maxlm.runtime import gcs

                gcs.filesystem().invalidate_cache(str(self._folder))
            return list(self._folder.glob(self._pattern))
        except OSError:
            return []

    def poll(self) -> dict:
        for path in self._listing():
            if path.name in self._finished:
                continue
            try:
                record = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if record["done"]:
                self._finished[path.name] = record
                self._running.pop(path.name, None)
            else:
                self._running[path.name] = record
        records = [*self._finished.values(), *self._running.values()]
        return {"done": len(self._finished) + sum(r["fraction"] for r in self._running.values()),
                "documents": _total(records, "documents"), "tokens": _total(records, "tokens")}


def _total(records: list[dict], key: str) -> int | None:
    counted = [r[key] for r in records if r[key] is not None]
    return sum(counted) if counted else None


@contextlib.contextmanager
def pass_progress(scratch, pass_name: str, what: str, total: int, unit: str = "units"):
    """While the block runs a pass of `total` jobs, a line every period: the jobs' counts summed.
    The last line (the pass done) has the final counts."""
    tally = _Tally(directory(str(scratch)), pass_name)
    with progress.Progress(what, total, unit) as line, progress.polling(line, tally.poll):
        yield line
