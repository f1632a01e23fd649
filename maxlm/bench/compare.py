"""`python -m maxlm.bench compare --peer=maxtext --config=...`: maxlm's train step next to MaxText's on
this machine's CPU, the same model, batch and optimizer on both sides.

Method. The resolved maxlm config is mapped key by key to MaxText's overrides
(maxlm/bench/maxtext_peer.py); what MaxText cannot express the same way is refused with one line
(exit 2). Each side runs as its own process, `maxlm.bench train` and MaxText's trainer on synthetic
data, `--pairs` times, the side that goes first alternating so that a machine drifting faster or
slower favours neither. Of each run:

- tokens/s: batch x seq / the median time of the `--steps` steps after `--warmup_steps` untimed
  ones (maxlm: its bench JSON; MaxText: the seconds it logs per step, of which the first two are
  dispatch time only, hence `--warmup_steps` >= 2);
- time to first step: from spawning the process to its line saying that the first step finished
  (imports, initialisation and a cold compile: neither side gets a compilation cache).

Reported: each side's median over the pairs, and the median of the per-pair ratios maxlm / MaxText.

`--runtime=own` runs each side in its own environment with its own defaults: maxlm with this
interpreter and its CPU XLA flag (maxlm/__init__.py), MaxText in the peer venv with the user's
XLA_FLAGS. `--runtime=same` runs maxlm with the peer venv's interpreter too (same Python, jax and
jaxlib) and gives both the same XLA_FLAGS, maxlm's CPU flag plus the user's: only the code differs.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable

from maxlm import cli, model
from maxlm.bench import maxtext_peer as peer
from maxlm.runtime.errors import ConfigError

MAXLM_FIRST_STEP_LINE = re.compile(r"^bench: step 0 done")  # printed by maxlm.bench train
FIGURES = ("tokens_per_sec", "step_sec_median", "first_step_sec")  # what a pair reports of each run
RUNTIME_PROBE = ("import importlib.metadata as m, json, platform; print(json.dumps({'python': "
                 "platform.python_version(), 'jax': m.version('jax'), 'jaxlib': m.version('jaxlib')}))")
MAXTEXT_PROBE = ("import importlib.metadata as m, json, os, maxtext; print(json.dumps({'version': "
                 "m.version('maxtext'), 'package_dir': os.path.dirname(maxtext.__file__)}))")


class RunFailed(RuntimeError):
    """A run that exited with an error or printed too little; `output` is what it printed."""

    def __init__(self, message: str, output: str):
        super().__init__(message)
        self.output = output


@dataclasses.dataclass
class Side:
    name: str
    command: list[str]
    env: dict[str, str]  # set over the inherited environment
    first_step_line: re.Pattern | None  # None: no steps run (a compile)
    measure: Callable[[str], dict]  # the run's output -> tokens_per_sec, step_sec_median, ...

    def shell(self) -> str:
        """The command as a user can paste it."""
        return " ".join([f"{k}={shlex.quote(v)}" for k, v in self.env.items()] + [shlex.join(self.command)])


@dataclasses.dataclass
class Output:
    text: str  # stdout and stderr
    first_step_sec: float | None  # from the spawn to the first-step line; None if none came
    returncode: int


def parse_bench_json(text: str) -> dict:
    """The JSON object `maxlm.bench` printed last (indented: it starts on a line of its own)."""
    start = 0 if text.startswith("{\n") else text.rfind("\n{\n") + 1
    return json.JSONDecoder().raw_decode(text, start)[0]


def maxlm_measure(text: str) -> dict:
    result = parse_bench_json(text)
    return {"tokens_per_sec": result["tokens_per_sec"], "step_sec_median": result["step_sec_median"],
            "xla_flags": result["xla_flags"]}  # the flags in effect, maxlm's default included


def stream_output(command: list[str], env: dict[str, str], first_step_line: re.Pattern) -> Output:
    """Runs `command` with `env` over this environment, less XLA_FLAGS (this process's has maxlm's
    default in it) and JAX's cache directory, timing the first-step line as it comes."""
    inherited = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR")}
    lines, first_step_sec = [], None
    start = time.perf_counter()
    with subprocess.Popen(command, env={**inherited, **env}, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:
            lines.append(line)
            if first_step_line and first_step_sec is None and first_step_line.search(line):
                first_step_sec = time.perf_counter() - start
    return Output("".join(lines), first_step_sec, proc.returncode)


def run_side(side: Side, launch: Callable[..., Output]) -> dict:
    out = launch(side.command, side.env, side.first_step_line)
    if out.returncode != 0:
        raise RunFailed(f"{side.name} exited with status {out.returncode}", out.text)
    try:
        return {**side.measure(out.text), "first_step_sec": out.first_step_sec}
    except (ValueError, KeyError) as e:  # a log or JSON without the figures
        raise RunFailed(f"{side.name}: no figures in its output ({type(e).__name__}: {e})", out.text) from None


def run_pairs(sides: list[Side], pairs: int, launch: Callable[..., Output] = stream_output) -> list[dict]:
    """`pairs` runs of each side, one at a time, the side that goes first alternating."""
    results = []
    for i in range(pairs):
        order = sides if i % 2 == 0 else sides[::-1]
        runs = {}
        for side in order:
            runs[side.name] = run = run_side(side, launch)
            first = "-" if run["first_step_sec"] is None else f"{run['first_step_sec']:.1f} s"
            peer.progress(f"pair {i + 1}/{pairs}: {side.name}: {run['tokens_per_sec']:,.0f} tokens/s, "
                          f"first step {first}")
        results.append({"first": order[0].name, **runs})
    return results


def summarize(results: list[dict]) -> dict:
    """Each pair's figures and ratio maxlm / MaxText, and the medians over the pairs."""
    def median(values):
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    def ratio(pair, key):
        a, b = pair["maxlm"][key], pair["maxtext"][key]
        return None if a is None or b is None else a / b

    sides = ("maxlm", "maxtext")
    return {
        "pairs": [{"first": r["first"], **{s: {k: r[s][k] for k in FIGURES} for s in sides},
                   "ratio": ratio(r, "tokens_per_sec")} for r in results],
        **{f"{s}_tokens_per_sec_median": median(r[s]["tokens_per_sec"] for r in results) for s in sides},
        "median_ratio": median(ratio(r, "tokens_per_sec") for r in results),
        **{f"{s}_first_step_sec_median": median(r[s]["first_step_sec"] for r in results) for s in sides},
        "first_step_ratio": median(ratio(r, "first_step_sec") for r in results),
    }


def maxlm_bench_flags(argv: list[str], warmup: int, timed: int) -> list[str]:
    """The command line's flags for `maxlm.bench train`: those compare alone reads left out, the
    step counts explicit."""
    own = ("peer", "pairs", "runtime", "peer_venv", "peer_python", "steps", "warmup_steps")
    out, skip_value = [], False
    for arg in argv:
        if skip_value or arg == "compare":
            skip_value = False
            continue
        if arg.startswith("--") and arg[2:].split("=")[0] in own:
            skip_value = "=" not in arg  # `--pairs 3`
            continue
        out.append(arg)
    return out + [f"--warmup_steps={warmup}", f"--steps={timed}"]


def make_sides(cfg, runtime: str, peer_python: str, maxtext_dir: str, overrides: list[str],
               bench_flags: list[str], warmup: int, timed: int) -> list[Side]:
    """maxlm's and MaxText's commands and environments for `runtime` ("own" or "same")."""
    user = cli.USER_XLA_FLAGS
    xla_flags, maxlm_python, maxlm_env = user, sys.executable, {}
    if runtime == "same":
        xla_flags = user if cli.CPU_FLAG in user else f"{user} {cli.CPU_DEFAULT}".strip()
        maxlm_python = peer_python
        maxlm_env = {"PYTHONPATH": os.pathsep.join(filter(None, [peer.REPO, os.environ.get("PYTHONPATH")]))}
    common = {"JAX_PLATFORMS": "cpu", **({"XLA_FLAGS": xla_flags} if xla_flags else {})}
    base_yml = os.path.join(maxtext_dir, "configs", "base.yml")
    tokens_per_step = cfg.batch_size * cfg.seq_len
    return [
        Side("maxlm", [maxlm_python, "-m", "maxlm.bench", "train", *bench_flags], {**maxlm_env, **common},
             MAXLM_FIRST_STEP_LINE, maxlm_measure),
        Side("maxtext", [peer_python, "-m", peer.TRAIN_MODULE, base_yml, *overrides],
             {"DECOUPLE_GCLOUD": "TRUE", **common}, peer.FIRST_STEP_LINE,
             lambda text: peer.measure(text, warmup, timed, tokens_per_step)),
    ]


def probe(python: str, code: str) -> dict:
    """The JSON that `code` prints last when `python` runs it."""
    out = subprocess.run([python, "-c", code], capture_output=True, text=True)
    if out.returncode:
        raise peer.PeerError(f"{python} -c {code!r} failed: {(out.stderr.strip().splitlines() or [''])[-1]}")
    return json.loads(out.stdout.splitlines()[-1])


def host() -> dict:
    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    return {"cpu": cpu, "nproc": len(os.sched_getaffinity(0))}


def model_summary(cfg, maxtext_params_billion: float | None) -> dict:
    m = cfg.model
    return {"params": model.count_params(m), "maxtext_reported_params_billion": maxtext_params_billion,
            **{k: m[k] for k in ("num_layers", "d_model", "num_heads", "num_kv_heads", "head_dim", "mlp_dim",
                                 "vocab_size", "tie_embeddings", "dtype", "remat", "scan_layers")},
            "batch_size": cfg.batch_size, "seq_len": cfg.seq_len}


def check_flags(f) -> None:
    if f.warmup_steps < 2:
        cli.config_error("compare needs --warmup_steps of 2 or more: MaxText's first two step times are dispatch only")
    if re.search(r"xla_force_host_platform_device_count=(?!1\b)", cli.USER_XLA_FLAGS):
        cli.config_error("compare runs on one device: take --xla_force_host_platform_device_count out of XLA_FLAGS")


def compare() -> dict:
    """The comparison the parsed flags ask for, as a JSON-ready dict."""
    from absl import flags

    f = flags.FLAGS
    check_flags(f)
    cfg = cli.resolved_config(1, num_granules=1, platform="cpu")
    workdir = tempfile.mkdtemp(prefix="maxlm-compare-")
    try:
        overrides = peer.maxtext_args(cfg, f.warmup_steps + f.steps, workdir)
        venv = os.path.abspath(f.peer_venv or os.path.join(peer.REPO, ".venv-maxtext"))
        peer.ensure_peer_venv(venv, f.peer_python)
        peer_python = os.path.join(venv, "bin", "python")
        maxtext = probe(peer_python, MAXTEXT_PROBE)
        peer.check_keys(overrides, os.path.join(maxtext["package_dir"], "configs", "base.yml"))
        sides = make_sides(cfg, f.runtime, peer_python, maxtext["package_dir"], overrides,
                           maxlm_bench_flags(sys.argv[1:], f.warmup_steps, f.steps), f.warmup_steps, f.steps)
        peer.progress(f"{f.pairs} pair(s), runtime {f.runtime}:\n  {sides[0].shell()}\n  {sides[1].shell()}")
        results = run_pairs(sides, f.pairs)
        runtimes = {side.name: probe(side.command[0], RUNTIME_PROBE) for side in sides}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    runtimes["maxlm"]["xla_flags"] = results[0]["maxlm"]["xla_flags"]
    runtimes["maxtext"]["xla_flags"] = sides[1].env.get("XLA_FLAGS", "")
    return {
        "benchmark": "compare", "peer": "maxtext", "peer_version": maxtext["version"], "runtime": f.runtime,
        "ratio": "maxlm / maxtext", "warmup_steps": f.warmup_steps, "timed_steps": f.steps,
        **summarize(results), "model": model_summary(cfg, results[0]["maxtext"]["params_billion"]),
        "runtimes": runtimes, "commands": {side.name: side.shell() for side in sides},
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "host": host(),
    }


def main(run=compare) -> dict:
    """`run()` (`compare`, or `compare_plan.compare_plans` for a TPU slice) with its failures as one
    message: a config MaxText cannot run (exit 2), a peer venv that cannot be made or a run that
    failed (exit 1, with the run's last lines)."""
    try:
        return run()
    except ConfigError as e:
        cli.config_error(str(e))
    except peer.PeerError as e:
        print(f"maxlm: compare: {e}", file=sys.stderr)
    except RunFailed as e:
        tail = "".join(e.output.splitlines(keepends=True)[-30:])
        print(f"maxlm: compare: {e}; its last lines:\n{tail}", file=sys.stderr)
    sys.exit(1)


def define_flags() -> None:
    from absl import flags

    flags.DEFINE_enum("peer", "maxtext", ["maxtext"], "compare: the code base maxlm is set against.")
    flags.DEFINE_integer("pairs", 3, "compare: runs of each side, interleaved.", lower_bound=1)
    flags.DEFINE_enum("runtime", "own", ["own", "same"], "compare: own = each side in its own environment with "
                      "its own defaults; same = maxlm in the peer's environment, both with the same XLA_FLAGS.")
    flags.DEFINE_string("peer_venv", "", "compare: the peer's venv, made from launch/peers/maxtext.lock when "
                        "missing (default: .venv-maxtext at the repository root).")
    flags.DEFINE_enum("layers", "unrolled", ["unrolled", "scanned"], "compare --target: compile both sides' "
                      "layers unrolled (every figure comparable) or scanned (memory as the presets run; XLA's "
                      "costs then count one layer, so no cost ratios).")
    flags.DEFINE_string("peer_python", "", "compare: the Python 3.12+ that makes the peer venv (default: "
                        "the one maxlm runs on).")
