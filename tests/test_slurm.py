"""launch/slurm.sbatch on a real SLURM cluster of two simulated nodes (tests/slurm_cluster.py),
with JAX's own SLURM detection (nothing mocked): a 2-node job preempted by SIGTERM, requeued and
resumed to the single-process losses, and a sweep with --launcher=slurm."""

import csv
import subprocess
import sys
import time

import pytest

from tests import slurm_cluster
from tests.helpers import ROOT, command_env, losses

# Both tests share one cluster in one xdist worker (--dist loadgroup, as the Makefile runs them);
# split over two (plain -n 2) each starts its own, which tests/slurm_cluster.py keeps apart.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("slurm")]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    reason = slurm_cluster.unavailable_reason()
    if reason:
        pytest.skip(reason)
    with slurm_cluster.local_slurm(tmp_path_factory.mktemp("slurm")) as env:
        yield env


def job_env(slurm, home, devices=4):
    """What a job inherits from sbatch (--export=ALL): CPU devices per task, the compile cache,
    and the platform the batch script asks every task to find (cpu here, gpu by default)."""
    return {**command_env(home, devices), "SLURM_CONF": slurm["SLURM_CONF"], "MAXLM_PLATFORM": "cpu"}


def train_flags(workdir, data_dirs, steps=16):
    return ["--config=configs/tiny.py", f"--workdir={workdir}", f"--config.steps={steps}",
            "--config.log_every_steps=1", "--config.checkpoint.every_steps=4",
            "--config.eval.every_steps=0", "--config.metrics.tensorboard=False",
            *(f"--config.{k}={v}" for k, v in data_dirs.items())]


@pytest.mark.ci
def test_a_2_node_job_preempted_requeues_and_resumes_to_the_single_process_losses(
        slurm, tmp_path, data_dirs):
    reference = tmp_path / "reference"
    done = subprocess.run([sys.executable, "-m", "maxlm.train", *train_flags(reference, data_dirs)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=command_env(tmp_path, devices=8))
    assert done.returncode == 0, done.stderr[-3000:]

    run, env = tmp_path / "run", job_env(slurm, tmp_path)
    submitted = subprocess.run(
        ["sbatch", "--parsable", "--nodes=2", "--gpus-per-node=0", "--cpus-per-task=2",
         f"--output={tmp_path}/job-%j.log", "launch/slurm.sbatch", *train_flags(run, data_dirs)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split(";")[0]
    log = tmp_path / f"job-{job}.log"
    # generous: the first start compiles on a machine the other tests keep busy
    deadline = time.monotonic() + 480
    while len(losses(run, partial=True)) < 6:  # under way, past its first checkpoint
        assert time.monotonic() < deadline, log.read_text()[-3000:] if log.exists() else "no log"
        time.sleep(0.2)
    subprocess.run(["scancel", "--signal=TERM", job], env=env, check=True, timeout=60)
    assert slurm_cluster.wait_for_job(env, job) == "COMPLETED", log.read_text()[-3000:]

    text = log.read_text()
    saved = int(text.split("checkpoint of step ")[1].split()[0])
    # requeued once, by the preemption: a start that failed (it is requeued too: srun's TERM to the
    # other task makes it exit 143) would be a second one
    assert text.count("requeueing job") == 1 and f"requeueing job {job} (1 of 20)" in text, text[-3000:]
    assert f"resumed from {run / 'checkpoints'} at step {saved}" in text
    assert "done at step 16" in text
    got, want = losses(run), losses(reference)
    assert sorted(got) == sorted(want) == list(range(1, 17))
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-4), step


@pytest.mark.ci
def test_a_sweep_runs_its_points_as_slurm_jobs(slurm, tmp_path, data_dirs):
    """Both points submitted at once (--no_wait; sbatch --wait polls SLURM every few tens of
    seconds), then gathered from their metrics.jsonl (--collect)."""
    sweep_file = tmp_path / "sweep.py"
    sweep_file.write_text(
        "def get_config():\n"
        f"    return {{'base': 'configs/tiny.py', 'devices': 4, 'steps': 2,\n"
        f"            'overrides': {{**{data_dirs!r}, 'optim.warmup_steps': 1}},\n"
        "            'grid': {'mesh': [(4, 1, 1), (2, 2, 1)], 'batch_size': [8]}}\n")
    sweep = [sys.executable, "launch/sweep.py", str(sweep_file), f"--workdir={tmp_path / 'out'}",
             "--launcher=slurm"]
    env = job_env(slurm, tmp_path)
    submitted = subprocess.run([*sweep, "--no_wait", "--", "--nodes=1", "--gpus-per-node=0",
                                "--cpus-per-task=2"],
                               cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert submitted.returncode == 0, submitted.stdout[-3000:] + submitted.stderr[-3000:]
    jobs = [line.split("submitted job ")[1].strip() for line in submitted.stdout.splitlines()
            if "submitted job " in line]
    assert len(jobs) == 2
    assert [slurm_cluster.wait_for_job(env, job) for job in jobs] == ["COMPLETED"] * 2
    collected = subprocess.run([*sweep, "--collect"], cwd=ROOT, env=env, capture_output=True,
                               text=True, timeout=120)
    assert collected.returncode == 0, collected.stdout[-3000:] + collected.stderr[-3000:]
    rows = list(csv.DictReader(open(tmp_path / "out" / "sweep.csv")))
    assert sorted(r["mesh"] for r in rows) == ["2x2x1", "4x1x1"]
    assert all(r["status"] == "ok" and float(r["tokens_per_sec"]) > 0 for r in rows), rows
