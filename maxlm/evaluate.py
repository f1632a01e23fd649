"""Evaluation: the eval step and loop of the training loop and of `python -m maxlm.eval`.

    python -m maxlm.eval --workdir=DIR [--split=validation] [--step=N] [--eval_steps=N]

(`eval.py` is the entry point; `python -m maxlm.evaluate` is the same command.) The command reads
the run back (`runs.load_run`: DIR/config.json, one checkpoint's parameters, default the newest)
and prints one JSON object:

    {"step", "split", "loss", "perplexity", "accuracy", "tokens", "batches", "checkpoint"}

`loss` is the mean next-token cross-entropy (nats/token) over the non-padding tokens of the first
`eval_steps` batches of the split (default `eval.steps`): the validation batches the training
loop's own eval reads, with the same jitted step, so at a step where the run evaluated, `loss`
equals its `eval_loss`. `accuracy` is the share of those tokens whose argmax prediction is the
target.
"""

from __future__ import annotations

import functools
import json
import math

import jax
import ml_collections

from maxlm import cli, distributed, mesh as mesh_lib, model, runs, state as state_lib


def eval_step(model_cfg, params, batch) -> dict:
    """Sums over one batch's non-padding tokens: cross-entropy, correct argmax predictions, tokens."""
    per_token = model.token_losses(model_cfg, params, batch)
    weights_BL = per_token["weights"]
    return {"loss_sum": (per_token["cross_entropy"] * weights_BL).sum(),
            "correct": (per_token["correct"] * weights_BL).sum(), "num_tokens": weights_BL.sum()}


def make_eval_step(model_cfg, mesh, rules):
    """`eval_step` jitted with the parameters' and batch's shardings; the same function for the same
    model and mesh, so evaluating again (or several checkpoints) compiles once."""
    return _eval_step(json.dumps(model_cfg.to_dict(), sort_keys=True), mesh, rules)


@functools.lru_cache(maxsize=8)
def _eval_step(model_json: str, mesh, rules):
    model_cfg = ml_collections.ConfigDict(json.loads(model_json))
    return jax.jit(
        functools.partial(eval_step, model_cfg),
        in_shardings=(state_lib.param_shardings(model_cfg, mesh, rules),
                      mesh_lib.batch_sharding(mesh, rules)),
        out_shardings=mesh_lib.replicated(mesh),
    )


def perplexity(loss: float) -> float:
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


def evaluate(cfg, params, dataset, mesh, rules, num_batches: int) -> dict:
    """Loss, perplexity and next-token accuracy over batches 0..num_batches-1 of `dataset`."""
    step_fn = make_eval_step(cfg.model, mesh, rules)
    with mesh_lib.activate(mesh, rules):
        sums = jax.device_get([step_fn(params, mesh_lib.read_batch(dataset, i, mesh, rules))
                               for i in range(num_batches)])
    totals = {key: sum(float(s[key]) for s in sums) for key in ("loss_sum", "correct", "num_tokens")}
    tokens = max(totals["num_tokens"], 1.0)
    loss = totals["loss_sum"] / tokens
    return {"loss": loss, "perplexity": perplexity(loss), "accuracy": totals["correct"] / tokens,
            "tokens": int(totals["num_tokens"]), "batches": num_batches}


def evaluate_run(workdir: str, split: str = "validation", step: int | None = None,
                 eval_steps: int | None = None) -> dict:
    """The JSON object `python -m maxlm.eval` prints. Raises RunError (a ValueError) on a
    workdir, split or data that cannot be used."""
    from maxlm.data import make_dataset
    from maxlm.data.sources import SPLITS

    if split not in SPLITS:
        raise runs.RunError(f"--split={split!r}: expected one of {', '.join(SPLITS)}")
    if eval_steps is not None and eval_steps < 1:
        raise runs.RunError(f"--eval_steps={eval_steps} must be >= 1")
    run = runs.load_run(workdir, step)
    cfg = run["config"]
    dataset = make_dataset(cfg, split)  # ValueError (DataError) on data that does not load
    result = evaluate(cfg, run["params"], dataset, run["mesh"], run["rules"],
                      eval_steps or cfg.eval.steps)
    return {"step": run["step"], "split": split, **result, "checkpoint": run["path"]}


# ----------------------------------------------------------------------------- command line


def main(argv) -> None:
    f = cli.start(argv, required=("workdir",))
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


if __name__ == "__main__":
    cli.run(main, define_flags, config_file=False)
