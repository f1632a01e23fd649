"""Sweep mesh shapes (and any other config keys) and rank the points by throughput.

    python launch/sweep.py configs/sweeps/cpu8.py --workdir=runs/sweep
    python launch/sweep.py configs/sweeps/v5p_64.py --workdir=gs://bucket/sweep --launcher=tpu -- \
        --name=sweep --zone=us-east5-a --accelerator=v5p-64
    python launch/sweep.py configs/sweeps/gpu8.py --workdir=/shared/sweep --launcher=slurm -- \
        --partition=h200

A sweep file's `get_config()` returns a dict naming a base config, fixed overrides and a grid;
every combination of the grid is a point. Points the config validator rejects are listed with its
reason and skipped. `--launcher` decides where the others run:

  local  (default) each point is compiled ahead of time here (`python -m maxlm.bench plan`:
         per-device memory) and then timed (`python -m maxlm.bench`), each in its own process so a
         crash or OOM costs one point, not the sweep; `--plan` only compiles. With `--plan
         --target=v5p-64` (or any `bench plan` target) each point is compiled for that hardware
         instead and ranked by its estimated tokens/s (docs/tpus.md): no TPU or GPU needed. Each
         point leaves its JSON and logs in `DIR/NNN/`.
  tpu    each point is a short training run (`maxlm.train`, workdir `DIR/NNN`) through
         `launch/tpu.py` with the arguments after `--`: the first point creates the TPU and keeps
         it, the next ones reuse it without reinstalling, the last one deletes it (unless `--keep`
         is among them). DIR must be readable here and on the workers: a gs:// bucket.
  slurm  each point is `sbatch [args after --] launch/slurm.sbatch <train args>`, waited for in
         turn (`--no_wait`: all submitted at once; gather later with `--collect`). DIR must be on
         the cluster's shared filesystem (or gs://) and readable here.

For tpu and slurm the results come from each point's `DIR/NNN/metrics.jsonl`: the medians of
tokens/s, MFU and step time over the steps after the warm-up. `--dry_run` prints the commands
(tpu: also every gcloud command of `tpu.py --dry_run`) and runs nothing. The table is written to
`DIR/sweep.csv` and printed, fastest first.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import io
import itertools
import json
import os
import shlex
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from etils import epath  # noqa: E402

from maxlm import config as config_lib
from maxlm.observe import metrics  # noqa: E402
from maxlm.runtime import paths  # noqa: E402  (after the path fix-up above)

COLUMNS = ("point", "mesh", "batch_size", "overrides", "status", "memory_per_device_mib",
           "tokens_per_sec", "mfu", "step_sec_median", "model_tflops_per_sec", "reason")
SWEEP_MESH_AXES = ("data", "fsdp", "tensor")  # a grid's 3-tuple "mesh" and the csv's mesh column
WARMUP_STEPS = 2  # untimed steps first (the first one compiles), as `maxlm.bench --warmup_steps`


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
    """Every combination of the grid's values, with "mesh" split into its axes: a 3-tuple is
    (data, fsdp, tensor), a 4-tuple (data, fsdp, sequence, tensor), a 5-tuple (stage, data, fsdp,
    sequence, tensor), a 6-tuple all axes (stage, data, fsdp, expert, sequence, tensor);
    "mesh.sequence", "mesh.stage", "mesh.expert" may also be grid keys of their own."""
    keys = list(grid)
    points = []
    for values in itertools.product(*(grid[k] for k in keys)):
        point = {}
        for key, value in zip(keys, values):
            if key == "mesh":
                axes = {3: SWEEP_MESH_AXES, 4: ("data", "fsdp", "sequence", "tensor"),
                        5: ("stage", "data", "fsdp", "sequence", "tensor")}.get(len(value), config_lib.MESH_AXES)
                point.update(zip((f"mesh.{a}" for a in axes), value))
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
    targeted = any(w.startswith("--target=") for w in what)
    if sweep.get("fake_cpu_devices") and not targeted:  # this machine: `devices` fake CPU devices
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


def run_point(sweep, overrides: dict, point_dir: str, plan_only: bool, target: str = "") -> dict:
    os.makedirs(point_dir, exist_ok=True)
    plan, error = _bench(sweep, ["plan", *([f"--target={target}"] if target else [])], overrides,
                         point_dir, "plan")
    if error:
        return {"status": "failed", "reason": error}
    if plan["fits"] is False:
        peak = plan.get("bytes_per_device", {}).get("peak")
        return {"status": "too big", "memory_per_device_mib": round(peak / 2**20, 1) if peak else "",
                "reason": plan.get("xla_message") or f"peak above the device's {plan['device_memory_bytes']:,} bytes"}
    row = {"status": "ok", "memory_per_device_mib": round(plan["bytes_per_device"]["peak"] / 2**20, 1)}
    estimate = plan.get("estimate", {})
    if "step_sec" in estimate:  # compiled for a target: its estimate is the point's figure
        row.update(status="ok (estimated)", tokens_per_sec=estimate["tokens_per_sec"], mfu=estimate["mfu"],
                   step_sec_median=estimate["step_sec"],
                   model_tflops_per_sec=estimate["model_flops_per_device"] * plan["device_count"]
                   / estimate["step_sec"] / 1e12)
    if plan_only:
        return row
    timed, error = _bench(sweep, [f"--steps={sweep['steps']}", "--warmup_steps=2"], overrides,
                          point_dir, "bench")
    if error:
        return {**row, "status": "failed", "reason": error}
    return {**row, **{k: timed[k] for k in
            ("tokens_per_sec", "mfu", "step_sec_median", "model_tflops_per_sec")}}


# ----------------------------------------------------------------------------- tpu and slurm


def train_args(sweep, overrides: dict, point_dir: str) -> list[str]:
    """`maxlm.train` arguments of a point: a short run logging every step, no eval. The packed
    data lives next to the points (DIR/packed), which every host of a point shares and every
    point reuses, unless the sweep sets data.cache_dir."""
    cache = [] if "data.cache_dir" in overrides else [
        f"--config.data.cache_dir={point_dir.rstrip('/').rsplit('/', 1)[0]}/packed"]
    return [f"--config={sweep['base']}", f"--workdir={point_dir}",
            f"--config.steps={WARMUP_STEPS + sweep['steps']}", "--config.log_every_steps=1",
            "--config.eval.every_steps=0", *cache, *(f"--config.{k}={v}" for k, v in overrides.items())]


def tpu_command(launcher_args: list[str], train: list[str], first: bool, last: bool,
                dry_run: bool) -> list[str]:
    """`launch/tpu.py` for one point: only the first creates the TPU (and installs maxlm on it),
    every point but the last keeps it."""
    flags = ([] if first else ["--reuse", "--no_install"]) + ([] if last else ["--keep"])
    return [sys.executable, os.path.join(ROOT, "launch", "tpu.py"), *launcher_args, *flags,
            *(["--dry_run"] if dry_run else []), "--", *train]


def slurm_command(launcher_args: list[str], train: list[str], point: str, point_dir: str,
                  wait: bool) -> list[str]:
    """`sbatch` of `launch/slurm.sbatch` for one point (`--wait`: returns when the job ends, with
    its exit status); its log goes to the point's directory when that is a local path."""
    output = [] if paths.is_remote(point_dir) else [f"--output={point_dir}/slurm-%j.log"]
    return ["sbatch", "--parsable", *(["--wait"] if wait else []), f"--job-name=maxlm-sweep-{point}",
            *output, *launcher_args, "launch/slurm.sbatch", *train]


def collect(sweep, overrides: dict, point_dir: str) -> dict:
    """A point's results from its `metrics.jsonl`: medians over the steps after the warm-up."""
    path = epath.Path(point_dir) / "metrics.jsonl"
    try:
        written = metrics.read_metrics(path) if path.exists() else []
    except OSError as e:
        return {"status": "failed", "reason": f"{path}: {e}"}
    # a rerun's row for a step replaces the earlier one
    rows = {r["step"]: r for r in written if "tokens_per_sec" in r and r["step"] > WARMUP_STEPS}
    if not rows:
        return {"status": "failed", "reason": f"no training steps after the warm-up in {path}"}
    median = lambda key: statistics.median(r[key] for r in rows.values())  # noqa: E731
    from maxlm.observe import flops  # imports jax: only here

    cfg = config_lib.resolve(config_lib.apply_overrides(load_base(sweep["base"]), overrides),
                             sweep["devices"])
    per_token = flops.flops_per_token(cfg.model, cfg.seq_len)
    return {"status": "ok", "tokens_per_sec": median("tokens_per_sec"), "mfu": median("mfu"),
            "step_sec_median": median("step_time_sec"),
            "model_tflops_per_sec": median("tokens_per_sec") * per_token / 1e12}


def run_remote(args, launcher_args: list[str], sweep, overrides: dict, point: str,
               point_dir: str, first: bool, last: bool) -> dict:
    """One point through launch/tpu.py or sbatch; its results once it has finished."""
    train = train_args(sweep, overrides, point_dir)
    if args.launcher == "tpu":
        command = tpu_command(launcher_args, train, first, last, args.dry_run)
    else:
        command = slurm_command(launcher_args, train, point, point_dir, wait=not args.no_wait)
    print("[sweep] " + shlex.join(command), flush=True)
    if args.dry_run and args.launcher == "slurm":
        return {"status": "dry_run"}
    if not paths.is_remote(point_dir) and not args.dry_run:
        os.makedirs(point_dir, exist_ok=True)  # sbatch's --output needs the directory
    result = subprocess.run(command, cwd=ROOT, stdout=subprocess.PIPE if args.launcher == "slurm" else None,
                            text=True)
    if args.dry_run:
        return {"status": "dry_run"}
    if args.launcher == "slurm" and args.no_wait:
        if result.returncode:
            return {"status": "failed", "reason": f"sbatch exited with status {result.returncode}"}
        job = result.stdout.strip().split(";")[0]
        print(f"[sweep] {point}: submitted job {job}", flush=True)
        return {"status": "submitted", "reason": f"job {job}; gather with --collect"}
    if result.returncode:
        return {"status": "failed", "reason": f"{args.launcher} run exited with status {result.returncode}"}
    return collect(sweep, overrides, point_dir)


# ----------------------------------------------------------------------------- the sweep


def main(argv: list[str]) -> int:
    split = argv.index("--") if "--" in argv else len(argv)
    argv, launcher_args = argv[:split], argv[split + 1:]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sweep", help="configs/sweeps/NAME.py")
    parser.add_argument("--workdir", required=True, help="a directory or gs:// URL")
    parser.add_argument("--launcher", choices=("local", "tpu", "slurm"), default="local",
                        help="where each point runs; tpu/slurm take launch/tpu.py flags / sbatch "
                             "options after --")
    parser.add_argument("--plan", action="store_true", help="only compile: per-device memory (local)")
    parser.add_argument("--target", default="", help="with --plan: compile every point for this hardware "
                        "(a `bench plan` target, e.g. v5p-64) and rank by the estimated tokens/s")
    parser.add_argument("--dry_run", action="store_true", help="tpu/slurm: print the commands, run nothing")
    parser.add_argument("--no_wait", action="store_true", help="slurm: submit every point, wait for none")
    parser.add_argument("--collect", action="store_true",
                        help="tpu/slurm: run nothing, gather the points' metrics into sweep.csv")
    args = parser.parse_args(argv)
    remote = args.launcher != "local"
    if args.plan and remote:
        parser.error("--plan compiles on this machine's devices: use it with --launcher=local")
    if args.target and not args.plan:
        parser.error("--target is for --plan: a sweep that runs points runs them where they are")
    if (args.dry_run or args.collect) and not remote:
        parser.error("--dry_run and --collect are for --launcher=tpu or slurm")
    if args.no_wait and args.launcher != "slurm":
        parser.error("--no_wait is for --launcher=slurm")
    if launcher_args and not remote:
        parser.error("arguments after -- go to launch/tpu.py or sbatch: use --launcher=tpu or slurm")
    if args.launcher == "tpu" and not args.collect and not launcher_args:
        parser.error("give launch/tpu.py's flags after --, e.g. -- --name=sweep --zone=us-east5-a "
                     "--accelerator=v5p-64")
    if not remote and paths.is_remote(args.workdir):
        parser.error("--launcher=local writes its points' logs locally: give a local --workdir")
    sweep = load_sweep(args.sweep)
    if not args.dry_run:
        epath.Path(args.workdir).mkdir(parents=True, exist_ok=True)

    rows, todo = [], []
    for index, point in enumerate(expand(sweep['grid'])):
        overrides = {**sweep['overrides'], **point}
        # "mesh" is data x fsdp x tensor; mesh.sequence, mesh.stage go with the overrides
        row = {"point": f"{index:03d}",
               "mesh": "x".join(str(overrides.get(f"mesh.{a}", "?")) for a in SWEEP_MESH_AXES),
               "batch_size": overrides.get("batch_size", ""),
               "overrides": " ".join(f"{k}={v}" for k, v in point.items()
                                     if k not in {f"mesh.{a}" for a in SWEEP_MESH_AXES}
                                     and k != "batch_size")}
        reason = validate(sweep['base'], overrides, sweep['devices'])
        if reason:
            row.update(status="skipped", reason=reason)
            print(f"[sweep] {row['point']} {row['mesh']} skipped: {reason}", flush=True)
        else:
            todo.append((row, overrides))
        rows.append(row)
    for i, (row, overrides) in enumerate(todo):
        point_dir = (os.fspath(paths.workdir_path(args.workdir) / row["point"]) if remote
                     else os.path.join(args.workdir, row["point"]))  # remote: absolute, or a URL
        print(f"[sweep] {row['point']} {row['mesh']} batch {row['batch_size']} ...", flush=True)
        if args.collect:
            row.update(collect(sweep, overrides, point_dir))
        elif remote:
            row.update(run_remote(args, launcher_args, sweep, overrides, row["point"], point_dir,
                                  first=i == 0, last=i == len(todo) - 1))
        else:
            row.update(run_point(sweep, overrides, point_dir, args.plan, args.target))
    if args.dry_run:
        return 0

    # Fastest first; with --plan, the smallest per-device memory first.
    rows.sort(key=lambda r: (-(r.get("tokens_per_sec") or -1), r.get("memory_per_device_mib") or 1e30))
    table = io.StringIO()
    writer = csv.DictWriter(table, fieldnames=COLUMNS)
    writer.writeheader()
    writer.writerows({k: r.get(k, "") for k in COLUMNS} for r in rows)
    csv_path = epath.Path(args.workdir) / "sweep.csv"
    csv_path.write_text(table.getvalue())
    print(f"\n{'mesh':>8} {'batch':>5} {'MiB/dev':>8} {'tokens/s':>10} {'MFU':>6} {'step s':>8}  status")
    for r in rows:
        memory = f"{r['memory_per_device_mib']:>8,.1f}" if r.get("memory_per_device_mib") else f"{'':>8}"
        if r["status"].startswith("ok") and "tokens_per_sec" in r:
            print(f"{r['mesh']:>8} {r['batch_size']:>5} {memory} {r['tokens_per_sec']:>10,.0f} "
                  f"{r['mfu']:>6.1%} {r['step_sec_median']:>8.4f}  {r['status']} {r['overrides']}")
        elif r["status"].startswith("ok"):
            print(f"{r['mesh']:>8} {r['batch_size']:>5} {memory} {'':>10} {'':>6} {'':>8}  ok {r['overrides']}")
        else:
            print(f"{r['mesh']:>8} {r['batch_size']:>5} {memory} {'':>10} {'':>6} {'':>8}  {r['status']}: {r['reason']}")
    print(f"\nwrote {csv_path}")
    return 0 if any(r["status"].startswith("ok") or r["status"] == "submitted" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
