"""`python -m maxlm.bench plan`: the train step compiled ahead of time, and what it will need.

    result = plan(cfg)                    # for this machine's devices
    result = plan(cfg, targets.load(...)) # for a GPU host or TPU slice that is not here

Nothing runs and no state is materialised: the state and batch are ShapeDtypeStructs with their
shardings, and `jit(...).lower(...).compile()` gives XLA's buffer assignment. For a target the plan
adds an estimated step time, with its model written out (`estimate_step`).

A big model's compiles take minutes, so each phase, `compile` and (for a target) `estimate`, has
a progress line on stderr (maxlm/runtime/progress.py); stdout is the plan's JSON alone.
"""

from __future__ import annotations

import math
import re
import time

import jax
import ml_collections
import numpy as np

from maxlm import config as config_lib, model
from maxlm.bench.targets import Target
from maxlm.model import attention_plan, moe
from maxlm.observe import flops
from maxlm.optim import optimizers as optim
from maxlm.runtime import progress
from maxlm.sharding import mesh as mesh_lib, state as state_lib
from maxlm.train import step as step_lib

ESTIMATE_MODEL = ("step_sec = max(hardware FLOPs / peak FLOP/s, bytes accessed / memory bandwidth) per "
                  "device, a roofline lower bound (no communication, perfect overlap): hardware FLOPs "
                  "are the model's (6N + attention per token) plus the forward work the remat policy "
                  "recomputes; bytes are XLA's count, scaled from 1- and 2-layer compiles; mfu = model "
                  "FLOPs / (step_sec x peak), an upper bound")


def _bytes_per_device(tree) -> int:
    """Bytes one device holds of a pytree of ShapeDtypeStructs/arrays with NamedShardings (the
    largest shard, i.e. device 0's for the even splits the rules produce)."""
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
               for x in jax.tree.leaves(tree))


def compile_step(cfg, devices):
    """(compiled train step, abstract state, abstract batch) for `cfg` over `devices`."""
    rules = mesh_lib.rules_of(cfg.mesh)
    mesh = mesh_lib.make_mesh(cfg.mesh, devices)
    tx = optim.make_optimizer(cfg)
    shardings = state_lib.shardings(cfg, tx, mesh, rules, state_lib.abstract_state(cfg, tx))
    state = state_lib.abstract_state(cfg, tx, shardings)
    batch_sharding = mesh_lib.batch_sharding(mesh, rules)
    batch = {k: jax.ShapeDtypeStruct((cfg.batch_size, cfg.seq_len), np.int32, sharding=batch_sharding)
             for k in ("inputs", "targets", "segment_ids", "positions")}
    train_fn = step_lib.make_train_step(cfg, tx, mesh, rules, shardings)
    with mesh_lib.activate(mesh, rules):
        return train_fn.lower(state, batch, np.float32(1.0)).compile(), state, batch


def _model_size(cfg, platform: str) -> dict:
    """Total parameters and those one token uses (fewer in an MoE model); an MoE model's
    grouped-matmul backend on `platform`."""
    m = cfg.model
    sizes = {"params": model.count_params(m), "active_params": model.active_params(m)}
    return {**sizes, **moe.kernels(m, platform)}


def _out_of_memory(error: Exception) -> str | None:
    """XLA's message when compiling failed for want of memory (TPU compilers refuse such a step;
    GPU ones only warn), else None."""
    text = str(error)
    return text.strip().splitlines()[0][:2000] if "RESOURCE_EXHAUSTED" in text else None


def plan(cfg, target: Target | None = None, estimate: bool = True) -> dict:
    """Per-device memory of the train step over this machine's devices or `target`'s; for a target
    (and `estimate`) also the FLOPs, bytes and estimated step time (`estimate_step`)."""
    devices = list(target.devices) if target else jax.devices()
    result = {
        "benchmark": "plan", "config": cfg.name, "target": target.name if target else "",
        "device_kind": devices[0].device_kind, "device_count": len(devices),
        "process_count": len({d.process_index for d in devices}),
        "mesh": {axis: cfg.mesh[axis] for axis in config_lib.MESH_AXES},
        "dtype": cfg.model.dtype, "remat": cfg.model.remat, "scan_layers": cfg.model.scan_layers,
        **attention_plan.kernels(cfg, devices[0].platform), "grad_accum_steps": cfg.optim.grad_accum_steps,
        "shard_state_over_data": cfg.optim.shard_state_over_data, "mu_dtype": cfg.optim.mu_dtype,
        **_model_size(cfg, devices[0].platform), "batch_size": cfg.batch_size, "seq_len": cfg.seq_len,
    }
    if target:  # what JAX may allocate there
        limit = target.usable_bytes
    else:
        limit = (devices[0].memory_stats() or {}).get("bytes_limit")
    phases = ["compile", "estimate"] if target and estimate else ["compile"]
    start = time.perf_counter()
    try:
        with _phase("compile", phases, target) as line, progress.polling(line):  # one opaque compile: a heartbeat
            compiled, state, batch = compile_step(cfg, devices)
    except Exception as e:  # noqa: BLE001 - XLA's errors come as several types
        message = _out_of_memory(e)
        if message is None:
            raise
        return {**result, "device_memory_bytes": limit, "fits": False, "xla_message": message,
                "compile_sec": time.perf_counter() - start, "jax_version": jax.__version__}
    compile_sec = time.perf_counter() - start
    mem = compiled.memory_analysis()
    hlo = compiled.as_text()  # megabytes for a big model: printed once
    argument, output = int(mem.argument_size_in_bytes), int(mem.output_size_in_bytes)
    alias = int(mem.alias_size_in_bytes)  # donated state: inputs that are reused as outputs
    temp = int(mem.temp_size_in_bytes)
    # XLA's own peak where the backend reports a plausible one (GPU/TPU); the CPU backend's
    # figure leaves temp out, so there: everything live at once, an upper bound.
    peak = int(getattr(mem, "peak_memory_in_bytes", 0) or 0)
    peak_source = "xla"
    if peak < temp:
        peak, peak_source = argument + output - alias + temp, "arguments+outputs-aliased+temp"
    result.update({
        "bytes_per_device": {
            "params": _bytes_per_device(state["params"]),
            "opt_state": _bytes_per_device(state["opt_state"]),
            "batch": _bytes_per_device(batch),
            "temp": temp,  # activations and other scratch XLA allocates inside the step
            "arguments": argument, "outputs": output, "aliased": alias, "peak": peak,
        },
        "peak_source": peak_source,
        "device_memory_bytes": limit,
        "fits": None if limit is None else peak <= limit,
        # XLA's calls into libraries and kernels: __cudnn$fmha* (fused attention),
        # __cublas$lt$matmul$f8, tpu_custom_call (Pallas/Mosaic kernels such as splash attention)
        "kernels": sorted(set(re.findall(r'custom_call_target="([^"]+)"', hlo))),
        "tpu_kernels": tpu_kernels(hlo),
        "collectives": collectives(hlo),
        "compile_sec": compile_sec,
        "xla_cost": xla_cost(compiled),
    })
    if target and estimate:
        with _phase("estimate", phases, target, total=len(PROBE_LAYERS), unit="compiles") as line, \
                progress.polling(line):
            result["estimate"] = estimate_step(cfg, target, compiled, line)
    result["jax_version"] = jax.__version__
    return result


def _phase(name: str, phases: list[str], target: Target | None, total: int | None = None,
           unit: str = "units") -> progress.Progress:
    """The progress line of the plan's phase `name`: `plan [TARGET] NAME (phase K/N)`."""
    what = f"plan {target.name + ' ' if target else ''}{name}"
    if len(phases) > 1:
        what += f" (phase {phases.index(name) + 1}/{len(phases)})"
    return progress.Progress(what, total, unit)


def tpu_kernels(hlo_text: str) -> list[str]:
    """The kernels behind a TPU step's tpu_custom_calls, by name: a Pallas kernel by the jitted
    function that calls it (megablox's `gmm` and `tgmm`), one of libtpu's own by its op
    (`ragged-dot-none`, what XLA makes of jax.lax.ragged_dot on a TPU)."""
    names = set()
    for line in hlo_text.splitlines():
        if 'custom_call_target="tpu_custom_call"' in line and (op := re.search(r'op_name="([^"]+)"', line)):
            parts = op.group(1).split("/")
            name = parts[parts.index("pallas_call") - 1] if "pallas_call" in parts[1:] else parts[-1]
            names.add(re.sub(r"^jit\((.*)\)$", r"\1", name))
    return sorted(names)


COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "ragged-all-to-all", "collective-permute")


def collectives(hlo_text: str) -> dict[str, int]:
    """How many of each collective the compiled step holds (an async pair `-start`/`-done` once),
    by XLA's op name: what the mesh's axes cost in communication, e.g. `ragged-all-to-all` for the
    MoE's dropless exchange on GPUs and TPUs (model.expert_dispatch)."""
    counts = {}
    for op in re.findall(r" (" + "|".join(COLLECTIVES) + r")(?:-start)?\(", hlo_text):  # the op, not a name (%...)
        counts[op] = counts.get(op, 0) + 1
    return dict(sorted(counts.items()))


def xla_cost(compiled) -> dict:
    """XLA's own counts for the compiled step, per device: FLOPs, bytes accessed, transcendentals
    and (TPU) its optimal seconds. XLA counts a loop's body once, so with scanned layers these
    cover one layer (`estimate` extrapolates); compile with `model.scan_layers=False` for the
    whole step. Empty where the compiler gives no analysis."""
    analysis = compiled.cost_analysis() or {}
    analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis
    keys = ("flops", "bytes accessed", "transcendentals", "optimal_seconds")  # XLA's names
    return {k.replace(" ", "_"): float(analysis[k]) for k in keys if k in analysis}


def _probe_config(cfg, num_layers: int):
    """`cfg` reduced to one microbatch of `num_layers` unrolled layers, the same per device."""
    probe = ml_collections.ConfigDict(cfg.to_dict())
    probe.model.num_layers = num_layers
    probe.model.scan_layers = False
    probe.batch_size = cfg.batch_size // cfg.optim.grad_accum_steps
    probe.optim.grad_accum_steps = 1
    return probe


PROBE_LAYERS = (1, 2)  # the unrolled layer counts `probe_bytes` compiles


def probe_bytes(cfg, devices, line: progress.Progress | None = None) -> float:
    """XLA's bytes accessed per device for a whole step. XLA counts a loop's body once, whatever
    its trip count (the scanned layers, the accumulation scan), so the step is compiled twice more
    with 1 and 2 unrolled layers and one microbatch, and the count is extrapolated:
    step ≈ accumulation steps × (bytes(1) + (layers - 1) × (bytes(2) - bytes(1))). The optimizer
    update is then counted once per microbatch, so this errs high by (accumulation steps - 1)
    updates. `line` counts the compiles done."""
    counts = []
    for layers in PROBE_LAYERS:
        compiled, _, _ = compile_step(_probe_config(cfg, layers), devices)
        analysis = compiled.cost_analysis()
        analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis
        counts.append(float(analysis.get("bytes accessed", 0.0)))
        if line is not None:
            line.update(advance=1)
    return cfg.optim.grad_accum_steps * (counts[0] + (cfg.model.num_layers - 1) * (counts[1] - counts[0]))


def estimate_step(cfg, target: Target, compiled, line: progress.Progress | None = None) -> dict:
    """A step time and MFU for `target` (ESTIMATE_MODEL), per device; none where its compiler gives
    no cost analysis (`compiled`, the step's, tells). `line` counts its compiles."""
    if not compiled.cost_analysis():
        return {"model": "none: this compiler gives no cost analysis without the device"}
    devices = list(target.devices)
    peak = flops.peak_flops(devices, cfg.model.dtype)["per_device_flops_per_sec"]
    tokens_per_device = cfg.batch_size * cfg.seq_len / len(devices)
    model_flops = flops.flops_per_token(cfg.model, cfg.seq_len) * tokens_per_device
    hardware_flops = flops.hardware_flops_per_token(cfg.model, cfg.seq_len) * tokens_per_device
    bytes_accessed = probe_bytes(cfg, devices, line)
    compute_sec = hardware_flops / peak
    memory_sec = bytes_accessed / target.memory_bytes_per_sec
    step_sec = max(compute_sec, memory_sec)
    return {
        "model": ESTIMATE_MODEL,
        "model_flops_per_device": model_flops,
        "hardware_flops_per_device": hardware_flops,
        "bytes_accessed_per_device": bytes_accessed,
        "peak_flops_per_device": peak,
        "memory_bytes_per_sec": target.memory_bytes_per_sec,
        "compute_sec": compute_sec,
        "memory_sec": memory_sec,
        "step_sec": step_sec,
        "tokens_per_sec": cfg.batch_size * cfg.seq_len / step_sec,
        "mfu": model_flops / (step_sec * peak),
    }
