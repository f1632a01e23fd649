"""launch/local.py: N processes on JAX's multi-controller runtime, same numbers, restarts."""

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers import ROOT, command_env, losses

pytestmark = pytest.mark.slow
LAUNCH = [sys.executable, str(ROOT / "launch" / "local.py")]


def train_args(workdir, data_dirs, *extra):
    return [
        "--config=configs/tiny.py", f"--workdir={workdir}", "--config.eval.every_steps=0",
        *(f"--config.{k}={v}" for k, v in data_dirs.items()), *extra,
    ]


def env(tmp_path, **extra):
    return command_env(tmp_path, devices=None, **extra)


@pytest.mark.ci
def test_2x4_hybrid_run_preempted_resumes_on_4x2_with_the_1x8_losses(tmp_path, data_dirs):
    """One job, three shapes, the single-process numbers throughout (1e-4 relative):
    2 processes x 4 devices on a hybrid mesh (data split across the processes: mesh.dcn_data=2),
    SIGTERM to the launcher (every process saves the same step, exit 143), then resumed on
    4 processes x 2 devices with fsdp split across them (mesh.dcn_fsdp=4: each process holds two
    separate parts of the batch), against an uninterrupted 1 x 8 run."""
    steps = ["--config.steps=12", "--config.log_every_steps=1", "--config.metrics.tensorboard=False"]
    alone = subprocess.run(
        [sys.executable, "-m", "maxlm.train", *train_args(tmp_path / "1x8", data_dirs, *steps)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env=env(tmp_path, XLA_FLAGS="--xla_force_host_platform_device_count=8"),
    )
    assert alone.returncode == 0, alone.stderr[-3000:]
    want = losses(tmp_path / "1x8")

    run = tmp_path / "run"
    mesh = ["--config.mesh.data=2", "--config.mesh.fsdp=4"]
    first = subprocess.Popen(
        [*LAUNCH, "--processes=2", "--devices_per_process=4", "--",
         *train_args(run, data_dirs, *steps, *mesh, "--config.mesh.dcn_data=2")],
        cwd=ROOT, env=env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        deadline = time.monotonic() + 240
        while len(losses(run, partial=True)) < 2:  # training is under way
            assert time.monotonic() < deadline and first.poll() is None
            time.sleep(0.05)
        first.send_signal(signal.SIGTERM)
        out, _ = first.communicate(timeout=180)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 143, out[-3000:]
    assert "[0] maxlm: preempted (SIGTERM): checkpoint of step" in out, out[-3000:]
    saved = int(out.split("checkpoint of step ")[1].split()[0])
    assert 2 <= saved < 12

    second = subprocess.run(
        [*LAUNCH, "--processes=4", "--devices_per_process=2", "--",
         *train_args(run, data_dirs, *steps, *mesh, "--config.mesh.dcn_fsdp=4")],
        cwd=ROOT, env=env(tmp_path), capture_output=True, text=True, timeout=300,
    )
    assert second.returncode == 0, second.stdout[-3000:]
    assert "[3] " in second.stdout and f"resumed from {run / 'checkpoints'} at step {saved}" in second.stdout
    got = losses(run)
    assert sorted(got) == sorted(want) == list(range(1, 13))
    for step, loss in want.items():
        assert got[step] == pytest.approx(loss, rel=1e-4), step


@pytest.mark.ci
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


def tpu_dry_run(*flags: str) -> list[str]:
    result = subprocess.run(
        [sys.executable, str(ROOT / "launch" / "tpu.py"), "--name=pod", "--zone=us-east5-a",
         "--accelerator=v5p-64", "--dry_run", *flags, "--",
         "--config=configs/llama_1b.py", "--workdir=gs://bucket/run", "--config.name=a b"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def remote_command(line: str) -> str:
    """The --command=... that a printed `gcloud ... ssh` line runs on the workers."""
    return next(w for w in shlex.split(line[len("[tpu] "):]) if w.startswith("--command="))[len("--command="):]


def test_tpu_dry_run_prints_every_command():
    lines = tpu_dry_run("--spot", "--queued", "--env=JAX_COMPILATION_CACHE_DIR=gs://b/c c")
    assert lines[0].startswith("[tpu] gcloud compute tpus queued-resources create pod --node-id=pod")
    assert "--accelerator-type=v5p-64" in lines[0] and "--spot" in lines[0]
    install = remote_command(next(line for line in lines if "uv venv" in line))
    # uv (from the image's pip); the Python by launch/find_python.sh's rule, which ends with uv's
    # own 3.12 (TPU images ship 3.10); the runtime lock and the pinned libtpu (gcsfs for gs:// is in
    # the runtime lock), no test packages
    assert "python3 -m pip install --user --quiet uv==" in install
    assert "python=$(PYTHON='' UV=~/.local/bin/uv launch/find_python.sh)" in install
    assert 'uv venv --python "$python" .venv' in install
    assert "-r requirements.lock -r locks/tpu.lock" in install and "requirements-test" not in install
    assert "gcsfs" not in install
    start = next(line for line in lines if "tpu_worker.sh start" in line)
    assert "--node=all --worker=all" in start
    remote = remote_command(start)
    # --env exported on every worker, quoted, before the worker script (which sources libtpu's
    # preset, whose `:-` keeps a set value); the training arguments quoted through ssh
    assert remote.startswith("cd maxlm && export 'JAX_COMPILATION_CACHE_DIR=gs://b/c c' && "
                             "launch/tpu_worker.sh start --config=configs/llama_1b.py")
    assert "'--config.name=a b'" in remote
    follow = lines[lines.index(start) + 1]  # then worker 0 is followed to the end
    assert "--node=0 --worker=0" in follow and remote_command(follow).endswith("tpu_worker.sh wait")
    assert lines[-2].startswith("[tpu] gcloud compute tpus queued-resources scp 'pod:~/maxlm-run/train.log' pod-train.log")
    assert lines[-1].startswith("[tpu] gcloud compute tpus queued-resources delete pod")


def test_tpu_dry_run_multislice_and_detach():
    """--num_slices: one queued resource of N nodes; each slice started with its MEGASCALE_*
    variables (coordinator: slice 0's worker 0, asked first). --detach: no follow, no delete."""
    lines = tpu_dry_run("--num_slices=2", "--detach")
    assert "--node-count=2 --node-prefix=pod" in lines[0] and "queued-resources create" in lines[0]
    address = next(i for i, line in enumerate(lines) if "hostname -I" in line)
    assert "--node=0 --worker=0" in lines[address]
    starts = [line for line in lines if "tpu_worker.sh start" in line]
    assert len(starts) == 2 and lines.index(starts[0]) > address
    for slice_id, line in enumerate(starts):
        assert f"--node={slice_id} --worker=all" in line
        assert (f"MEGASCALE_NUM_SLICES=2 && export MEGASCALE_SLICE_ID={slice_id}") in remote_command(line)
    assert not any("tpu_worker.sh wait" in line or " delete " in line for line in lines)
    assert "--attach" in lines[-1]


def fake_gcloud(tmp_path) -> tuple[dict, Path]:
    """The environment to run launch/tpu.py against tests/fake_gcloud.py (one worker, its home
    under the returned directory), training on the CPU in one process."""
    bin_dir, state = tmp_path / "bin", tmp_path / "gcloud"
    bin_dir.mkdir()
    state.mkdir()
    (bin_dir / "gcloud").write_text(
        f'#!/bin/bash\nexec {sys.executable} {ROOT / "tests" / "fake_gcloud.py"} "$@"\n')
    (bin_dir / "gcloud").chmod(0o755)
    return env(tmp_path, PATH=f"{bin_dir}:/usr/bin:/bin", FAKE_GCLOUD_DIR=str(state),
               PYTHON=sys.executable, MAXLM_PLATFORM="cpu", MAXLM_DISTRIBUTED="off"), state


@pytest.mark.ci
def test_tpu_launcher_detaches_attaches_and_restarts_a_preempted_slice(tmp_path, data_dirs):
    """Against a stand-in gcloud: the training starts detached (its own session; the launcher
    returns with --detach), --attach follows it, and a spot preemption (SIGTERM to the training,
    the slice gone) re-creates the slice, ships and starts again: the run resumes from its
    checkpoint and ends done; every worker's log lands in WORKDIR/logs."""
    launcher_env, state = fake_gcloud(tmp_path)
    workdir = tmp_path / "run"
    tpu = [sys.executable, str(ROOT / "launch" / "tpu.py"), "--name=pod", "--zone=z",
           "--accelerator=v5p-8", "--spot"]
    train = train_args(workdir, data_dirs, "--config.steps=200", "--config.log_every_steps=1",
                       "--config.metrics.tensorboard=False")
    started = subprocess.run([*tpu, "--detach", "--", *train], cwd=tmp_path, env=launcher_env,
                             capture_output=True, text=True, timeout=120)
    assert started.returncode == 0, started.stdout + started.stderr
    assert "tpus tpu-vm delete" not in started.stdout  # --detach keeps the slice
    pid = int((state / "pod.home" / "maxlm-run" / "train.pid").read_text())
    assert psutil.pid_exists(pid) and os.getsid(pid) == pid  # running on, in a session of its own

    attached = subprocess.Popen([*tpu, "--attach", "--", *train], cwd=tmp_path, env=launcher_env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 240
    while max(losses(workdir, partial=True), default=0) < 2:
        assert time.time() < deadline and attached.poll() is None
        time.sleep(0.5)
    (state / "pod.state").write_text("PREEMPTED")
    os.kill(pid, signal.SIGTERM)
    output, _ = attached.communicate(timeout=300)
    assert attached.returncode == 0, output
    assert "stopped with status 143, slice state PREEMPTED: restart 1 of 20" in output
    calls = [" ".join(json.loads(line)[2:4]) for line in (state / "calls.jsonl").read_text().splitlines()]
    after_preemption = calls[calls.index("tpu-vm describe"):]
    assert ["tpu-vm delete", "tpu-vm create", "tpu-vm scp", "tpu-vm ssh", "tpu-vm ssh"] == [
        c for c in after_preemption if c != "tpu-vm describe"][:5]  # re-create, ship, install, start
    assert calls[-1] == "tpu-vm delete"  # done: the slice is deleted
    assert sorted(losses(workdir)) == list(range(1, 201))
    log = (workdir / "logs" / f"{socket.gethostname()}.log").read_text()
    assert "resum" in log.lower() and "the training ended with status 0" in log
    assert (tmp_path / "pod-train.log").exists()  # worker 0's log, copied back


def fake_slurm(tmp_path, srun_body: str) -> dict:
    """Stand-ins for srun (running `srun_body`) and scontrol; the environment to run the sbatch
    script with them."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text("#!/bin/bash\n" + srun_body)
    (bin_dir / "scontrol").write_text('#!/bin/bash\necho "scontrol $*"\n')
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    return {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": "42", "SLURM_SUBMIT_DIR": str(ROOT),
            "PYTHON": sys.executable}


SBATCH = ["bash", str(ROOT / "launch" / "slurm.sbatch"), "--config=configs/llama_1b.py",
          "--workdir=/shared/run"]


@pytest.mark.parametrize("status, restarts, requeued", [(0, 0, False), (143, 0, True), (1, 0, False),
                                                        (143, 20, False)])
def test_slurm_script_runs_srun_and_requeues_on_preemption(tmp_path, status, restarts, requeued):
    """The sbatch script with stand-ins for srun and scontrol: 143 (saved after SIGTERM) requeues,
    at most MAXLM_MAX_REQUEUES (20) times."""
    env = fake_slurm(tmp_path, 'echo "srun $* MAXLM_DISTRIBUTED=$MAXLM_DISTRIBUTED XLA_FLAGS=$XLA_FLAGS"\n'
                               f"exit {status}\n")
    result = subprocess.run(SBATCH, env={**env, "SLURM_RESTART_COUNT": str(restarts)},
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == status
    assert (f"srun --kill-on-bad-exit=1 {sys.executable} -m maxlm.train --config=configs/llama_1b.py "
            "--workdir=/shared/run --config.platform=gpu") in result.stdout
    assert "MAXLM_DISTRIBUTED=auto" in result.stdout
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in result.stdout
    assert ("scontrol requeue 42" in result.stdout) == requeued
    if status == 143 and not requeued:
        assert "not requeued: 20 requeues done" in result.stdout


def test_slurm_script_forwards_sigterm_to_srun_and_waits_for_the_save(tmp_path):
    """SIGTERM to the batch shell (scancel, preemption, --signal=B:TERM at the time limit) reaches
    srun, and the shell waits for it to save and exit before requeueing."""
    env = fake_slurm(tmp_path, 'trap \'sleep 1; echo "srun: saved"; exit 143\' TERM\n'
                               'echo "srun: running"; while true; do sleep 0.1; done\n')
    script = subprocess.Popen(SBATCH, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert script.stdout.readline().strip() == "srun: running"
        script.send_signal(signal.SIGTERM)
        out, _ = script.communicate(timeout=30)
    finally:
        if script.poll() is None:
            script.kill()
    assert script.returncode == 143
    lines = out.splitlines()
    assert lines[:2] == ["maxlm: SIGTERM: asking every task to save and stop", "srun: saved"]
    assert "scontrol requeue 42" in out


def test_distributed_auto_lets_jax_detect_the_cluster(monkeypatch):
    from maxlm.runtime import distributed

    calls = []
    monkeypatch.setattr(distributed.jax.distributed, "initialize", lambda **kw: calls.append(kw))
    monkeypatch.delenv("JAX_COORDINATOR_ADDRESS", raising=False)
    monkeypatch.setenv("MAXLM_DISTRIBUTED", "auto")
    assert distributed.initialize() and calls == [{"local_device_ids": None}]
    monkeypatch.delenv("MAXLM_DISTRIBUTED")
    assert not distributed.initialize() and len(calls) == 1


@pytest.mark.parametrize("env, ids", [
    ({}, None),  # not SLURM: JAX decides
    ({"SLURM_TASKS_PER_NODE": "1(x4)"}, None),  # SLURM, no GPU known (CPU): JAX decides
    ({"SLURM_TASKS_PER_NODE": "1(x4)", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}, list(range(8))),
    ({"SLURM_TASKS_PER_NODE": "8(x2)", "SLURM_LOCALID": "3", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}, [3]),
    ({"SLURM_STEP_TASKS_PER_NODE": "2,8", "SLURM_NODEID": "0", "SLURM_LOCALID": "1",
      "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}, [4, 5, 6, 7]),
    ({"SLURM_TASKS_PER_NODE": "8", "SLURM_LOCALID": "5", "CUDA_VISIBLE_DEVICES": "5",
      "SLURM_GPUS_ON_NODE": "8"}, [0]),  # --gpus-per-task=1: SLURM bound its GPU to the task
], ids=["no-slurm", "cpu", "one-task-per-node", "one-task-per-gpu", "two-tasks", "bound"])
def test_every_gpu_of_every_node_under_slurm(env, ids):
    """JAX's SLURM detection alone would give each task [SLURM_LOCALID]: 1 GPU of 8 per node."""
    from maxlm.runtime import distributed

    if env:
        env = {"SLURM_JOB_ID": "42", "SLURM_LOCALID": "0", **env}
    assert distributed.slurm_local_device_ids(env, gpu_count=lambda: 0) == ids


def test_tasks_that_cannot_share_the_gpus_evenly_are_a_config_error():
    from maxlm import config as config_lib
    from maxlm.runtime import distributed

    env = {"SLURM_JOB_ID": "1", "SLURM_LOCALID": "0", "SLURM_TASKS_PER_NODE": "3",
           "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
    with pytest.raises(config_lib.ConfigError, match="3 SLURM tasks on this node cannot share its 8 GPUs"):
        distributed.slurm_local_device_ids(env)


def test_gpu_host_launcher_on_a_machine_without_gpus_is_exit_2_before_anything(tmp_path):
    """launch/gpu_host.sh with a GPU preset, as a user with a CPU-only jax would type it: one line
    naming the platform (its XLA flags accepted on the way), no workdir."""
    result = subprocess.run(
        ["bash", "launch/gpu_host.sh", "--config=configs/llama_1b_h100x8.py", f"--workdir={tmp_path / 'run'}"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env=command_env(tmp_path, devices=None, PYTHON=sys.executable))
    assert result.returncode == 2, result.stderr[-2000:]
    assert "platform='gpu' but JAX runs on 'cpu'" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()
