"""launch/sweep.py: grid expansion, validator skips, one process per point, sweep.csv."""

import csv
import json
import os
import subprocess
import sys

import pytest
from xla_flags import without_test_flags

from tests.helpers import ROOT

sys.path.insert(0, str(ROOT / "launch"))
import sweep  # noqa: E402


def test_expand_splits_mesh_and_crosses_every_key():
    points = sweep.expand({"mesh": [(8, 1, 1), (2, 2, 2)], "batch_size": [8, 16]})
    assert len(points) == 4
    assert points[1] == {"mesh.data": 8, "mesh.fsdp": 1, "mesh.tensor": 1, "batch_size": 16}
    five, six = sweep.expand({"mesh": [(2, 1, 2, 2, 1), (1, 1, 2, 4, 1, 1)]})
    assert five == {"mesh.stage": 2, "mesh.data": 1, "mesh.fsdp": 2, "mesh.sequence": 2, "mesh.tensor": 1}
    assert six == {"mesh.stage": 1, "mesh.data": 1, "mesh.fsdp": 2, "mesh.expert": 4, "mesh.sequence": 1,
                   "mesh.tensor": 1}


def test_validate_gives_the_config_errors_reason():
    reason = sweep.validate("configs/tiny.py", {"mesh.data": 1, "mesh.fsdp": 1, "mesh.tensor": 8}, 8)
    assert "must be divisible by mesh.tensor=8" in reason
    assert sweep.validate("configs/tiny.py", {"mesh.data": 2, "mesh.fsdp": 4, "mesh.tensor": 1}, 8) is None


@pytest.mark.ci
@pytest.mark.slow
def test_a_short_sweep_writes_a_sorted_csv(tmp_path):
    sweep_file = tmp_path / "short.py"
    sweep_file.write_text(
        "def get_config():\n"
        "    return {'base': 'configs/tiny.py', 'devices': 8, 'fake_cpu_devices': True, 'steps': 2,\n"
        "            'overrides': {},\n"
        "            'grid': {'mesh': [(8, 1, 1), (2, 2, 2), (1, 1, 8)], 'batch_size': [8]}}\n"
    )
    result = subprocess.run(
        [sys.executable, str(ROOT / "launch" / "sweep.py"), str(sweep_file), f"--workdir={tmp_path / 'out'}"],
        cwd=ROOT, capture_output=True, text=True, timeout=400,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    rows = list(csv.DictReader(open(tmp_path / "out" / "sweep.csv")))
    assert [r["mesh"] for r in rows if r["status"] == "ok"] != []
    assert {r["mesh"]: r["status"] for r in rows} == {"8x1x1": "ok", "2x2x2": "ok", "1x1x8": "skipped"}
    speeds = [float(r["tokens_per_sec"]) for r in rows if r["status"] == "ok"]
    assert speeds == sorted(speeds, reverse=True) and all(s > 0 for s in speeds)
    assert "num_heads=4 must be divisible by mesh.tensor=8" in result.stdout
    assert (tmp_path / "out" / "000" / "bench.json").is_file()
    assert all(float(r["memory_per_device_mib"]) > 0 for r in rows if r["status"] == "ok")
    planned = subprocess.run(
        [sys.executable, str(ROOT / "launch" / "sweep.py"), str(sweep_file), "--plan",
         f"--workdir={tmp_path / 'plan'}"], cwd=ROOT, capture_output=True, text=True, timeout=400,
    )
    assert planned.returncode == 0, planned.stdout[-2000:] + planned.stderr[-2000:]
    plan_rows = list(csv.DictReader(open(tmp_path / "plan" / "sweep.csv")))
    assert all(r["tokens_per_sec"] == "" for r in plan_rows)  # compiled, never run
    assert sorted(float(r["memory_per_device_mib"]) for r in plan_rows if r["status"] == "ok") == [
        float(r["memory_per_device_mib"]) for r in plan_rows if r["status"] == "ok"]


@pytest.mark.parametrize("name", ["cpu8", "v5p_64", "gpu8"])
def test_shipped_sweep_files_expand_to_valid_points(name):
    spec = sweep.load_sweep(str(ROOT / "configs" / "sweeps" / f"{name}.py"))
    points = sweep.expand(spec["grid"])
    reasons = [sweep.validate(spec["base"], {**spec["overrides"], **p}, spec["devices"]) for p in points]
    assert sum(r is None for r in reasons) >= len(points) // 2, reasons


# ----------------------------------------------------------------------------- tpu and slurm

SHORT = ("def get_config():\n"
         "    return {'base': 'configs/tiny.py', 'devices': 8, 'steps': 3, 'overrides': {'seq_len': 32},\n"
         "            'grid': {'mesh': [(8, 1, 1), (1, 1, 8), (2, 2, 2), (1, 8, 1)], 'batch_size': [8]}}\n")


def run_sweep(tmp_path, *args):
    sweep_file = tmp_path / "short.py"
    sweep_file.write_text(SHORT)
    return subprocess.run([sys.executable, str(ROOT / "launch" / "sweep.py"), str(sweep_file), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def commands(stdout, marker):
    return [line for line in stdout.splitlines() if marker in line]


def test_tpu_dry_run_runs_each_point_through_tpu_py_on_one_reused_tpu(tmp_path):
    result = run_sweep(tmp_path, "--workdir=gs://bucket/sweep", "--launcher=tpu", "--dry_run", "--",
                       "--name=pod", "--zone=us-east5-a", "--accelerator=v5p-64", "--project=p")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "001 1x1x8 skipped: model.num_heads=4 must be divisible by mesh.tensor=8" in out
    points = commands(out, "launch/tpu.py")
    assert len(points) == 3  # 000, 002, 003: one tpu.py run each
    for point, command in zip(("000", "002", "003"), points):
        assert "--name=pod --zone=us-east5-a --accelerator=v5p-64 --project=p" in command
        assert f"--workdir=gs://bucket/sweep/{point} " in command and "--dry_run" in command
        assert "--config=configs/tiny.py " in command  # 2 warm-up steps + 3 timed, every one logged
        assert "--config.steps=5 --config.log_every_steps=1 --config.eval.every_steps=0" in command
        assert "--config.seq_len=32" in command and "--config.batch_size=8" in command
        assert "--config.data.cache_dir=gs://bucket/sweep/packed " in command  # shared by the hosts
    assert "--config.mesh.data=8 --config.mesh.fsdp=1 --config.mesh.tensor=1" in points[0]
    assert "--config.mesh.data=2 --config.mesh.fsdp=2 --config.mesh.tensor=2" in points[1]
    # create once and keep; reuse without reinstalling; the last point deletes
    assert "--keep" in points[0] and "--reuse" not in points[0]
    assert "--reuse --no_install --keep" in points[1]
    assert "--reuse --no_install" in points[2] and "--keep" not in points[2]
    gcloud = commands(out, "[tpu] ")
    assert len(commands(out, "tpu-vm create pod")) == 1 and gcloud[0].startswith("[tpu] gcloud compute tpus tpu-vm create pod")
    assert len(commands(out, "locks/tpu.lock")) == 1  # installed once
    runs = commands(out, "launch/tpu_worker.sh start")  # each point's training, on every worker
    assert len(runs) == 3 and all("--worker=all" in r for r in runs)
    assert len(commands(out, "tpu-vm delete pod")) == 1 and gcloud[-1].startswith("[tpu] gcloud compute tpus tpu-vm delete pod")
    assert not (tmp_path / "gs:").exists()  # nothing written


def test_slurm_dry_run_submits_each_point_with_sbatch(tmp_path):
    workdir = tmp_path / "sweep"
    result = run_sweep(tmp_path, f"--workdir={workdir}", "--launcher=slurm", "--dry_run", "--",
                       "--nodes=2", "--partition=h200")
    assert result.returncode == 0, result.stderr
    points = commands(result.stdout, "[sweep] sbatch")
    assert len(points) == 3
    for point, command in zip(("000", "002", "003"), points):
        assert command.startswith(f"[sweep] sbatch --parsable --wait --job-name=maxlm-sweep-{point} "
                                  f"--output={workdir}/{point}/slurm-%j.log --nodes=2 --partition=h200 "
                                  f"launch/slurm.sbatch --config=configs/tiny.py --workdir={workdir}/{point} ")
        assert "--config.eval.every_steps=0" in command and "--config.seq_len=32" in command
    assert "--config.mesh.data=1 --config.mesh.fsdp=8 --config.mesh.tensor=1" in points[2]
    assert not workdir.exists()  # a dry run writes nothing
    no_wait = run_sweep(tmp_path, f"--workdir={workdir}", "--launcher=slurm", "--dry_run", "--no_wait")
    assert no_wait.returncode == 0 and "--wait" not in no_wait.stdout


def test_collect_gathers_each_points_metrics_into_the_csv(tmp_path):
    """What tpu and slurm points leave: DIR/NNN/metrics.jsonl, medians after the warm-up."""
    workdir = tmp_path / "sweep"
    for point, speed in (("000", 1000.0), ("003", 3000.0)):
        (workdir / point).mkdir(parents=True)
        lines = [{"step": s, "loss": 5.0, "tokens_per_sec": speed * (0.1 if s <= 2 else 1) + s,
                  "mfu": 0.1, "step_time_sec": 256 / speed} for s in range(1, 6)]
        (workdir / point / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    result = run_sweep(tmp_path, f"--workdir={workdir}", "--launcher=slurm", "--collect")
    assert result.returncode == 0, result.stdout + result.stderr
    rows = list(csv.DictReader(open(workdir / "sweep.csv")))
    assert [r["point"] for r in rows[:2]] == ["003", "000"]  # fastest first
    by_point = {r["point"]: r for r in rows}
    assert {p: r["status"] for p, r in by_point.items()} == {
        "000": "ok", "001": "skipped", "002": "failed", "003": "ok"}
    assert float(by_point["003"]["tokens_per_sec"]) == 3004.0  # median of steps 3, 4, 5
    assert float(by_point["003"]["model_tflops_per_sec"]) > 0
    assert "no training steps after the warm-up" in by_point["002"]["reason"]


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir(os.path.join(os.environ.get("MAXLM_TARGET_COMPILERS", ""), "libtpu")),
                    reason="libtpu is not installed here (`make test` installs it in .venv/target-compilers)")
@pytest.mark.ci
def test_a_planned_sweep_for_a_tpu_slice_ranks_points_by_their_estimate(tmp_path):
    """--plan --target=v5p-8: every point compiled for the slice (no TPU), ranked by estimated
    tokens/s; a point too big for the chips' HBM is listed as such, with XLA's reason."""
    sweep_file = tmp_path / "v5p.py"
    sweep_file.write_text(
        "def get_config():\n"
        "    return {'base': 'configs/tiny.py', 'devices': 4, 'steps': 2,\n"
        "            'overrides': {'seq_len': 256, 'model.dtype': 'bfloat16'},\n"
        "            'grid': {'mesh': [(4, 1, 1), (1, 4, 1)], 'batch_size': [8],\n"
        "                     'model.vocab_size': [264, 64000000]}}\n"
    )
    result = subprocess.run(
        [sys.executable, str(ROOT / "launch" / "sweep.py"), str(sweep_file), "--plan", "--target=v5p-8",
         f"--workdir={tmp_path / 'out'}"], cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": os.environ["MAXLM_TARGET_COMPILERS"],
             "XLA_FLAGS": without_test_flags(os.environ.get("XLA_FLAGS", ""))})  # the slice's own compile
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    rows = list(csv.DictReader(open(tmp_path / "out" / "sweep.csv")))
    ranked = [r for r in rows if r["status"] == "ok (estimated)"]
    assert [r["overrides"] for r in ranked] == ["model.vocab_size=264"] * 2
    speeds = [float(r["tokens_per_sec"]) for r in ranked]
    assert speeds == sorted(speeds, reverse=True) and all(0 < float(r["mfu"]) <= 1 for r in ranked)
    too_big = [r for r in rows if r["status"] == "too big"]
    assert len(too_big) == 2 and all("RESOURCE_EXHAUSTED" in r["reason"] for r in too_big)
