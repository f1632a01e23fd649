"""Workdir paths, local or remote (`gs://bucket/run`, `s3://...`), through `etils.epath`.

Orbax writes checkpoints through epath; everything else a run writes or scans in its workdir
(`config.json`, `metrics.jsonl`, TensorBoard events, the checkpoint directory listing) goes through
here, so `--workdir=gs://bucket/run` needs no local filesystem. epath's GCS backend needs `gcsfs`
(or TensorFlow) installed, as orbax does for the same URLs.

Object stores cannot append to an object in place: `AppendFile` holds what is written to a
remote file and adds it at most every `REMOTE_FLUSH_SECONDS` (GCS allows about one write per
second to one object) and when closed; on `gs://` by compose (maxlm/runtime/gcs.py), which sends only the
new bytes, elsewhere by rewriting the object whole.
"""

from __future__ import annotations

import os
import shutil
import time

from etils import epath

from maxlm.runtime import gcs

REMOTE_FLUSH_SECONDS = 10.0


def is_remote(path) -> bool:
    """A URL (`gs://`, `s3://`, ...) rather than a local path."""
    return "://" in os.fspath(path)


def workdir_path(path) -> epath.Path:
    """`path` as an epath.Path: URLs as they are, local paths made absolute."""
    return epath.Path(path if is_remote(path) else os.path.abspath(os.fspath(path)))


def free_bytes(path) -> int | None:
    """Bytes free on the filesystem of the local directory `path`; None for a URL (an object
    store has no such figure)."""
    return None if is_remote(path) else shutil.disk_usage(os.fspath(path)).free


def tree_bytes(path) -> int:
    """Bytes of the files under `path`, local or remote (iterdir rather than walk: epath's
    fsspec walk drops the gs:// prefix)."""
    return sum(tree_bytes(p) if p.is_dir() else p.stat().length for p in epath.Path(path).iterdir())


def human_bytes(n: float) -> str:
    """`n` bytes as `512 B`, `1.2 MB`, ... (powers of 1024)."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


class AppendFile:
    """A file opened for appending (text or bytes, as written) on a local or remote path.

    Local: the file itself, opened through epath in append mode; `flush` reaches the OS.
    Remote: writes are held in memory until `flush` adds them to the object (no more often than
    every `min_interval` seconds; `close` always does): the first flush of a new file writes it,
    later ones append (see `append_to_object`).
    """

    def __init__(self, path, min_interval: float = REMOTE_FLUSH_SECONDS):
        self.path = epath.Path(path)
        self.remote = is_remote(path)
        self.min_interval = min_interval
        if self.remote:
            self._held = bytearray()  # written, not yet in the object
            self._stored = self.path.exists()
            self._written_at = float("-inf")
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("ab")

    def tail(self, n: int = 1) -> bytes:
        """The last `n` bytes of the file as it stands (including unflushed writes)."""
        if not self.remote:
            self._file.flush()
        held = bytes(self._held[-n:]) if self.remote else b""
        if len(held) == n or not self.path.exists():
            return held
        with self.path.open("rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(size - (n - len(held)), 0))
            return f.read() + held

    def write(self, data: str | bytes) -> None:
        data = data.encode("utf-8") if isinstance(data, str) else data
        if self.remote:
            self._held += data
        else:
            self._file.write(data)

    def flush(self, force: bool = False) -> None:
        if not self.remote:
            self._file.flush()
        elif self._held and (force or time.monotonic() - self._written_at >= self.min_interval):
            if self._stored:
                append_to_object(self.path, bytes(self._held))
            else:
                self.path.write_bytes(bytes(self._held))
                self._stored = True
            self._held.clear()
            self._written_at = time.monotonic()

    def close(self) -> None:
        if self.remote:
            self.flush(force=True)
        else:
            self._file.close()


def append_to_object(path: epath.Path, data: bytes) -> None:
    """Adds `data` to the end of the existing remote object `path`: on gs:// by compose (only the
    new bytes travel); where that is missing (other stores, GCS zonal buckets) by reading the
    object and writing it back whole."""
    if os.fspath(path).startswith("gs://"):
        try:
            gcs.append(os.fspath(path), data)
            return
        except NotImplementedError:
            pass
    path.write_bytes(path.read_bytes() + data)
