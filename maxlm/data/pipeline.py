"""Training and eval batches as a pure function of (config, step).

The source is read, cleaned, tokenized and packed once per (source, filters, tokenizer, seq_len,
split) — `prepare` — into a cache entry: the token stream stored once (uint16 when the vocabulary
fits) plus document starts, from which any row's four int32 arrays are derived on read.
A grain `MapDataset` of row ids then fixes which rows form each batch, by index alone, with no
iterator state: `batch(step)` is the same on every run, after any resume and for any number of
processes, and each process reads only its own rows. Nothing here imports TensorFlow.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import grain
import numpy as np

from maxlm.data import filters, sources
from maxlm.data.corpus import file_lock
from maxlm.data.errors import DataError
from maxlm.data.packing import PackedStream, token_dtype
from maxlm.data.prefetch import Prefetcher, batch_parts_key
from maxlm.data.tokenizer import Tokenizer, load_tokenizer

log = logging.getLogger(__name__)

SOURCES = ("tfds:python_stdlib", "tfds:NAME[/CONFIG][:VERSION]", "PATH|DIR|GLOB")
SPLITS = sources.SPLITS
# Bump when packing or the cache layout changes, so stale caches are not reused.
_PACKED_FORMAT = 2


class TokenDataset:
    """Packed rows of one split, served as fixed global batches.

    Row order. Let N = num_rows, B = the global batch size and E = N // B steps per epoch.
    Step s belongs to epoch e = s // E and takes rows `order[e*N + (s % E)*B + k]` for k < B,
    where `order` is `grain.MapDataset.range(N)[.shuffle(seed)].repeat(None)`:
      * train: grain's shuffle draws epoch e's order as the permutation
        `index_shuffle(i, max_index=N-1, seed=(shuffle_seed + e) mod 2**32, rounds=4)` of
        [0, N), with `shuffle_seed` derived from `config.seed` (see `_shuffle_seed`). So each
        epoch is a fresh, seed-determined permutation, computed per index in O(1) memory.
      * validation: no shuffle; epoch e repeats rows 0..N-1 in order.
    The last N - E*B rows of each epoch's order are dropped (drop_remainder); when training
    they are different rows each epoch.
    """

    def __init__(
        self,
        rows: PackedStream,
        *,
        tokenizer: Tokenizer,
        batch_size: int,
        seed: int | None,
        split: str,
        efficiency: float | None = None,
    ):
        self.split = split
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self._rows = rows  # usually memory-mapped
        self.num_rows, self.seq_len = rows.num_rows, rows.seq_len
        self.steps_per_epoch = self.num_rows // batch_size
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"the {split!r} split has {self.num_rows} packed rows of seq_len={self.seq_len}, "
                f"fewer than one batch of batch_size={batch_size}; lower batch_size or seq_len"
            )
        order = grain.MapDataset.range(self.num_rows)
        if seed is not None:
            order = order.shuffle(seed=_shuffle_seed(seed))
        self.order = order.repeat(None)  # index e*N + i: row i of epoch e's order
        self._efficiency = efficiency

    @property
    def packing_efficiency(self) -> float:
        """Fraction of non-padding tokens over the whole split."""
        if self._efficiency is None:
            self._efficiency = self._rows.packing_efficiency
        return self._efficiency

    def epoch_of(self, step: int) -> int:
        return step // self.steps_per_epoch

    def row_ids(self, step: int, process_index=0, process_count: int = 1) -> np.ndarray:
        """Ids of the rows `batch(step, ...)` returns, in order."""
        step, parts, process_count = int(step), batch_parts_key(process_index), int(process_count)
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if process_count < 1 or self.batch_size % process_count:
            raise ValueError(
                f"batch_size={self.batch_size} must be divisible by the process count "
                f"{process_count}"
            )
        for part in parts:
            if not 0 <= part < process_count:
                raise ValueError(f"process_index={part} not in [0, {process_count})")
        per_process = self.batch_size // process_count
        epoch, step_in_epoch = divmod(step, self.steps_per_epoch)
        start = epoch * self.num_rows + step_in_epoch * self.batch_size
        firsts = [start + part * per_process for part in parts]
        return np.fromiter(
            (self.order[i] for first in firsts for i in range(first, first + per_process)),
            np.int64, per_process * len(parts),
        )

    def batch(
        self, step: int, process_index=0, process_count: int = 1
    ) -> dict[str, np.ndarray]:
        """This process's contiguous slice of global batch `step`.

        Rows [p*B/P, (p+1)*B/P) of the global batch, as int32 arrays `[B/P, seq_len]` under
        `inputs, targets, segment_ids, positions`. `process_index` may also be a tuple of such
        parts p (ascending): a process whose devices hold several separate slices of the batch
        (see `mesh.batch_parts`) gets them concatenated, `[len(parts)*B/P, seq_len]`.
        """
        return self._rows.rows(self.row_ids(step, process_index, process_count))

    def prefetch(self, depth: int = 2) -> Prefetcher:
        """This dataset, its `batch` served from a background thread reading `depth` steps ahead.

        Same calls, same arrays (each is `batch(step, ...)` itself, keyed by step): asking for a
        step other than the next one (a resume, a rollback) restarts reading there. Cached, so
        `ds.prefetch()` in a loop returns the same object; its thread ends with the dataset.
        """
        cache = self.__dict__.setdefault("_prefetchers", {})
        if depth not in cache:
            cache[depth] = Prefetcher(self, depth)
        return cache[depth]

    def __repr__(self) -> str:
        return (
            f"TokenDataset(split={self.split!r}, num_rows={self.num_rows}, "
            f"seq_len={self.seq_len}, batch_size={self.batch_size}, tokenizer={self.tokenizer!r})"
        )


def _shuffle_seed(seed: int) -> int:
    # grain reshuffles epoch e with seed + e, so raw seeds s and s+1 would share all but one
    # epoch order. Hashing the seed first keeps runs with nearby seeds unrelated.
    return int(np.random.SeedSequence(seed).generate_state(1, np.uint32)[0])




def make_dataset(config, split: str) -> TokenDataset:
    """The packed `split` ("train" or "validation") of `config.data.source`.

    Reads `seed, batch_size, seq_len, model.vocab_size` and `data.*`. Prepares the packed cache
    on first use (`prepare`). Raises `DataError` (a ValueError) on bad data, naming file and line.
    """
    source = sources.parse_source(config.data.source)  # a malformed source fails before anything loads
    tokenizer = checked_tokenizer(config)
    stream, info = prepare(config, split, tokenizer, source)
    return TokenDataset(
        stream,
        tokenizer=tokenizer,
        batch_size=config.batch_size,
        seed=config.seed if split == "train" else None,
        split=split,
        efficiency=info["packing_efficiency"],
    )


def checked_tokenizer(config) -> Tokenizer:
    """`data.tokenizer`, loaded and checked against `model.vocab_size`."""
    tokenizer = load_tokenizer(config.data.tokenizer)
    if tokenizer.vocab_size > config.model.vocab_size:
        raise ValueError(
            f"tokenizer {tokenizer.spec!r} has vocab_size={tokenizer.vocab_size}, more than "
            f"model.vocab_size={config.model.vocab_size}; set model.vocab_size >= "
            f"{tokenizer.vocab_size}"
        )
    return tokenizer


def cache_meta(config, split: str, tokenizer: Tokenizer, source: sources.Source) -> dict:
    """Everything the packed cache entry depends on (its key is a hash of this)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    d = config.data
    return {
        "format": _PACKED_FORMAT,
        "source": d.source,
        "source_fingerprint": sources.source_fingerprint(source, d),
        "split": split,
        "text_key": d.text_key,
        "txt_documents": d.txt_documents,
        "validation_percent": d.validation_percent,
        "bad_records": d.bad_records,
        "filters": filters.settings(d),
        "tokenizer": tokenizer.spec,
        "tokenizer_fingerprint": tokenizer.fingerprint,
        "vocab_size": tokenizer.vocab_size,
        "seq_len": config.seq_len,
    }


def cache_path(config, split: str, tokenizer: Tokenizer | None = None,
               source: sources.Source | None = None) -> tuple[Path, dict]:
    """(the cache entry's directory, its meta) for `split`; `tokenizer` and `source` (the parsed
    `data.source`) are loaded and parsed here when not given."""
    source = source or sources.parse_source(config.data.source)
    tokenizer = tokenizer or checked_tokenizer(config)
    meta = cache_meta(config, split, tokenizer, source)
    key = hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()[:16]
    cache_dir = os.path.expanduser(config.data.cache_dir)
    return Path(cache_dir) / f"{source.slug}-{split}-L{config.seq_len}-{key}", meta


def prepare(config, split: str, tokenizer: Tokenizer | None = None,
            source: sources.Source | None = None) -> tuple[PackedStream, dict]:
    """(memory-mapped packed stream, the cache entry's meta.json), building the entry if missing.

    The entry is written atomically (temporary directory, then rename) under a file lock, so
    concurrent processes build it once. meta.json carries the statistics `stats` prints.
    """
    source = source or sources.parse_source(config.data.source)
    tokenizer = tokenizer or checked_tokenizer(config)
    final, meta = cache_path(config, split, tokenizer, source)
    if not (final / "meta.json").is_file():
        final.parent.mkdir(parents=True, exist_ok=True)
        with file_lock(final.parent / f".{final.name}.lock"):
            if not (final / "meta.json").is_file():  # not built while we waited
                # Packing runs only under this lock: a temporary dir left is a dead run's.
                for stale in final.parent.glob(f".{final.name}.tmp-*"):
                    shutil.rmtree(stale, ignore_errors=True)
                _pack_into(final, meta, source, config.data, tokenizer)
    info = json.loads((final / "meta.json").read_text())
    stream = PackedStream(
        np.load(final / "targets.npy", mmap_mode="r"),
        np.load(final / "doc_starts.npy"),
        info["seq_len"],
        tokenizer.bos_id,
        tokenizer.eos_id,
        tokenizer.pad_id,
    )
    log.info("%s: %d packed rows of %d tokens from %s", split, stream.num_rows, info["seq_len"], final)
    return stream, info


def iter_clean_documents(source: sources.Source, data_cfg, split: str, counts):
    """Yields the documents of `split` of `source` after `data.filters`, streaming
    (`sources.iter_documents`); skip and filter counts go to `counts`, complete once the iterator
    is exhausted."""
    read = 0

    def counted(texts):
        nonlocal read
        for text in texts:
            read += 1
            yield text

    kept = 0
    texts = counted(sources.iter_documents(source, data_cfg, split, counts))
    for text in filters.iter_filtered(texts, filters.settings(data_cfg), counts):
        kept += 1
        yield text
    if not kept:
        raise DataError(f"data.source={data_cfg.source!r}: data.filters dropped all "
                        f"{read} {split!r} documents ({dict(counts)})")


def read_clean_documents(data_cfg, split: str, counts) -> list[str]:
    """The documents of `split` of `data_cfg.source` after `data.filters`, as a list
    (see `iter_clean_documents`)."""
    return list(iter_clean_documents(sources.parse_source(data_cfg.source), data_cfg, split, counts))


# `prepare` reads, filters and tokenizes a split this many documents, or characters of text,
# at a time (whichever limit is hit first), so its memory is bounded by one chunk, not the corpus.
CHUNK_DOCUMENTS = 10_000
CHUNK_CHARS = 16 << 20


def _chunks(texts, max_docs: int, max_chars: int):
    chunk, chars = [], 0
    for text in texts:
        chunk.append(text)
        chars += len(text)
        if len(chunk) >= max_docs or chars >= max_chars:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


def _npy_header(dtype: np.dtype, length: int) -> bytes:
    """The header `np.save` writes for a 1-D array of `length` items of `dtype`."""
    import io

    buf = io.BytesIO()
    d = np.lib.format.header_data_from_array_1_0(np.empty(0, dtype))
    np.lib.format.write_array_header_1_0(buf, {**d, "shape": (int(length),)})
    return buf.getvalue()


class _NpyWriter:
    """A 1-D `.npy` file grown by `append`; its bytes equal `np.save` of the concatenation.

    The header's size does not depend on the length for 1-D arrays (it is padded to 64 bytes),
    so room for it is left first and the real header written over it on `close`.
    """

    def __init__(self, path: Path, dtype):
        self.dtype, self.length = np.dtype(dtype), 0
        self._header_size = len(_npy_header(self.dtype, 0))
        if len(_npy_header(self.dtype, 2**62)) != self._header_size:  # never for 1-D
            raise AssertionError("npy header size depends on the length")
        self._f = open(path, "wb")
        self._f.write(b"\0" * self._header_size)

    def append(self, arr: np.ndarray) -> None:
        arr = np.ascontiguousarray(arr, self.dtype)
        self._f.write(memoryview(arr).cast("B"))
        self.length += len(arr)

    def close(self) -> None:
        header = _npy_header(self.dtype, self.length)
        assert len(header) == self._header_size
        self._f.seek(0)
        self._f.write(header)
        self._f.close()


def _pack_into(final: Path, meta: dict, source: sources.Source, data_cfg, tokenizer: Tokenizer) -> None:
    """Reads, cleans, tokenizes and packs a split into `final`, atomically, in chunks.

    Each chunk of `CHUNK_DOCUMENTS` documents or `CHUNK_CHARS` characters is tokenized and
    appended to the token stream and document starts on disk, so peak memory is bounded by a
    chunk; the files are bitwise those `PackedStream.from_documents` of the whole split gives.
    """
    start = time.perf_counter()
    seq_len, dtype = meta["seq_len"], token_dtype(tokenizer.vocab_size)
    counts = collections.Counter()
    read_sec = tokenize_sec = 0.0
    num_docs = long_docs = offset = 0
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    writers = []
    try:
        targets_w = _NpyWriter(tmp / "targets.npy", dtype)
        writers.append(targets_w)
        starts_w = _NpyWriter(tmp / "doc_starts.npy", np.int64)
        writers.append(starts_w)
        chunks = _chunks(iter_clean_documents(source, data_cfg, meta["split"], counts),
                         CHUNK_DOCUMENTS, CHUNK_CHARS)  # fmt: skip
        while True:
            t0 = time.perf_counter()
            texts = next(chunks, None)
            t1 = time.perf_counter()
            read_sec += t1 - t0
            if texts is None:
                break
            ids = tokenizer.encode_batch(texts)
            del texts
            tokenize_sec += time.perf_counter() - t1
            # As `PackedStream.from_documents`: each document's ids then eos, end to end.
            lengths = np.fromiter((len(x) + 1 for x in ids), np.int64, len(ids))
            ends = np.cumsum(lengths)
            eos = np.array([tokenizer.eos_id], dtype)
            targets = np.concatenate([a for x in ids for a in (x, eos)], dtype=dtype, casting="unsafe")
            targets_w.append(targets)
            starts_w.append(offset + ends - lengths)
            offset += int(ends[-1])
            num_docs += len(ids)
            # Longer than a row: split across rows as continuing segments, never truncated.
            long_docs += int(np.count_nonzero(lengths > seq_len))
            del ids, targets
        targets_w.close()
        starts_w.close()
        stream = PackedStream(
            np.load(tmp / "targets.npy", mmap_mode="r"), np.load(tmp / "doc_starts.npy", mmap_mode="r"),
            seq_len, tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id,
        )  # fmt: skip
        stats = {
            "documents": num_docs,
            "tokens": stream.num_tokens,
            "sequences": stream.num_rows,
            "packing_efficiency": stream.packing_efficiency,
            "long_documents": long_docs,
            "skipped": {k: v for k, v in sorted(counts.items()) if not k.startswith("filtered_") and k != "files"},
            "filtered": {k[len("filtered_"):]: counts.get(k, 0) for k in
                         (f"filtered_{n}" for n in filters.FILTER_KEYS)},
            **({"files": counts["files"]} if counts.get("files") else {}),
            "read_sec": round(read_sec, 3),
            "tokenize_sec": round(tokenize_sec, 3),
        }
        del stream
        (tmp / "meta.json").write_text(json.dumps({**meta, **stats}, indent=2, sort_keys=True))
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "meta.json").is_file():  # not a lost race: a real failure
                raise
    finally:
        for w in writers:
            w._f.close()  # no-op once closed
        shutil.rmtree(tmp, ignore_errors=True)
    log.info(
        "prepared %s[%s]: %d docs (skipped %s, filtered %s), %d tokens in %d rows x %d "
        "(efficiency %.4f), read in %.1fs, tokenized in %.1fs, total %.1fs -> %s",
        meta["source"], meta["split"], stats["documents"], stats["skipped"], stats["filtered"],
        stats["tokens"], stats["sequences"], seq_len, stats["packing_efficiency"],
        read_sec, tokenize_sec, time.perf_counter() - start, final,
    )  # fmt: skip
