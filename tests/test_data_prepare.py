"""maxlm.data's prepare step: streamed in bounded chunks, bitwise the in-memory packing, with
memory bounded by the chunk rather than the corpus."""

from __future__ import annotations

import collections
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from maxlm.data import PackedStream, make_dataset, pipeline, sources
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
        monkeypatch.setattr(pipeline, "CHUNK_DOCUMENTS", docs)
        monkeypatch.setattr(pipeline, "CHUNK_CHARS", chars)
        cfg = make_config(src, tmp_path / name, **overrides)
        built[name] = {s: (pipeline.prepare(cfg, s), pipeline.cache_path(cfg, s)[0]) for s in sources.SPLITS}
        built[name]["ds"] = make_dataset(cfg, "train")
    for split in sources.SPLITS:
        # The reference: the whole split in memory, as before streaming.
        cfg = make_config(src, tmp_path / "ref", **overrides)
        tok = pipeline.checked_tokenizer(cfg)
        texts = pipeline.read_clean_documents(cfg.data, split, collections.Counter())
        ref = PackedStream.from_documents(tok.encode_batch(texts), SEQ_LEN, tok.bos_id, tok.eos_id,
                                          tok.pad_id, dtype=pipeline.token_dtype(tok.vocab_size))  # fmt: skip
        ref_files = {}
        for fname, arr in (("targets.npy", ref.targets_T), ("doc_starts.npy", ref.doc_starts_D)):
            np.save(tmp_path / fname, arr)
            ref_files[fname] = (tmp_path / fname).read_bytes()
        metas = []
        for name in runs:
            (stream, info), entry = built[name][split]
            assert entry.name == built["whole"][split][1].name
            for fname, data in ref_files.items():
                assert (entry / fname).read_bytes() == data, (name, split, fname)
            assert sorted(p.name for p in entry.iterdir()) == ["doc_starts.npy", "meta.json", "targets.npy"]
            metas.append({k: v for k, v in json.loads((entry / "meta.json").read_text()).items()
                          if not k.endswith("_sec")})  # fmt: skip
            assert info["documents"] == len(texts) and info["tokens"] == ref.num_tokens
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
from maxlm.data import pipeline
c = config_lib.defaults()
c.seq_len, c.batch_size = 2048, 8
c.data.source, c.data.cache_dir = sys.argv[1], sys.argv[2]
c.data.tokenizer, c.data.validation_percent = "byte", 0.0
pipeline.CHUNK_CHARS = int(sys.argv[3])
tok = pipeline.checked_tokenizer(c)
pipeline.cache_path(c, "train", tok)  # fingerprints the source
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
_, info = pipeline.prepare(c, "train", tok)
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
