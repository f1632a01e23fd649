"""The built-in `python_stdlib` corpus: a real TFDS dataset built offline from this interpreter.

Every `.py` file of the running Python's standard library (minus `site-packages`) is one example
with features `text` and `path` (relative, `/`-separated). About 2% of files, chosen by a stable
hash of the path, form the `validation` split. The dataset is written in ArrayRecord format, so
`tfds.data_source("python_stdlib", data_dir=..., split=...)` gives random access without
TensorFlow (tensorflow-datasets builds and reads ArrayRecord with TensorFlow absent).

`ensure_corpus` builds it once per `data_dir`, atomically: into a temporary sibling directory,
then one `os.rename` into place, under a file lock so concurrent processes build it only once.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import sys
import sysconfig
import tempfile
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import tensorflow_datasets as tfds
from etils import epath

log = logging.getLogger(__name__)

NAME = "python_stdlib"
CORPUS_VERSION = "1.0.0"
SPLITS = ("train", "validation")
VALIDATION_PERCENT = 2


def default_source_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def is_validation(rel_path: str) -> bool:
    """Stable split assignment: the same file is in the same split on every machine and build."""
    return zlib.crc32(rel_path.encode("utf-8")) % 100 < VALIDATION_PERCENT


def scan_source(root: str | os.PathLike) -> tuple[list[tuple[str, str]], int]:
    """Returns ([(rel_path, text)] sorted by rel_path, number of non-UTF-8 files skipped)."""
    root = Path(root)
    rel_paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Installed third-party packages are not the standard library.
        dirnames[:] = [d for d in dirnames if d != "site-packages"]
        for name in filenames:
            if name.endswith(".py"):
                rel_paths.append((Path(dirpath) / name).relative_to(root).as_posix())
    docs, num_skipped = [], 0
    for rel_path in sorted(rel_paths):  # sorted: the build must not depend on directory order
        try:
            docs.append((rel_path, (root / rel_path).read_bytes().decode("utf-8")))
        except UnicodeDecodeError:
            num_skipped += 1
    return docs, num_skipped


def fingerprint_docs(docs: list[tuple[str, str]]) -> str:
    """A content hash of the corpus; changes iff some path or text changes."""
    h = hashlib.sha256()
    for rel_path, text in docs:
        for part in (rel_path.encode("utf-8"), text.encode("utf-8")):
            h.update(len(part).to_bytes(8, "little"))
            h.update(part)
    return h.hexdigest()[:16]


class PythonStdlib(tfds.core.GeneratorBasedBuilder):
    """TFDS builder for the Python standard library sources (no download: read from disk)."""

    VERSION = tfds.core.Version(CORPUS_VERSION)
    RELEASE_NOTES = {CORPUS_VERSION: "Initial release."}

    def __init__(self, *, source_root: str | os.PathLike | None = None, **kwargs):
        # tfds.builder() constructs this class to *read* the dataset too; the root only matters
        # when building.
        self._source_root = Path(source_root or default_source_root())
        # ArrayRecord: random access with no TensorFlow (TFRecord, tfds' default, needs it).
        kwargs.setdefault("file_format", "array_record")
        super().__init__(**kwargs)

    # tfds 4.9.10 resolves a builder's source file through `importlib_resources`, which it only
    # declares as a dependency for Python < 3.9 (tensorflow/datasets#11212), so building fails with
    # ModuleNotFoundError. The plain file path is what tfds falls back to anyway.
    @tfds.core.utils.classproperty
    @classmethod
    def code_path(cls) -> epath.Path:
        return epath.Path(__file__)

    # TFDS prints "Downloading and preparing dataset Unknown size (download: ...)" before a build
    # and "Dataset ... downloaded and prepared" after it, which read as a download where nothing
    # is downloaded; `ensure_corpus` logs what it built instead.
    def _log_download_bytes(self) -> None:
        pass

    def _log_download_done(self) -> None:
        pass

    def _info(self) -> tfds.core.DatasetInfo:
        # DatasetInfo directly, not dataset_info_from_configs(): that looks for a package dir of
        # metadata files this module does not have.
        return tfds.core.DatasetInfo(
            builder=self,
            description="`.py` files of the Python standard library, one example per file.",
            features=tfds.features.FeaturesDict(
                {"text": tfds.features.Text(), "path": tfds.features.Text()}
            ),
            metadata=tfds.core.MetadataDict(),
        )

    def _split_generators(self, dl_manager):
        del dl_manager  # Nothing to download.
        docs, num_skipped = scan_source(self._source_root)
        if not docs:
            raise ValueError(f"no UTF-8 .py files found under {str(self._source_root)!r}")
        self.info.metadata.update(
            {
                "fingerprint": fingerprint_docs(docs),
                "source_root": str(self._source_root),
                "num_files": len(docs),
                "num_skipped_not_utf8": num_skipped,
            }
        )
        if num_skipped:
            log.warning("%s: skipped %d files that are not valid UTF-8", NAME, num_skipped)
        val = [d for d in docs if is_validation(d[0])]
        train = [d for d in docs if not is_validation(d[0])]
        return {"train": self._generate_examples(train), "validation": self._generate_examples(val)}

    def _generate_examples(self, docs: list[tuple[str, str]]) -> Iterator[tuple[str, dict]]:
        for rel_path, text in docs:
            yield rel_path, {"text": text, "path": rel_path}


def _version_dir(data_dir: Path) -> Path:
    return data_dir / NAME / CORPUS_VERSION


def _is_built(data_dir: Path) -> bool:
    # The version directory only ever appears by rename of a finished build.
    return (_version_dir(data_dir) / "dataset_info.json").is_file()


@contextlib.contextmanager
def file_lock(path: str | os.PathLike) -> Iterator[None]:
    """Exclusive advisory lock (flock) held for the `with` body; released if the process dies."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing drops the lock


@contextlib.contextmanager
def _no_progress_bar() -> Iterator[None]:
    was_active = getattr(tfds.core.utils.tqdm_utils, "_active", True)
    tfds.display_progress_bar(False)
    try:
        yield
    finally:
        tfds.display_progress_bar(was_active)


def ensure_corpus(
    data_dir: str | os.PathLike, source_root: str | os.PathLike | None = None
) -> None:
    """Builds `python_stdlib` under `data_dir` (`~` expanded) unless it is already there.

    `source_root` defaults to this interpreter's stdlib; tests pass a small directory. An existing
    build is used as is, whatever root it was built from (see `corpus_metadata`).
    """
    data_dir = Path(os.path.expanduser(os.fspath(data_dir)))
    if _is_built(data_dir):
        return
    data_dir.mkdir(parents=True, exist_ok=True)
    with file_lock(data_dir / f".{NAME}.lock"):
        if _is_built(data_dir):  # another process finished it while we waited
            return
        # Builds run only under this lock, so any temporary directory left is a dead build's.
        for stale in data_dir.glob(f".{NAME}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{NAME}.tmp-", dir=data_dir))
        try:
            start = time.perf_counter()
            builder = PythonStdlib(data_dir=str(tmp), source_root=source_root)
            with _no_progress_bar():
                # TFDS prints its progress to stdout: to stderr instead, so that a command whose
                # output is JSON (`python -m maxlm.data prepare`, `bench`) stays JSON
                with contextlib.redirect_stdout(sys.stderr):
                    builder.download_and_prepare(download_dir=str(tmp / "downloads"))
            final = _version_dir(data_dir)
            final.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.rename(_version_dir(tmp), final)
            except OSError:
                if not _is_built(data_dir):  # not a lost race (e.g. a filesystem without flock)
                    raise
            meta = builder.info.metadata
            log.info(
                "built %s (%d files, %d skipped as not UTF-8) from %s into %s in %.1fs",
                NAME,
                meta["num_files"],
                meta["num_skipped_not_utf8"],
                meta["source_root"],
                final,
                time.perf_counter() - start,
            )
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def load_split(data_dir: str | os.PathLike, split: str):
    """Random-access source of `{"text": bytes, "path": bytes}` dicts; no TensorFlow involved."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; {NAME} has {SPLITS}")
    data_dir = Path(os.path.expanduser(os.fspath(data_dir)))
    if not _is_built(data_dir):  # tfds' own error here is about file formats: misleading
        raise FileNotFoundError(f"{NAME} is not built under {str(data_dir)!r}; call ensure_corpus")
    # download=False: never let tfds build in place (non-atomically) behind our back.
    return tfds.data_source(NAME, data_dir=str(data_dir), split=split, download=False)


def corpus_metadata(data_dir: str | os.PathLike) -> dict:
    """What the build recorded: fingerprint, source_root, num_files, num_skipped_not_utf8."""
    data_dir = os.path.expanduser(os.fspath(data_dir))
    return dict(tfds.builder(NAME, data_dir=data_dir).info.metadata)
