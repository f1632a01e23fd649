"""Training and eval batches as a pure function of (config, step).

The corpus is tokenized and packed once into rows of `seq_len` (cached on disk as `.npy`).
A grain `MapDataset` of row ids then fixes which rows form each batch, by index alone, with no
iterator state: `batch(step)` is the same on every run, after any resume and for any number of
processes, and each process reads only its own rows. Nothing here imports TensorFlow.
"""

from __future__ import annotations

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

from maxlm.data import corpus
from maxlm.data.packing import KEYS, pack_documents, packing_efficiency
from maxlm.data.tokenizer import Tokenizer, load_tokenizer

log = logging.getLogger(__name__)

SOURCES = ("tfds:python_stdlib",)
SPLITS = corpus.SPLITS
# Bump when packing or the cache layout changes, so stale caches are not reused.
_PACKED_FORMAT = 1


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
        rows: dict[str, np.ndarray],
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
        self._rows = rows  # key -> [num_rows, seq_len] int32, usually memory-mapped
        self.num_rows, self.seq_len = rows["inputs"].shape
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
            self._efficiency = packing_efficiency(self._rows["segment_ids"])
        return self._efficiency

    def epoch_of(self, step: int) -> int:
        return step // self.steps_per_epoch

    def row_ids(self, step: int, process_index: int = 0, process_count: int = 1) -> np.ndarray:
        """Ids of the rows `batch(step, ...)` returns, in order."""
        step, process_index, process_count = int(step), int(process_index), int(process_count)
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if process_count < 1 or self.batch_size % process_count:
            raise ValueError(
                f"batch_size={self.batch_size} must be divisible by the process count "
                f"{process_count}"
            )
        if not 0 <= process_index < process_count:
            raise ValueError(f"process_index={process_index} not in [0, {process_count})")
        per_process = self.batch_size // process_count
        epoch, step_in_epoch = divmod(step, self.steps_per_epoch)
        first = epoch * self.num_rows + step_in_epoch * self.batch_size
        first += process_index * per_process
        return np.fromiter(
            (self.order[i] for i in range(first, first + per_process)), np.int64, per_process
        )

    def batch(
        self, step: int, process_index: int = 0, process_count: int = 1
    ) -> dict[str, np.ndarray]:
        """This process's contiguous slice of global batch `step`.

        Rows [p*B/P, (p+1)*B/P) of the global batch, as int32 arrays `[B/P, seq_len]` under
        `inputs, targets, segment_ids, positions`.
        """
        ids = self.row_ids(step, process_index, process_count)
        return {k: np.ascontiguousarray(self._rows[k][ids]) for k in KEYS}

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

    Reads `seed, batch_size, seq_len, model.vocab_size` and `data.{source, tfds_dir, cache_dir,
    tokenizer}`. Builds the corpus and the packed cache on first use.
    """
    source = config.data.source
    if source not in SOURCES:
        raise ValueError(f"unknown data.source {source!r}; available sources: {SOURCES}")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    tokenizer = load_tokenizer(config.data.tokenizer)
    if tokenizer.vocab_size > config.model.vocab_size:
        raise ValueError(
            f"tokenizer {tokenizer.spec!r} has vocab_size={tokenizer.vocab_size}, more than "
            f"model.vocab_size={config.model.vocab_size}; set model.vocab_size >= "
            f"{tokenizer.vocab_size}"
        )
    tfds_dir = os.path.expanduser(config.data.tfds_dir)
    corpus.ensure_corpus(tfds_dir)
    rows, info = _load_or_pack(
        source=source,
        split=split,
        tokenizer=tokenizer,
        seq_len=config.seq_len,
        tfds_dir=tfds_dir,
        cache_dir=os.path.expanduser(config.data.cache_dir),
    )
    return TokenDataset(
        rows,
        tokenizer=tokenizer,
        batch_size=config.batch_size,
        seed=config.seed if split == "train" else None,
        split=split,
        efficiency=info["packing_efficiency"],
    )


def _load_or_pack(*, source, split, tokenizer, seq_len, tfds_dir, cache_dir):
    """Returns (memory-mapped packed rows by key, the cache's meta.json)."""
    meta = {
        "format": _PACKED_FORMAT,
        "source": source,
        "split": split,
        "tokenizer": tokenizer.spec,
        "tokenizer_fingerprint": tokenizer.fingerprint,
        "vocab_size": tokenizer.vocab_size,
        "seq_len": seq_len,
        "corpus_fingerprint": corpus.corpus_metadata(tfds_dir)["fingerprint"],
    }
    key = hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()[:16]
    final = Path(cache_dir) / f"{corpus.NAME}-{split}-L{seq_len}-{key}"
    if not (final / "meta.json").is_file():
        final.parent.mkdir(parents=True, exist_ok=True)
        with corpus.file_lock(final.parent / f".{final.name}.lock"):
            if not (final / "meta.json").is_file():  # not built while we waited
                # Packing runs only under this lock: a temporary dir left is a dead run's.
                for stale in final.parent.glob(f".{final.name}.tmp-*"):
                    shutil.rmtree(stale, ignore_errors=True)
                _pack_into(final, meta, tfds_dir, tokenizer)
    rows = {k: np.load(final / f"{k}.npy", mmap_mode="r") for k in KEYS}
    info = json.loads((final / "meta.json").read_text())
    log.info("%s: %d packed rows of %d tokens from %s", split, info["num_rows"], seq_len, final)
    return rows, info


def _pack_into(final: Path, meta: dict, tfds_dir: str, tokenizer: Tokenizer) -> None:
    """Tokenizes and packs a split into `final`, atomically (temporary dir, then rename)."""
    start = time.perf_counter()
    docs = corpus.load_split(tfds_dir, meta["split"])
    texts = [docs[i]["text"].decode("utf-8") for i in range(len(docs))]
    ids = tokenizer.encode_batch(texts)
    tokenized = time.perf_counter()
    rows = pack_documents(
        ids, meta["seq_len"], tokenizer.bos_id, tokenizer.eos_id, pad_id=tokenizer.pad_id
    )
    stats = {
        "num_docs": len(texts),
        "num_rows": int(rows["inputs"].shape[0]),
        "num_tokens": int(np.count_nonzero(rows["segment_ids"])),
        "packing_efficiency": packing_efficiency(rows["segment_ids"]),
    }
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        for k in KEYS:
            np.save(tmp / f"{k}.npy", rows[k])
        (tmp / "meta.json").write_text(json.dumps({**meta, **stats}, indent=2, sort_keys=True))
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "meta.json").is_file():  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info(
        "tokenized %d %s docs in %.1fs and packed them into %d rows x %d (%d tokens, "
        "efficiency %.4f) in %.1fs -> %s",
        stats["num_docs"],
        meta["split"],
        tokenized - start,
        stats["num_rows"],
        meta["seq_len"],
        stats["num_tokens"],
        stats["packing_efficiency"],
        time.perf_counter() - tokenized,
        final,
    )
