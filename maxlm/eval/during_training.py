"""Evaluation: the eval step and loop of the training loop and of `python -m maxlm.eval`.

    python -m maxlm.eval --workdir=DIR [--split=validation] [--step=N] [--eval_steps=N]
    python -m maxlm.eval --workdir=DIR --task=FILE.jsonl[,FILE.jsonl ...] [--shots=K] [--seed=S]

(`maxlm/eval/__main__.py` is that command.) The command reads
the run back (`saved_run.load_run`: DIR/config.json, one checkpoint's parameters, default the newest)
and prints one JSON object:

    {"step", "split", "loss", "perplexity", "accuracy", "tokens", "batches", "checkpoint"}

(and "loss_by_position" with `eval.position_buckets`: `evaluate`).
`loss` is the mean next-token cross-entropy (nats/token) over the non-padding tokens of the first
`eval_steps` batches of the split (default `eval.steps`): the validation batches the training
loop's own eval reads, with the same jitted step, so at a step where the run evaluated, `loss`
equals its `eval_loss`. `accuracy` is the share of those tokens whose argmax prediction is the
target. With the run's `eval.sets` (and the validation split), `"sets"` holds the same for each
named set. With `--task`, it prints one object per task instead (`maxlm/eval/tasks.py`).

The training loop's eval (`load_eval_data` before anything compiles, `eval_row` at each eval)
covers the validation split, `eval.sets` and `eval.tasks` in one metrics row.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math

import jax
import jax.numpy as jnp
import ml_collections

from maxlm import model
from maxlm.checkpoint import saved_run
from maxlm.data.errors import DataError
from maxlm.eval import tasks as tasks_lib
from maxlm.observe import metrics
from maxlm.sharding import mesh as mesh_lib, state as state_lib


def eval_step(model_cfg, params, batch, position_buckets: int = 0) -> dict:
    """Sums over one batch's non-padding tokens: cross-entropy, correct argmax predictions, tokens;
    with `position_buckets` K, also the cross-entropy and tokens [K] of each bucket of positions
    in the document (`bucket_of`)."""
    per_token = model.token_losses(model_cfg, params, batch)
    weights_BL = per_token["weights"]
    loss_BL = per_token["cross_entropy"] * weights_BL
    out = {"loss_sum": loss_BL.sum(), "correct": (per_token["correct"] * weights_BL).sum(),
           "num_tokens": weights_BL.sum()}
    if position_buckets:
        bucket_BL = bucket_of(batch["positions"], batch["positions"].shape[1], position_buckets)
        # a masked sum per bucket: no [B, L, K] array, and the plain loss's sum stays as it was
        out["bucket_loss_sum"] = jnp.stack([jnp.where(bucket_BL == k, loss_BL, 0).sum() for k in range(position_buckets)])
        out["bucket_tokens"] = jnp.stack([jnp.where(bucket_BL == k, weights_BL, 0).sum() for k in range(position_buckets)])
    return out


def bucket_of(positions, seq_len: int, buckets: int):
    """The bucket of each position in its document: `buckets` equal spans of [0, seq_len), bucket k
    holding positions [ceil(k·L/K), ceil((k+1)·L/K))."""
    return positions * buckets // seq_len


def bucket_starts(seq_len: int, buckets: int) -> list[int]:
    """Each bucket's first position: what names it in the metrics (`eval/loss_by_position/START`)."""
    return [-(-k * seq_len // buckets) for k in range(buckets)]


def make_eval_step(model_cfg, mesh, rules, position_buckets: int = 0):
    """`eval_step` jitted with the parameters' and batch's shardings; the same function for the same
    model, mesh and buckets, so evaluating again (or several checkpoints) compiles once."""
    return _eval_step(json.dumps(model_cfg.to_dict(), sort_keys=True), mesh, rules, position_buckets)


@functools.lru_cache(maxsize=8)
def _eval_step(model_json: str, mesh, rules, position_buckets: int):
    model_cfg = ml_collections.ConfigDict(json.loads(model_json))
    return jax.jit(
        functools.partial(eval_step, model_cfg, position_buckets=position_buckets),
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
    """Loss, perplexity and next-token accuracy over batches 0..num_batches-1 of `dataset`, at most
    one pass over it: past its last batch the split would start again and count rows twice. With
    `eval.position_buckets`, `loss_by_position` too: {bucket's first position: its mean loss}
    (NaN for a bucket without tokens)."""
    num_batches = min(num_batches, dataset.steps_per_epoch)
    buckets = cfg.eval.position_buckets
    step_fn = make_eval_step(cfg.model, mesh, rules, buckets)
    with mesh_lib.activate(mesh, rules):
        sums = jax.device_get([step_fn(params, mesh_lib.read_batch(dataset, i, mesh, rules))
                               for i in range(num_batches)])
    totals = {key: sum(float(s[key]) for s in sums) for key in ("loss_sum", "correct", "num_tokens")}
    tokens = max(totals["num_tokens"], 1.0)
    loss = totals["loss_sum"] / tokens
    out = {"loss": loss, "perplexity": perplexity(loss), "accuracy": totals["correct"] / tokens,
           "tokens": int(totals["num_tokens"]), "batches": num_batches}
    if buckets:
        loss_K, tokens_K = (sum(s[key].astype("float64") for s in sums) for key in ("bucket_loss_sum", "bucket_tokens"))
        out["loss_by_position"] = {start: float(lk / tk) if tk else math.nan
                                   for start, lk, tk in zip(bucket_starts(cfg.seq_len, buckets), loss_K, tokens_K)}
    return out


# ----------------------------------------------------------------------------- eval.sets


def training_sources(cfg) -> list[str]:
    """The source specs the run trains on: `data.mixture`'s, else `data.source`."""
    return [spec for _, spec, _ in cfg.data.mixture] or [cfg.data.source]


def eval_set_config(cfg, source: str):
    """The config that prepares eval set `source` as its `data.source`, with the run's tokenizer,
    filters and seq_len. Its `validation` split is what is evaluated: a TFDS source's own, or for
    local files given as the run gives a training source, the `data.validation_percent` share that
    training holds out (same spec, same hash). Other local files are held out whole."""
    from maxlm.data import sources

    sub = cfg.copy_and_resolve_references()
    sub.data.source, sub.data.mixture = source, ()
    if sources.parse_source(source).kind == "files" and source not in training_sources(cfg):
        check_not_trained_on(cfg, source)
        sub.data.validation_percent = 100.0  # every document is held out
    return sub


def check_not_trained_on(cfg, source: str) -> None:
    """DataError when local files `source` include a file of a training source: held out whole,
    they would score documents the run trains on."""
    from maxlm.data import sources

    files = {f.resolve() for f in sources.list_files(source)[1]}
    for spec in training_sources(cfg):
        if sources.parse_source(spec).kind != "files":
            continue
        shared = sorted(files & {f.resolve() for f in sources.list_files(spec)[1]})
        if shared:
            raise DataError(f"{len(shared)} of its files ({shared[0]}, ...) are in the training source "
                            f"{spec!r}: give the set that same spec to evaluate the share training "
                            "holds out (data.validation_percent), or files the run does not train on")


def load_eval_sets(cfg) -> dict:
    """`eval.sets`' validation datasets by name, each prepared like `data.source` (on first use).
    Raises DataError naming the set."""
    from maxlm.data import make_dataset

    datasets = {}
    for name, source in cfg.eval.sets:
        try:
            datasets[name] = make_dataset(eval_set_config(cfg, source), "validation")
        except ValueError as e:
            raise DataError(f"eval.sets {name!r}: {e}") from None
    return datasets


def evaluate_sets(cfg, params, datasets: dict, mesh, rules) -> dict:
    """`evaluate`'s result per named set, over `eval.steps` batches or the set's whole rows if it
    has fewer (a row is never counted twice)."""
    return {name: evaluate(cfg, params, dataset, mesh, rules, cfg.eval.steps)
            for name, dataset in datasets.items()}


# ----------------------------------------------------------------------------- the training loop's eval


@dataclasses.dataclass
class EvalData:
    """What the training loop's eval reads (`load_eval_data`)."""

    validation: object  # the run's validation split (data.source or data.mixture)
    sets: dict  # eval.sets: name -> its validation dataset
    tasks: list  # eval.tasks: tasks.PreparedTask each


def load_eval_data(cfg) -> EvalData:
    """The validation split, `eval.sets` and `eval.tasks` (with `eval.task_shots`, drawn with the
    run's seed), loaded, prepared and checked before anything compiles. Raises ValueError
    (DataError: FILE:LINE, or the set's name)."""
    from maxlm.data import make_dataset

    return EvalData(make_dataset(cfg, "validation"), load_eval_sets(cfg),
                    load_tasks(cfg, cfg.eval.tasks, cfg.eval.task_shots, cfg.seed))


def load_tasks(cfg, paths, shots: int, seed: int) -> list:
    """Task files read, checked and packed with the run's tokenizer and batch shape."""
    from maxlm.data.tokenizers import checked_tokenizer

    tokenizer = checked_tokenizer(cfg)
    return [tasks_lib.prepare(tasks_lib.load_task(path), tokenizer, cfg.seq_len, cfg.batch_size, shots, seed)
            for path in paths]


def eval_row(cfg, params, data: EvalData, mesh, rules) -> dict:
    """One eval's metrics row: `eval_loss`, `eval_perplexity`; the validation loss by position
    bucket (`eval/loss_by_position/START` each, with `eval.position_buckets`); `eval/<set>/loss`,
    `eval/<set>/perplexity` per set; `eval/<task>/<metric>` per task (`tasks.METRICS`)."""
    result = evaluate(cfg, params, data.validation, mesh, rules, cfg.eval.steps)
    row = {"eval_loss": result["loss"], "eval_perplexity": result["perplexity"]}
    row.update({f"{metrics.LOSS_BY_POSITION}/{start}": value for start, value in result.get("loss_by_position", {}).items()})
    for name, on_set in evaluate_sets(cfg, params, data.sets, mesh, rules).items():
        row.update({f"eval/{name}/loss": on_set["loss"], f"eval/{name}/perplexity": on_set["perplexity"]})
    for prepared in data.tasks:
        row.update(tasks_lib.metrics_row(tasks_lib.score(cfg, params, prepared, mesh, rules)))
    return row


# ----------------------------------------------------------------------------- a run read back


def evaluate_run(workdir: str, split: str = "validation", step: int | None = None,
                 eval_steps: int | None = None) -> dict:
    """The JSON object `python -m maxlm.eval` prints. Raises RunError (a ValueError) on a
    workdir, split or data that cannot be used."""
    from maxlm.data import make_dataset
    from maxlm.data.sources import SPLITS

    if split not in SPLITS:
        raise saved_run.RunError(f"--split={split!r}: expected one of {', '.join(SPLITS)}")
    if eval_steps is not None and eval_steps < 1:
        raise saved_run.RunError(f"--eval_steps={eval_steps} must be >= 1")
    run = saved_run.load_run(workdir, step)
    cfg, params, mesh, rules = run["config"], run["params"], run["mesh"], run["rules"]
    dataset = make_dataset(cfg, split)  # ValueError (DataError) on data that does not load
    out = {"step": run["step"], "split": split,
           **evaluate(cfg, params, dataset, mesh, rules, eval_steps or cfg.eval.steps)}
    if split == "validation" and cfg.eval.sets:
        out["sets"] = evaluate_sets(cfg, params, load_eval_sets(cfg), mesh, rules)
    return {**out, "checkpoint": run["path"]}


def evaluate_tasks(workdir: str, paths, shots: int | None = None, seed: int | None = None,
                   step: int | None = None) -> list[dict]:
    """The objects `--task` prints: `tasks.score`'s result per task file, with step and
    checkpoint. `shots` and `seed` default to the run's `eval.task_shots` and `seed`, so at a step
    where the run evaluated its `eval.tasks`, the numbers are the ones it logged."""
    if shots is not None and shots < 0:
        raise saved_run.RunError(f"--shots={shots} must be >= 0")
    if seed is not None and seed < 0:
        raise saved_run.RunError(f"--seed={seed} must be >= 0")
    run = saved_run.load_run(workdir, step)
    cfg = run["config"]
    prepared = load_tasks(cfg, paths, cfg.eval.task_shots if shots is None else shots,
                          cfg.seed if seed is None else seed)  # every file checked before scoring
    return [{**tasks_lib.score(cfg, run["params"], p, run["mesh"], run["rules"]), "step": run["step"],
             "checkpoint": run["path"]} for p in prepared]
