"""Where documents come from: `data.source` → a deterministic stream of texts per split.

`resolve` gives the config's sources: `data.source`, or each entry of `data.mixture`. Two kinds
of source:

* `tfds:NAME[/CONFIG][:VERSION]` — a TFDS dataset already prepared (ArrayRecord) under
  `data.tfds_dir`, read with `tfds.data_source` (random access, no TensorFlow). The text is the
  `data.text_key` feature. Nothing is downloaded: a dataset that is not there is a `DataError`.
  `tfds:python_stdlib`, the built-in corpus, is built on first use (see `corpus.py`).
* a file, a directory (searched recursively) or a glob of local files, by extension:
  `.txt` — one document per file (`data.txt_documents="file"`) or per blank-line-separated block
  (`"paragraph"`); `.jsonl` — one JSON object per line, text under `data.text_key`;
  `.parquet` — the `data.text_key` column; `.array_record` — each record is one UTF-8 document.
  A `.txt` or `.jsonl` file may be gzip or zstd compressed, and is read so by its first bytes
  (its magic number), whatever its name; such a file may also be named `NAME.txt.gz`,
  `NAME.jsonl.zst`, or `NAME.json.gz` (JSON Lines, as Dolma ships them). zstd needs the
  `zstandard` package: without it such a file is a `DataError` saying how to install it.
  Local sources have no splits: a document goes to `validation` when a stable hash of
  `relative/path:line` falls under `data.validation_percent`, else to `train`.

Bad data (see `counts` keys): empty files, empty documents and text that is not UTF-8 are skipped
and counted; a broken JSON line, a line that is not an object, a missing `text_key` or a non-string
value are a `DataError` naming the file and line, or, with `data.bad_records="skip"`, skipped and
counted as `bad_records`. A source that matches no file or yields no document is a `DataError`.
"""

from __future__ import annotations

import collections
import contextlib
import glob
import gzip
import hashlib
import io
import json
import logging
import os
import re
import zlib
from dataclasses import dataclass
from pathlib import Path

from maxlm.data import corpus
from maxlm.data.errors import DataError

log = logging.getLogger(__name__)

EXTENSIONS = (".txt", ".jsonl", ".parquet", ".array_record")
# Compressed text: `NAME.KIND.SUFFIX` is read as KIND (`.json`: JSON Lines, Dolma's name for them).
COMPRESSED_SUFFIXES = (".gz", ".zst", ".zstd")
COMPRESSED_KINDS = {".txt": ".txt", ".jsonl": ".jsonl", ".json": ".jsonl"}
# What a file's first bytes say it is compressed with (RFC 1952's gzip, RFC 8878's zstd frame).
MAGIC = {b"\x1f\x8b": "gzip", b"\x28\xb5\x2f\xfd": "zstd"}
ZSTD_INSTALL = "pip install zstandard"
# A file's lines that are not UTF-8 are each counted; only this many of them are logged.
LOGGED_BAD_LINES = 3
SPLITS = ("train", "validation")
_PARAGRAPH = re.compile(r"\n(?:[ \t\r\f\v]*\n)+")


@dataclass(frozen=True)
class Source:
    spec: str
    kind: str  # "tfds" or "files"
    tfds_name: str = ""  # NAME[/CONFIG] for tfds
    tfds_version: str = ""  # "" = newest prepared

    @property
    def slug(self) -> str:
        """A short readable name for cache entries."""
        if self.kind == "tfds":
            return self.tfds_name.replace("/", "_")
        stem = Path(self.spec.rstrip("/*")).name or "files"
        return re.sub(r"[^A-Za-z0-9_.]+", "_", stem)[:40] or "files"


def parse_source(spec: str) -> Source:
    if not isinstance(spec, str) or not spec:
        raise DataError(f"data.source must be 'tfds:NAME[/CONFIG][:VERSION]' or a path/glob, got {spec!r}")
    if spec.startswith("tfds:"):
        name, _, version = spec[len("tfds:"):].partition(":")
        if not re.fullmatch(r"[a-z0-9_]+(/[A-Za-z0-9_.\-]+)?", name) or (
            version and not re.fullmatch(r"\d+\.\d+\.\d+", version)
        ):
            raise DataError(
                f"data.source={spec!r} is not 'tfds:NAME[/CONFIG][:X.Y.Z]' "
                "(e.g. the built-in 'tfds:python_stdlib')"
            )
        return Source(spec, "tfds", name, version)
    return Source(spec, "files")


def resolve(config) -> list[tuple[str, float, object]]:
    """(name, weight, config) per source the run reads: each `data.mixture` entry with the run's
    config copied and its `data.source` set to the entry's, or `data.source` alone (the config
    itself, named by its spec). Every spec is parsed here, so a malformed one fails before
    anything loads."""
    if not config.data.mixture:
        parse_source(config.data.source)
        return [(config.data.source, 1.0, config)]
    out = []
    for name, spec, weight in config.data.mixture:
        parse_source(spec)
        sub = config.copy_and_resolve_references()
        sub.data.source, sub.data.mixture = spec, ()
        out.append((name, float(weight), sub))
    return out


# ----------------------------------------------------------------------------------------- TFDS


def _tfds_version_dir(source: Source, tfds_dir: str) -> Path:
    base = Path(tfds_dir) / source.tfds_name
    if source.tfds_version:
        candidates = [base / source.tfds_version]
    else:
        candidates = sorted(
            (p for p in base.glob("*.*.*") if p.is_dir()),
            key=lambda p: tuple(int(x) for x in p.name.split(".") if x.isdigit()),
            reverse=True,
        )
    for c in candidates:
        if (c / "dataset_info.json").is_file():
            return c
    raise DataError(
        f"TFDS dataset {source.tfds_name!r}{' version ' + source.tfds_version if source.tfds_version else ''} "
        f"is not prepared under data.tfds_dir={tfds_dir!r} (nothing is downloaded at run time: "
        "prepare it there in ArrayRecord format first, or use the built-in 'tfds:python_stdlib')"
    )


def _open_tfds(source: Source, tfds_dir: str, split: str):
    import tensorflow_datasets as tfds

    if source.tfds_name == corpus.NAME:
        corpus.ensure_corpus(tfds_dir)
        return corpus.load_split(tfds_dir, split)
    version_dir = _tfds_version_dir(source, tfds_dir)
    info = json.loads((version_dir / "dataset_info.json").read_text())
    splits = [s["name"] for s in info.get("splits", [])]
    if split not in splits:
        raise DataError(
            f"TFDS dataset {source.tfds_name!r} has splits {splits}, no {split!r}",
            str(version_dir),
        )
    fmt = info.get("fileFormat", "")
    if fmt and fmt != "array_record":
        raise DataError(
            f"TFDS dataset {source.tfds_name!r} is stored as {fmt!r}; random access without "
            "TensorFlow needs it rebuilt with file_format='array_record'",
            str(version_dir),
        )
    name = f"{source.tfds_name}:{version_dir.name}"
    return tfds.data_source(name, data_dir=tfds_dir, split=split, download=False)


def _tfds_documents(source, data_cfg, split, counts, first: int = 0, stop: int | None = None):
    """Yields `(where, text)` of examples [first, stop) one at a time (random access, so memory
    stays flat)."""
    tfds_dir = os.path.expanduser(data_cfg.tfds_dir)
    ds = _open_tfds(source, tfds_dir, split)
    text_key = data_cfg.text_key
    skip = data_cfg.bad_records == "skip"
    where = f"tfds:{source.tfds_name}[{split}]"
    for i in range(first, len(ds) if stop is None else stop):
        example = ds[i]
        if text_key not in example:
            if i == 0 and not skip:
                raise DataError(
                    f"no feature data.text_key={text_key!r}; features are {sorted(example)}",
                    where,
                )
            counts["bad_records"] += 1
            continue
        text = _checked_text(example[text_key], counts, f"{where}#{i}")
        if text is not None:
            yield f"{where}#{i}", text


# ---------------------------------------------------------------------------------- local files


def file_kind(path: Path) -> str | None:
    """The kind a file is read as, by its name: one of EXTENSIONS (`.txt`, `.jsonl` also for a
    compressed `NAME.txt.gz`, `NAME.jsonl.zst`, `NAME.json.gz`, ...), or None when unsupported."""
    if path.suffix in EXTENSIONS:
        return path.suffix
    if path.suffix in COMPRESSED_SUFFIXES:
        return COMPRESSED_KINDS.get(Path(path.stem).suffix)
    return None


def compression(path: Path) -> str | None:
    """"gzip" or "zstd" when the file's first bytes are that format's magic number, else None."""
    with open(path, "rb") as f:
        head = f.read(4)
    return next((name for magic, name in MAGIC.items() if head.startswith(magic)), None)


@contextlib.contextmanager
def open_text_file(path: Path):
    """The bytes of a `.txt` or `.jsonl` file as a binary stream, decompressed when it is gzip or
    zstd (`compression`), read as it comes. A zstd file without the `zstandard` package, and a
    compressed stream that is corrupt or cut short, are a DataError naming the file."""
    kind = compression(path)
    if kind == "zstd":
        try:
            import zstandard
        except ImportError:
            raise DataError(f"the file is zstd-compressed; reading it needs the zstandard package: "
                            f"{ZSTD_INSTALL} (or decompress it: zstd -d)", str(path)) from None
        errors: tuple = (zstandard.ZstdError, EOFError)
    else:
        errors = (gzip.BadGzipFile, EOFError, zlib.error)
    with open(path, "rb") as raw:
        if kind == "gzip":
            stream = gzip.GzipFile(fileobj=raw)
        elif kind == "zstd":  # all frames: zstd -c a b > ab and pzstd write several
            stream = io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True))
        else:
            stream = raw
        try:
            yield stream
        except errors as e:
            raise DataError(f"the {kind} stream is corrupt or cut short ({e or type(e).__name__})", str(path)) from None


def list_files(spec: str) -> tuple[Path, list[Path]]:
    """(root, sorted files) for a file, a directory or a glob; root keys the split hash."""
    path = os.path.expanduser(spec)
    if any(ch in path for ch in "*?["):
        files = [Path(p) for p in glob.glob(path, recursive=True) if os.path.isfile(p)]
        root = Path(re.split(r"[*?\[]", path, maxsplit=1)[0] or ".")
        root = root if root.is_dir() else root.parent
    elif os.path.isdir(path):
        root = Path(path)
        files = [p for p in root.rglob("*") if p.is_file() and file_kind(p)]
    elif os.path.isfile(path):
        root, files = Path(path).parent, [Path(path)]
    else:
        raise DataError(f"data.source={spec!r}: no such file, directory or matching glob")
    files = sorted(files)
    if not files:
        raise DataError(
            f"data.source={spec!r} matches no {'/'.join(EXTENSIONS)} files (empty source)"
        )
    for f in files:
        if not file_kind(f):
            name = "".join(f.suffixes[-2:]) if f.suffix in COMPRESSED_SUFFIXES else f.suffix
            raise DataError(f"unsupported file type {name or f.name!r}; supported: "
                            f"{EXTENSIONS}, .txt and .jsonl (or .json) also with {COMPRESSED_SUFFIXES}", str(f))
    return root, files


def _checked_text(value, counts, where: str) -> str | None:
    """`value` as text, or None (counted) when it is empty or not UTF-8."""
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError:
            counts["not_utf8"] += 1
            log.warning("%s: skipped: not valid UTF-8", where)
            return None
    if value is None or not value.strip():
        counts["empty_documents"] += 1
        return None
    return value


def _read_jsonl(path: Path, rel: str, data_cfg, counts):
    """`_read_file` of a JSON Lines file: one JSON object a line, its text under `text_key`."""
    text_key = data_cfg.text_key
    skip = data_cfg.bad_records == "skip"
    not_utf8 = 0  # this file's: each is counted, the first LOGGED_BAD_LINES logged, then a sum
    with open_text_file(path) as f:  # binary lines split on b"\n" only, as bytes.split did
        for n, raw_line in enumerate(f, start=1):
            if not raw_line.strip():
                continue
            try:
                obj = json.loads(raw_line)
            except UnicodeDecodeError:
                counts["not_utf8"] += 1
                not_utf8 += 1
                if not_utf8 <= LOGGED_BAD_LINES:
                    log.warning("%s:%d: skipped: not valid UTF-8", path, n)
                continue
            except json.JSONDecodeError as e:
                _bad_record(f"broken JSON line ({e.msg}, column {e.colno})", str(path), n, counts, skip)
                continue
            if not isinstance(obj, dict):
                _bad_record(f"expected a JSON object, got {type(obj).__name__}", str(path), n, counts, skip)
            elif text_key not in obj:
                _bad_record(f"no data.text_key={text_key!r} field (fields: {sorted(obj)[:8]})",
                            str(path), n, counts, skip)
            elif not isinstance(obj[text_key], str):
                _bad_record(f"field {text_key!r} is {type(obj[text_key]).__name__}, not a string",
                            str(path), n, counts, skip)
            else:
                yield from _doc(obj[text_key], counts, f"{rel}:{n}")
    if not_utf8 > LOGGED_BAD_LINES:
        log.warning("%s: skipped %d lines that are not valid UTF-8 (the first %d logged above)",
                    path, not_utf8, LOGGED_BAD_LINES)


def _bad_record(message, file, line, counts, skip):
    if not skip:
        raise DataError(message + " (set data.bad_records='skip' to skip and count such records)", file, line)
    counts["bad_records"] += 1
    log.warning("%s:%d: skipped: %s", file, line, message)


def _doc(value, counts, where: str):
    text = _checked_text(value, counts, where)
    if text is not None:
        yield where, text


# Records per read from parquet and array_record files, so a big file is never held whole.
_RECORDS_PER_READ = 1024


def _read_file(path: Path, rel: str, data_cfg, counts):
    """Yields `(where, text)` from one file, streaming: a .jsonl line, a parquet batch or an
    array_record range at a time (a .txt file is one document, or its paragraphs, read whole);
    compressed text decompressed as it is read (`open_text_file`)."""
    kind, text_key, skip = file_kind(path), data_cfg.text_key, data_cfg.bad_records == "skip"
    if path.stat().st_size == 0:
        counts["empty_files"] += 1
        log.warning("%s: skipped: empty file", path)
        return
    if kind == ".txt":
        with open_text_file(path) as f:
            raw = f.read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            counts["not_utf8"] += 1
            line = raw[: e.start].count(b"\n") + 1
            log.warning("%s:%d: skipped file: not valid UTF-8", path, line)
            return
        del raw
        if data_cfg.txt_documents == "paragraph":
            pos, line = 0, 1
            for m in [*_PARAGRAPH.finditer(text), None]:
                end = m.start() if m else len(text)
                yield from _doc(text[pos:end], counts, f"{rel}:{line}")
                if m:
                    line += text.count("\n", pos, m.end())
                    pos = m.end()
        else:
            yield from _doc(text, counts, f"{rel}:1")
    elif kind == ".jsonl":
        yield from _read_jsonl(path, rel, data_cfg, counts)
    elif kind == ".parquet":
        import pyarrow.parquet as pq

        schema = pq.read_schema(path)
        if text_key not in schema.names:
            raise DataError(f"no data.text_key={text_key!r} column (columns: {schema.names})", str(path))
        n = 0
        with pq.ParquetFile(path) as pf:
            for batch in pf.iter_batches(batch_size=_RECORDS_PER_READ, columns=[text_key]):
                for value in batch.column(0).to_pylist():
                    n += 1
                    if value is not None and not isinstance(value, (str, bytes)):
                        _bad_record(f"column {text_key!r} holds {type(value).__name__}", str(path), n, counts, skip)
                        continue
                    yield from _doc(value, counts, f"{rel}:{n}")
    else:  # .array_record
        from array_record.python.array_record_module import ArrayRecordReader

        reader = ArrayRecordReader(str(path))
        try:
            total = reader.num_records()
            for begin in range(0, total, _RECORDS_PER_READ):
                records = reader.read(begin, min(begin + _RECORDS_PER_READ, total))
                for n, record in enumerate(records, start=begin + 1):
                    yield from _doc(record, counts, f"{rel}:{n}")
        finally:
            reader.close()


def _file_documents(root: Path, files, data_cfg, counts):
    for path in files:
        path = Path(path)
        try:
            rel = path.relative_to(root).as_posix()
        except ValueError:
            rel = path.as_posix()
        yield from _read_file(path, rel, data_cfg, counts)


# ------------------------------------------------------------------------------------------ units

# A split is read, cleaned and packed in units, each on its own (one shard of the packed cache, so
# they can run in parallel). Units are fixed by the source and config alone, never by the number
# of workers: consecutive files of about `data.shard_mb` MB together, or `data.shard_examples`
# examples of a TFDS split.
# Counters in `counts` that tally what was read (not skips): files, documents read from the files
# (either split), documents of the split.
TALLIES = ("files", "documents_read", "split_documents")


@dataclass(frozen=True)
class Unit:
    """Files `files` (under `root`, which keys the split hash), or TFDS examples [first, stop)."""

    root: str = ""
    files: tuple[str, ...] = ()
    first: int = 0
    stop: int = 0


def plan_units(source: Source, data_cfg, split: str) -> list[Unit]:
    """The units of `split`, in the split's document order."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    if source.kind == "tfds":
        total, step = len(_open_tfds(source, os.path.expanduser(data_cfg.tfds_dir), split)), data_cfg.shard_examples
        return [Unit(first=i, stop=min(i + step, total)) for i in range(0, total, step)]
    root, files = list_files(source.spec)
    units, group, size = [], [], 0
    for f in files:
        group.append(str(f))
        size += f.stat().st_size
        if size >= data_cfg.shard_mb * 2**20:
            units.append(Unit(str(root), tuple(group)))
            group, size = [], 0
    if group:
        units.append(Unit(str(root), tuple(group)))
    return units


def iter_unit_documents(source: Source, data_cfg, split: str, unit: Unit, counts: collections.Counter):
    """Yields the texts of `split` in `unit`, in order, one at a time; skips (and `TALLIES`) go
    to `counts`."""
    if source.kind == "tfds":
        for _, text in _tfds_documents(source, data_cfg, split, counts, unit.first, unit.stop):
            counts["split_documents"] += 1
            yield text
        return
    percent, want_val = float(data_cfg.validation_percent), split == "validation"
    counts["files"] += len(unit.files)
    for where, text in _file_documents(Path(unit.root), unit.files, data_cfg, counts):
        counts["documents_read"] += 1
        if is_validation(where, percent) == want_val:
            counts["split_documents"] += 1
            yield text


def check_not_empty(source: Source, data_cfg, split: str, counts: collections.Counter) -> None:
    """DataError when `split` of `source` gave no document (`counts`' tallies), saying why."""
    if counts["split_documents"]:
        return
    if source.kind == "tfds":
        raise DataError(f"tfds:{source.tfds_name}[{split}]: no non-empty documents (empty source)")
    if not counts["documents_read"]:
        raise DataError(f"data.source={source.spec!r} has no non-empty documents (empty source)")
    raise DataError(
        f"data.source={source.spec!r}: no documents in the {split!r} split (data.validation_percent="
        f"{float(data_cfg.validation_percent):g} of {counts['files']} files' documents by hash; raise it, or set "
        "eval.every_steps=0)"
    )


def is_validation(key: str, percent: float) -> bool:
    return zlib.crc32(key.encode("utf-8")) % 10_000 < percent * 100


def iter_documents(source: Source, data_cfg, split: str, counts: collections.Counter | None = None):
    """Yields the texts of `split` of `source` (`parse_source(data_cfg.source)`) in a fixed order,
    one at a time, unit after unit: memory stays bounded by one document (or one read of
    `_RECORDS_PER_READ` records), whatever the source's size. Skips are added to `counts`. Raises
    DataError (an empty source or split: at the end)."""
    counts = collections.Counter() if counts is None else counts
    for unit in plan_units(source, data_cfg, split):
        yield from iter_unit_documents(source, data_cfg, split, unit, counts)
    check_not_empty(source, data_cfg, split, counts)
    skipped = {k: v for k, v in counts.items() if k not in TALLIES and v}
    if skipped:
        log.warning("%s[%s]: skipped %s", source.spec, split, skipped)


def read_documents(data_cfg, split: str, counts: collections.Counter | None = None) -> list[str]:
    """The texts of `split` of `data_cfg.source` in a fixed order, as a list (`iter_documents`)."""
    return list(iter_documents(parse_source(data_cfg.source), data_cfg, split, counts))


def source_fingerprint(source: Source, data_cfg) -> str:
    """Changes whenever the source's content could have changed (keys the packed cache)."""
    h = hashlib.sha256(source.spec.encode())
    if source.kind == "tfds":
        tfds_dir = os.path.expanduser(data_cfg.tfds_dir)
        if source.tfds_name == corpus.NAME:
            corpus.ensure_corpus(tfds_dir)
            h.update(corpus.corpus_metadata(tfds_dir)["fingerprint"].encode())
        else:
            h.update((_tfds_version_dir(source, tfds_dir) / "dataset_info.json").read_bytes())
    else:
        _, files = list_files(source.spec)
        for f in files:
            st = f.stat()
            h.update(f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]
