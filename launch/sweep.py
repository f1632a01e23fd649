"""Sweep mesh shapes (and any other config keys) and rank the points by throughput.

    python launch/sweep.py configs/sweeps/cpu8.py --workdir=runs/sweep

A sweep file's `get_config()` returns a dict naming a base config, fixed overrides and a grid;
every combination of the grid is a point. Points the config validator rejects are listed with its
reason and skipped. Each remaining point is compiled ahead of time (`python -m maxlm.bench plan`:
per-device memory) and then timed (`python -m maxlm.bench`), each in its own process so a crash or
OOM costs one point, not the sweep; `--plan` only compiles. Each point leaves its JSON and logs in
`DIR/NNN/`. The table is written to `DIR/sweep.csv` and printed, fastest first.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import itertools
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from maxlm import config as config_lib  # noqa: E402  (after the path fix-up above)

COLUMNS = ("point", "mesh", "batch_size", "overrides", "status", "memory_per_device_mib",
           "tokens_per_sec", "mfu", "step_sec_median", "model_tflops_per_sec", "reason")


def load_sweep(path: str):
    spec = importlib.util.spec_from_file_location("sweep", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def load_base(path: str):
    spec = importlib.util.spec_from_file_location("base", os.path.join(ROOT, path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def expand(grid) -> list[dict]:
    """Every combination of the grid's values, with "mesh" split into its three axes."""
    keys = list(grid)
    points = []
    for values in itertools.product(*(grid[k] for k in keys)):
        point = {}
        for key, value in zip(keys, values):
            if key == "mesh":
                point.update(zip(("mesh.data", "mesh.fsdp", "mesh.tensor"), value))
            else:
                point[key] = value
        points.append(point)
    return points


def validate(base_path: str, overrides: dict, devices: int) -> str | None:
    """The validator's reason to reject this point, or None."""
    cfg = config_lib.apply_overrides(load_base(base_path), overrides)
    try:
        config_lib.resolve(cfg, devices)
    except config_lib.ConfigError as e:
        return str(e)
    return None


def _bench(sweep, what: list[str], overrides: dict, point_dir: str, name: str):
    """Runs one `python -m maxlm.bench` for a point: (its JSON, or None and the last error line)."""
    command = [sys.executable, "-m", "maxlm.bench", *what, f"--config={sweep['base']}",
               *(f"--config.{k}={v}" for k, v in overrides.items())]
    env = dict(os.environ)
    if sweep.get("fake_cpu_devices"):  # this machine: `devices` fake CPU devices
        env.update(JAX_PLATFORMS="cpu",
                   XLA_FLAGS=f"--xla_force_host_platform_device_count={sweep['devices']}")
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    with open(os.path.join(point_dir, f"{name}.log"), "w") as f:
        f.write(" ".join(command) + "\n\n" + result.stderr)
    if result.returncode != 0:
        return None, f"{name} failed ({result.returncode}): " + (
            result.stderr.strip().splitlines() or ["no output"])[-1]
    with open(os.path.join(point_dir, f"{name}.json"), "w") as f:
        f.write(result.stdout)
    return json.loads(result.stdout), None


def run_point(sweep, overrides: dict, point_dir: str, plan_only: bool) -> dict:
    os.makedirs(point_dir, exist_ok=True)
    plan, error = _bench(sweep, ["plan"], overrides, point_dir, "plan")
    if error:
        return {"status": "failed", "reason": error}
    row = {"status": "ok", "memory_per_device_mib": round(plan["bytes_per_device"]["peak"] / 2**20, 1)}
    if plan_only:
        return row
    timed, error = _bench(sweep, [f"--steps={sweep['steps']}", "--warmup_steps=2"], overrides,
                          point_dir, "bench")
    if error:
        return {**row, "status": "failed", "reason": error}
    return {**row, **{k: timed[k] for k in
            ("tokens_per_sec", "mfu", "step_sec_median", "model_tflops_per_sec")}}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sweep", help="configs/sweeps/NAME.py")
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--plan", action="store_true", help="only compile: per-device memory")
    args = parser.parse_args(argv)
    sweep = load_sweep(args.sweep)
    os.makedirs(args.workdir, exist_ok=True)

    rows = []
    for index, point in enumerate(expand(sweep['grid'])):
        overrides = {**sweep['overrides'], **point}
        row = {"point": f"{index:03d}",
               "mesh": "x".join(str(overrides.get(f"mesh.{a}", "?")) for a in config_lib.MESH_AXES),
               "batch_size": overrides.get("batch_size", ""),
               "overrides": " ".join(f"{k}={v}" for k, v in point.items()
                                     if not k.startswith("mesh.") and k != "batch_size")}
        reason = validate(sweep['base'], overrides, sweep['devices'])
        if reason:
            row.update(status="skipped", reason=reason)
            print(f"[sweep] {row['point']} {row['mesh']} skipped: {reason}", flush=True)
        else:
            print(f"[sweep] {row['point']} {row['mesh']} batch {row['batch_size']} ...", flush=True)
            row.update(run_point(sweep, overrides, os.path.join(args.workdir, row["point"]), args.plan))
        rows.append(row)

    # Fastest first; with --plan, the smallest per-device memory first.
    rows.sort(key=lambda r: (-(r.get("tokens_per_sec") or -1), r.get("memory_per_device_mib") or 1e30))
    with open(os.path.join(args.workdir, "sweep.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows({k: r.get(k, "") for k in COLUMNS} for r in rows)
    print(f"\n{'mesh':>8} {'batch':>5} {'MiB/dev':>8} {'tokens/s':>10} {'MFU':>6} {'step s':>8}  status")
    for r in rows:
        memory = f"{r['memory_per_device_mib']:>8,.1f}" if r.get("memory_per_device_mib") else f"{'':>8}"
        if r["status"] == "ok" and "tokens_per_sec" in r:
            print(f"{r['mesh']:>8} {r['batch_size']:>5} {memory} {r['tokens_per_sec']:>10,.0f} "
                  f"{r['mfu']:>6.1%} {r['step_sec_median']:>8.4f}  ok {r['overrides']}")
        elif r["status"] == "ok":
            print(f"{r['mesh']:>8} {r['batch_size']:>5} {memory} {'':>10} {'':>6} {'':>8}  ok {r['overrides']}")
        else:
            print(f"{r['mesh']:>8} {r['batch_size']:>5} {memory} {'':>10} {'':>6} {'':>8}  {r['status']}: {r['reason']}")
    print(f"\nwrote {os.path.join(args.workdir, 'sweep.csv')}")
    return 0 if any(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
