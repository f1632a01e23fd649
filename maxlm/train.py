"""The training loop: `python -m maxlm.train --config=configs/NAME.py --workdir=DIR`.

One step, end to end: `data.batch(step)` (numpy, this process's rows) → a global jax.Array sharded
over (data, fsdp) → `train_step` (jit with in/out shardings, the state donated) → metrics written
one step late so reading them never stalls the device → orbax checkpoint every
`checkpoint.every_steps`. Rerunning with the same DIR resumes from the newest checkpoint.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec

from maxlm import checkpoint, cli, config as config_lib, mesh as mesh_lib, metrics, model, optim
from maxlm.data import make_dataset

log = logging.getLogger("maxlm")

State = dict[str, Any]  # {"step": int32 scalar, "params": pytree, "opt_state": pytree}


class NonFiniteLossError(RuntimeError):
    """Training produced a NaN/inf loss; nothing from that point on is saved."""


# ----------------------------------------------------------------------------- state and shardings


def init_state(cfg, tx: optax.GradientTransformation, rng: jax.Array) -> State:
    params = model.init_params(cfg.model, rng)
    return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params)}


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
    return {"step": PartitionSpec(), "params": param_specs, "opt_state": opt_specs}


def create_sharded_state(cfg, tx, mesh, rules, rng):
    """Initialises the state directly into its shards: no device ever holds the full state.

    Returns (state, state_shardings).
    """
    init = functools.partial(init_state, cfg, tx)
    abstract = jax.eval_shape(init, rng)
    shardings = mesh_lib.logical_to_shardings(state_logical_specs(cfg, tx, abstract), mesh, rules)
    with mesh_lib.activate(mesh, rules):
        state = jax.jit(init, out_shardings=shardings)(rng)
    return state, shardings


def abstract_state(cfg, tx, shardings) -> State:
    """ShapeDtypeStructs with shardings: orbax's restore target."""
    shapes = jax.eval_shape(functools.partial(init_state, cfg, tx), jax.random.key(0))
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings
    )


# ----------------------------------------------------------------------------- steps


def train_step(cfg, tx, schedule, state: State, batch) -> tuple[State, dict]:
    grad_fn = jax.value_and_grad(functools.partial(model.loss_fn, cfg.model), has_aux=True)
    (loss, aux), grads = grad_fn(state["params"], batch)
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    step_metrics = {
        "loss": loss,
        "grad_norm": optax.tree.norm(grads),  # before clipping
        "param_norm": optax.tree.norm(params),
        "lr": schedule(state["step"]),  # the rate this update used
        "num_tokens": aux["num_tokens"],
    }
    return {"step": state["step"] + 1, "params": params, "opt_state": opt_state}, step_metrics


def eval_step(cfg, params, batch) -> dict:
    loss, aux = model.loss_fn(cfg.model, params, batch)
    return {"loss_sum": loss * aux["num_tokens"], "num_tokens": aux["num_tokens"]}


def compile_steps(cfg, tx, mesh, rules, state_shardings):
    """The jitted train and eval steps with explicit in/out shardings."""
    schedule = optim.learning_rate_schedule(cfg.optim)
    batch_sharding = mesh_lib.batch_sharding(mesh, rules)
    scalars = mesh_lib.replicated(mesh)
    train = jax.jit(
        functools.partial(train_step, cfg, tx, schedule),
        in_shardings=(state_shardings, batch_sharding),
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


def _host_batch(dataset, step: int):
    return dataset.batch(step, jax.process_index(), jax.process_count())


def evaluate(cfg, eval_fn, params, dataset, mesh, rules) -> float:
    totals = [eval_fn(params, global_batch(_host_batch(dataset, i), mesh, rules)) for i in range(cfg.eval.steps)]
    loss_sum = sum(float(t["loss_sum"]) for t in totals)
    return loss_sum / max(sum(float(t["num_tokens"]) for t in totals), 1.0)


def _format(step: int, row: dict) -> str:
    parts = [f"step {step:>6}"]
    for key, fmt in (("loss", "{:.4f}"), ("eval_loss", "{:.4f}"), ("lr", "{:.2e}"),
                     ("grad_norm", "{:.3f}"), ("tokens_per_sec", "{:,.0f}"), ("mfu", "{:.1%}")):
        if key in row:
            parts.append(f"{key} " + fmt.format(row[key]))
    return " | ".join(parts)


def load_data(cfg):
    """(train, validation) datasets; raises ValueError on bad data, before anything compiles."""
    train_data = make_dataset(cfg, "train")
    eval_data = make_dataset(cfg, "validation") if cfg.eval.every_steps else None
    return train_data, eval_data


def train_and_evaluate(cfg, workdir: str, data=None) -> dict:
    """Trains `cfg` (already resolved) in `workdir`, resuming from its newest checkpoint.

    `data` is `load_data(cfg)`'s result, loaded here when None. Returns the last training row.
    """
    train_data, eval_data = data if data is not None else load_data(cfg)
    os.makedirs(workdir, exist_ok=True)
    rules = mesh_lib.rules_of(cfg.mesh)
    mesh = mesh_lib.make_mesh(cfg.mesh)
    if jax.process_index() == 0:
        with open(os.path.join(workdir, "config.json"), "w") as f:
            f.write(config_lib.to_json(cfg))

    tx = optim.make_optimizer(cfg.optim)
    state, shardings = create_sharded_state(cfg, tx, mesh, rules, jax.random.key(cfg.seed))
    manager = checkpoint.open_manager(workdir, cfg.checkpoint)
    restored = checkpoint.restore_latest(manager, abstract_state(cfg, tx, shardings))
    if restored is not None:
        state = restored
        log.info("resumed from %s at step %d", checkpoint.checkpoint_dir(workdir), int(state["step"]))
    train_fn, eval_fn = compile_steps(cfg, tx, mesh, rules, shardings)

    writer = metrics.make_writers(workdir, jax.process_index() == 0, cfg.metrics.tensorboard)
    flops_per_token = metrics.flops_per_token(cfg.model, cfg.seq_len)
    peak = metrics.peak_flops(jax.devices(), cfg.model.dtype)
    tokens_per_step = cfg.batch_size * cfg.seq_len
    log.info("model: %s parameters, %.3g training FLOPs/token; peak %.3g FLOP/s (%s, %s)",
             f"{model.count_params(cfg.model):,}", flops_per_token,
             peak["total_flops_per_sec"], peak["device_kind"], peak["source"])

    start_step = int(state["step"])
    last_saved = start_step
    last_row: dict = {}
    first_loss = float("nan")
    # A log step's metrics are read back only after the next step is dispatched, so logging never
    # stalls the device. Throughput is measured between moments when a known step has finished.
    pending = None  # (step, device metrics)
    clock = {"time": time.perf_counter(), "step": start_step}

    def flush_pending():
        nonlocal pending, last_row
        if pending is None:
            return
        step, device_metrics = pending
        pending = None
        row = {k: float(v) for k, v in jax.device_get(device_metrics).items()}  # waits for `step`
        now = time.perf_counter()
        steps_timed = max(step - clock["step"], 1)  # 0 only when the compile step is logged
        tokens_per_sec = tokens_per_step * steps_timed / (now - clock["time"])
        clock.update(time=now, step=step)
        check_finite(step, row)
        row.update(
            tokens_per_sec=tokens_per_sec,
            step_time_sec=tokens_per_step / tokens_per_sec,
            mfu=metrics.mfu(tokens_per_sec, flops_per_token, peak["total_flops_per_sec"]),
        )
        del row["num_tokens"]
        writer.write(step, row)
        log.info(_format(step, row))
        last_row = dict(row, step=step, first_loss=first_loss)

    def check_finite(step: int, step_metrics) -> None:
        values = {k: float(step_metrics[k]) for k in ("loss", "grad_norm")}
        if not all(np.isfinite(v) for v in values.values()):
            raise NonFiniteLossError(
                f"non-finite {values} at step {step}; stopped without saving "
                f"(newest checkpoint: {f'step {last_saved}' if last_saved else 'none'})"
            )

    def restart_clock(finished_step: int):
        """Compilation, eval and checkpointing are not training time."""
        clock.update(time=time.perf_counter(), step=finished_step)

    with mesh_lib.activate(mesh, rules):
        for step in range(start_step, cfg.steps):
            batch = global_batch(_host_batch(train_data, step), mesh, rules)
            state, step_metrics = train_fn(state, batch)
            done = step + 1
            flush_pending()  # the previous log step's row; step `done` is already queued
            if step == start_step:  # the first call compiled: keep it out of the throughput
                first_loss = float(step_metrics["loss"])
                if done % cfg.log_every_steps:
                    restart_clock(done)
            if done % cfg.log_every_steps == 0 or done == cfg.steps:
                pending = (done, step_metrics)
            if cfg.eval.every_steps and (done % cfg.eval.every_steps == 0 or done == cfg.steps):
                flush_pending()
                eval_loss = evaluate(cfg, eval_fn, state["params"], eval_data, mesh, rules)
                writer.write(done, {"eval_loss": eval_loss})
                log.info(_format(done, {"eval_loss": eval_loss}))
                restart_clock(done)
            if done % cfg.checkpoint.every_steps == 0 or done == cfg.steps:
                flush_pending()
                check_finite(done, step_metrics)  # never save a non-finite state
                checkpoint.save(manager, done, state, cfg.to_dict())
                last_saved = done
                restart_clock(done)
        flush_pending()
    manager.wait_until_finished()
    manager.close()
    writer.close()
    return last_row


# ----------------------------------------------------------------------------- command line


def main(argv) -> None:
    from absl import flags

    if len(argv) > 1:
        cli.config_error(f"unexpected arguments {argv[1:]}")
    cli.setup_logging()
    if not flags.FLAGS.workdir:
        cli.config_error("--workdir=DIR is required")
    workdir = flags.FLAGS.workdir
    cfg = cli.resolved_config(jax.device_count())
    try:
        data = load_data(cfg)
    except ValueError as e:  # bad data or a data/config mismatch: the user's to fix
        cli.config_error(str(e))
    try:
        last = train_and_evaluate(cfg, workdir, data)
    except NonFiniteLossError as e:
        print(f"maxlm: {e}", file=sys.stderr)
        sys.exit(3)
    if jax.process_index() == 0:
        if "loss" in last:
            print(f"done at step {last['step']}: loss {last['loss']:.4f} "
                  f"(first step of this run: {last['first_loss']:.4f})")
        else:
            print(f"nothing to do: the checkpoint in {workdir} is already at step {cfg.steps}")
        print(f"checkpoints: {checkpoint.checkpoint_dir(workdir)}")
        print(f"metrics:     {os.path.join(os.path.abspath(workdir), 'metrics.jsonl')}")


def _define_flags() -> None:
    from absl import flags

    flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and config.json.")


if __name__ == "__main__":
    cli.run(main, _define_flags)
