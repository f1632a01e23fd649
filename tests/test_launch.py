"""launch/local.py: N processes on JAX's multi-controller runtime, same numbers, restarts."""

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.slow
LAUNCH = [sys.executable, str(ROOT / "launch" / "local.py")]


def train_args(workdir, data_dirs, *extra):
    return [
        "--config=configs/tiny.py", f"--workdir={workdir}", "--config.eval.every_steps=0",
        *(f"--config.{k}={v}" for k, v in data_dirs.items()), *extra,
    ]


def env(tmp_path, **extra):
    base = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "JAX_PLATFORMS": "cpu"}
    return {**base, **extra}


def losses(workdir):
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_two_processes_by_four_devices_equal_one_by_eight(tmp_path, data_dirs):
    multi, single = tmp_path / "2x4", tmp_path / "1x8"
    launched = subprocess.run(
        [*LAUNCH, "--processes=2", "--devices_per_process=4", "--",
         *train_args(multi, data_dirs, "--config.steps=10")],
        cwd=ROOT, env=env(tmp_path), capture_output=True, text=True, timeout=300,
    )
    assert launched.returncode == 0, launched.stdout[-3000:]
    assert "[1] " in launched.stdout and "[0] done at step 10" in launched.stdout
    alone = subprocess.run(
        [sys.executable, "-m", "maxlm.train", *train_args(single, data_dirs, "--config.steps=10")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env=env(tmp_path, XLA_FLAGS="--xla_force_host_platform_device_count=8"),
    )
    assert alone.returncode == 0, alone.stderr[-3000:]
    assert sorted(losses(multi)) == sorted(losses(single)) == [5, 10]
    for step, loss in losses(single).items():
        assert losses(multi)[step] == pytest.approx(loss, rel=1e-4)


def test_a_dead_process_restarts_the_job_which_resumes(tmp_path, data_dirs):
    workdir = tmp_path / "run"
    launcher = subprocess.Popen(
        [*LAUNCH, "--processes=2", "--devices_per_process=2", "--max_restarts=2", "--",
         *train_args(workdir, data_dirs, "--config.steps=20", "--config.checkpoint.every_steps=5")],
        cwd=ROOT, env=env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        deadline = time.monotonic() + 240
        while not (workdir / "checkpoints" / "10").is_dir():  # a committed checkpoint
            assert time.monotonic() < deadline and launcher.poll() is None
            time.sleep(0.2)
        victim = psutil.Process(launcher.pid).children()[1]  # process 1 of the job
        os.kill(victim.pid, signal.SIGKILL)
        out, _ = launcher.communicate(timeout=300)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, out[-3000:]
    assert "restarting the job (1 of 2)" in out
    assert "resumed from" in out
    assert max(losses(workdir)) == 20


def test_config_errors_are_not_retried(tmp_path, data_dirs):
    result = subprocess.run(
        [*LAUNCH, "--processes=2", "--", *train_args(tmp_path / "bad", data_dirs, "--config.batch_size=3")],
        cwd=ROOT, env=env(tmp_path), capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    assert "batch_size=3 must be divisible" in result.stdout
    assert "restarting" not in result.stdout
