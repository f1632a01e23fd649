"""Runs that `python -m maxlm.train` refuses (exit 2, one line on stderr) leave nothing behind:
a workdir that cannot be one, a resume with another model function (issue 54, items 2, 6, 8) or
with data files changed since the checkpoint (item 3)."""

import json
import os
import subprocess
import sys

import jax
import pytest

from maxlm import config as config_lib
from maxlm.checkpoint import compatibility, store as checkpoint
from maxlm.data import source_fingerprints as data_source_fingerprints
from maxlm.resilience import data_position
from maxlm.train import loop
from tests.helpers import ROOT, command_env, load_config, with_overrides

pytestmark = pytest.mark.slow

BASE = {"steps": 2, "eval.every_steps": 0, "log_every_steps": 1, "metrics.tensorboard": False,
        "checkpoint.every_steps": 2, "optim.warmup_steps": 1}


def tiny(data_dirs, **overrides):
    return config_lib.resolve(with_overrides(load_config("tiny"), {**data_dirs, **BASE, **overrides}),
                              jax.device_count())


def train_command(workdir, data_dirs, home, **overrides) -> subprocess.CompletedProcess:
    """`python -m maxlm.train` on configs/tiny.py with BASE and `overrides`, as a user types it."""
    flags = {**data_dirs, **BASE, **overrides}
    return subprocess.run(
        [sys.executable, "-m", "maxlm.train", "--config=configs/tiny.py", f"--workdir={workdir}",
         *(f"--config.{k}={v}" for k, v in flags.items())],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=command_env(home, devices=None))


def refused_line(result) -> str:
    """The one `maxlm:` line of an exit-2 run, with no traceback."""
    assert result.returncode == 2, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("maxlm:")]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    return lines[0]


def snapshot(directory) -> dict[str, tuple[int, bytes]]:
    """Every file under `directory`: (its mtime, its bytes); directories by name alone."""
    out = {}
    for root, dirs, files in os.walk(directory):
        for name in dirs:
            out[os.path.relpath(os.path.join(root, name), directory)] = (0, b"")
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, directory)] = (os.stat(path).st_mtime_ns, f.read())
    return out


def test_a_workdir_that_is_a_file_or_cannot_be_made_exits_2_in_one_line(tmp_path, data_dirs):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("not a workdir\n")
    line = refused_line(train_command(a_file, data_dirs, tmp_path))
    assert "is not a directory" in line and str(a_file) in line
    assert a_file.read_text() == "not a workdir\n"
    line = refused_line(train_command("/proc/nope/run", data_dirs, tmp_path))
    assert "cannot use /proc/nope/run as the workdir" in line


def test_a_refused_new_workdir_leaves_no_directory_and_no_lock(tmp_path, data_dirs):
    workdir = tmp_path / "new" / "run"
    line = refused_line(train_command(workdir, data_dirs, tmp_path,
                                      **{"checkpoint.restore_from": str(tmp_path / "none")}))
    assert "holds no complete checkpoint" in line
    assert not (tmp_path / "new").exists()  # not the workdir, nor its parent made for it


@pytest.fixture(scope="module")
def trained(tmp_path_factory, data_dirs):
    """A workdir trained 2 steps (one checkpoint), in-process: no lock file of its own."""
    workdir = tmp_path_factory.mktemp("trained")
    loop.train_and_evaluate(tiny(data_dirs), str(workdir))
    return workdir


def test_a_resume_as_another_model_of_the_same_shapes_exits_2_and_writes_nothing(trained, data_dirs, tmp_path):
    (trained / ".maxlm-lock").write_text("host earlier, pid 1, started 2026-12-01T00:00:00+00:00\n")  # a dead run's
    before = snapshot(trained)
    line = refused_line(train_command(trained, data_dirs, tmp_path, steps=4, **{"model.mlp_activation": "geglu"}))
    assert "model.mlp_activation='geglu' (checkpoint: 'swiglu')" in line and "another function" in line
    assert snapshot(trained) == before  # config.json, metrics.jsonl, the checkpoint, the old lock's text and time


@pytest.mark.parametrize("key, value", [("model.norm_plus_one", True), ("model.scale_embeddings", True),
                                        ("model.qk_norm", "per_head"), ("model.norm_eps", 1e-6)])
def test_every_key_of_the_function_is_compared_on_resume(trained, data_dirs, key, value):
    with pytest.raises(config_lib.ConfigError, match=rf"{key}={value!r} \(checkpoint: "):
        loop.check_start(tiny(data_dirs, steps=4, **{key: value}), str(trained))


def test_the_encoding_changes_only_with_seq_len_and_the_free_keys_change_freely(trained, data_dirs):
    with pytest.raises(config_lib.ConfigError, match=r"model.rope_theta=500000.0 \(checkpoint: 10000.0\).*same seq_len"):
        loop.check_start(tiny(data_dirs, steps=4, **{"model.rope_theta": 500000.0}), str(trained))
    seq_len = tiny(data_dirs).seq_len
    loop.check_start(tiny(data_dirs, steps=4, seq_len=2 * seq_len, **{  # a context extension
        "model.rope_theta": 500000.0, "data.resume_position": "tokens"}), str(trained))
    loop.check_start(tiny(data_dirs, steps=4, **{"model.sliding_window": 16, "model.remat": "full",
                                                 "model.z_loss": 1e-4}), str(trained))


def test_every_model_key_is_in_exactly_one_class():
    classes = (compatibility.FUNCTION_KEYS, compatibility.ENCODING_KEYS, compatibility.FREE_KEYS)
    listed = [key for keys in classes for key in keys]
    assert sorted(listed) == sorted(config_lib.defaults().model.keys())  # none twice, none left out


def test_docs_list_the_keys_free_to_change_on_resume():
    text = (ROOT / "docs" / "checkpoints.md").read_text()
    section = text.split("## What may change on resume")[1].split("\n## ")[0]
    for key in compatibility.FREE_KEYS + compatibility.ENCODING_KEYS:
        assert f"`model.{key}`" in section, key


def write_documents(directory, name: str, count: int) -> None:
    """`count` text documents of a few hundred words each in `directory/name`, one per line of a .jsonl."""
    directory.mkdir(exist_ok=True)
    lines = [json.dumps({"text": " ".join(f"word{(i * 7 + j) % 97} line{i}" for j in range(300))})
             for i in range(count)]
    (directory / name).write_text("\n".join(lines) + "\n")


def test_files_added_to_the_data_since_the_checkpoint_follow_data_resume_position(tmp_path, data_dirs):
    source = tmp_path / "docs"
    write_documents(source, "a.jsonl", 40)
    workdir = tmp_path / "run"
    loop.train_and_evaluate(tiny(data_dirs, **{"data.source": str(source)}), str(workdir))
    write_documents(source, "b.jsonl", 40)  # more data in the same directory: the same data.source
    before, cache_before = snapshot(workdir), sorted(os.listdir(data_dirs["data.cache_dir"]))
    line = refused_line(train_command(workdir, data_dirs, tmp_path, steps=4, **{"data.source": str(source)}))
    assert f"the files of data source {str(source)!r}" in line and "data.resume_position=tokens" in line
    assert snapshot(workdir) == before
    assert sorted(os.listdir(data_dirs["data.cache_dir"])) == cache_before  # no cache of the new files built
    # data.resume_position=start: the new files from their first batch, and the step goes on
    loop.train_and_evaluate(tiny(data_dirs, steps=4, **{"data.source": str(source), "data.resume_position": "start"}),
                            str(workdir))
    meta = checkpoint.read_json(str(workdir / "checkpoints" / "4"), "meta")
    assert meta["data_position"] == 2  # steps 3 and 4 read batches 0 and 1 of the new stream
    assert meta["data"]["fingerprints"] == data_source_fingerprints(tiny(data_dirs, **{"data.source": str(source)}))
    # a checkpoint that recorded no fingerprint (before they were) resumes on its keys alone
    assert data_position.edited_since(str(workdir), {"keys": meta["data"]["keys"]}, tiny(data_dirs)) == []
