"""Progress lines for long work (maxlm/runtime/progress.py): the line's fields and ETA, the throttle, a
terminal's one rewritten line against a log's plain lines, the off switch; and the lines of a
2-worker prepare (summed across the workers' files, maxlm/data/prepare/unit_progress.py) and of tokenizer
training. Times are a fake clock's, or only bounded below, so a loaded machine changes nothing."""

from __future__ import annotations

import io
import json
import re
import threading
import types

import pytest

from maxlm.data.prepare import build
from maxlm.runtime import progress
from tests.test_data_prepare import _long_doc
from tests.test_data_sources import make_config


class Clock:
    """`time.monotonic` for maxlm.runtime.progress, moved by hand."""

    def __init__(self):
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(progress, "time", types.SimpleNamespace(monotonic=c.monotonic))
    return c


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_gets_a_plain_line_per_period_with_counts_rate_and_eta(clock):
    out = io.StringIO()
    p = progress.Progress("prepare web[train]", 40, every_s=10, stream=out)
    clock.now += 5
    p.update(4)
    assert out.getvalue() == ""  # not a period yet
    clock.now += 5
    p.update(10, documents=1234, tokens=5_600_000)
    clock.now += 3
    p.update(advance=2)  # 12 done; printed at the next period
    clock.now += 7
    p.update(documents=2000)
    clock.now += 10
    p.update(40, documents=4000, tokens=20_000_000)
    clock.now += 4
    p.close()
    assert out.getvalue().splitlines() == [
        "maxlm: prepare web[train]: 10/40 units (25%), 1,234 documents, 5.6M tokens, 560.0K tokens/s, elapsed 10s, ETA 30s",
        "maxlm: prepare web[train]: 12/40 units (30%), 2,000 documents, 5.6M tokens, 280.0K tokens/s, elapsed 20s, ETA 47s",
        "maxlm: prepare web[train]: 40/40 units (100%), 4,000 documents, 20.0M tokens, 666.7K tokens/s, elapsed 30s",
        "maxlm: prepare web[train]: 40/40 units (100%), 4,000 documents, 20.0M tokens, 588.2K tokens/s, elapsed 34s, done",
    ]


def test_a_terminal_gets_one_line_rewritten_in_place(clock):
    out = Terminal()
    with progress.Progress("tokenizer: read the train split", None, every_s=1, stream=out) as p:
        for documents in (100, 200, 300):
            clock.now += 1
            p.update(documents=documents)
        assert "\n" not in out.getvalue()
    text = out.getvalue()
    assert text.count("\r") == 4 and text.count("\x1b[K") == 4 and text.endswith("done\x1b[K\n")
    assert text.split("\r")[2] == "maxlm: tokenizer: read the train split: 200 documents, elapsed 2s\x1b[K"  # no total: no ETA


def test_quick_work_stays_quiet_and_a_failure_ends_stopped(clock):
    out = io.StringIO()
    with progress.Progress("quick", 3, every_s=10, stream=out) as p:
        clock.now += 9
        p.update(3)
    assert out.getvalue() == ""
    with pytest.raises(RuntimeError), progress.Progress("slow", 3, unit="files", every_s=10, stream=out) as p:
        clock.now += 12
        p.update(1)
        raise RuntimeError("bad data")
    assert out.getvalue().splitlines() == ["maxlm: slow: 1/3 files (33%), elapsed 12s, ETA 24s",
                                           "maxlm: slow: 1/3 files (33%), elapsed 12s, stopped"]


def test_the_period_comes_from_the_environment_and_0_is_off(monkeypatch, clock):
    monkeypatch.setenv(progress.ENV, "0.5")
    assert progress.period_seconds() == 0.5
    for off in ("0", "-1", "inf"):
        monkeypatch.setenv(progress.ENV, off)
        assert progress.period_seconds() == 0
    monkeypatch.setenv(progress.ENV, "ten")  # a typo must not stop the work: the default
    assert progress.period_seconds() == progress.DEFAULT_SECONDS
    monkeypatch.delenv(progress.ENV)
    assert progress.period_seconds() == progress.DEFAULT_SECONDS
    monkeypatch.setattr(progress.processes, "process_index", lambda: 1)  # one line per job
    assert progress.period_seconds() == 0
    out = io.StringIO()
    with progress.Progress("work", 2, stream=out) as p:
        clock.now += 100
        p.update(1)
    assert not p.enabled and out.getvalue() == ""


def test_durations_and_counts():
    assert [progress.format_duration(s) for s in (0, -3, 45, 125.4, 3720, 3600 * 30)] == [
        "0s", "0s", "45s", "2m05s", "1h02m", "30h00m"]
    assert [progress.format_count(n) for n in (950, 1234, 5.6e6, 3e9, 1.75e14)] == [
        "950", "1.2K", "5.6M", "3.0B", "175.0T"]


def test_polling_reads_counts_from_a_thread_and_closes_with_the_last_ones():
    out = io.StringIO()
    polled = threading.Event()
    counts = {"done": 1, "documents": 10}

    def poll():
        polled.set()
        return dict(counts)

    with progress.Progress("work", 2, every_s=1e-6, stream=out) as p, progress.polling(p, poll):
        assert polled.wait(30)  # the thread polled (and printed: every poll is past a period)
        counts.update(done=2, documents=25)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("maxlm: work: 1/2 units (50%), 10 documents, elapsed ")
    assert lines[-1].startswith("maxlm: work: 2/2 units (100%), 25 documents, elapsed ") and lines[-1].endswith(", done")


_LINE = re.compile(r"maxlm: prepare (\S+)\[train\]: (\d+)/(\d+) units \((\d+)%\)(?:, ([\d,]+) documents)?"
                   r"(?:, (\S+) tokens, \S+ tokens/s)?, elapsed \S+(, ETA \S+|, done)?")


def test_a_two_worker_prepare_prints_the_workers_counts_summed(tmp_path, monkeypatch, capsys):
    """A split of 11 units prepared by 2 worker processes: each unit's job writes its counts to a
    file, the builder prints their sum. Lines come at every poll (a period of 1 µs); the last
    one, `done`, has the entry's documents and tokens, and the entry holds no progress file."""
    src = tmp_path / "src"
    src.mkdir()
    for i in range(12):
        (src / f"f{i:02d}.jsonl").write_text("".join(json.dumps({"text": _long_doc(10 * i + j)}) + "\n" for j in range(3)))
    monkeypatch.setenv(progress.ENV, "1e-6")
    cfg = make_config(src, tmp_path, **{"data.shard_mb": 0.004, "data.validation_percent": 0.0})
    rows, info = build.prepare(cfg, "train", workers=2)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("maxlm: prepare")]
    parsed = [_LINE.fullmatch(line) for line in lines]
    assert len(lines) >= 2 and all(parsed), lines
    documents = [int(m[5].replace(",", "")) if m[5] else 0 for m in parsed]
    assert documents == sorted(documents)  # running totals
    last = parsed[-1]
    assert last.group(6, 7) == (progress.format_count(info["tokens"]), ", done")
    assert last[2] == last[3] == str(len(info["shards"]))  # every unit, counted once
    assert documents[-1] == info["documents"] == 36 and len(info["shards"]) >= 8
    entry = build.cache_path(cfg, "train")[0]
    assert sorted(p.name for p in entry.iterdir()) == sorted(["meta.json", *(s["file"] for s in info["shards"])])


def test_tokenizer_training_prints_the_documents_read_and_a_heartbeat(tmp_path, monkeypatch, capsys):
    from maxlm.data.__main__ import train_tokenizer

    src = tmp_path / "src"
    src.mkdir()
    for i in range(8):
        (src / f"d{i}.txt").write_text(_long_doc(i))
    monkeypatch.setenv(progress.ENV, "1e-6")
    cfg = make_config(src, tmp_path, **{"data.validation_percent": 0.0, "data.tokenizer_vocab_size": 300,
                                        "model.vocab_size": 512})
    train_tokenizer(cfg, str(tmp_path / "tok.json"))
    lines = [line for line in capsys.readouterr().err.splitlines() if line.endswith(", done")]
    assert len(lines) == 2, lines
    assert re.fullmatch(r"maxlm: tokenizer: read the train split: 8 documents, elapsed \S+, done", lines[0])
    assert re.fullmatch(r"maxlm: tokenizer: train a byte-level BPE: 8 documents, elapsed \S+, done", lines[1])
