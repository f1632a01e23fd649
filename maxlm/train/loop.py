"""The training loop: `python -m maxlm.train --config=configs/NAME.py --workdir=DIR`.

One step, end to end: `mesh.read_batch` (this process's rows of batch `step`, as one global
jax.Array sharded over (data, fsdp)) → `step.make_train_step`'s jitted step (in/out shardings,
the state donated) → metrics read back one step late (`step_logger.StepLogger`) → the one action
`decision.decide` returns for the step's facts (eval, an orbax checkpoint, a postponed save, a
restore, a rollback, a stop) carried out. Rerunning with the same DIR resumes from the newest good
checkpoint.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os

import jax
import numpy as np

from maxlm import config as config_lib, model
from maxlm.checkpoint import compatibility, store as checkpoint
from maxlm.data import make_dataset
from maxlm.eval import during_training
from maxlm.hf import files as hf
from maxlm.model import attention_plan, moe
from maxlm.model.kernels import fp8
from maxlm.observe import flops, metrics, profiler
from maxlm.observe.goodput import Goodput, Stopwatch, TimedCheckpointer
from maxlm.observe.monitor import Monitor
from maxlm.observe.step_logger import StepLogger, budget_line
from maxlm.optim import loss_scale, optimizers as optim
from maxlm.resilience import anomaly, data_position, faults
from maxlm.runtime import console, paths
from maxlm.runtime.errors import ConfigError
from maxlm.sharding import mesh as mesh_lib, state as state_lib
from maxlm.train import decision, step as step_lib

log = logging.getLogger("maxlm")


def load_data(cfg):
    """(train dataset, during_training.EvalData); raises ValueError on bad data, before anything compiles."""
    train_data = make_dataset(cfg, "train")
    eval_data = during_training.load_eval_data(cfg) if cfg.eval.every_steps else None
    return train_data, eval_data


def train_and_evaluate(cfg, workdir: str, data=None, stopwatch: Stopwatch | None = None) -> dict:
    """Trains `cfg` (already resolved) in `workdir`, resuming from its newest good checkpoint.

    `data`: `load_data(cfg)`'s result, loaded here when None; `stopwatch`: goodput.py's, started here
    when None. Returns the last training row. Raises faults.Preempted after SIGTERM or Ctrl-C (its checkpoint
    committed) and NonFiniteLossError when non-finite steps persist after `checkpoint.max_restores` restores.
    """
    train_data, eval_data = data if data is not None else load_data(cfg)
    mesh, rules = mesh_lib.make_mesh(cfg.mesh), mesh_lib.rules_of(cfg.mesh)
    out = paths.workdir_path(workdir)  # a local directory or gs://... alike: see maxlm/runtime/paths.py
    out.mkdir(parents=True, exist_ok=True)
    gp = Goodput(stopwatch or Stopwatch(), workdir, jax.process_index() == 0)  # where the wall time goes
    if jax.process_index() == 0:
        (out / "config.json").write_text(config_lib.to_json(cfg))
    tx = optim.make_optimizer(cfg)
    rng = jax.random.key(cfg.seed)
    shardings = state_lib.shardings(cfg, tx, mesh, rules, jax.eval_shape(functools.partial(state_lib.init_state, cfg, tx), rng))
    abstract = state_lib.abstract_state(cfg, tx, shardings)

    # initialised only when nothing restores (a resume holds one state, not two): start-up time, not restore
    fresh_state = gp.timed("startup", lambda: state_lib.create_sharded_state(cfg, tx, mesh, rules, rng)[0])
    ckpt = TimedCheckpointer(checkpoint.Checkpointer(workdir, cfg.checkpoint), gp.stopwatch)
    ckpt.warn_if_short_of_space(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract)))
    state, lr_scale, meta = gp.timed("restore", starting_state)(cfg, ckpt, fresh_state, abstract)
    anomalies = anomaly.Anomalies(cfg.anomaly, meta)  # loss spikes: detector, skipped batches
    if (position := data_position.continued(meta, cfg, train_data, ckpt.directory)) is not None:
        anomalies.rebase(int(state["step"]), position)  # data changed on purpose: data.resume_position
    train_fn = train_step_fn(cfg, mesh, rules, shardings, anomalies.position)
    tracker = faults.FaultTracker(cfg.checkpoint, clock_every=cfg.log_every_steps)
    plan = decision.Plan.of(cfg)
    writer = metrics.make_writers(workdir, jax.process_index() == 0, cfg.metrics.tensorboard,
                                  wandb=cfg.metrics if cfg.metrics.wandb else None)
    writer.write_hparams(metrics.flatten_config(cfg.to_dict()))
    trace = profiler.StepProfiler(cfg.profile, workdir, enabled=jax.process_index() == 0)
    step = int(state["step"])
    logger = make_step_logger(cfg, writer, step, lambda: {**anomalies.counters(), **gp.counters()})
    iteration = 0  # the preemption sync point's id: every iteration, only increasing (restores go back)
    try:
        with mesh_lib.activate(mesh, rules), faults.PreemptionWatcher() as preemption:
            while step < cfg.steps:
                trace.before_step(step)
                batch = gp.timed("data", mesh_lib.read_batch)(train_data.prefetch(), anomalies.position(step), mesh, rules)
                with gp.step(step + 1, compiling=logger.compiles(train_fn)):  # productive, lost or compile
                    state, step_metrics = logger.call(train_fn, state, batch, np.float32(lr_scale))
                done = step = step + 1
                iteration += 1
                # Both asked every iteration, restores and rollbacks included: every process must
                # reach the same sync points, or a multi-process job hangs at the next one.
                stop, time_due = preemption.reached(iteration), tracker.exchange_clock(done)
                if trace.after_step(done, step_metrics):  # waited for the step, wrote the trace
                    logger.flush()
                    logger.restart_clock(done)
                logger.step_done(done, step_metrics)  # the previous log step's row; `done` queued
                # the streaks of non-finite steps and of loss spikes, read one step late (a skipped
                # step is not a loss sample, so a non-finite streak never ends a spike streak too)
                facts = decision.Facts(done, stop=stop, streak_ended=tracker.streak_ended(step_metrics),
                                       last_spike=anomalies.spiked(done - 1, step_metrics),
                                       in_spike=anomalies.in_streak(), owed=tracker.owed, time_due=time_due)
                if at_save_point := (decision.save_point(plan, facts) is not None):
                    # reading the step's own streak waits for the step, as its save would: only here
                    logger.flush()
                    facts = dataclasses.replace(facts, bad_streak=int(step_metrics["bad_streak"]))
                act = decision.decide(plan, facts)
                if act.evaluate:
                    logger.flush()
                    logger.eval_done(done, gp.timed("eval", during_training.eval_row)(cfg, state["params"], eval_data, mesh, rules))
                match act.action:
                    case decision.Action.SAVE:
                        ckpt.save(done, state, checkpoint_meta(cfg, lr_scale, anomalies, done, train_data),
                                  cfg.to_dict(), kind=act.kind)
                        tracker.saved(done, act.kind)
                        anomalies.saved(done)
                    case decision.Action.POSTPONE:
                        tracker.postponed(done, act.kind, non_finite=bool(facts.bad_streak))
                    case decision.Action.RECOVER:  # back to the last good checkpoint
                        state, lr_scale, meta = recover(cfg, ckpt, tracker, abstract, fresh_state, state,
                                                        lr_scale, act.step)
                        anomalies.restored(meta)
                    case decision.Action.ROLL_BACK:  # back to before the spikes, skipping their batches
                        state = roll_back(cfg, ckpt, anomalies, abstract, fresh_state, state, act.step)
                        tracker.restarted()
                if at_save_point:  # the flush and the save are not training time
                    logger.restart_clock(done)
                if act.action in (decision.Action.RECOVER, decision.Action.ROLL_BACK):
                    step = int(state["step"])
                    logger.restart(step)
                    if act.stop:
                        stop_after_restore(cfg, ckpt, state, lr_scale, anomalies, preemption, train_data)
                elif act.stop:  # the preemption's checkpoint saved: once committed, stop
                    ckpt.wait()
                    raise faults.Preempted(done, interrupted=preemption.agreed_interrupted())
            logger.flush()
    finally:
        trace.close()
        ckpt.close()
        writer.close()
        gp.close()  # goodput.json with the attempt's time up to here
    return logger.last_row


def starting_state(cfg, ckpt: checkpoint.Checkpointer, fresh_state, abstract):
    """(state, lr scale, meta) to start from: the workdir's newest good checkpoint; else, for an
    empty workdir, `checkpoint.restore_from` or `checkpoint.init_from_hf`; else `fresh_state()`,
    which is called only when the parameters or the optimizer state do not all come from a
    checkpoint. `meta`: the checkpoint's meta when a whole state was restored (its skipped batches
    and spike statistics carry on), else {}."""
    ckpt_cfg = cfg.checkpoint
    # what a checkpoint written without float16 compute lacks: the initial loss scale
    missing = loss_scale.init(cfg.optim) if loss_scale.enabled(cfg) else {}
    restored = ckpt.restore_latest(abstract)
    if restored is not None:
        log.info("resumed from %s at step %d", ckpt.restored_from, int(restored[0]["step"]))
        lr_scale = float(restored[1].get("lr_scale", 1.0))
        return state_lib.with_missing_from(restored[0], missing, ckpt.directory), lr_scale, restored[1]
    if ckpt_cfg.restore_from:
        path = checkpoint.resolve_restore_from(ckpt_cfg.restore_from)
        only = ckpt_cfg.restore_params_only
        log.info("started from %s (%s)", path, "params only" if only else "full state")
        if only:
            return dict(fresh_state(), params=checkpoint.restore_state(path, abstract, params_only=True)[0]["params"]), 1.0, {}
        loaded, meta = checkpoint.restore_state(path, abstract)
        return state_lib.with_missing_from(loaded, missing, path), 1.0, meta
    if ckpt_cfg.init_from_hf:  # a Hugging Face Llama folder: params only, step 0
        log.info("starting from Hugging Face checkpoint %s (params only)", ckpt_cfg.init_from_hf)
        return dict(fresh_state(), params=hf.load_params(ckpt_cfg.init_from_hf, cfg.model, abstract["params"], cfg.seq_len)), 1.0, {}
    return fresh_state(), 1.0, {}


def check_start(cfg, workdir: str) -> None:
    """Before anything compiles: what a fresh workdir would start from (`checkpoint.restore_from`,
    `checkpoint.init_from_hf`) exists and fits the run, and the checkpoint it starts from has the
    run's shapes, model function (compatibility.FUNCTION_KEYS) and position encoding and, for a
    full state, its `optim.name`, and read the data as this run would (the stream keys, the
    sources' files: data_position.py); ValueError (exit 2) if not. Reads no packed data. A workdir
    with a checkpoint of its own resumes it, so `init_from_hf` is not read then."""
    ckpt_cfg, own = cfg.checkpoint, checkpoint.complete_steps(checkpoint.checkpoint_dir(workdir))
    source = checkpoint.resolve_restore_from(ckpt_cfg.restore_from) if ckpt_cfg.restore_from else None
    if ckpt_cfg.init_from_hf and not own:
        hf.check_init_from_hf(cfg)
    start = own[-1][1] if own else source
    full_state = bool(own) or not ckpt_cfg.restore_params_only
    if start and (problem := compatibility.start_problem(start, cfg, full_state)):
        raise ConfigError(problem)
    if start and full_state:  # the step goes on, and with it the data position
        saved = config_lib.from_recorded(checkpoint.read_json(start, "config")).to_dict()
        recorded = checkpoint.read_json(start, "meta").get("data", {})
        data_position.check(recorded.get("keys") or data_position.stream_keys(saved), cfg, start,
                            data_position.encoding(saved), data_position.edited_since(start, recorded, cfg))


def train_step_fn(cfg, mesh, rules, shardings, position):
    """The jitted train step, `(state, batch, lr_scale)` (restores lower the scale without a new
    compile), wrapped for fault injection when a `debug.` key asks for it: NaN gradients
    (`debug.nan_at_step`; one record of the steps injected, so `nan_transient` steps replay clean
    after a restore) and loss spikes (`debug.spike_at_batch`, at the data positions `position(step)`
    says)."""
    tx = optim.make_optimizer(cfg)
    train_fn = step_lib.make_train_step(cfg, tx, mesh, rules, shardings)
    if cfg.debug.nan_at_step >= 0:
        injecting_fn = step_lib.make_train_step(cfg, tx, mesh, rules, shardings, inject_nan=True)
        train_fn = faults.with_nan_injection(train_fn, injecting_fn, cfg.debug, set())
    if cfg.debug.spike_at_batch >= 0:
        train_fn = anomaly.with_spike_injection(train_fn, cfg.debug, position)
    return train_fn


def stop_after_restore(cfg, ckpt, state, lr_scale, anomalies, preemption, train_data) -> None:
    """A preemption agreed on an iteration that restored a checkpoint: stop at the restored step,
    saving it first when it is not a checkpoint already (the initial state)."""
    step = int(state["step"])
    ckpt.wait()
    if ckpt.latest_step() != step:
        ckpt.save(step, state, checkpoint_meta(cfg, lr_scale, anomalies, step, train_data), cfg.to_dict(), kind="preemption")
        ckpt.wait()
    raise faults.Preempted(step, interrupted=preemption.agreed_interrupted())


def recover(cfg, ckpt, tracker: faults.FaultTracker, abstract, fresh_state, state, lr_scale: float,
            bad_step: int):
    """After `max_bad_steps` consecutive non-finite steps ending at `bad_step`: (state, lr scale)
    of the last good checkpoint (every checkpoint is one: see decision.decide's POSTPONE), or
    `fresh_state()`'s when there is none; the lr scale times `restore_lr_scale`."""
    ckpt.wait()
    restores = tracker.recovering(bad_step, ckpt.latest_step())  # raises past max_restores
    back = ckpt.restore_latest(abstract)
    if back is None:
        state = fresh_state()
    else:
        state = state_lib.with_missing_from(back[0], state, ckpt.directory)
    lr_scale *= cfg.checkpoint.restore_lr_scale
    step = int(state["step"])
    console.warn(f"{cfg.checkpoint.max_bad_steps} consecutive non-finite steps up to step {bad_step}: "
             f"restored {'step %d' % step if back else 'the initial state'} "
             f"(restore {restores} of {cfg.checkpoint.max_restores}, lr scale {lr_scale:g})")
    return state, lr_scale, back[1] if back else None


def roll_back(cfg, ckpt, anomalies: anomaly.Anomalies, abstract, fresh_state, state, last_spike: int):
    """After `anomaly.max_spikes` consecutive loss spikes ending at `last_spike`: the state of the
    newest good checkpoint from before the first spike (or `fresh_state()`'s), with the checkpoints
    written since removed and the batches from there on skipped (maxlm/resilience/anomaly.py)."""
    first = anomalies.detector.stats.first
    threshold = anomalies.detector.threshold()
    anomalies.check_rollback(last_spike)  # raises past max_rollbacks, before anything changes
    ckpt.wait()
    back = ckpt.restore_latest(abstract, before=first)
    ckpt.discard_after(int(back[0]["step"]) if back else -1)
    state = state_lib.with_missing_from(back[0], state, ckpt.directory) if back else fresh_state()
    step = int(state["step"])
    skipped = anomalies.rolled_back(last_spike, step, back[1] if back else None)
    console.warn(f"{cfg.anomaly.max_spikes} consecutive loss spikes (steps {first}-{last_spike}, above "
             f"{threshold:.4g}): rolled back to {'step %d' % step if back else 'the initial state'}, "
             f"skipping {skipped} batches from there (rollback {anomalies.rollbacks})")
    return state


def checkpoint_meta(cfg, lr_scale: float, anomalies: anomaly.Anomalies, step: int, train_data) -> dict:
    position = anomalies.position(step)
    return {"seed": cfg.seed, "lr_scale": lr_scale, "process_count": jax.process_count(),
            "device_count": jax.device_count(), "mesh": {a: cfg.mesh[a] for a in config_lib.MESH_AXES},
            "data_position": position, **data_position.record(cfg, train_data, position), **anomalies.meta()}


def xla_flag(name: str) -> str | None:
    """The value XLA takes for `--name` from XLA_FLAGS: the last one on the line wins."""
    value = None
    for flag in os.environ.get("XLA_FLAGS", "").split():
        key, _, setting = flag.partition("=")
        if key == f"--{name}":
            value = setting or "true"
    return value


def moe_kernels(cfg) -> str:
    """How an MoE run computes its experts: capacity or dropless (its grouped matmul), and how the
    tokens reach experts split over mesh.expert."""
    m, resolved = cfg.model, moe.kernels(cfg.model)
    if m.capacity_factor:
        compute = f"capacity factor {m.capacity_factor:g} (dense dispatch)"
    else:
        compute = f"dropless, grouped matmul {resolved['grouped_matmul']}"
    if cfg.mesh.expert == 1:
        return f"{compute}; no expert axis"
    exchange = "all-to-all" if m.capacity_factor else resolved["expert_dispatch"]
    return f"{compute}; tokens to the {cfg.mesh.expert} devices of mesh.expert by {exchange}"


def make_step_logger(cfg, writer, start_step: int, counters=dict) -> StepLogger:
    """The run's StepLogger; logs what the run is (model size, FLOPs, peak, kernels, parallelism)."""
    per_token = flops.flops_per_token(cfg.model, cfg.seq_len)
    peak = flops.peak_flops(jax.devices(), cfg.model.dtype)
    m = cfg.model
    active = f" ({model.active_params(m):,} active per token: {m.experts_per_token} of {m.num_experts} experts)" \
        if m.num_experts else ""
    log.info("model: %s parameters%s, %.3g training FLOPs/token; peak %.3g FLOP/s (%s, %s)",
             f"{model.count_params(m):,}", active, per_token, peak["total_flops_per_sec"], peak["device_kind"],
             peak["source"])
    log.info(budget_line(cfg, per_token))
    kernels = attention_plan.kernels(cfg)
    # what the attention computes: the window may change on resume (docs/checkpoints.md#what-may-change-on-resume)
    window = f", sliding window {m.sliding_window}" if m.sliding_window else ""
    if m.layer_pattern:
        window += f" on the L layers of {m.layer_pattern!r}"
    if m.attn_logit_softcap:
        window += f", scores soft-capped at {m.attn_logit_softcap:g}"
    log.info("attention: %s%s (context parallel: %s), layers %s, remat %s, compute %s, fp8 %s",
             kernels["attention"], window, kernels["context_parallel"],
             "scanned" if m.scan_layers else "unrolled", m.remat, m.dtype, "on" if m.fp8 else "off")
    if m.num_experts:
        log.info("experts: %s", moe_kernels(cfg))
    log.info("optimizer: %s", optim.describe(cfg))
    if cfg.mesh.stage > 1 or cfg.mesh.sequence > 1:
        stages, micro, repeats = cfg.mesh.stage, m.pipeline_microbatches, m.pipeline_repeats
        schedule = "GPipe: (stages - 1) / (microbatches + stages - 1)" if repeats == 1 else \
            f"circular, {repeats} chunks of {m.num_layers // (stages * repeats)} layers a stage: " \
            "(stages - 1) / (repeats x microbatches + stages - 1)"
        log.info("parallelism: sequence %d; pipeline %d stages x %d layers, %d microbatches, bubble %.1f%% (%s)",
                 cfg.mesh.sequence, stages, m.num_layers // stages, micro,
                 100 * model.bubble_fraction(stages, micro, repeats), schedule)
    if jax.default_backend() == "gpu" and xla_flag("xla_gpu_deterministic_ops") != "true":
        console.warn("XLA_FLAGS lacks --xla_gpu_deterministic_ops=true (launch/gpu_env.sh sets it): on a GPU "
                     "the losses are then not bitwise reproducible, nor a resume equal to a run straight "
                     "through (autotuned GEMM algorithms, atomic scatter-adds)")
    if m.fp8 and jax.default_backend() == "gpu" and xla_flag("xla_gpu_enable_triton_gemm") != "false":
        console.warn(f"model.fp8 without {fp8.TRITON_GEMM_OFF} (launch/gpu_env.sh sets it): XLA may compile "
                 "the float8 dots as 16-bit Triton GEMMs, not float8 ones")
    if m.fp8 and not fp8.is_native(jax.devices()[0]):
        console.warn(f"model.fp8 is emulated on {jax.devices()[0].device_kind}: float8-rounded operands, "
                 "not faster (float8 GEMMs need an NVIDIA GPU of compute capability >= 8.9)")
    return StepLogger(writer, start_step=start_step, total_steps=cfg.steps, log_every=cfg.log_every_steps,
                      tokens_per_step=cfg.batch_size * cfg.seq_len, flops_per_token=per_token,
                      peak_flops_per_sec=peak["total_flops_per_sec"], counters=counters,
                      monitor=Monitor.from_config(cfg, accelerator=jax.default_backend() != "cpu"))
