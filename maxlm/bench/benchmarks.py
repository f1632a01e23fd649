"""Benchmarks that print one JSON object: `python -m maxlm.bench [train] --config=configs/NAME.py`.

`train` (the default) times the real jitted train step (same shardings, donation and optimizer as
`maxlm.train`) on synthetic token batches, so the figure is the model's speed, independent of the
input pipeline. Warm-up steps (compilation included) are excluded; every timed step is waited
for, and the median is reported with the spread.

`plan` compiles the train step ahead of time for the configured mesh (abstract state and batch,
nothing executed) and reports per-device bytes: parameters, optimizer state, batch, and XLA's
temp (activations) and peak figures, whether that fits the device's memory when known, and the
kernels XLA called (cuDNN attention, cuBLAS float8 GEMMs, ...). With `--target=h100x8` (or h200x8, h100x16: GPUxN) it
compiles for that hardware instead of this machine's (maxlm/bench/targets: no GPU needed).

`prepare` writes a generated corpus (`--corpus_mb`, `--corpus_files`) and times the data
`prepare` of it with each of `--prepare_workers` processes, checks that they wrote the same shards,
then reads the shards back (rows/s, and a reader's peak memory).

`attention` compares cuDNN's fused attention with the XLA path at the config's shapes (GPU only):
largest differences of outputs and gradients, and each one's forward+backward time.

`grouped_matmul` times the dropless MoE's grouped matmul on each backend at the config's shapes
(maxlm/bench/grouped_matmul_timing.py).

`compare --peer=maxtext` runs `train` and MaxText's trainer for the same model, batch and optimizer
on the CPU, each in its own process, in interleaved pairs: each side's tokens/s and time to first
step, and their ratios (maxlm/bench/compare.py).
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from maxlm import cli, config as config_lib, model
from maxlm.bench import targets
from maxlm.bench.plan import plan
from maxlm.observe import flops
from maxlm.optim import optimizers as optim
from maxlm.runtime import distributed
from maxlm.sharding import mesh as mesh_lib, state as state_lib
from maxlm.train import step as step_lib


class SyntheticData:
    """Random tokens, one document per row: the shape and cost of a real packed batch, served like
    `data.TokenDataset.batch` (every step the same global batch; a process gets its rows)."""

    def __init__(self, cfg):
        B, L = cfg.batch_size, cfg.seq_len
        tokens = np.random.default_rng(cfg.seed).integers(3, cfg.model.vocab_size, size=(B, L + 1), dtype=np.int32)
        self.rows = {
            "inputs": tokens[:, :-1],
            "targets": tokens[:, 1:],
            "segment_ids": np.ones((B, L), np.int32),
            "positions": np.broadcast_to(np.arange(L, dtype=np.int32), (B, L)).copy(),
        }

    def batch(self, step: int, parts, count: int) -> dict:
        parts = (parts,) if isinstance(parts, int) else parts
        size = len(self.rows["inputs"]) // count
        rows = np.concatenate([np.arange(p * size, (p + 1) * size) for p in parts])
        return {k: v[rows] for k, v in self.rows.items()}


def bench_train(cfg, warmup_steps: int, timed_steps: int, profile_dir: str = "") -> dict:
    """Times the train step; with `profile_dir`, then traces two more steps there (untimed, so the
    profiler's overhead never reaches the figures)."""
    rules = mesh_lib.rules_of(cfg.mesh)
    mesh = mesh_lib.make_mesh(cfg.mesh)
    tx = optim.make_optimizer(cfg)
    state, shardings = state_lib.create_sharded_state(cfg, tx, mesh, rules, jax.random.key(cfg.seed))
    train_fn = step_lib.make_train_step(cfg, tx, mesh, rules, shardings)
    batch = mesh_lib.read_batch(SyntheticData(cfg), 0, mesh, rules)

    # On CPU the peak is probed after every timed step, in the same window as the step it divides
    on_cpu = jax.devices()[0].platform == "cpu"
    times, probes = [], []
    compile_start = time.perf_counter()
    for i in range(warmup_steps + timed_steps):
        start = time.perf_counter()
        with mesh_lib.activate(mesh, rules):
            state, step_metrics = train_fn(state, batch, np.float32(1.0))
        jax.block_until_ready(step_metrics)
        if i == 0:
            compile_sec = time.perf_counter() - compile_start
            print("bench: step 0 done", file=sys.stderr, flush=True)  # bench compare's mark
        if i >= warmup_steps:
            times.append(time.perf_counter() - start)
            if on_cpu:  # one device's matmul, outside the step's mesh
                probes.append(flops.matmul_flops_per_sec(jax.devices()[0], flops.CPU_PROBE_DTYPE))
    with mesh_lib.activate(mesh, rules):
        if profile_dir:
            with jax.profiler.trace(profile_dir, create_perfetto_trace=True):
                for _ in range(2):
                    state, step_metrics = train_fn(state, batch, np.float32(1.0))
                jax.block_until_ready(step_metrics)

    step_sec = statistics.median(times)
    tokens_per_step = cfg.batch_size * cfg.seq_len
    tokens_per_sec = tokens_per_step / step_sec
    flops_per_token = flops.flops_per_token(cfg.model, cfg.seq_len)
    peak = flops.peak_flops(jax.devices(), cfg.model.dtype)
    peak_total, mfu = peak["total_flops_per_sec"], None
    if probes:  # each step against the probe read right after it; the median of those
        peak_total, peak["source"] = statistics.median(probes), "measured between the timed steps"
        mfu = statistics.median(tokens_per_step * flops_per_token / (t * p) for t, p in zip(times, probes))
    return {
        "benchmark": "train_step",
        "config": cfg.name,
        "tokens_per_sec": tokens_per_sec,
        "model_tflops_per_sec": tokens_per_sec * flops_per_token / 1e12,
        "mfu": mfu if mfu is not None else flops.mfu(tokens_per_sec, flops_per_token, peak_total),
        "peak_tflops_per_sec": peak_total / 1e12,
        "peak_source": peak["source"],
        **({"peak_probe_tflops_per_sec": {"median": peak_total / 1e12, "min": min(probes) / 1e12,
                                          "max": max(probes) / 1e12, "count": len(probes)}} if probes else {}),
        "device_kind": peak["device_kind"],
        "device_count": jax.device_count(),
        "process_count": jax.process_count(),
        "mesh": {axis: cfg.mesh[axis] for axis in config_lib.MESH_AXES},
        "pipeline_microbatches": cfg.model.pipeline_microbatches,
        "pipeline_repeats": cfg.model.pipeline_repeats,
        "pipeline_bubble_fraction": model.bubble_fraction(cfg.mesh.stage, cfg.model.pipeline_microbatches,
                                                          cfg.model.pipeline_repeats),
        "params": model.count_params(cfg.model),
        "active_params": model.active_params(cfg.model),
        "training_flops_per_token": flops_per_token,
        "batch_size": cfg.batch_size,
        "seq_len": cfg.seq_len,
        "dtype": cfg.model.dtype,
        "step_sec_median": step_sec,
        "step_sec_min": min(times),
        "step_sec_max": max(times),
        "timed_steps": timed_steps,
        "warmup_steps": warmup_steps,
        "first_step_sec_incl_compile": compile_sec,
        # what the allocator held at most (GPU/TPU; the CPU backend keeps no statistics)
        "peak_memory_bytes": (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use"),
        "final_loss": float(step_metrics["loss"]),
        "jax_version": jax.__version__,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        **({"profile_dir": profile_dir} if profile_dir else {}),
    }


def bench_checkpoint(cfg, repeats: int = 3) -> dict:
    """Per tier (persistent: the workdir's orbax checkpoints; local: checkpoint.local_dir, a temp
    dir when unset): the save stall (what the loop blocks for), the full save and the restore of
    `cfg`'s train state, each the median of `repeats`."""
    import tempfile

    from maxlm.checkpoint import store as checkpoint

    rules = mesh_lib.rules_of(cfg.mesh)
    mesh = mesh_lib.make_mesh(cfg.mesh)
    tx = optim.make_optimizer(cfg)
    state, shardings = state_lib.create_sharded_state(cfg, tx, mesh, rules, jax.random.key(cfg.seed))
    jax.block_until_ready(state)
    abstract = state_lib.abstract_state(cfg, tx, shardings)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
    figures, given = {}, cfg.checkpoint.local_dir
    with tempfile.TemporaryDirectory(dir=os.environ.get("MAXLM_BENCH_DIR")) as workdir:
        checkpoint_cfg = cfg.checkpoint.to_dict()
        checkpoint_cfg["local_dir"] = given or os.path.join(workdir, "local-{process}")
        ckpt = checkpoint.Checkpointer(workdir, config_lib.ml_collections.ConfigDict(checkpoint_cfg))
        for tier, kind in (("persistent", "regular"), ("local", "local")):
            stall, full, restore = [], [], []
            for i in range(repeats):
                step = 2 * i + (1 if tier == "persistent" else 2)
                ckpt.wait()
                start = time.perf_counter()
                ckpt.save(step, state, {"seed": cfg.seed}, cfg.to_dict(), kind=kind)
                stall.append(time.perf_counter() - start)
                ckpt.wait()
                full.append(time.perf_counter() - start)
                start = time.perf_counter()
                if tier == "persistent":
                    restored, _ = checkpoint.restore_state(os.path.join(ckpt.directory, str(step)), abstract)
                else:
                    restored, _ = ckpt.local.restore(abstract, lambda state, step: None, at_least=step)
                jax.block_until_ready(restored)
                restore.append(time.perf_counter() - start)
                del restored
            figures[tier] = {"save_stall_sec": statistics.median(stall), "save_full_sec": statistics.median(full),
                             "restore_sec": statistics.median(restore),
                             "stall_fraction_of_save": statistics.median(stall) / statistics.median(full),
                             "save_gb_per_sec": nbytes / statistics.median(full) / 1e9,
                             "all": {"stall": stall, "full": full, "restore": restore}}
        ckpt.close()
    return {
        "benchmark": "checkpoint",
        "config": cfg.name,
        "params": model.count_params(cfg.model),
        "state_bytes": nbytes,
        "device_count": jax.device_count(),
        "process_count": jax.process_count(),
        "mesh": {axis: cfg.mesh[axis] for axis in config_lib.MESH_AXES},
        "local_dir": given or "a temp dir beside the workdir",
        **figures,
        "repeats": repeats,
    }


def bench_attention(cfg, timed_steps: int) -> dict:
    """cuDNN against XLA attention at the config's shapes (one layer's q, k, v; packed documents):
    the largest differences of the outputs and of the three gradients, and each one's median
    forward+backward time. Needs an NVIDIA GPU (cuDNN)."""
    from maxlm.model import attention

    m = cfg.model
    B, L, dtype = cfg.batch_size, cfg.seq_len, model.compute_dtype(m)
    keys = jax.random.split(jax.random.key(cfg.seed), 4)
    q = jax.random.normal(keys[0], (B, L, m.num_heads, m.head_dim), dtype)
    k, v = (jax.random.normal(key, (B, L, m.num_kv_heads, m.head_dim), dtype) for key in keys[1:3])
    cotangent = jax.random.normal(keys[3], q.shape, jnp.float32)
    doc_len = np.random.default_rng(cfg.seed).integers(L // 8, L // 2, size=(B, 16)).cumsum(axis=1)
    segment_ids = jnp.asarray((np.arange(L)[None, :, None] >= doc_len[:, None, :]).sum(-1) + 1, jnp.int32)

    def fwd_bwd(backend):
        def loss(q, k, v):
            mask = attention.document_mask(backend, segment_ids, dtype)
            out = attention.attend(backend, q, k, v, mask, segment_ids)
            return (out.astype(jnp.float32) * cotangent).sum(), out
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))

    results, times = {}, {}
    for backend in ("cudnn", "xla"):
        fn = fwd_bwd(backend)
        results[backend] = jax.block_until_ready(fn(q, k, v))  # compiles
        runs = []
        for _ in range(timed_steps):
            start = time.perf_counter()
            jax.block_until_ready(fn(q, k, v))
            runs.append(time.perf_counter() - start)
        times[backend] = statistics.median(runs)
    (_, out_c), grads_c = results["cudnn"]
    (_, out_x), grads_x = results["xla"]
    names = ("out", "dq", "dk", "dv")
    cudnn_arrays = [x.astype(jnp.float32) for x in (out_c, *grads_c)]
    xla_arrays = [x.astype(jnp.float32) for x in (out_x, *grads_x)]

    def largest(x) -> float:
        return float(jnp.abs(x).max())

    return {
        "benchmark": "attention", "config": cfg.name, "device_kind": jax.devices()[0].device_kind,
        "batch_size": B, "seq_len": L, "heads": m.num_heads, "kv_heads": m.num_kv_heads,
        "head_dim": m.head_dim, "dtype": str(jnp.dtype(dtype)), "timed_steps": timed_steps,
        "fwd_bwd_sec_median": times, "cudnn_speedup": times["xla"] / times["cudnn"],
        # the differences, and the XLA values' own size to read them against
        "max_abs_diff": {n: largest(c - x) for n, c, x in zip(names, cudnn_arrays, xla_arrays)},
        "max_abs": {n: largest(x) for n, x in zip(names, xla_arrays)},
        "jax_version": jax.__version__,
    }


def bench_data(cfg) -> dict:
    """Data-pipeline tokens/s per core: packed reading, tokenize+pack vs raw sentencepiece."""
    from maxlm.bench import throughput

    return throughput.measure(cfg)


def main(argv) -> None:
    from absl import flags

    what = argv[1] if len(argv) > 1 else "train"
    if what not in ("train", "data", "prepare", "checkpoint", "plan", "attention", "grouped_matmul", "compare"):
        cli.config_error(f"unknown benchmark {what!r}; available: train, data, prepare, checkpoint, plan, "
                         "attention, grouped_matmul, compare")
    cli.setup_logging()
    if what == "compare":  # two code bases, each in its own processes: nothing to initialise here
        from maxlm.bench import compare, compare_plan

        f = flags.FLAGS  # --target: both train steps compiled for a TPU slice, not run
        run = functools.partial(compare_plan.compare_plans, f) if f.target else compare.compare
        print(json.dumps(compare.main(run), indent=2))
        return
    if flags.FLAGS.target:  # compiled for hardware that is not here: nothing to initialise
        if what != "plan":
            cli.config_error(f"--target is for `plan` only, not {what!r}")
        targets.prepare()
        try:
            target = targets.load(flags.FLAGS.target, flags.FLAGS.num_slices)
        except config_lib.ConfigError as e:
            cli.config_error(str(e))
        # granules: TPU slices, or GPU hosts (processes), as mesh.dcn_* counts them
        granules = target.slices if target.platform == "tpu" else target.hosts
        cfg = cli.resolved_config(len(target.devices), num_granules=granules, platform=target.platform)
        result = plan(cfg, target, estimate=flags.FLAGS.estimate)
    else:
        distributed.initialize()  # a multi-process benchmark: JAX_COORDINATOR_ADDRESS or auto
        result = run_benchmark(what, cli.resolved_config(jax.device_count()))
    if jax.process_index() == 0:  # every process measured its part; one prints
        print(json.dumps(result, indent=2))


def run_benchmark(what: str, cfg) -> dict:
    """The named benchmark on this machine's devices."""
    from absl import flags

    if what == "checkpoint":  # blocking part of an async save, full save, restore
        return bench_checkpoint(cfg)
    if what == "plan":  # per-device memory, compiled ahead of time; nothing executes
        return plan(cfg)
    if what == "attention":  # cuDNN against XLA: differences and times (GPU)
        return bench_attention(cfg, flags.FLAGS.steps)
    if what == "grouped_matmul":  # the MoE's grouped matmul on each backend against a dense one
        from maxlm.bench.grouped_matmul_timing import bench_grouped_matmul

        if not cfg.model.num_experts:
            cli.config_error("bench grouped_matmul needs an MoE model: set model.num_experts > 0")
        return bench_grouped_matmul(cfg, flags.FLAGS.steps)
    if what in ("data", "prepare"):
        try:
            if what == "prepare":  # a generated corpus prepared by 1 and 2 workers, read back
                from maxlm.bench import throughput

                f = flags.FLAGS
                return throughput.measure_prepare(cfg, f.corpus_mb, f.corpus_files,
                                                  [int(w) for w in f.prepare_workers])
            return bench_data(cfg)
        except ValueError as e:  # bad data: one line, exit 2
            cli.config_error(str(e))
    return bench_train(cfg, flags.FLAGS.warmup_steps, flags.FLAGS.steps, flags.FLAGS.profile_dir)


def define_flags() -> None:
    from absl import flags

    flags.DEFINE_integer("warmup_steps", 3, "Untimed steps first (the first one compiles).")
    flags.DEFINE_float("corpus_mb", 1024, "prepare: size of the generated corpus.")
    flags.DEFINE_integer("corpus_files", 16, "prepare: files of the generated corpus.")
    flags.DEFINE_list("prepare_workers", ["1", "2"], "prepare: the worker counts to time, in order.")
    flags.DEFINE_integer("steps", 10, "Timed steps; the median is reported.")
    flags.DEFINE_string("target", "", "plan: compile for this hardware instead of this machine's: "
                        "GPUxN (N GPUs on hosts of 8) or a Cloud TPU slice, e.g. " + ", ".join(targets.NAMES)
                        + " (needs JAX's CUDA plugin or libtpu, no accelerator).")
    flags.DEFINE_bool("estimate", True, "plan --target: also estimate the step time and MFU (two more "
                      "compiles, of 1 and 2 layers: see maxlm/bench/plan.py).")
    flags.DEFINE_integer("num_slices", 1, "plan --target=TPU slice: that many slices over the "
                         "data-center network (set mesh.dcn_data or dcn_fsdp to match).")
    flags.DEFINE_string("profile_dir", "", "train: also trace two untimed steps into this directory "
                        "(jax.profiler: TensorBoard's profile plugin or Perfetto).")
    from maxlm.bench import compare

    compare.define_flags()

