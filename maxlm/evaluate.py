"""Evaluate a run's checkpoint: `python -m maxlm.eval --workdir=DIR [--split=validation]
[--step=N] [--eval_steps=N]` (`python -m maxlm.evaluate` is the same command).

Reads `DIR/config.json` (the resolved config the run recorded), restores one checkpoint's
parameters (default the newest complete one) onto a mesh built from that config for the devices
here (re-resolved when their count differs from the run's), and prints one JSON object:

    {"step", "split", "loss", "perplexity", "accuracy", "tokens", "batches", "checkpoint"}

`loss` is the mean next-token cross-entropy (nats/token) over the non-padding tokens of the first
`eval_steps` batches of the split (default `eval.steps`): the validation batches the training
loop's own eval reads, so at a step where the run evaluated, `loss` equals its `eval_loss`.
`accuracy` is the share of those tokens whose argmax prediction is the target.

`load_run` (config + mesh + parameters of a checkpoint) is shared with `python -m maxlm.generate`.
"""

from __future__ import annotations

import functools
import json
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections

from maxlm import checkpoint, cli, config as config_lib, distributed, mesh as mesh_lib, model, paths


class RunError(ValueError):
    """A workdir that cannot be used: no config.json, no checkpoint, a bad split (exit 2)."""


# ----------------------------------------------------------------------------- loading a run


def _merged(base: dict, recorded: dict) -> dict:
    """`recorded` over `base`, key by key: keys added to the defaults since the run was recorded
    keep their defaults."""
    out = dict(base)
    for key, value in recorded.items():
        nested = isinstance(value, dict) and isinstance(base.get(key), dict)
        out[key] = _merged(base[key], value) if nested else value
    return out


def read_config(workdir: str, num_devices: int | None = None) -> ml_collections.ConfigDict:
    """The config `workdir` recorded, resolved for `num_devices` (default: all devices here).

    The recorded mesh is kept when its size is the device count; otherwise it is re-resolved as
    (stage=1, data=1, fsdp=-1, sequence=1, tensor=its tensor if that divides the devices, else 1),
    single granule.
    """
    path = paths.workdir_path(workdir) / "config.json"
    if not path.exists():
        raise RunError(f"no config.json in {paths.workdir_path(workdir)} "
                       "(is --workdir a training run's workdir?)")
    try:
        recorded = json.loads(path.read_text())
    except ValueError as e:
        raise RunError(f"{path} is not valid JSON ({e})") from None
    num_devices = jax.device_count() if num_devices is None else num_devices
    cfg = ml_collections.ConfigDict(_merged(config_lib.defaults().to_dict(), recorded))
    if math.prod(int(cfg.mesh[a]) for a in config_lib.MESH_AXES) != num_devices:
        tensor = int(cfg.mesh.tensor)
        cfg.mesh.update(stage=1, data=1, fsdp=-1, sequence=1, tensor=tensor if num_devices % tensor == 0 else 1,
                        dcn_data=1, dcn_fsdp=1)
    try:
        return config_lib.resolve(cfg, num_devices, mesh_lib.num_granules())
    except config_lib.ConfigError as e:
        raise RunError(f"the run's config does not fit the {num_devices} devices here: {e}") from None


def checkpoint_path(workdir: str, step: int | None = None) -> str:
    """`DIR/checkpoints/STEP`: the newest complete checkpoint, or the one of `step`."""
    directory = checkpoint.checkpoint_dir(workdir)
    complete = [(s, p) for s, p in checkpoint.step_dirs(directory)["complete"]
                if checkpoint.file_problem(p) is None]
    if not complete:
        raise RunError(f"no complete checkpoint in {directory}")
    if step is None:
        return complete[-1][1]
    for s, p in complete:
        if s == step:
            return p
    steps = ", ".join(str(s) for s, _ in complete)
    raise RunError(f"--step={step}: no complete checkpoint of that step in {directory} (steps: {steps})")


def param_shardings(cfg, mesh, rules):
    """NamedShardings of the parameters: their logical axes through the config's mesh rules."""
    return mesh_lib.logical_to_shardings(model.param_logical_specs(cfg.model), mesh, rules)


def restore_params(path: str, cfg, mesh, rules):
    """The parameters of the checkpoint at `path`, restored straight into their shards."""
    shapes = jax.eval_shape(functools.partial(model.init_params, cfg.model), jax.random.key(0))
    abstract = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            shapes, param_shardings(cfg, mesh, rules))
    try:
        state, meta = checkpoint.restore_state(path, {"params": abstract}, params_only=True)
    except Exception as e:  # noqa: BLE001 - damage or a config that does not match the checkpoint
        raise RunError(f"{path} does not restore with the run's config: {checkpoint._short(e)}") from None
    return state["params"], meta


def load_run(workdir: str, step: int | None = None) -> dict[str, Any]:
    """{"config", "mesh", "rules", "params", "step", "path"} of a checkpoint of `workdir`."""
    cfg = read_config(workdir)
    path = checkpoint_path(workdir, step)
    rules = mesh_lib.rules_of(cfg.mesh)
    mesh = mesh_lib.make_mesh(cfg.mesh)
    params, meta = restore_params(path, cfg, mesh, rules)
    return {"config": cfg, "mesh": mesh, "rules": rules, "params": params,
            "step": int(meta.get("step", os.path.basename(path))), "path": path}


# ----------------------------------------------------------------------------- evaluation


def eval_step(model_cfg, params, batch) -> dict:
    """Sums over one batch's non-padding tokens: cross-entropy, correct argmax predictions, tokens.

    The cross-entropy is `model.loss_fn`'s (so it equals the training loop's eval); the argmax
    needs the logits, computed a second time from the same hidden states.
    """
    _, aux = model.loss_fn(model_cfg, params, batch)
    logits_BLV = model.apply(model_cfg, params, batch)
    weights_BL = (batch["segment_ids"] > 0).astype(jnp.float32)
    correct_BL = (jnp.argmax(logits_BLV, axis=-1) == batch["targets"]).astype(jnp.float32)
    return {"loss_sum": aux["cross_entropy"] * aux["num_tokens"],
            "correct": (correct_BL * weights_BL).sum(), "num_tokens": aux["num_tokens"]}


@functools.lru_cache(maxsize=8)
def _eval_fn(model_json: str, mesh, rules):
    """`eval_step` jitted with the parameters' and batch's shardings (one per model and mesh, so
    evaluating several checkpoints compiles once)."""
    cfg = ml_collections.ConfigDict({"model": json.loads(model_json)})
    return jax.jit(
        functools.partial(eval_step, cfg.model),
        in_shardings=(param_shardings(cfg, mesh, rules), mesh_lib.batch_sharding(mesh, rules)),
        out_shardings=mesh_lib.replicated(mesh),
    )


def evaluate(cfg, params, dataset, mesh, rules, num_batches: int) -> dict:
    """Loss, perplexity and next-token accuracy over batches 0..num_batches-1 of `dataset`."""
    from maxlm import train  # the loop's own batch assembly, so these are its eval batches

    step_fn = _eval_fn(json.dumps(cfg.model.to_dict(), sort_keys=True), mesh, rules)
    totals = {"loss_sum": 0.0, "correct": 0.0, "num_tokens": 0.0}
    with mesh_lib.activate(mesh, rules):
        for i in range(num_batches):
            batch = train.global_batch(train._host_batch(dataset, i, mesh, rules), mesh, rules)
            for key, value in jax.device_get(step_fn(params, batch)).items():
                totals[key] += float(value)
    tokens = max(totals["num_tokens"], 1.0)
    loss = totals["loss_sum"] / tokens
    return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)),
            "accuracy": totals["correct"] / tokens, "tokens": int(totals["num_tokens"]),
            "batches": num_batches}


def evaluate_run(workdir: str, split: str = "validation", step: int | None = None,
                 eval_steps: int | None = None) -> dict:
    """The JSON object `python -m maxlm.eval` prints. Raises RunError (a ValueError) on a
    workdir, split or data that cannot be used."""
    from maxlm.data import make_dataset
    from maxlm.data.sources import SPLITS

    if split not in SPLITS:
        raise RunError(f"--split={split!r}: expected one of {', '.join(SPLITS)}")
    if eval_steps is not None and eval_steps < 1:
        raise RunError(f"--eval_steps={eval_steps} must be >= 1")
    run = load_run(workdir, step)
    cfg = run["config"]
    dataset = make_dataset(cfg, split)  # ValueError (DataError) on data that does not load
    result = evaluate(cfg, run["params"], dataset, run["mesh"], run["rules"],
                      eval_steps or cfg.eval.steps)
    return {"step": run["step"], "split": split, **result, "checkpoint": run["path"]}


# ----------------------------------------------------------------------------- command line


def main(argv) -> None:
    from absl import flags

    if len(argv) > 1:
        cli.config_error(f"unexpected arguments {argv[1:]}")
    cli.setup_logging()
    f = flags.FLAGS
    if not f.workdir:
        cli.config_error("--workdir=DIR is required")
    distributed.initialize()
    try:
        result = evaluate_run(f.workdir, f.split, f.step, f.eval_steps)
    except ValueError as e:  # RunError, DataError: the user's to fix
        cli.config_error(str(e))
    if jax.process_index() == 0:
        print(json.dumps(result), flush=True)


def define_flags() -> None:
    from absl import flags

    flags.DEFINE_string("workdir", None, "A training run's workdir (config.json, checkpoints/).")
    flags.DEFINE_string("split", "validation", "Data split: validation or train.")
    flags.DEFINE_integer("step", None, "Checkpoint step (default: the newest complete one).")
    flags.DEFINE_integer("eval_steps", None, "Batches to evaluate (default: the config's eval.steps).")


def run(main_fn, define) -> None:
    """absl flags (errors → one line, exit 2, as every maxlm command), then `main_fn(argv)`."""
    from absl import app

    define()
    app.run(main_fn, flags_parser=cli._parse_flags)


if __name__ == "__main__":
    run(main, define_flags)
