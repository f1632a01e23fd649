"""maxlm.data's prepare step: streamed in bounded chunks, bitwise the split packed in one go, with
memory bounded by the chunk rather than the corpus; units packed in parallel into the same shards
whatever the number of workers."""

from __future__ import annotations

import collections
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from maxlm.data import make_dataset, sources
from maxlm.data.packing import Packer, token_dtype
from maxlm.data.prepare import build, filters
from maxlm.data.tokenizers import checked_tokenizer
from tests.test_data_sources import REPO, SEQ_LEN, _doc, make_config

# ---------------------------------------------------------------------------------------------
# Streaming prepare: bounded memory, bitwise the in-memory result


def _mixed_folder(root: Path) -> Path:
    """txt (paragraphs), jsonl, parquet and array_record documents, with duplicates and junk."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from array_record.python.array_record_module import ArrayRecordWriter

    root.mkdir()
    for i in range(9):
        (root / f"t{i}.txt").write_text(f"{_doc(i)}\n\n{_doc(i, 3)}\n\n{_doc(i % 4, 80)}\n")
    lines = [json.dumps({"text": _doc(300 + i % 17, 5 + i % 60)}) for i in range(60)]
    (root / "r.jsonl").write_text("\n".join(lines) + "\n")
    pq.write_table(pa.table({"text": [_doc(400 + i, 1 + i) for i in range(40)] + [_doc(1)]}),
                   root / "p.parquet")  # fmt: skip
    w = ArrayRecordWriter(str(root / "a.array_record"), "group_size:1")
    for i in range(30):
        w.write(_doc(500 + i % 11, 7 * i % 90).encode())
    w.close()
    return root


@pytest.mark.parametrize("tokenizer", ["byte", "sp"])
def test_chunked_prepare_is_bitwise_the_in_memory_one(tmp_path, monkeypatch, tokenizer, request):
    src = _mixed_folder(tmp_path / "src")
    overrides = {"data.txt_documents": "paragraph", "data.filters.dedup": True,
                 "data.filters.min_words": 4, "data.validation_percent": 20.0}  # fmt: skip
    if tokenizer == "sp":
        overrides["data.tokenizer"] = str(request.getfixturevalue("sp_model"))
    runs = {"docs3": (3, 1 << 40), "chars200": (1 << 40, 200), "whole": (1 << 40, 1 << 40)}
    built = {}
    for name, (docs, chars) in runs.items():
        monkeypatch.setattr(build, "CHUNK_DOCUMENTS", docs)
        monkeypatch.setattr(build, "CHUNK_CHARS", chars)
        cfg = make_config(src, tmp_path / name, **overrides)
        built[name] = {s: (build.prepare(cfg, s), build.cache_path(cfg, s)[0]) for s in sources.SPLITS}
        built[name]["ds"] = make_dataset(cfg, "train")
    for split in sources.SPLITS:
        # The reference: the whole split in memory, packed in one go.
        cfg = make_config(src, tmp_path / "ref", **overrides)
        tok = checked_tokenizer(cfg)
        texts = filters.read_clean_documents(cfg.data, split, collections.Counter())
        packer = Packer(SEQ_LEN, token_dtype(tok.vocab_size), tok.eos_id)
        ref = packer.add(tok.encode_batch(texts)) + packer.finish()
        metas = []
        for name in runs:
            (rows, info), entry = built[name][split]
            assert entry.name == built["whole"][split][1].name
            # one unit (a small source): one shard, the records of the whole split as one stream
            assert sorted(p.name for p in entry.iterdir()) == ["meta.json", "rows-00000-of-00001.array_record"]
            assert [rows.source[i] for i in range(rows.num_rows)] == ref, (name, split)
            metas.append({k: v for k, v in json.loads((entry / "meta.json").read_text()).items()
                          if not k.endswith("_sec")})  # fmt: skip
            assert info["documents"] == len(texts) and info["tokens"] == packer.tokens
        assert metas[0] == metas[1] == metas[2]
    assert built["whole"]["train"][0][1]["filtered"]["dedup"] > 0
    for step in (0, 1, 5, 17):
        want = built["whole"]["ds"].batch(step)
        for name in ("docs3", "chars200"):
            got = built[name]["ds"].batch(step)
            for k in want:
                np.testing.assert_array_equal(got[k], want[k])


_RSS_SCRIPT = """
import json, resource, sys
from maxlm import config as config_lib
from maxlm.data.prepare import build
from maxlm.data.tokenizers import checked_tokenizer
c = config_lib.defaults()
c.seq_len, c.batch_size = 2048, 8
c.data.source, c.data.cache_dir = sys.argv[1], sys.argv[2]
c.data.tokenizer, c.data.validation_percent = "byte", 0.0
build.CHUNK_CHARS = int(sys.argv[3])
tok = checked_tokenizer(c)
build.cache_path(c, "train", tok)  # fingerprints the source
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
_, info = build.prepare(c, "train", tok, workers=1)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"growth_mb": (after - before) / 1024, "tokens": info["tokens"]}))
"""


def test_prepare_memory_is_bounded_by_the_chunk_not_the_corpus(tmp_path):
    """Packs ~200 MB of text (16 jsonl files) in 4 MB chunks; peak RSS grows far less than the
    corpus (the in-memory version held the text plus 4 bytes per token: > 1 GB here)."""
    src = tmp_path / "big"
    src.mkdir()
    line = json.dumps({"text": "the quick brown fox jumps over the lazy dog. " * 220}) + "\n"  # ~10 KB
    per_file = (200 << 20) // 16 // len(line)
    for i in range(16):
        (src / f"part{i:02d}.jsonl").write_text(line * per_file)
    corpus_mb = sum(f.stat().st_size for f in src.iterdir()) / 2**20
    out = subprocess.run(
        [sys.executable, "-c", _RSS_SCRIPT, str(src), str(tmp_path / "packed"), str(4 << 20)],
        cwd=REPO, capture_output=True, text=True, check=True, timeout=120,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert corpus_mb > 190 and result["tokens"] > 190 * 2**20
    assert result["growth_mb"] < 0.25 * corpus_mb, result


def _prepare_cli(cache: Path, src: Path, *flags: str) -> dict:
    result = subprocess.run(
        [sys.executable, "-m", "maxlm.data", "prepare", "--config=configs/tiny.py",
         f"--config.data.source={src}", f"--config.data.cache_dir={cache}", "--config.data.shard_mb=0.004",
         "--config.data.validation_percent=10", *flags],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def _long_doc(i: int, changed: int = -1) -> str:
    return " ".join("CHANGED" if j == changed else f"w{i}_{j}" for j in range(200))


@pytest.mark.ci
@pytest.mark.parametrize("kind", ["dedup", "near_dedup"])
def test_one_or_two_workers_write_the_same_shards_and_dedup_across_them(tmp_path, kind):
    """`prepare --workers=1` and `--workers=2` on a folder of 24 files in units of ~4 KB: the
    same shards bitwise, the same statistics, and duplicates dropped across units (the serial
    result: the first of each group kept) in a process pool. Files 12-23 repeat the documents of
    files 0-11: exactly (dedup), or with one word of 200 changed (near_dedup, MinHash-LSH)."""
    src = tmp_path / "src"
    src.mkdir()
    for i in range(24):
        docs = [_long_doc(100 * (i % 12) + j, changed=-1 if kind == "dedup" or i < 12 else j) for j in range(3)]
        (src / f"f{i:02d}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    flag = f"--config.data.filters.{kind}=True"
    one = _prepare_cli(tmp_path / "one", src, "--workers=1", flag)
    two = _prepare_cli(tmp_path / "two", src, "--workers=2", flag)
    assert one["train"]["shards"] == two["train"]["shards"] >= 8
    for split in ("train", "validation"):
        a, b = Path(one[split]["cache"]), Path(two[split]["cache"])
        assert a.name == b.name
        for shard in sorted(a.glob("*.array_record")):
            assert shard.read_bytes() == (b / shard.name).read_bytes(), shard.name
        meta_a, meta_b = (json.loads((d / "meta.json").read_text()) for d in (a, b))
        assert {k: v for k, v in meta_a.items() if not k.endswith("_sec")} == {
            k: v for k, v in meta_b.items() if not k.endswith("_sec")}
    cfg = make_config(src, tmp_path / "serial", **{f"data.filters.{kind}": True, "data.validation_percent": 10.0})
    serial_counts = collections.Counter()
    serial = filters.read_clean_documents(cfg.data, "train", serial_counts)
    meta = json.loads((Path(two["train"]["cache"]) / "meta.json").read_text())
    tok = checked_tokenizer(cfg)
    assert meta["documents"] == len(serial) and meta["filtered"][kind] == serial_counts[f"filtered_{kind}"] > 0
    assert meta["tokens"] == sum(len(ids) + 1 for ids in tok.encode_batch(serial))


def test_mulmod_is_python_integer_arithmetic():
    """`minhash.mulmod` against Python's exact integers, (a * b) % (2^61 - 1): every pair of edge
    operands (0, 1, around the prime, around the 2^31 and 2^30 splits it works in, up to 2^64 - 1,
    whose products overflow 64 bits unless reduced first) and random ones, below the prime (the
    MinHash keys' own: shingle hashes and coefficients) and over all of uint64."""
    from maxlm.data.prepare import minhash

    p = (1 << 61) - 1
    edges = sorted({0, 1, 2, 3, p - 2, p - 1, p, p + 1, 2 * p, 2 * p + 1, 1 << 61, (1 << 62) - 1, 1 << 62,
                    1 << 63, (1 << 64) - 2, (1 << 64) - 1, (1 << 30) - 1, 1 << 30, (1 << 31) - 1, 1 << 31,
                    (1 << 31) + 1, 1 << 32, (1 << 60) + 12345, p - (1 << 31), p - (1 << 30)})
    rng = np.random.default_rng(0)
    below_p = [int(x) for x in rng.integers(0, p, 2000, dtype=np.uint64)]
    anything = [int(x) for x in rng.integers(0, np.iinfo(np.uint64).max, 2000, dtype=np.uint64, endpoint=True)]
    pairs = [(a, b) for a in edges for b in edges] + list(zip(below_p, below_p[::-1])) \
        + list(zip(anything, anything[::-1])) + list(zip(below_p, anything))
    a, b = (np.array(column, np.uint64) for column in zip(*pairs))
    got = minhash.mulmod(a, b)
    assert got.dtype == np.uint64
    wrong = [(x, y, int(g)) for x, y, g in zip(a.tolist(), b.tolist(), got.tolist()) if g != x * y % p]
    assert wrong == [], wrong[:5]
    # broadcast, as band_keys calls it: shingles [n, 1] against coefficients [1, m]
    np.testing.assert_array_equal(minhash.mulmod(a[:7, None], b[None, :5]),
                                  [[x * y % p for y in b[:5].tolist()] for x in a[:7].tolist()])


def test_minhash_keys_find_near_duplicates_not_different_texts():
    from maxlm.data.prepare import minhash

    def shared(a, b):
        return len(set(minhash.band_keys(a, 5, 14, 8)) & set(minhash.band_keys(b, 5, 14, 8)))

    base = _long_doc(1)
    assert shared(base, _long_doc(1, changed=100)) > 0  # Jaccard of the 5-grams ~0.95
    assert shared(base, base.upper()) == 14  # case-insensitive: all bands
    assert shared(base, _long_doc(2)) == 0
    half = " ".join(base.split()[:100] + _long_doc(3).split()[100:])  # Jaccard ~0.32
    assert shared(base, half) == 0


@pytest.mark.slow
@pytest.mark.ci
def test_a_gs_cache_is_prepared_once_and_read_in_place(tmp_path, data_dirs):
    """data.cache_dir=gs://... against a Cloud Storage stand-in on 127.0.0.1: `prepare` (2
    workers) writes the entry in place, meta.json last, and Beam's DirectRunner (2 worker
    processes, its scratch files in the bucket too) writes the same shards; training then reads
    the shards in place through array_record's GCS reader, with the local cache's losses."""
    from etils import epath

    from tests.gcs import BUCKET, fake_gcs
    from tests.helpers import command_env

    with fake_gcs() as gcs_env:
        env = command_env(tmp_path, devices=None, **gcs_env)
        common = ["--config=configs/tiny.py", f"--config.data.tfds_dir={data_dirs['data.tfds_dir']}",
                  "--config.eval.every_steps=0", "--config.steps=6", "--config.log_every_steps=1",
                  "--config.metrics.tensorboard=False"]
        cache = f"gs://{BUCKET}/packed"
        prepared = subprocess.run([sys.executable, "-m", "maxlm.data", "prepare", *common,
                                   f"--config.data.cache_dir={cache}", "--workers=2"],
                                  cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert prepared.returncode == 0, prepared.stderr[-3000:]
        assert prepared.stdout.lstrip().startswith("{"), prepared.stdout[:500]
        entry = epath.Path(json.loads(prepared.stdout)["train"]["cache"])
        assert str(entry).startswith(cache) and (entry / "meta.json").exists()
        shards = {p.name: p.read_bytes() for p in entry.iterdir() if p.name.endswith(".array_record")}
        assert shards and not (entry / ".scratch").exists()
        beam = subprocess.run([sys.executable, "-m", "maxlm.data", "prepare", *common,
                               f"--config.data.cache_dir=gs://{BUCKET}/beam", "--runner=beam", "--",
                               "--direct_num_workers=2", "--direct_running_mode=multi_processing"],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert beam.returncode == 0, beam.stderr[-3000:]
        beam_entry = epath.Path(json.loads(beam.stdout)["train"]["cache"])
        assert {p.name: p.read_bytes() for p in beam_entry.iterdir() if p.name.endswith(".array_record")} == shards

        def train(workdir, cache_dir):
            result = subprocess.run([sys.executable, "-m", "maxlm.train", *common, f"--workdir={workdir}",
                                     f"--config.data.cache_dir={cache_dir}"],
                                    cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
            assert result.returncode == 0, result.stderr[-3000:]
            rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
            return result.stderr, [r["loss"] for r in rows if "loss" in r]

        log, remote = train(tmp_path / "remote", cache)
        assert "prepared " not in log and f"from {cache}" in log  # read in place, not built again
        _, local = train(tmp_path / "local", tmp_path / "local-cache")
        assert remote == local and len(remote) == 6


def test_two_builders_of_one_gs_entry_keep_to_their_own_scratch(tmp_path, monkeypatch):
    """Two jobs prepare the same gs:// entry at once (against the Cloud Storage stand-in): the
    second builds it whole while the first is between its dedup passes. Each keeps its passes'
    files in a scratch directory of its own (`.scratch-HOST-PID-RANDOM`) and removes it at its end
    without touching the other's: both finish, and the entry holds its shards and meta.json alone.
    (With one `ENTRY/.scratch` for all, the second removed the first's keys under it.)"""
    import dataclasses
    import os
    import socket

    from tests.gcs import BUCKET, fake_gcs

    src = tmp_path / "src"
    src.mkdir()
    for i in range(6):  # files 3-5 repeat files 0-2
        (src / f"f{i}.jsonl").write_text("".join(json.dumps({"text": _long_doc(10 * (i % 3) + j)}) + "\n"
                                                 for j in range(3)))
    cfg = make_config(src, tmp_path, **{"data.filters.dedup": True, "data.shard_mb": 0.004,
                                        "data.cache_dir": f"gs://{BUCKET}/packed"})
    scratches = []
    scratch_name = build._scratch_name
    monkeypatch.setattr(build, "_scratch_name", lambda: scratches.append(scratch_name()) or scratches[-1])

    @dataclasses.dataclass(frozen=True)
    class OvertakenRunner(build.Runner):
        """A local runner in this process, during whose dedup passes another job builds the entry."""

        def map(self, fn, jobs):
            if fn is build._find_repeats:
                build._build(entry, meta, cfg.data, tokenizer, build.Runner(1))
            return super().map(fn, jobs)

    with fake_gcs():
        tokenizer = checked_tokenizer(cfg)
        entry, meta = build.cache_path(cfg, "train", tokenizer)
        build._build(entry, meta, cfg.data, tokenizer, OvertakenRunner(1))
        info = json.loads((entry / "meta.json").read_text())
        assert info["filtered"]["dedup"] > 0 and len(info["shards"]) >= 3
        left = sorted(p.name for p in entry.iterdir())
        assert left == sorted(["meta.json", *(s["file"] for s in info["shards"])])  # no scratch
    assert len(set(scratches)) == 2
    assert all(name.startswith(f".scratch-{socket.gethostname()}-{os.getpid()}-") for name in scratches)


@pytest.mark.slow
@pytest.mark.ci
def test_the_beam_runner_writes_the_local_runners_shards(tmp_path):
    """`prepare --runner=beam` on Beam's DirectRunner in multi-processing mode (2 workers), exact
    and near dedup on: the same shards bitwise and the same statistics as `--runner=local`."""
    src = tmp_path / "src"
    src.mkdir()
    for i in range(24):
        docs = [_long_doc(100 * (i % 12) + j, changed=-1 if i < 12 or j else 7) for j in range(3)]
        (src / f"f{i:02d}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    flags = ["--config.data.filters.dedup=True", "--config.data.filters.near_dedup=True",
             "--config.eval.every_steps=0"]
    local = _prepare_cli(tmp_path / "local", src, "--workers=1", *flags)
    beam = _prepare_cli(tmp_path / "beam", src, "--runner=beam", *flags, "--",
                        "--direct_num_workers=2", "--direct_running_mode=multi_processing")
    assert beam["runner"] == "beam" and beam["train"]["shards"] == local["train"]["shards"] >= 8
    a, b = Path(local["train"]["cache"]), Path(beam["train"]["cache"])
    assert a.name == b.name and sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir())
    for shard in a.glob("*.array_record"):
        assert shard.read_bytes() == (b / shard.name).read_bytes(), shard.name
    meta_a, meta_b = (json.loads((d / "meta.json").read_text()) for d in (a, b))
    assert {k: v for k, v in meta_a.items() if not k.endswith("_sec")} == {
        k: v for k, v in meta_b.items() if not k.endswith("_sec")}
    assert meta_a["filtered"]["dedup"] > 0 and meta_a["filtered"]["near_dedup"] > 0
