"""data.mixture: several sources drawn by weight, a pure function of (config, step)."""

import json
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from maxlm import config as config_lib
from maxlm.data import make_dataset
from maxlm.data.mixture import BLOCK, block_counts
from tests.helpers import ROOT, command_env
from tests.test_data_sources import make_config


def test_block_counts_are_the_weights_by_largest_remainder():
    assert block_counts([3, 1], 8).tolist() == [6, 2]
    assert block_counts([1, 1, 1], 10).tolist() == [4, 3, 3]  # the tie goes to the first
    counts = block_counts([0.5, 0.3, 0.2])
    assert counts.sum() == BLOCK and np.abs(counts / BLOCK - [0.5, 0.3, 0.2]).max() < 1 / BLOCK


def _sources(tmp_path):
    """Source `a` writes only 'a' words, `b` only 'b' words: a row's bytes say where it is from."""
    for name, docs in (("a", 40), ("b", 6)):
        (tmp_path / name).mkdir()
        for i in range(docs):
            (tmp_path / name / f"{i}.txt").write_text(" ".join(name * (1 + (i + j) % 5) for j in range(30)))
    return tmp_path / "a", tmp_path / "b"


def _mixture_config(tmp_path, a, b, **overrides):
    return make_config(a, tmp_path, **{"data.validation_percent": 0.0, "batch_size": 8,
                                       "data.mixture": (("web", str(a), 3.0), ("code", str(b), 1.0)),
                                       **overrides})


def _row_source(row_inputs) -> str:
    letters = {chr(t - 3) for t in row_inputs if t > 3 and chr(t - 3).isalpha()}  # byte ids are byte + 3
    assert len(letters) == 1, letters
    return letters.pop()


def test_rows_come_from_the_sources_by_weight_each_in_its_own_epochs(tmp_path):
    a, b = _sources(tmp_path)
    ds = make_dataset(_mixture_config(tmp_path, a, b), "train")
    steps = BLOCK // ds.batch_size  # one block: the weights exactly
    slots = np.arange(steps * ds.batch_size)
    source, sample = ds.slot_sources(slots)
    assert np.bincount(source).tolist() == [3 * BLOCK // 4, BLOCK // 4]
    for i in (0, 1):  # each source reads its own rows in order: 0, 1, 2, ... across its epochs
        assert sample[source == i].tolist() == list(range(int((source == i).sum())))
    for step in (0, 1, 7):
        batch = ds.batch(step)
        got = [_row_source(row) for row in batch["inputs"]]
        want = ["a" if s == 0 else "b" for s in source[step * 8:(step + 1) * 8]]
        assert got == want
    # each epoch of a source is a new permutation of its rows; the small source (`b`) starts its
    # second epoch while `a` is still in its first
    rows_a, rows_b = ds._rows[0].num_rows, ds._rows[1].num_rows
    epochs = [[ds.orders[1][k] for k in range(e * rows_b, (e + 1) * rows_b)] for e in (0, 1)]
    assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(rows_b)) and epochs[0] != epochs[1]
    b_second_epoch = np.flatnonzero((source == 1) & (sample == rows_b))[0]
    assert sample[:b_second_epoch][source[:b_second_epoch] == 0].max() < rows_a


def test_any_process_count_reads_the_same_global_batch(tmp_path):
    a, b = _sources(tmp_path)
    ds = make_dataset(_mixture_config(tmp_path, a, b), "train")
    for step in (0, 3, 700):
        whole = ds.batch(step)
        for count in (2, 4):
            parts = [ds.batch(step, p, count) for p in range(count)]
            for key in whole:
                np.testing.assert_array_equal(np.concatenate([part[key] for part in parts]), whole[key])
        np.testing.assert_array_equal(ds.batch(step, (1, 3), 4)["inputs"],
                                      whole["inputs"][np.r_[2:4, 6:8]])


@pytest.mark.parametrize("mixture, message", [
    ((("web", "x", 0.0),), "data.mixture entries are (name, source, weight > 0)"),
    ((("w eb", "x", 1.0),), "data.mixture entries are"),
    ((("web", "x", 1.0), ("web", "y", 1.0)), "data.mixture names must differ"),
])
def test_a_bad_mixture_is_a_config_error(mixture, message):
    cfg = config_lib.defaults()
    cfg.data.mixture = mixture
    with pytest.raises(config_lib.ConfigError, match=re.escape(message)):
        config_lib.resolve(cfg, 1)


@pytest.mark.ci
@pytest.mark.slow
def test_a_mixture_trains_and_resumes_through_the_cli(tmp_path, data_dirs):
    """As a user types it: the mixture as a --config flag, stats per source, a run that stops and
    resumes with the uninterrupted run's losses."""
    a, b = _sources(tmp_path)
    mixture = f"(('web','{a}',3.0),('code','{b}',1.0))"
    common = ["--config=configs/tiny.py", f"--config.data.mixture={mixture}",
              "--config.data.validation_percent=0", "--config.eval.every_steps=0",
              f"--config.data.cache_dir={tmp_path / 'cache'}", "--config.metrics.tensorboard=False",
              "--config.log_every_steps=1"]
    env = command_env(tmp_path, devices=None)
    stats = subprocess.run([sys.executable, "-m", "maxlm.data", "stats", *common], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=300)
    assert stats.returncode == 0, stats.stderr[-2000:]
    per_source = json.loads(stats.stdout)
    assert sorted(per_source) == ["code", "web"] and per_source["code"]["documents"] == 6
    peek = subprocess.run([sys.executable, "-m", "maxlm.data", "peek", "--step=3", "--rows=2", *common],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert peek.returncode == 0 and peek.stdout.startswith("# step 3 of train, rows ['"), peek.stderr[-2000:]

    def train(workdir, steps):
        result = subprocess.run([sys.executable, "-m", "maxlm.train", *common, f"--workdir={workdir}",
                                 f"--config.steps={steps}", "--config.checkpoint.every_steps=4"],
                                cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["loss"] for r in rows if "loss" in r}, result.stderr

    whole, _ = train(tmp_path / "whole", 8)
    # the same run stopped after its step-4 checkpoint: its later checkpoint and rows removed
    shutil.copytree(tmp_path / "whole", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "8")
    metrics = tmp_path / "resumed" / "metrics.jsonl"
    metrics.write_text("".join(line + "\n" for line in metrics.read_text().splitlines()
                               if json.loads(line).get("step", 0) <= 4))
    resumed, log = train(tmp_path / "resumed", 8)
    assert "at step 4" in log and resumed == whole and len(whole) == 8


def test_a_mixtures_pass_ends_before_any_source_repeats_a_row():
    """`steps_per_epoch` of a mixture (how far an eval may read): whole blocks before the source
    that runs out first comes round again."""
    from types import SimpleNamespace

    from maxlm.data.mixture import MixtureDataset

    parts = [("a", SimpleNamespace(num_rows=3 * BLOCK)), ("b", SimpleNamespace(num_rows=BLOCK // 2))]
    stats = {"a": {"tokens": 1, "sequences": 1}, "b": {"tokens": 1, "sequences": 1}}
    mixture = MixtureDataset(parts, [0.75, 0.25], tokenizer=None, batch_size=64, seq_len=8, seed=0,
                             split="validation", stats=stats)
    assert list(mixture.counts) == [3 * BLOCK // 4, BLOCK // 4]
    assert mixture.steps_per_epoch == 2 * BLOCK // 64  # b: BLOCK/2 rows, BLOCK/4 a block: 2 blocks
    slots = np.arange(mixture.steps_per_epoch * 64)
    source, sample = mixture.slot_sources(slots)
    for i, (_, rows) in enumerate(parts):
        assert sample[source == i].max() < rows.num_rows and len(np.unique(sample[source == i])) == (source == i).sum()
