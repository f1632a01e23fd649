"""launch/sweep.py: grid expansion, validator skips, one process per point, sweep.csv."""

import csv
import subprocess
import sys

import pytest

from tests.helpers import ROOT

sys.path.insert(0, str(ROOT / "launch"))
import sweep  # noqa: E402


def test_expand_splits_mesh_and_crosses_every_key():
    points = sweep.expand({"mesh": [(8, 1, 1), (2, 2, 2)], "batch_size": [8, 16]})
    assert len(points) == 4
    assert points[1] == {"mesh.data": 8, "mesh.fsdp": 1, "mesh.tensor": 1, "batch_size": 16}


def test_validate_gives_the_config_errors_reason():
    reason = sweep.validate("configs/tiny.py", {"mesh.data": 1, "mesh.fsdp": 1, "mesh.tensor": 8}, 8)
    assert "must be divisible by mesh.tensor=8" in reason
    assert sweep.validate("configs/tiny.py", {"mesh.data": 2, "mesh.fsdp": 4, "mesh.tensor": 1}, 8) is None


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
