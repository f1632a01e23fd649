"""`prepare`: a split of `data.source` read (`sources`), cleaned (`filters`), tokenized and
packed (`packing`) once into a cache entry of ArrayRecord shards (`shards`), unit by unit, in
parallel; or the entry found, built before.

An entry (`cache_path`) is a directory:

    meta.json                           what the entry depends on (the hash of which names it),
                                        its statistics, and the index: every shard's row count
    rows-00000-of-00004.array_record    one shard per unit of the source (`sources.plan_units`):
    ...                                 the unit's documents packed on their own

Units are fixed by the source, never by the number of workers, so any number of workers writes
the same shards bitwise. Memory per worker is bounded by one chunk of `CHUNK_DOCUMENTS` documents
or `CHUNK_CHARS` characters, whatever the unit's or the corpus's size.

Exact and near dedup (`data.filters.dedup`, `near_dedup`) are global over the split, in three
passes:
1. each unit computes the keys of its documents that pass the other filters (16 bytes each, to a
   file): the text's hash for exact dedup, its MinHash-LSH band keys for near dedup;
2. the keys are split into partitions by value, and each partition finds its repeats: every
   document after the first in the split's order (unit, then position) with a key seen before;
3. each unit packs its documents, leaving those out.
A partition holds 1/P of the split's keys, so no process holds them all. The result is the serial
one (`filters.iter_filtered`): the first of each group is kept.

While a pass runs, its jobs report their counts through the scratch directory and the builder
prints their sum as a progress line (`unit_progress`).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import multiprocessing
import os
import secrets
import shutil
import socket
import tempfile
import time
from pathlib import Path

import numpy as np

from maxlm.data import sources
from maxlm.data.corpus import file_lock
from maxlm.data.errors import DataError
from maxlm.data.packing import token_dtype
from maxlm.data.prepare import filters, unit_progress
from maxlm.data.shards import ShardedRows, ShardWriter
from maxlm.data.tokenizers import Tokenizer, checked_tokenizer, load_tokenizer
from maxlm.runtime import paths, processes

log = logging.getLogger(__name__)

# Bump when packing or the cache layout changes, so stale caches are not reused.
PACKED_FORMAT = 3
# A unit is read, filtered and tokenized this many documents, or characters of text, at a time.
CHUNK_DOCUMENTS = 10_000
CHUNK_CHARS = 16 << 20


def cache_meta(config, split: str, tokenizer: Tokenizer, source: sources.Source) -> dict:
    """Everything the packed cache entry depends on (its key is a hash of this)."""
    if split not in sources.SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {sources.SPLITS}")
    d = config.data
    return {
        "format": PACKED_FORMAT,
        "source": d.source,
        "source_fingerprint": sources.source_fingerprint(source, d),
        "split": split,
        "text_key": d.text_key,
        "txt_documents": d.txt_documents,
        "validation_percent": d.validation_percent,
        "bad_records": d.bad_records,
        "filters": filters.settings(d),
        # the units: a change repacks (shards are packed on their own)
        "shard_mb": d.shard_mb if source.kind == "files" else None,
        "shard_examples": d.shard_examples if source.kind == "tfds" else None,
        "tokenizer": tokenizer.spec,
        "tokenizer_fingerprint": tokenizer.fingerprint,
        "vocab_size": tokenizer.vocab_size,
        "seq_len": config.seq_len,
    }


def cache_path(config, split: str, tokenizer: Tokenizer | None = None) -> tuple[Path, dict]:
    """(the cache entry's directory, its meta) for `split` of `data.source`: a local path, or an
    epath for a URL such as `gs://bucket/packed`. `tokenizer` (`checked_tokenizer(config)` when
    not given) is the one the entry is packed with."""
    source = sources.parse_source(config.data.source)
    meta = cache_meta(config, split, tokenizer or checked_tokenizer(config), source)
    key = hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()[:16]
    return _cache_root(config.data.cache_dir) / f"{source.slug}-{split}-L{config.seq_len}-{key}", meta


def _cache_root(cache_dir: str):
    return paths.workdir_path(cache_dir) if paths.is_remote(cache_dir) else Path(os.path.expanduser(cache_dir))


def prepare(config, split: str, tokenizer: Tokenizer | None = None, workers: int | None = None,
            beam_args: tuple[str, ...] | None = None) -> tuple[ShardedRows, dict]:
    """(the packed rows of `split` of `data.source`, its entry's meta.json), building the entry if
    missing with `workers` processes (default `data.workers`; 0: one per core), or as Apache Beam
    pipelines with `beam_args` (their options: the runner and its settings) when that is given.
    `tokenizer`: as `cache_path`'s.

    A local entry is written atomically (a temporary directory, then a rename) under a file lock,
    so concurrent processes build it once; a remote one is built locally and copied up, meta.json
    last. On a job of several processes only process 0 builds. meta.json carries the statistics
    `stats` prints and the shards' row counts.
    """
    tokenizer = tokenizer or checked_tokenizer(config)
    workers = config.data.workers if workers is None else workers
    runner = Runner(workers or os.cpu_count() or 1, beam_args)

    def build_once() -> Path:
        final, meta = cache_path(config, split, tokenizer)
        _build_once(final, meta, config.data, tokenizer, runner)
        return final

    final = _built_by_process_0(build_once) if processes.process_count() > 1 else build_once()
    return open_entry(final, split, tokenizer)


def _build_once(final: Path, meta: dict, data_cfg, tokenizer: Tokenizer, runner: Runner) -> None:
    if paths.is_remote(str(final)):
        # An object store has no rename and no lock: the entry is written in place, meta.json
        # last (its presence marks the entry complete); builders racing on it write the same bytes.
        if not (final / "meta.json").exists():
            _build(final, meta, data_cfg, tokenizer, runner)
        return
    if not (final / "meta.json").is_file():
        final.parent.mkdir(parents=True, exist_ok=True)
        with file_lock(final.parent / f".{final.name}.lock"):
            if not (final / "meta.json").is_file():  # not built while we waited
                # Building runs only under this lock: a temporary dir left is a dead run's.
                for stale in final.parent.glob(f".{final.name}.tmp-*"):
                    shutil.rmtree(stale, ignore_errors=True)
                _build(final, meta, data_cfg, tokenizer, runner)


def _scratch_name() -> str:
    """The scratch directory of one builder of a remote entry, inside it: `.scratch-HOST-PID-RANDOM`.
    Builders racing on an entry (two jobs preparing the same cache) write the same shards, but
    each its own passes' files, which it removes at its end without touching the other's."""
    return f".scratch-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"


def _scratch(path: str):
    """A path of the build's scratch directory: local, or on the remote entry's storage (where
    the workers of a distributed Beam runner can all reach it)."""
    return paths.workdir_path(path) if paths.is_remote(path) else Path(path)


def _save(path, array: np.ndarray) -> None:
    with path.open("wb") as f:
        np.save(f, array)


def _load(path) -> np.ndarray:
    with path.open("rb") as f:
        return np.load(f)


def open_entry(final: Path, split: str, tokenizer: Tokenizer) -> tuple[ShardedRows, dict]:
    """(the rows of a built entry's shards, its meta.json)."""
    info = json.loads((final / "meta.json").read_text())
    rows = ShardedRows([str(final / s["file"]) for s in info["shards"]], info["seq_len"],
                       info["token_dtype"], tokenizer.bos_id, tokenizer.pad_id)
    log.info("%s: %d packed rows of %d tokens in %d shards from %s", split, rows.num_rows,
             info["seq_len"], len(info["shards"]), final)
    return rows, info


def _built_by_process_0(build_it) -> Path:
    """A job of several processes prepares once: process 0 builds the entry (or finds it; only it
    reads the source), the others wait for it and read what it wrote. A failure of process 0's
    build stops every process (`processes.from_process_0`); one that cannot see the entry (a cache
    directory local to each host) is a DataError naming the path, on every process."""
    text = processes.from_process_0(lambda: str(build_it()).encode()).decode()
    entry = paths.workdir_path(text) if paths.is_remote(text) else Path(text)
    if blind := processes.blind((entry / "meta.json").exists()):
        raise DataError(f"data.cache_dir is not shared by the job's processes: process(es) "
                        f"{', '.join(map(str, blind))} cannot read {text}, which process 0 prepared; put "
                        "data.cache_dir on storage every host shares, or prepare it on each host first "
                        "(`python -m maxlm.data prepare`)")
    return entry


def _build(final: Path, meta: dict, data_cfg, tokenizer: Tokenizer, runner: Runner) -> None:
    start = time.perf_counter()
    source = sources.parse_source(data_cfg.source)
    split, seq_len = meta["split"], meta["seq_len"]
    units = sources.plan_units(source, data_cfg, split)
    runner = runner.at_most(len(units))
    partitions = runner.workers
    remote = paths.is_remote(str(final))
    if remote:  # shards straight into the entry, the passes' files in this builder's own scratch
        out, tmp = final, final / _scratch_name()
        tmp.mkdir(parents=True, exist_ok=True)
    else:  # everything in a temporary sibling, renamed into place at the end
        out = tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        job = {"source": source, "data_cfg": data_cfg, "split": split, "tmp": str(tmp),
               "progress": unit_progress.period()}
        if job["progress"]:
            unit_progress.directory(str(tmp)).mkdir(parents=True, exist_ok=True)
        kinds = [k for k in DEDUP_KINDS if data_cfg.filters[k]]
        passes = _Passes(f"prepare {source.slug}[{split}]", tmp, runner, ["keys", "repeats", "pack"] if kinds else ["pack"])
        if kinds:
            passes.run("keys", _key_unit, [{**job, "unit": u, "index": k} for k, u in enumerate(units)])
            passes.run("repeats", _find_repeats, [
                {"tmp": str(tmp), "progress": job["progress"], "units": len(units), "kinds": kinds, "partition": p,
                 "partitions": partitions} for p in range(partitions)], unit="partitions")
        name = "rows-{:05d}-of-{:05d}.array_record"
        results = passes.run("pack", _pack_unit, [
            {**job, "unit": u, "index": k, "out": str(out / name.format(k, len(units))),
             "tokenizer": tokenizer.spec, "tokenizer_options": tokenizer.options, "seq_len": seq_len,
             "dtype": token_dtype(tokenizer.vocab_size).name, "eos_id": tokenizer.eos_id, "kinds": kinds}
            for k, u in enumerate(units)])
        counts = sum((collections.Counter(r["counts"]) for r in results), collections.Counter())
        documents = sum(r["documents"] for r in results)
        sources.check_not_empty(source, data_cfg, split, counts)
        if not documents:
            raise DataError(f"data.source={data_cfg.source!r}: data.filters dropped all "
                            f"{counts['split_documents']} {split!r} documents ({dict(counts)})")
        tokens, rows = sum(r["tokens"] for r in results), sum(r["rows"] for r in results)
        stats = {
            "documents": documents,
            "tokens": tokens,
            "sequences": rows,
            "packing_efficiency": tokens / (rows * seq_len),
            "long_documents": sum(r["long_documents"] for r in results),
            "skipped": {k: v for k, v in sorted(counts.items())
                        if not k.startswith("filtered_") and k not in sources.TALLIES},
            "filtered": {k: counts.get(f"filtered_{k}", 0) for k in filters.FILTER_KEYS},
            **({"files": counts["files"]} if counts.get("files") else {}),
            "token_dtype": token_dtype(tokenizer.vocab_size).name,
            "shards": [{"file": name.format(k, len(units)), "rows": r["rows"]} for k, r in enumerate(results)],
            "read_sec": round(sum(r["read_sec"] for r in results), 3),
            "tokenize_sec": round(sum(r["tokenize_sec"] for r in results), 3),
        }
        for leftover in tmp.glob("*.npy"):  # the dedup passes' keys and drop lists
            leftover.unlink()
        unit_progress.remove(str(tmp))
        (out / "meta.json").write_text(json.dumps({**meta, **stats}, indent=2, sort_keys=True))
        if not remote:
            try:
                os.rename(out, final)
            except OSError:
                if not (final / "meta.json").is_file():  # not a lost race: a real failure
                    raise
    finally:
        if remote:
            try:
                tmp.rmtree(missing_ok=True)
            except OSError as e:  # not to hide the build's own error
                log.warning("could not remove the scratch directory %s: %s", tmp, e)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    log.info(
        "prepared %s[%s] with %s: %d units, %d docs%s, %d tokens in %d rows x %d (efficiency %.4f), "
        "total %.1fs -> %s",
        meta["source"], split, runner, len(units), stats["documents"], _nonzero_counts(stats), tokens, rows,
        seq_len, stats["packing_efficiency"], time.perf_counter() - start, final,
    )  # fmt: skip


def _nonzero_counts(stats: dict) -> str:
    """` (skipped {...}, filtered {...})` with only the counts that are not zero, and only the
    groups that have one: "" when nothing was skipped or filtered (the zeros are in meta.json)."""
    groups = [f"{name} {nonzero}" for name in ("skipped", "filtered")
              if (nonzero := {k: v for k, v in stats[name].items() if v})]
    return f" ({', '.join(groups)})" if groups else ""


@dataclasses.dataclass(frozen=True)
class _Passes:
    """A build's passes, each run by `runner` under a progress line (`unit_progress`): `what`,
    and with several passes the pass's name and number."""

    what: str
    scratch: Path
    runner: Runner
    names: list[str]

    def run(self, name: str, fn, jobs: list[dict], unit: str = "units") -> list:
        what = self.what if len(self.names) == 1 else f"{self.what} {name} (pass {self.names.index(name) + 1}/{len(self.names)})"
        with unit_progress.pass_progress(self.scratch, name, what, len(jobs), unit):
            return self.runner.map(fn, jobs)


@dataclasses.dataclass(frozen=True)
class Runner:
    """Where prepare's passes run: a local process pool of `workers`, or, with `beam_args` (the
    pipeline's options), Apache Beam: one pipeline per pass, each a map over the pass's jobs. The
    jobs talk through files in the entry's scratch directory, so both write the same shards."""

    workers: int
    beam_args: tuple[str, ...] | None = None

    def at_most(self, jobs: int) -> Runner:
        return dataclasses.replace(self, workers=max(1, min(self.workers, jobs)))

    def map(self, fn, jobs: list[dict]) -> list:
        """`[fn(job) for job in jobs]`, in parallel."""
        if self.beam_args is not None:
            return _beam_map(fn, jobs, self.beam_args)
        if self.workers <= 1 or len(jobs) <= 1:
            return [fn(job) for job in jobs]
        # spawned: the caller may have started JAX's threads, which a fork would copy broken
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(self.workers, mp_context=context) as pool:
            return list(pool.map(fn, jobs))

    def __str__(self) -> str:
        return f"beam {' '.join(self.beam_args)}".strip() if self.beam_args is not None else f"{self.workers} workers"


def _beam_map(fn, jobs: list[dict], beam_args) -> list:
    """`fn` over `jobs` as one Beam pipeline; each result comes back through a JSON file in the
    job's scratch directory (the pipeline's workers may be other machines sharing it)."""
    import apache_beam as beam
    from apache_beam.options.pipeline_options import PipelineOptions

    with beam.Pipeline(options=PipelineOptions(list(beam_args))) as pipeline:
        _ = (pipeline | beam.Create(list(enumerate(jobs))) | beam.Map(_run_and_record, fn))
    out = []
    for i, job in enumerate(jobs):
        path = _scratch(job["tmp"]) / f"result-{fn.__name__}-{i:05d}.json"
        out.append(json.loads(path.read_text()))
        path.unlink()
    return out


def _run_and_record(indexed_job, fn) -> None:
    i, job = indexed_job
    (_scratch(job["tmp"]) / f"result-{fn.__name__}-{i:05d}.json").write_text(json.dumps(fn(job)))


def _unit_texts(job: dict, counts: collections.Counter, report: unit_progress.UnitReport):
    """The unit's documents that pass the filters other than the dedups; `report` learns how much
    of the unit is read."""
    settings = {**filters.settings(job["data_cfg"]), "dedup": False, "near_dedup": False}
    return filters.iter_filtered(_unit_documents(job, counts, report), settings, counts)


def _unit_documents(job: dict, counts: collections.Counter, report: unit_progress.UnitReport):
    """The unit's documents in order, read piece by piece so that `report` learns how far it is."""
    for piece, read in unit_progress.pieces(job["source"], job["unit"]):
        yield from sources.iter_unit_documents(job["source"], job["data_cfg"], job["split"], piece, counts)
        report.reached(read)


DEDUP_KINDS = ("dedup", "near_dedup")


def _key_unit(job: dict) -> None:
    """Pass 1: per dedup kind, the unit's document keys and each key's document position, to
    KIND-keys-K.npy and KIND-where-K.npy."""
    settings = filters.settings(job["data_cfg"])
    keys = {kind: [] for kind in DEDUP_KINDS if settings[kind]}
    where = {kind: [] for kind in keys}
    report = unit_progress.UnitReport(job, "keys", job["index"])
    for i, text in enumerate(_unit_texts(job, collections.Counter(), report)):
        report.document()
        for kind, found in (("dedup", lambda: [filters.exact_key(text)]),
                            ("near_dedup", lambda: filters.near_keys(text, settings))):
            if kind in keys:
                new = found()
                keys[kind] += new
                where[kind] += [i] * len(new)
    for kind in keys:
        array = np.frombuffer(b"".join(keys[kind]), np.uint64).reshape(-1, 2)
        _save(_scratch(job["tmp"]) / f"{kind}-keys-{job['index']:05d}.npy", array)
        _save(_scratch(job["tmp"]) / f"{kind}-where-{job['index']:05d}.npy", np.asarray(where[kind], np.int64))
    report.finish(documents=report.documents or 0)


def _find_repeats(job: dict) -> None:
    """Pass 2, for one partition of the key values: the documents with a key an earlier document
    (in (unit, position) order) has, written to KIND-drops-P.npy as (unit, position) rows."""
    tmp, p, parts = _scratch(job["tmp"]), job["partition"], job["partitions"]
    for kind in job["kinds"]:
        keys, where = [], []
        for k in range(job["units"]):
            unit_keys = _load(tmp / f"{kind}-keys-{k:05d}.npy")
            mine = np.flatnonzero(unit_keys[:, 0] % parts == p)
            keys.append(np.asarray(unit_keys[mine]))
            positions = _load(tmp / f"{kind}-where-{k:05d}.npy")[mine]
            where.append(np.stack([np.full(len(mine), k, np.int64), positions], axis=1))
        keys, where = np.concatenate(keys), np.concatenate(where)
        order = np.lexsort((where[:, 1], where[:, 0], keys[:, 1], keys[:, 0]))  # by key, then unit, position
        keys, where = keys[order], where[order]
        repeat = np.zeros(len(keys), bool)
        repeat[1:] = (keys[1:] == keys[:-1]).all(axis=1)
        _save(tmp / f"{kind}-drops-{p:05d}.npy", np.unique(where[repeat], axis=0))
    unit_progress.UnitReport(job, "repeats", p).finish()


def _dropped_positions(tmp: Path, unit: int, kind: str) -> set[int]:
    drops = [_load(f) for f in sorted(tmp.glob(f"{kind}-drops-*.npy"))]
    return {int(i) for d in drops for i in d[d[:, 0] == unit, 1]}


def _pack_unit(job: dict) -> dict:
    """Pass 3: the unit's documents (minus dedup's drops) tokenized and packed into its shard."""
    counts = collections.Counter()
    drops = {kind: _dropped_positions(_scratch(job["tmp"]), job["index"], kind) for kind in job["kinds"]}
    drop = set().union(*drops.values())
    for position in drop:  # counted under the first dedup that drops it: exact, then near
        counts["filtered_dedup" if position in drops.get("dedup", ()) else "filtered_near_dedup"] += 1
    # array_record writes local files only: a remote shard is written here, then copied up
    local_dir = tempfile.mkdtemp(prefix="maxlm-shard-") if paths.is_remote(job["out"]) else None
    path = os.path.join(local_dir, "shard.array_record") if local_dir else job["out"]
    report = unit_progress.UnitReport(job, "pack", job["index"])
    try:
        result = _pack_texts(job, counts, drop, ShardWriter(path, job["seq_len"], job["dtype"], job["eos_id"]), report)
        if local_dir:
            with open(path, "rb") as src, _scratch(job["out"]).open("wb") as dst:
                shutil.copyfileobj(src, dst, 16 << 20)
    finally:
        if local_dir:
            shutil.rmtree(local_dir, ignore_errors=True)
    report.finish(result["documents"], result["tokens"])
    return result


def _pack_texts(job: dict, counts: collections.Counter, drop: set[int], writer: ShardWriter,
                report: unit_progress.UnitReport) -> dict:
    """The unit's documents but `drop` tokenized in chunks and packed by `writer`, counted to `report`."""
    tokenizer = load_tokenizer(job["tokenizer"], **job["tokenizer_options"])
    read_sec = tokenize_sec = 0.0
    long_docs = 0
    texts = (t for i, t in enumerate(_unit_texts(job, counts, report)) if i not in drop)
    chunk, chars = [], 0
    t0 = time.perf_counter()
    for text in _with_end(texts):
        if text is not None:
            chunk.append(text)
            chars += len(text)
            report.document()
        if chunk and (text is None or len(chunk) >= CHUNK_DOCUMENTS or chars >= CHUNK_CHARS):
            t1 = time.perf_counter()
            read_sec += t1 - t0
            ids = tokenizer.encode_batch(chunk, num_threads=1)  # a worker is one core: `workers` sets the cores
            long_docs += sum(len(x) + 1 > job["seq_len"] for x in ids)
            writer.add(ids)
            report.packed(writer.packer.tokens)
            chunk, chars = [], 0
            t0 = time.perf_counter()
            tokenize_sec += t0 - t1
    writer.close()
    packed = writer.packer
    return {"counts": dict(counts), "documents": packed.documents, "tokens": packed.tokens,
            "rows": packed.rows, "long_documents": long_docs, "read_sec": read_sec, "tokenize_sec": tokenize_sec}


def _with_end(texts):
    """`texts`, then None: the end, at which the last chunk is packed."""
    yield from texts
    yield None
