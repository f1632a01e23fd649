"""The training loop: `python -m maxlm.train --config=configs/NAME.py --workdir=DIR`.

One step, end to end: `data.batch(step)` (numpy, this process's rows) → a global jax.Array sharded
over (data, fsdp) → `train_step` (jit with in/out shardings, the state donated) → metrics written
one step late so reading them never stalls the device → orbax checkpoint every
`checkpoint.every_steps`. Rerunning with the same DIR resumes from the newest checkpoint.
"""

from __future__ import annotations

import functools
import logging
import math
import sys
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from maxlm import checkpoint, cli, config as config_lib, distributed, fp8, loss_scale, mesh as mesh_lib, metrics, model, optim, paths, profiler
from maxlm.data import make_dataset

log = logging.getLogger("maxlm")

State = dict[str, Any]  # {"step", "params", "opt_state", "skipped_steps", "bad_streak"} + float16:
#                        loss_scale.STATE_KEYS {"loss_scale", "good_steps", "overflow_steps"}


# "Preempted, checkpoint committed": 128 + SIGTERM, what schedulers already read as "terminated
# by SIGTERM" and retry (Kubernetes/GKE Job restart and podFailurePolicy rules, SLURM requeue
# scripts); 0 would tell them the run is finished and stop the requeue.
PREEMPTED_EXIT = 143


class NonFiniteLossError(RuntimeError):
    """Non-finite steps kept coming back after restoring the last good checkpoint (exit 3)."""


# ----------------------------------------------------------------------------- state and shardings


def init_state(cfg, tx: optax.GradientTransformation, rng: jax.Array) -> State:
    params = model.init_params(cfg.model, rng)
    zero = jnp.zeros((), jnp.int32)
    state = {"step": zero, "params": params, "opt_state": tx.init(params),
             "skipped_steps": zero, "bad_streak": zero}  # non-finite steps: total, consecutive
    if loss_scale.enabled(cfg):
        state.update(loss_scale.init(cfg.optim))
    return state


def state_logical_specs(cfg, tx: optax.GradientTransformation, abstract_state: State) -> State:
    """Logical PartitionSpecs for the whole state: optimizer moments follow their parameter."""
    param_specs = model.param_logical_specs(cfg.model)
    opt_specs = optax.tree_map_params(
        tx,
        lambda _, spec: spec,
        abstract_state["opt_state"],
        param_specs,
        transform_non_params=lambda _: PartitionSpec(),
        is_leaf=model.is_spec,
    )
    # every other entry (step, counters, loss scale) is a replicated scalar
    return {**{key: PartitionSpec() for key in abstract_state},
            "params": param_specs, "opt_state": opt_specs}


def _add_data_axis(shape, spec: PartitionSpec, logical: PartitionSpec, sizes) -> PartitionSpec:
    """ZeRO-1: `spec` (mesh axes) with `data` added to one dim: the `embed` dim if its size divides
    by its current shards × data, else the first dim that does; unchanged if none does (small
    vectors) or `data` is already used. `sizes`: the mesh's {axis: size}."""
    pad = lambda t: (*t, *(None,) * (len(shape) - len(t)))
    axes = [() if a is None else (a,) if isinstance(a, str) else tuple(a) for a in pad(spec)]
    if sizes["data"] == 1 or any("data" in a for a in axes):
        return spec
    names = pad(logical)
    for i in sorted(range(len(shape)), key=lambda i: names[i] != "embed"):  # embed first
        if shape[i] % (math.prod(sizes[a] for a in axes[i]) * sizes["data"]) == 0:
            axes[i] = (*axes[i], "data")
            return PartitionSpec(*(None if not a else a[0] if len(a) == 1 else a for a in axes))
    return spec


def state_shardings(cfg, tx, mesh, rules, abstract: State) -> State:
    """NamedShardings of the whole state: `state_logical_specs` through the mesh rules, then, with
    `optim.shard_state_over_data` (ZeRO-1), Adam's moments also split over `data`. Parameters stay
    replicated over `data`; GSPMD reduce-scatters the gradients into the moments' shards and
    all-gathers the updated parameters."""
    shardings = mesh_lib.logical_to_shardings(state_logical_specs(cfg, tx, abstract), mesh, rules)
    if not cfg.optim.get("shard_state_over_data", False) or mesh.shape["data"] == 1:
        return shardings

    def zero1(leaf, logical):
        spec = nn.logical_to_mesh_axes(logical, rules)
        return NamedSharding(mesh, _add_data_axis(leaf.shape, spec, logical, mesh.shape))

    opt = optax.tree_map_params(
        tx, zero1, abstract["opt_state"], model.param_logical_specs(cfg.model),
        transform_non_params=lambda _: mesh_lib.replicated(mesh), is_leaf=model.is_spec,
    )
    return dict(shardings, opt_state=opt)


def create_sharded_state(cfg, tx, mesh, rules, rng):
    """Initialises the state directly into its shards: no device ever holds the full state.

    Returns (state, state_shardings).
    """
    init = functools.partial(init_state, cfg, tx)
    abstract = jax.eval_shape(init, rng)
    shardings = state_shardings(cfg, tx, mesh, rules, abstract)
    with mesh_lib.activate(mesh, rules):
        state = jax.jit(init, out_shardings=shardings)(rng)
    return state, shardings


def abstract_shapes(cfg, tx) -> State:
    return jax.eval_shape(functools.partial(init_state, cfg, tx), jax.random.key(0))


def abstract_state(cfg, tx, shardings) -> State:
    """ShapeDtypeStructs with shardings: orbax's restore target."""
    shapes = abstract_shapes(cfg, tx)
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings
    )


def with_missing_from(restored: State, fallback: State, source: str) -> State:
    """`restored` plus the entries its checkpoint lacked, from `fallback`: only the loss scale can
    be missing (checkpoint.restore_state), when a float16 run resumes a checkpoint written
    without float16 compute (or before loss scaling existed)."""
    if any(key not in restored for key in fallback):
        _warning(f"the checkpoint of step {int(restored['step'])} in {source} has no loss scale "
                 f"(written without float16 compute): using {float(fallback['loss_scale']):g}")
    return {**fallback, **restored}


# ----------------------------------------------------------------------------- steps


def _all_finite(tree) -> jax.Array:
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def _microbatches(batch, n: int):
    """[B, ...] → [n, B/n, ...], microbatch i = rows i, i+n, i+2n, ...

    Strided rather than contiguous rows: with the batch sharded over (data, fsdp) in contiguous
    blocks, every device then holds B/(n·devices) rows of *every* microbatch, so slicing one out
    moves no data (config.resolve checks B % (n·data·fsdp) == 0).
    """

    def split(x):
        x = nn.with_logical_constraint(x.reshape(x.shape[0] // n, n, *x.shape[1:]),
                                       ("batch", None, "length"))
        return nn.with_logical_constraint(x.swapaxes(0, 1), (None, "batch", "length"))

    return jax.tree.map(split, batch)


def loss_and_grads(cfg, params, batch, scale=None):
    """((loss, aux), grads) of the whole batch, as `jax.value_and_grad(model.loss_fn)` gives them.

    With `optim.grad_accum_steps` = n > 1, a `lax.scan` runs forward + backward on one microbatch
    (B/n rows) at a time, so activations scale with the microbatch. The loss is a mean over the
    batch's non-padding tokens, so each microbatch's mean loss and gradients are weighted by its
    token count and the sums divided by the batch's: the result equals the large-batch step (up to
    float summation order), however unevenly padding falls.

    With a loss `scale` (float16 compute, see maxlm/loss_scale.py) each microbatch's objective is
    multiplied by it before differentiating and the summed gradients divided by it in float32: the
    loss and gradients returned are unscaled (non-finite where the float16 backward overflowed).
    """
    loss_fn = functools.partial(model.loss_fn, cfg.model)
    if scale is None:
        grad_fn, unscale = jax.value_and_grad(loss_fn, has_aux=True), lambda grads: grads
    else:
        grad_fn = loss_scale.value_and_scaled_grad(loss_fn, scale)
        unscale = functools.partial(loss_scale.unscale, loss_scale=scale)
    n = cfg.optim.get("grad_accum_steps", 1)
    if n == 1:
        (loss, aux), grads = grad_fn(params, batch)
        return (loss, aux), unscale(grads)

    def body(carry, micro):
        (loss_i, aux_i), grads_i = grad_fn(params, micro)
        w = aux_i["num_tokens"]  # the microbatch's mean × its tokens = its loss sum
        sums = {"loss": loss_i * w, "cross_entropy": aux_i["cross_entropy"] * w, "num_tokens": w,
                "grads": jax.tree.map(lambda g: g * w, grads_i)}
        return jax.tree.map(jnp.add, carry, sums), None

    zero = jnp.zeros((), jnp.float32)
    init = {"loss": zero, "cross_entropy": zero, "num_tokens": zero,
            "grads": jax.tree.map(jnp.zeros_like, params)}
    sums, _ = jax.lax.scan(body, init, _microbatches(batch, n))
    denom = jnp.maximum(sums["num_tokens"], 1.0)
    grads = jax.tree.map(lambda g: g / denom, sums["grads"])
    aux = {"num_tokens": sums["num_tokens"], "cross_entropy": sums["cross_entropy"] / denom}
    return (sums["loss"] / denom, aux), unscale(grads)


def train_step(cfg, tx, schedule, state: State, batch, inject_nan=None) -> tuple[State, dict]:
    """One update; a step whose loss, gradient norm or new state is NaN/inf is not applied.

    A skipped step still advances `step` (its batch is consumed: the data position stays a pure
    function of the step) and counts in `skipped_steps` and `bad_streak` (reset by a good step).
    `inject_nan` (fault injection, `debug.nan_at_step`) makes this step's gradients NaN.

    With float16 compute the state carries a dynamic loss scale (maxlm/loss_scale.py): non-finite
    gradients while the scale can still halve are an overflow, skipped and counted in
    `overflow_steps` but not a bad step (`bad_streak` neither grows nor resets).
    """
    scale = state.get("loss_scale")  # None: no loss scaling (float32 / bfloat16 compute)
    (loss, aux), grads = loss_and_grads(cfg, state["params"], batch, scale)
    if inject_nan is not None:
        grads = jax.tree.map(lambda g: jnp.where(inject_nan, jnp.nan, g), grads)
    grad_norm = optax.tree.norm(grads)  # before clipping
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    # how far this step moved the weights, relative to their size (~1e-3 is typical for Adam)
    update_ratio = optax.tree.norm(updates) / optax.tree.norm(state["params"])
    grads_finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    ok = grads_finite & _all_finite(params) & _all_finite(opt_state)
    keep_if_bad = functools.partial(jax.tree.map, lambda new, old: jnp.where(ok, new, old))
    params = keep_if_bad(params, state["params"])
    opt_state = keep_if_bad(opt_state, state["opt_state"])
    bad = ~ok
    if scale is not None:
        bad &= ~loss_scale.overflowed(cfg.optim, state, grads_finite)
    bad = bad.astype(jnp.int32)
    new_state = {
        "step": state["step"] + 1,
        "params": params,
        "opt_state": opt_state,
        "skipped_steps": state["skipped_steps"] + bad,
        "bad_streak": jnp.where(ok, 0, state["bad_streak"] + bad),
    }
    step_metrics = {
        "loss": aux["cross_entropy"],  # plain next-token loss; `loss` above adds z-loss etc.
        "grad_norm": grad_norm,
        "param_norm": optax.tree.norm(params),
        "update_ratio": jnp.where(ok, update_ratio, 0.0),  # 0: the update was not applied
        "lr": schedule(state["step"]),  # the rate this update used
        "num_tokens": aux["num_tokens"],
        "skipped_steps": new_state["skipped_steps"],
        "bad_streak": new_state["bad_streak"],
    }
    if scale is not None:
        new_state.update(loss_scale.update(cfg.optim, state, grads_finite, applied=ok))
        step_metrics.update(loss_scale=scale,  # the scale this step used, as `lr`
                            overflow_steps=new_state["overflow_steps"])
    return new_state, step_metrics


def eval_step(cfg, params, batch) -> dict:
    _, aux = model.loss_fn(cfg.model, params, batch)
    return {"loss_sum": aux["cross_entropy"] * aux["num_tokens"], "num_tokens": aux["num_tokens"]}


def compile_steps(cfg, tx, mesh, rules, state_shardings, inject_nan: bool = False):
    """The jitted train and eval steps with explicit in/out shardings.

    With `inject_nan` the train step takes a third argument, a bool scalar (fault injection).
    """
    schedule = optim.learning_rate_schedule(cfg.optim)
    batch_sharding = mesh_lib.batch_sharding(mesh, rules)
    scalars = mesh_lib.replicated(mesh)
    train = jax.jit(
        functools.partial(train_step, cfg, tx, schedule),
        in_shardings=(state_shardings, batch_sharding) + ((scalars,) if inject_nan else ()),
        out_shardings=(state_shardings, scalars),
        donate_argnums=(0,),  # the old state's buffers become the new state's
    )
    evaluate = jax.jit(
        functools.partial(eval_step, cfg),
        in_shardings=(state_shardings["params"], batch_sharding),
        out_shardings=scalars,
    )
    return train, evaluate


def global_batch(numpy_batch: dict, mesh, rules) -> dict:
    """This process's rows → one global array per key, sharded over (data, fsdp)."""
    sharding = mesh_lib.batch_sharding(mesh, rules)
    return {
        k: jax.make_array_from_process_local_data(sharding, np.asarray(v))
        for k, v in numpy_batch.items()
    }


# ----------------------------------------------------------------------------- the loop


def _host_batch(dataset, step: int, mesh, rules):
    """This process's rows of global batch `step`: the parts of it its devices hold (one block of
    B/P rows on a plain mesh; see `mesh.batch_parts`), so the global batch is the same on any
    mesh and process count."""
    parts, count = mesh_lib.batch_parts(mesh, rules)
    return dataset.batch(step, parts[0] if len(parts) == 1 else parts, count)


def evaluate(cfg, eval_fn, params, dataset, mesh, rules) -> float:
    totals = [eval_fn(params, global_batch(_host_batch(dataset, i, mesh, rules), mesh, rules)) for i in range(cfg.eval.steps)]
    loss_sum = sum(float(t["loss_sum"]) for t in totals)
    return loss_sum / max(sum(float(t["num_tokens"]) for t in totals), 1.0)


def _format(step: int, row: dict, eta_sec: float | None = None) -> str:
    """One console line: `step 100 | loss 2.3456 | ... | tokens/s 41,000 | mfu 16.5% | eta 1h02m`."""
    parts = [f"step {step:>6}"]
    for key, label, fmt in (("loss", "loss", "{:.4f}"), ("eval_loss", "eval_loss", "{:.4f}"),
                            ("eval_perplexity", "eval_ppl", "{:.2f}"), ("lr", "lr", "{:.2e}"),
                            ("grad_norm", "grad_norm", "{:.3f}"), ("loss_scale", "loss_scale", "{:g}"),
                            ("tokens_per_sec", "tokens/s", "{:,.0f}"), ("mfu", "mfu", "{:.1%}")):
        if key in row:
            parts.append(f"{label} " + fmt.format(row[key]))
    if eta_sec is not None:
        parts.append(f"eta {metrics.format_eta(eta_sec)}")
    return " | ".join(parts)


def load_data(cfg):
    """(train, validation) datasets; raises ValueError on bad data, before anything compiles."""
    train_data = make_dataset(cfg, "train")
    eval_data = make_dataset(cfg, "validation") if cfg.eval.every_steps else None
    return train_data, eval_data


def _with_lr_scale(cfg, lr_scale: float):
    if lr_scale == 1.0:
        return cfg
    scaled = ml_collections.ConfigDict(cfg.to_dict())
    scaled.optim.lr = cfg.optim.lr * lr_scale
    return scaled


def train_and_evaluate(cfg, workdir: str, data=None) -> dict:
    """Trains `cfg` (already resolved) in `workdir`, resuming from its newest good checkpoint.

    `data` is `load_data(cfg)`'s result, loaded here when None. Returns the last training row.
    Raises checkpoint.Preempted after SIGTERM (its checkpoint committed) and NonFiniteLossError
    when non-finite steps persist after `checkpoint.max_restores` restores.
    """
    train_data, eval_data = data if data is not None else load_data(cfg)
    rules = mesh_lib.rules_of(cfg.mesh)
    mesh = mesh_lib.make_mesh(cfg.mesh)
    out = paths.workdir_path(workdir)  # a local directory or gs://... alike: see maxlm/paths.py
    out.mkdir(parents=True, exist_ok=True)
    if jax.process_index() == 0:
        (out / "config.json").write_text(config_lib.to_json(cfg))
    ckpt_cfg = cfg.checkpoint

    tx = optim.make_optimizer(cfg.optim)
    init_rng = jax.random.key(cfg.seed)
    state, shardings = create_sharded_state(cfg, tx, mesh, rules, init_rng)
    abstract = abstract_state(cfg, tx, shardings)
    ckpt = checkpoint.Checkpointer(workdir, ckpt_cfg)
    lr_scale = 1.0
    restored = ckpt.restore_latest(abstract)
    if restored is not None:
        state, meta = with_missing_from(restored[0], state, ckpt.directory), restored[1]
        lr_scale = float(meta.get("lr_scale", 1.0))
        log.info("resumed from %s at step %d", ckpt.directory, int(state["step"]))
    elif ckpt_cfg.restore_from:
        path = checkpoint.resolve_restore_from(ckpt_cfg.restore_from)
        loaded, _ = checkpoint.restore_state(path, abstract, params_only=ckpt_cfg.restore_params_only)
        state = dict(state, params=loaded["params"]) if ckpt_cfg.restore_params_only else \
            with_missing_from(loaded, state, path)
        log.info("started from %s (%s)", path, "params only" if ckpt_cfg.restore_params_only else "full state")
    elif ckpt_cfg.get("init_from_hf"):  # a Hugging Face Llama folder: params only, step 0
        from maxlm import hf

        state = dict(state, params=hf.load_params(ckpt_cfg.init_from_hf, cfg.model, shardings["params"]))
        log.info("started from Hugging Face checkpoint %s (params only)", ckpt_cfg.init_from_hf)

    injecting = cfg.debug.nan_at_step >= 0
    injected: set[int] = set()

    def build(scale):
        run_cfg = _with_lr_scale(cfg, scale)
        return compile_steps(run_cfg, optim.make_optimizer(run_cfg.optim), mesh, rules, shardings,
                             inject_nan=injecting)

    train_fn, eval_fn = build(lr_scale)
    config_dict = cfg.to_dict()

    writer = metrics.make_writers(workdir, jax.process_index() == 0, cfg.metrics.tensorboard)
    writer.write_hparams(metrics.flatten_config(config_dict))
    trace = profiler.StepProfiler(cfg.profile, workdir, enabled=jax.process_index() == 0)
    flops_per_token = metrics.flops_per_token(cfg.model, cfg.seq_len)
    peak = metrics.peak_flops(jax.devices(), cfg.model.dtype)
    tokens_per_step = cfg.batch_size * cfg.seq_len
    log.info("model: %s parameters, %.3g training FLOPs/token; peak %.3g FLOP/s (%s, %s)",
             f"{model.count_params(cfg.model):,}", flops_per_token,
             peak["total_flops_per_sec"], peak["device_kind"], peak["source"])
    log.info("attention: %s, layers %s, remat %s, compute %s, fp8 %s",
             model.attention_backend(cfg.model.attention, cfg.model.dtype, cfg.seq_len),
             "scanned" if cfg.model.scan_layers else "unrolled", cfg.model.remat, cfg.model.dtype,
             "on" if cfg.model.fp8 else "off")
    if cfg.mesh.get("stage", 1) > 1 or cfg.mesh.get("sequence", 1) > 1:
        stages, micro = cfg.mesh.get("stage", 1), cfg.model.pipeline_microbatches
        log.info("parallelism: sequence %d; pipeline %d stages x %d layers, %d microbatches, "
                 "bubble %.1f%% (GPipe: (stages - 1) / (microbatches + stages - 1))",
                 cfg.mesh.get("sequence", 1), stages, cfg.model.num_layers // stages, micro,
                 100 * model.bubble_fraction(stages, micro))
    if cfg.model.fp8 and not fp8.is_native(jax.devices()[0]):
        _warning(f"model.fp8 is emulated on {jax.devices()[0].device_kind}: float8-rounded operands, "
                 "not faster (float8 GEMMs need an NVIDIA GPU of compute capability >= 8.9)")

    step = int(state["step"])
    last_row: dict = {}
    first_loss = float("nan")
    # A log step's metrics are read back only after the next step is dispatched, so logging never
    # stalls the device. Throughput is measured between moments when a known step has finished.
    pending = None  # (step, device metrics)
    next_row: dict = {}  # added to the next training row written (compile_sec)
    compiled: set = set()  # train functions already called (their first call compiles)
    clock = {"time": time.perf_counter(), "step": step}
    restores = 0  # restores after bad streaks without getting past the failure since
    failed_at = -1
    save_due = None  # the kind of a save point that fell in a bad streak: saved at the next good step
    last_save_time = time.monotonic()

    def flush_pending():
        nonlocal pending, last_row
        if pending is None:
            return
        logged_step, device_metrics = pending
        pending = None
        row = {k: float(v) for k, v in jax.device_get(device_metrics).items()}  # waits for it
        now = time.perf_counter()
        steps_timed = max(logged_step - clock["step"], 1)  # 0 only when the compile step is logged
        tokens_per_sec = tokens_per_step * steps_timed / (now - clock["time"])
        clock.update(time=now, step=logged_step)
        row.update(
            tokens_per_sec=tokens_per_sec,
            step_time_sec=tokens_per_step / tokens_per_sec,
            mfu=metrics.mfu(tokens_per_sec, flops_per_token, peak["total_flops_per_sec"]),
            **metrics.device_memory(),  # nothing where the platform reports nothing (CPU)
            **next_row,
        )
        next_row.clear()
        del row["num_tokens"]
        writer.write(logged_step, row)
        log.info(_format(logged_step, row, eta_sec=row["step_time_sec"] * (cfg.steps - logged_step)))
        last_row = dict(row, step=logged_step, first_loss=first_loss)

    def restart_clock(finished_step: int):
        """Compilation, eval and checkpointing are not training time."""
        clock.update(time=time.perf_counter(), step=finished_step)

    def recover(bad_step: int):
        """`max_bad_steps` consecutive non-finite steps ending at `bad_step`: back to the last
        good checkpoint (every checkpoint is one: see the save below), lr optionally reduced."""
        nonlocal state, step, restores, failed_at, lr_scale, train_fn, eval_fn, pending, save_due
        pending, save_due = None, None
        ckpt.wait()
        restores += 1
        newest = ckpt.latest_step()
        if restores > ckpt_cfg.max_restores:
            raise NonFiniteLossError(
                f"{ckpt_cfg.max_bad_steps} consecutive non-finite steps up to step {bad_step}, "
                f"still after {restores - 1} restore(s) of the last good checkpoint "
                f"(checkpoint.max_restores={ckpt_cfg.max_restores}); stopped. Newest checkpoint: "
                f"{f'step {newest}' if newest is not None else 'none'}, all finite"
            )
        failed_at = max(failed_at, bad_step)
        back = ckpt.restore_latest(abstract)
        if back is None:
            state, _ = create_sharded_state(cfg, tx, mesh, rules, init_rng)
        else:
            state = with_missing_from(back[0], state, ckpt.directory)
        if ckpt_cfg.restore_lr_scale != 1.0:
            lr_scale *= ckpt_cfg.restore_lr_scale
            train_fn, eval_fn = build(lr_scale)
        step = int(state["step"])
        _warning(f"{ckpt_cfg.max_bad_steps} consecutive non-finite steps up to step {bad_step}: "
                 f"restored {'step %d' % step if back else 'the initial state'} "
                 f"(restore {restores} of {ckpt_cfg.max_restores}, lr scale {lr_scale:g})")
        restart_clock(step)

    def save(done: int, kind: str):
        nonlocal save_due, last_save_time, restores, failed_at
        meta = {"seed": cfg.seed, "lr_scale": lr_scale, "process_count": jax.process_count(),
                "device_count": jax.device_count(),
                "mesh": {a: cfg.mesh[a] for a in config_lib.MESH_AXES}}
        ckpt.save(done, state, meta, config_dict, kind=kind)
        save_due, last_save_time = None, time.monotonic()
        if done > failed_at >= 0:
            restores, failed_at = 0, -1

    try:
        with mesh_lib.activate(mesh, rules), checkpoint.PreemptionWatcher() as preemption:
            first = True
            prev_metrics = None  # the previous step's, for its non-finite verdict
            while step < cfg.steps:
                trace.before_step(step)
                args = (state, global_batch(_host_batch(train_data.prefetch(), step, mesh, rules), mesh, rules))
                if injecting:
                    hit = cfg.debug.nan_at_step <= step < cfg.debug.nan_at_step + cfg.debug.nan_steps
                    if hit and cfg.debug.nan_transient:  # only the first time this step runs
                        hit = step not in injected
                        injected.add(step)
                    args += (np.bool_(hit),)
                compiling, dispatched = train_fn not in compiled, time.perf_counter()
                state, step_metrics = train_fn(*args)  # the first call traces and compiles
                if compiling:
                    compiled.add(train_fn)
                    next_row["compile_sec"] = time.perf_counter() - dispatched
                    log.info("compiled the train step in %.1f s", next_row["compile_sec"])
                done = step = step + 1
                if trace.after_step(done, step_metrics):  # stopped and wrote the trace
                    flush_pending()
                    restart_clock(done)
                # read one step late, so the device already has the next step queued
                streak = int(prev_metrics["bad_streak"]) if prev_metrics is not None else 0
                prev_metrics = step_metrics
                flush_pending()  # the previous log step's row; step `done` is already queued
                if first:  # the first call compiled: keep it out of the throughput
                    first = False
                    first_loss = float(step_metrics["loss"])
                    if done % cfg.log_every_steps:
                        restart_clock(done)
                if streak >= ckpt_cfg.max_bad_steps:
                    recover(done - 1)
                    prev_metrics, first = None, True
                    continue
                if done % cfg.log_every_steps == 0 or done == cfg.steps:
                    pending = (done, step_metrics)
                if cfg.eval.every_steps and (done % cfg.eval.every_steps == 0 or done == cfg.steps):
                    flush_pending()
                    eval_loss = evaluate(cfg, eval_fn, state["params"], eval_data, mesh, rules)
                    eval_row = {"eval_loss": eval_loss, "eval_perplexity": _perplexity(eval_loss)}
                    writer.write(done, eval_row)
                    log.info(_format(done, eval_row))
                    restart_clock(done)
                preempted = preemption.reached(done)
                regular = done % ckpt_cfg.every_steps == 0 or done == cfg.steps
                timed = bool(ckpt_cfg.every_minutes) and not regular and _agree(
                    time.monotonic() - last_save_time >= 60 * ckpt_cfg.every_minutes)
                if regular or timed or preempted or save_due:
                    flush_pending()
                    streak = int(step_metrics["bad_streak"])
                    if streak >= ckpt_cfg.max_bad_steps and not preempted:
                        recover(done)
                        prev_metrics, first = None, True
                        continue
                    if streak and not preempted and done != cfg.steps:
                        if not save_due:
                            log.info("step %d was non-finite: its checkpoint waits for a good step", done)
                        save_due = save_due or ("regular" if regular else "temporary")
                    else:
                        kind = ("preemption" if preempted else "final" if done == cfg.steps
                                else "regular" if regular else save_due or "temporary")
                        save(done, kind)
                    restart_clock(done)
                if preempted:
                    flush_pending()
                    ckpt.wait()
                    raise checkpoint.Preempted(done)
            flush_pending()
    finally:
        trace.close()
        ckpt.close()
        writer.close()
    return last_row


def _perplexity(loss: float) -> float:
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


def _agree(flag: bool) -> bool:
    """Process 0's `flag` on every process (time-based decisions must not diverge)."""
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    return bool(multihost_utils.broadcast_one_to_all(np.bool_(flag)))


def _warning(message: str) -> None:
    if jax.process_index() == 0:
        print(f"maxlm: warning: {message}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- command line


def main(argv) -> None:
    from absl import flags

    if len(argv) > 1:
        cli.config_error(f"unexpected arguments {argv[1:]}")
    cli.setup_logging()
    if not flags.FLAGS.workdir:
        cli.config_error("--workdir=DIR is required")
    workdir = flags.FLAGS.workdir
    distributed.initialize()  # multi-process runs: from JAX_COORDINATOR_ADDRESS etc.
    cfg = cli.resolved_config(jax.device_count())
    try:
        data = load_data(cfg)
        if cfg.checkpoint.restore_from:
            checkpoint.resolve_restore_from(cfg.checkpoint.restore_from)
        if cfg.checkpoint.init_from_hf:
            from maxlm import hf

            hf.check_init_from_hf(cfg, workdir)
    except ValueError as e:  # bad data or a data/config mismatch: the user's to fix
        cli.config_error(str(e))
    try:
        last = train_and_evaluate(cfg, workdir, data)
    except NonFiniteLossError as e:
        print(f"maxlm: {e}", file=sys.stderr)
        sys.exit(3)
    except checkpoint.Preempted as e:
        print(f"maxlm: preempted (SIGTERM): checkpoint of step {e.step} committed in "
              f"{checkpoint.checkpoint_dir(workdir)}; rerun the same command to resume",
              file=sys.stderr)
        sys.exit(PREEMPTED_EXIT)
    if jax.process_index() == 0:
        if "loss" in last:
            print(f"done at step {last['step']}: loss {last['loss']:.4f} "
                  f"(first step of this run: {last['first_loss']:.4f})")
        else:
            print(f"nothing to do: the checkpoint in {workdir} is already at step {cfg.steps}")
        print(f"checkpoints: {checkpoint.checkpoint_dir(workdir)}")
        print(f"metrics:     {paths.workdir_path(workdir) / 'metrics.jsonl'}")


def _define_flags() -> None:
    from absl import flags

    flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and config.json.")


if __name__ == "__main__":
    cli.run(main, _define_flags)
