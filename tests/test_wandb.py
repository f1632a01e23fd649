"""metrics.wandb=True (maxlm/observe/metrics.py WandbWriter), offline (WANDB_MODE=offline, no
network): the run's W&B history holds metrics.jsonl's values and its config the resolved config; a
resumed run continues the same W&B run; without wandb, the run exits 2 with the install line."""

import glob
import json
import struct
import subprocess
import sys
import zlib

import pytest
from wandb.proto import wandb_internal_pb2  # optional for a run, pinned for the tests (requirements-test.lock)

from maxlm import config as config_lib
from maxlm.observe import metrics
from tests.helpers import ROOT, command_env

BLOCK, HEADER = 32768, 7


def wandb_records(path):
    """The `Record`s (wandb's protobuf) of a run-*.wandb file: wandb-core's transaction log, in
    LevelDB's log format (32 KiB blocks of chunks, each with a 7-byte header: CRC-32 seeded with the
    chunk's type, length, type: full, or first/middle/last of a record) after a 7-byte file header.
    The installed wandb has no Python reader of it (wandb-core, in Go, writes and reads it)."""
    data = open(path, "rb").read()
    assert data[:HEADER] == b":W&B" + struct.pack("<HB", 0xBEE1, 0), data[:HEADER]
    pos, record = HEADER, b""
    while pos < len(data):
        if BLOCK - pos % BLOCK < HEADER:  # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        chunk = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind == 0:  # zeros: padding
            continue
        assert crc == zlib.crc32(chunk, zlib.crc32(bytes([kind]))), f"bad chunk CRC in {path} before {pos}"
        record += chunk
        if kind in (1, 4):  # full, last
            parsed = wandb_internal_pb2.Record()
            parsed.ParseFromString(record)
            yield parsed
            record = b""


def read_run(path):
    """(run id, {step: {key: value}}, {config key: value}) of one run-*.wandb file."""
    run_id, history, config = None, {}, {}
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id = record.run.run_id
            config.update((i.key, json.loads(i.value_json)) for i in record.run.config.update)
        elif kind == "config":
            config.update((i.key, json.loads(i.value_json)) for i in record.config.update)
        elif kind == "history":
            row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            history[row.pop("_step")] = row
    return run_id, history, config


def offline_runs(wandb_dir):
    """read_run of each offline run under `wandb_dir`, oldest first."""
    return [read_run(p) for p in sorted(glob.glob(f"{wandb_dir}/wandb/offline-run-*/run-*.wandb"))]


def train(tmp_path, workdir, steps, **extra):
    env = command_env(tmp_path, devices=None, **{"WANDB_MODE": "offline", **extra})
    return subprocess.run([sys.executable, "-m", "maxlm.train", "--config=configs/tiny.py", f"--workdir={workdir}",
                           f"--config.steps={steps}", "--config.log_every_steps=2", "--config.eval.every_steps=4",
                           "--config.checkpoint.every_steps=4", "--config.optim.warmup_steps=1",
                           "--config.metrics.tensorboard=False", "--config.metrics.wandb=True"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_the_wandb_run_holds_the_rows_and_the_config_and_a_resume_continues_it(tmp_path):
    workdir = tmp_path / "run"
    first = train(tmp_path, workdir, 4)
    assert first.returncode == 0, first.stderr[-3000:]
    (run_id, history, config), = offline_runs(workdir)  # WORKDIR/wandb/ (no WANDB_DIR set)
    assert run_id == (workdir / "wandb_run_id").read_text().strip()
    rows = metrics.read_metrics(workdir)
    assert {r["step"] for r in rows if "loss" in r} == {2, 4}
    for row in rows:  # every value, under its TensorBoard tag
        for name, value in row.items():
            if name != "step":
                assert history[row["step"]][metrics.tensorboard_tag(name)] == value, (row["step"], name)
    assert config["steps"] == 4 and config["optim.lr"] == 3e-3 and config["metrics.wandb"] is True

    second = train(tmp_path, workdir, 8)  # resumes the step-4 checkpoint
    assert second.returncode == 0, second.stderr[-3000:]
    runs = offline_runs(workdir)  # offline, each start is a directory; `wandb sync` joins them by id
    assert [r[0] for r in runs] == [run_id, run_id]
    _, resumed, config = runs[1]
    assert sorted(resumed) == [6, 8] and config["steps"] == 8
    for row in metrics.read_metrics(workdir):
        if row["step"] > 4 and "loss" in row:
            assert resumed[row["step"]]["train/loss"] == row["loss"]


@pytest.mark.slow
def test_a_run_id_override_and_wandb_dir_are_used(tmp_path):
    workdir = tmp_path / "run"
    done = train(tmp_path, workdir, 2, WANDB_DIR=str(tmp_path / "elsewhere"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert not (workdir / "wandb").exists()
    (run_id, _, _), = offline_runs(tmp_path / "elsewhere")
    assert run_id == (workdir / "wandb_run_id").read_text().strip()
    assert metrics.wandb_run_id(workdir) == run_id  # read back, not made again
    assert metrics.wandb_run_id(workdir, "chosen-id") == "chosen-id"


def test_steps_before_the_last_logged_are_left_out_with_one_warning(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("HOME", str(tmp_path))
    writer = metrics.WandbWriter("stepsorder", "maxlm", dir=str(tmp_path))
    writer.write(5, {"loss": 2.0})
    writer.write(3, {"loss": 9.0})  # a rollback's repeated step
    writer.write(4, {"loss": 9.0})
    writer.write(5, {"eval_loss": 2.5})  # the eval row of the same step joins its row
    writer.write(6, {"loss": 1.5})
    writer.close()
    assert capsys.readouterr().err.count("W&B takes steps in increasing order") == 1
    (_, history, _), = offline_runs(tmp_path)
    assert {step: {k: v for k, v in row.items() if not k.startswith("_")} for step, row in history.items()} == {
        5: {"train/loss": 2.0, "eval/loss": 2.5}, 6: {"train/loss": 1.5}}


@pytest.mark.slow
def test_without_wandb_the_run_exits_2_with_the_install_line_before_writing(tmp_path):
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text("import sys\nsys.modules['wandb'] = None  # `import wandb` fails\n")
    workdir = tmp_path / "run"
    done = train(tmp_path, workdir, 2, PYTHONPATH=str(shim))
    assert done.returncode == 2, done.stderr[-3000:]
    line, = done.stderr.strip().splitlines()
    assert line.startswith("maxlm: config error: metrics.wandb=True needs the wandb package (")
    assert line.endswith("make install-wandb, or pip install -e '.[wandb]'")
    assert not workdir.exists()


@pytest.mark.slow
def test_online_without_an_api_key_the_run_exits_2_before_writing(tmp_path):
    """wandb.init refused it only after the run had written its workdir (issue 54)."""
    workdir = tmp_path / "run"
    done = train(tmp_path, workdir, 2, WANDB_MODE="online")  # HOME is tmp_path: no ~/.netrc
    assert done.returncode == 2, done.stderr[-3000:]
    line, = done.stderr.strip().splitlines()
    assert line.startswith("maxlm: config error: metrics.wandb=True: no W&B API key for https://api.wandb.ai")
    assert "WANDB_MODE=offline" in line and not workdir.exists()


@pytest.mark.parametrize("key, value, message", [
    ("wandb_project", "team/project", "metrics.wandb_project='team/project' must be a W&B project name"),
    ("wandb_project", "", "metrics.wandb_project='' must be a W&B project name"),
    ("wandb_run_id", "a:b", "metrics.wandb_run_id='a:b' must be a W&B run id"),
    ("wandb_run_id", " ab", "metrics.wandb_run_id=' ab' must be a W&B run id"),
])
def test_wandb_names_are_validated(key, value, message):
    cfg = config_lib.defaults()
    cfg.metrics.wandb = True
    cfg.metrics[key] = value
    with pytest.raises(config_lib.ConfigError, match="^" + message.replace("?", "\\?")):
        config_lib.resolve(cfg, num_devices=1)
