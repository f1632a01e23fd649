"""Data-pipeline throughput, for `python -m maxlm.bench data` (one process = one core).

(a) `packed_read`: `TokenDataset.batch(step)` on the prepared cache, random far-apart steps —
    what the training loop pays per step.
(b) `tokenize_pack`: sentencepiece encode (one thread) + pack into records + decode the rows
    (`packing.pack_documents`, prepare's and the reader's code) from raw text,
    against (c) `sp_encode`: the raw sentencepiece encode of the same texts in the same run.
    With `data.tokenizer=byte` a sentencepiece model is trained on the sample first, so (b)/(c)
    always measure sentencepiece; its vocabulary is model.vocab_size but at least
    `MIN_SAMPLE_VOCAB` (a byte-token config's 264 ids are fewer than BPE needs for the corpus's
    characters alone).
Each figure is the median of `repeats` timings; tokens/s/core = tokens / (seconds x threads used = 1).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import numpy as np

MIN_SAMPLE_VOCAB = 4096


def _median_rate(fn, tokens: int, repeats: int) -> tuple[float, list[float]]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return tokens / statistics.median(times), times


def measure(cfg, repeats: int = 5, read_batches: int = 20, sample_bytes: int = 4 << 20) -> dict:
    import collections

    import sentencepiece as spm

    from maxlm.data import make_dataset
    from maxlm.data.packing import pack_documents, token_dtype
    from maxlm.data.prepare import filters
    from maxlm.data.tokenizers import SentencePieceTokenizer, config_tokenizer

    # (a) packed reading
    ds = make_dataset(cfg, "train")
    rng = np.random.default_rng(0)
    steps = rng.integers(0, 10**9, size=read_batches)
    ds.batch(int(steps[0]))  # touch the memory map once
    read_tokens = read_batches * cfg.batch_size * cfg.seq_len
    read_rate, read_times = _median_rate(lambda: [ds.batch(int(s)) for s in steps], read_tokens, repeats)
    batch_ms = 1e3 * cfg.batch_size * cfg.seq_len / read_rate  # one global batch, one process
    # What the training loop waits for with `ds.prefetch()` while the device runs a step of
    # `hide_ms` (a sleep: the GIL is free, as while JAX computes): ~0 once reading hides.
    hide_ms = max(2 * batch_ms, 20.0)
    pf, waits = ds.prefetch(), []
    pf.batch(0)
    for s in range(1, 12):
        time.sleep(hide_ms / 1e3)
        start = time.perf_counter()
        pf.batch(s)
        waits.append(time.perf_counter() - start)
    pf.close()

    # (b), (c) from raw text: a fixed sample of train documents
    texts = filters.read_clean_documents(cfg.data, "train", collections.Counter())
    order = np.random.default_rng(cfg.seed).permutation(len(texts))
    sample, size = [], 0
    for i in order:
        if size >= sample_bytes:
            break
        sample.append(texts[i])
        size += len(texts[i].encode("utf-8"))
    with tempfile.TemporaryDirectory() as tmp:
        tok = config_tokenizer(cfg.data)
        trained = not isinstance(tok, SentencePieceTokenizer)
        if trained:
            path = os.path.join(tmp, "sample.txt")
            with open(path, "w", encoding="utf-8") as f:
                f.write("\n".join(sample[: max(1, len(sample) // 4)]))
            spm.SentencePieceTrainer.train(
                input=path, model_prefix=os.path.join(tmp, "tok"),
                vocab_size=max(cfg.model.vocab_size, MIN_SAMPLE_VOCAB),
                model_type="bpe", byte_fallback=True, pad_id=0, unk_id=1, bos_id=2, eos_id=3,
                normalization_rule_name="identity", remove_extra_whitespaces=False,
                hard_vocab_limit=False, max_sentence_length=1 << 16, num_threads=1, minloglevel=2,
            )  # fmt: skip
            tok = SentencePieceTokenizer(os.path.join(tmp, "tok.model"))
        sp = tok._sp
        num_tokens = sum(len(x) for x in tok.encode_batch(sample, num_threads=1))

        def raw_encode():
            sp.encode(sample, out_type=int, num_threads=1)

        def tokenize_pack():
            ids = tok.encode_batch(sample, num_threads=1)
            pack_documents(ids, cfg.seq_len, tok.bos_id, tok.eos_id, tok.pad_id, token_dtype(tok.vocab_size))

        raw_rate, raw_times = _median_rate(raw_encode, num_tokens, repeats)
        tp_rate, tp_times = _median_rate(tokenize_pack, num_tokens, repeats)
    return {
        "benchmark": "data",
        "config": cfg.name,
        "source": cfg.data.source,
        "seq_len": cfg.seq_len,
        "batch_size": cfg.batch_size,
        "repeats": repeats,
        "cpu_count": os.cpu_count(),
        "threads_per_measurement": 1,
        "packed_read_tokens_per_sec_per_core": read_rate,
        "packed_read_batches_per_repeat": read_batches,
        # One `batch(step)` of batch_size x seq_len on one host, against the step it must hide
        # under: > 5% of a step is why train.py reads through `prefetch()`.
        "batch_read_ms": batch_ms,
        "batch_read_share_of_1s_step": batch_ms / 1e3,
        "prefetch_wait_ms_median": 1e3 * statistics.median(waits),
        "prefetch_simulated_step_ms": hide_ms,
        "packed_read_cache_dtype": str(ds._rows.decoder.dtype),
        "packed_read_tokenizer": cfg.data.tokenizer,
        "tokenize_pack_tokens_per_sec_per_core": tp_rate,
        "sp_encode_tokens_per_sec_per_core": raw_rate,
        "tokenize_pack_over_sp_encode": tp_rate / raw_rate,
        "sp_model": "trained on the sample for this run" if trained else cfg.data.tokenizer,
        "sp_vocab_size": tok.vocab_size,
        "raw_text_sample_bytes": size,
        "raw_text_sample_docs": len(sample),
        "raw_text_sample_tokens": num_tokens,
        "times_sec": {"packed_read": read_times, "sp_encode": raw_times, "tokenize_pack": tp_times},
        "targets": {"packed_read_tokens_per_sec_per_core": 5e6, "tokenize_pack_over_sp_encode": 0.5},
    }


# ------------------------------------------------------------------------- prepare at scale

_READER_RSS = """
import json, resource, sys
import numpy as np
from maxlm.data.shards import ShardedRows
info = json.load(open(sys.argv[1] + "/meta.json"))
rows = ShardedRows([sys.argv[1] + "/" + s["file"] for s in info["shards"]], info["seq_len"],
                   info["token_dtype"], 2, 0)
ids = np.random.default_rng(0).integers(0, rows.num_rows, (50, int(sys.argv[2])))
for batch in ids:
    rows.rows(batch)
print(json.dumps({"rows": rows.num_rows, "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def write_corpus(out: str, corpus_mb: float, files: int) -> dict:
    """A generated corpus of `files` .jsonl files holding `corpus_mb` MB in all: the standard
    library's source files as documents, each copy made unique by its first line."""
    import json

    from maxlm.data import corpus

    docs, _ = corpus.scan_source(corpus.default_source_root())
    os.makedirs(out, exist_ok=True)
    per_file, written, copy = corpus_mb * 2**20 / files, 0, 0
    for k in range(files):
        size = 0
        with open(os.path.join(out, f"part-{k:05d}.jsonl"), "w", encoding="utf-8") as f:
            while size < per_file:
                path, text = docs[copy % len(docs)]
                line = json.dumps({"text": f"# copy {copy} of {path}\n{text}"}) + "\n"
                f.write(line)
                size += len(line)
                copy += 1
        written += size
    return {"corpus_bytes": written, "files": files, "documents": copy}


def measure_prepare(cfg, corpus_mb: float, files: int, workers: list[int]) -> dict:
    """`prepare` of a generated corpus with each number of `workers` (fresh caches), the shards
    compared bitwise, then the shards read back: rows/s and tokens/s, and a reader's peak memory
    on this corpus and on one a tenth of its size (flat: it does not grow with the corpus)."""
    import hashlib
    import json
    import subprocess
    import sys

    from maxlm.data.prepare import build
    from maxlm.data.tokenizers import checked_tokenizer

    with tempfile.TemporaryDirectory(dir=os.path.expanduser("~")) as tmp:
        corpus_info = write_corpus(os.path.join(tmp, "corpus"), corpus_mb, files)
        cfg.data.source, cfg.data.validation_percent = os.path.join(tmp, "corpus"), 0.0
        runs = []
        for n in workers:
            cfg.data.cache_dir = os.path.join(tmp, f"cache-{n}")
            start = time.perf_counter()
            rows, info = build.prepare(cfg, "train", workers=n)
            seconds = time.perf_counter() - start
            entry = build.cache_path(cfg, "train")[0]
            digest = hashlib.sha256(b"".join((entry / s["file"]).read_bytes() for s in info["shards"])).hexdigest()
            runs.append({"workers": n, "seconds": seconds, "tokens_per_sec": info["tokens"] / seconds,
                         "tokens_per_sec_per_worker": info["tokens"] / seconds / n, "shards_sha256": digest[:16]})
        ids = np.random.default_rng(0).integers(0, rows.num_rows, (20, cfg.batch_size))
        start = time.perf_counter()
        for batch in ids:
            rows.rows(batch)
        read_sec = time.perf_counter() - start
        # the tokenizer alone on one core, on the first 32 MB of the corpus: what a worker is up against
        sample = []
        with open(os.path.join(tmp, "corpus", "part-00000.jsonl"), encoding="utf-8") as f:
            for line in f:
                sample.append(json.loads(line)["text"])
                if sum(map(len, sample)) > 32 << 20:
                    break
        tokenizer = checked_tokenizer(cfg)
        start = time.perf_counter()
        encoded = tokenizer.encode_batch(sample, num_threads=1)
        encode_rate = sum(map(len, encoded)) / (time.perf_counter() - start)
        # the same prepared a tenth the size, for the reader's memory at 1x and 10x
        small = write_corpus(os.path.join(tmp, "small"), corpus_mb / 10, files)
        cfg.data.source, cfg.data.cache_dir = os.path.join(tmp, "small"), os.path.join(tmp, "cache-small")
        build.prepare(cfg, "train", workers=max(workers))
        readers = {}
        for name, where in (("1x", build.cache_path(cfg, "train")[0]), ("10x", entry)):
            out = subprocess.run([sys.executable, "-c", _READER_RSS, str(where), str(cfg.batch_size)],
                                 capture_output=True, text=True, check=True)
            readers[name] = json.loads(out.stdout.strip().splitlines()[-1])
        readers["1x"]["corpus_bytes"], readers["10x"]["corpus_bytes"] = small["corpus_bytes"], corpus_info["corpus_bytes"]
        result = {
            "benchmark": "prepare",
            "config": cfg.name,
            "tokenizer": cfg.data.tokenizer,
            "seq_len": cfg.seq_len,
            "cpu_count": os.cpu_count(),
            **corpus_info,
            "tokens": info["tokens"],
            "shards": len(info["shards"]),
            "shard_mb": cfg.data.shard_mb,
            "runs": runs,
            "tokenizer_alone_tokens_per_sec_per_core": encode_rate,
            "prepare_over_tokenizer_alone": runs[0]["tokens_per_sec_per_worker"] / encode_rate,
            "same_shards": len({r["shards_sha256"] for r in runs}) == 1,
            "read_rows_per_sec": ids.size / read_sec,
            "read_tokens_per_sec": ids.size * cfg.seq_len / read_sec,
            "reader_peak_rss": readers,
        }
    if len(runs) > 1:
        result["speedup"] = runs[0]["seconds"] / runs[-1]["seconds"]
    return result
