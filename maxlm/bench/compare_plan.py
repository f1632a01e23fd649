"""`python -m maxlm.bench compare --peer=maxtext --target=v5p-8 --config=...`: maxlm's and
MaxText's train steps compiled for the same Cloud TPU slice, XLA's figures side by side. Nothing
runs and no TPU is needed: libtpu compiles for the slice's topology (maxlm/bench/targets).

Method. Both sides compile in the peer venv, with one jax and one libtpu: a compiler's figures
compare only with the same compiler's. Layers are unrolled on both by default (`--layers=unrolled`:
`model.scan_layers=False`, MaxText's `scan_layers=False`), because XLA's cost analysis counts a
loop's body once. `--layers=scanned` compiles both with scanned layers, as the presets and MaxText
train by default: its memory figures are what a user's run plans, while its FLOPs and bytes count
one layer and are left out of the ratios. maxlm runs
`maxlm.bench plan --target`; MaxText its `train_compile` with `compile_topology`, which prints the
compiled step's cost and memory analyses. Of each, per device:

- flops, bytes accessed, transcendentals and libtpu's own `optimal_seconds` (cost analysis);
- temp (activations and scratch), arguments, outputs and aliased (donated) bytes, and from them
  peak = arguments + outputs - aliased + temp, the same formula on both sides (memory analysis);
- an estimated step time, max(flops / peak FLOP/s, bytes accessed / HBM bandwidth), from the
  chip's datasheet (maxlm/observe/flops.py, maxlm/bench/targets/tpu.py).

The config's logits chunks map to MaxText's vocabulary tiling of the same size
(`num_vocab_tiling` = seq_len / model.logits_chunk_size); the mesh's data, fsdp and tensor axes
to its `ici_*_parallelism`, and `mesh.sequence` with `model.context_parallel` to its context
parallelism (`maxtext_peer.context_parallel_args`).
"""

from __future__ import annotations

import ast
import datetime
import os
import re
import sys

from maxlm import cli
from maxlm.bench import compare, maxtext_peer as peer
from maxlm.bench.targets import tpu
from maxlm.observe import flops

COMPILE_MODULE = "maxtext.trainers.pre_train.train_compile"
COST_LINE = re.compile(r"^Cost analysis: (\{.*\})$", re.M)
MEMORY_LINE = re.compile(r"^Memory analysis: CompiledMemoryStats\((.*)\)$", re.M)
COSTS = ("flops", "bytes_accessed", "transcendentals", "optimal_seconds")
XLA_COST_KEYS = {"flops": "flops", "bytes_accessed": "bytes accessed", "transcendentals": "transcendentals",
                 "optimal_seconds": "optimal_seconds"}  # ours -> cost_analysis()'s
MEMORY = ("temp", "arguments", "outputs", "aliased", "peak")


def maxtext_plan(text: str) -> dict:
    """XLA's figures from train_compile's output: its printed cost and memory analyses."""
    cost, memory = COST_LINE.search(text), MEMORY_LINE.search(text)
    if not cost or not memory:
        raise ValueError("train_compile printed no cost or memory analysis")
    costs = ast.literal_eval(cost.group(1))
    stats = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", memory.group(1))}
    sizes = {"temp": stats["temp_size_in_bytes"], "arguments": stats["argument_size_in_bytes"],
             "outputs": stats["output_size_in_bytes"], "aliased": stats["alias_size_in_bytes"]}
    return {**{k: float(costs[XLA_COST_KEYS[k]]) for k in COSTS}, **with_peak(sizes)}


def maxlm_plan(text: str) -> dict:
    """The same figures from `maxlm.bench plan`'s JSON."""
    result = compare.parse_bench_json(text)
    sizes = {k: result["bytes_per_device"][k] for k in ("temp", "arguments", "outputs", "aliased")}
    return {**{k: result["xla_cost"][k] for k in COSTS}, **with_peak(sizes),
            "compile_sec": result["compile_sec"]}


def with_peak(sizes: dict) -> dict:
    return {**sizes, "peak": sizes["arguments"] + sizes["outputs"] - sizes["aliased"] + sizes["temp"]}


def estimate(figures: dict, target: str, dtype: str) -> dict:
    """max(flops / peak, bytes / bandwidth) per device for the chip of `target` (e.g. v5p-8)."""
    generation = target.split("-")[0]
    kind = {"v4": "TPU v4", "v5p": "TPU v5", "v5e": "TPU v5 lite", "v6e": "TPU v6 lite"}[generation]
    peak = flops.table_peak(kind, flops.dtype_name(dtype))
    bandwidth = tpu.TPUS[generation][4]
    compute, memory = figures["flops"] / peak, figures["bytes_accessed"] / bandwidth
    return {"compute_sec": compute, "memory_sec": memory, "step_sec": max(compute, memory)}


def sides(cfg, target: str, peer_python: str, maxtext_dir: str, config_flags: list[str]) -> list:
    """maxlm's and MaxText's compiles, both with `cfg.model.scan_layers`."""
    overrides = peer.maxtext_args(cfg, 1, "/tmp/maxlm-compare-plan", target=target)
    env = {"JAX_PLATFORMS": "cpu", "PYTHONPATH": peer.REPO}
    return [
        compare.Side("maxlm", [peer_python, "-m", "maxlm.bench", "plan", f"--target={target}", "--estimate=False",
                               *config_flags, f"--config.model.scan_layers={cfg.model.scan_layers}"], env, None,
                     maxlm_plan),
        compare.Side("maxtext", [peer_python, "-m", COMPILE_MODULE, os.path.join(maxtext_dir, "configs", "base.yml"),
                                 f"compile_topology={target}", "compile_topology_num_slices=1", *overrides],
                     {"DECOUPLE_GCLOUD": "TRUE"}, None, maxtext_plan),
    ]


def compare_plans(f) -> dict:
    """Both steps compiled for `--target`, as a JSON-ready dict."""
    if not re.fullmatch(r"v(4|5p|5e|6e)-\d+", f.target):
        cli.config_error(f"compare --target takes a TPU slice (v5p-8, v5p-64, ...), not {f.target!r}")
    if f.num_slices != 1:
        cli.config_error("compare --target compiles one slice (--num_slices=1)")
    cores = tpu.TPUS[f.target.split("-")[0]][2]
    cfg = cli.resolved_config(int(f.target.split("-")[1]) // cores, num_granules=1, platform="tpu")
    cfg.model.scan_layers = f.layers == "scanned"
    venv = os.path.abspath(f.peer_venv or os.path.join(peer.REPO, ".venv-maxtext"))
    peer.ensure_peer_venv(venv, f.peer_python)
    peer_python = os.path.join(venv, "bin", "python")
    maxtext = compare.probe(peer_python, compare.MAXTEXT_PROBE)
    config_flags = [a for a in sys.argv[1:] if a.startswith("--config")]
    both = sides(cfg, f.target, peer_python, maxtext["package_dir"], config_flags)
    peer.check_keys(both[1].command[5:], os.path.join(maxtext["package_dir"], "configs", "base.yml"))
    results = {}
    for side in both:
        peer.progress(f"compiling {side.name} for {f.target}:\n  {side.shell()}")
        results[side.name] = run = compare.run_side(side, compare.stream_output)
        del run["first_step_sec"]  # a compile has no steps
        if f.layers == "unrolled":
            run["estimate"] = estimate(run, f.target, cfg.model.dtype)
    compared = (*COSTS, *MEMORY) if f.layers == "unrolled" else MEMORY  # a scanned step's costs count one layer
    ratios = {k: results["maxlm"][k] / results["maxtext"][k] for k in compared if results["maxtext"][k]}
    if f.layers == "unrolled":
        ratios["estimated_step_sec"] = (results["maxlm"]["estimate"]["step_sec"]
                                        / results["maxtext"]["estimate"]["step_sec"])
    return {
        "benchmark": "compare_plan", "peer": "maxtext", "peer_version": maxtext["version"], "target": f.target,
        "layers": f.layers,
        "per_device": results, "ratio": ratios, "ratio_is": "maxlm / maxtext",
        "model": compare.model_summary(cfg, None), "mesh": {a: cfg.mesh[a] for a in ("data", "fsdp", "sequence", "tensor")},
        "context_parallel": peer.context_parallel_args(cfg),
        "logits_chunk_size": cfg.model.logits_chunk_size, "attention": peer.attention_of(cfg, "tpu"),
        "runtime": compare.probe(peer_python, compare.RUNTIME_PROBE) | {"libtpu": libtpu_version(peer_python)},
        "commands": {side.name: side.shell() for side in both},
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }


def libtpu_version(python: str) -> str:
    code = "import importlib.metadata as m, json; print(json.dumps(m.version('libtpu')))"
    return compare.probe(python, code)
