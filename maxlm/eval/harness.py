"""lm-evaluation-harness on a run: `python -m maxlm.eval --harness=TASK[,TASK] --workdir=RUN
[--harness_include=DIR] [--shots=K] [--harness_limit=N] [--seed=S] [--step=N]`.

lm-eval builds each task's requests (its YAML: dataset, prompt template, few-shot examples,
metrics) and hands them to `RunLM`, a model class that answers its three request types with the
run's parameters, tokenizer and mesh:

* `loglikelihood(context, continuation)`: tokenized and framed exactly as maxlm's own `--task`
  scorer does (`tasks.encode_pair`, `[bos] + context + continuation` cut on the left), packed into
  the run's `[batch_size, seq_len]` batches and scored by the same jitted step, so the same
  examples give the same numbers (a test checks `--harness` against `--task`).
* `loglikelihood_rolling(text)`: the text's tokens after `[bos]`, in lm-eval's rolling windows of
  `seq_len` predictions (each token predicted once, each window with as much context as fits),
  packed and scored the same way.
* `generate_until(context, gen_kwargs)`: `[bos] + context` cut on the left to leave room for
  `max_gen_toks`, decoded with the KV cache of `maxlm.generate` (greedy unless `do_sample` with a
  temperature), cut at the first stop string. Batches of `--harness_batch_size` prompts, padded
  to a power-of-two length, so a task compiles a handful of shapes.

Every process of a multi-host job runs lm-eval the same way (its requests are deterministic) and
scores them together on the global mesh; process 0 prints the results.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import sys

import jax
import numpy as np

from maxlm import generate as generate_lib
from maxlm.checkpoint import saved_run
from maxlm.eval import tasks as tasks_lib

log = logging.getLogger(__name__)


def _lm_eval():
    """lm_eval (a dependency; imported only for `--harness`), or RunError saying how to install it
    in an environment made without maxlm's requirements (an accelerator image, `--no-deps`)."""
    try:
        import lm_eval
        import lm_eval.api.model  # noqa: F401
    except ImportError as e:
        raise saved_run.RunError(f"--harness needs lm-evaluation-harness ({e}): pip install -r requirements.lock "
                            "(or 'lm-eval>=0.4.13,<0.5')") from None
    return lm_eval


def evaluate_harness(workdir: str, task_names, include: str | None = None, shots: int | None = None,
                     limit: int | None = None, seed: int | None = None, step: int | None = None,
                     batch_size: int = 32, builtin_tasks: bool = True) -> list[dict]:
    """The objects `--harness` prints: one per task (and group) lm-eval reports, with its metrics,
    the number of examples and shots, the step and checkpoint. Raises RunError on a bad flag, an
    unknown task, or a workdir that cannot be used. `builtin_tasks=False` indexes the tasks in
    `include` alone."""
    lm_eval = _lm_eval()
    from lm_eval.tasks import TaskManager

    from maxlm.data.tokenizers import checked_tokenizer

    for name, value, low in (("--shots", shots, 0), ("--harness_limit", limit, 1), ("--seed", seed, 0),
                             ("--harness_batch_size", batch_size, 1)):
        if value is not None and value < low:
            raise saved_run.RunError(f"{name}={value} must be >= {low}")
    manager = TaskManager(include_path=include, include_defaults=builtin_tasks)
    check_task_names(task_names, manager.all_tasks, include)
    run = saved_run.load_run(workdir, step)
    lm = run_lm_class()(run, checked_tokenizer(run["config"]), batch_size)
    seeds = {} if seed is None else {"random_seed": seed, "numpy_random_seed": seed, "fewshot_random_seed": seed}
    # lm-eval bootstraps some metrics' stderr in a forked pool by default; a fork of a process
    # running JAX's threads can deadlock, so its in-process bootstrap runs instead (the same draws)
    os.environ.setdefault("DISABLE_MULTIPROC", "1")
    logging.getLogger("lm_eval").setLevel(max(logging.WARNING, logging.getLogger("lm_eval").level))
    try:  # lm-eval prints some progress to stdout, which carries the results' JSON: it goes to stderr
        with contextlib.redirect_stdout(sys.stderr):
            out = lm_eval.simple_evaluate(model=lm, tasks=list(task_names), num_fewshot=shots, limit=limit,
                                          task_manager=manager, log_samples=False, **seeds)
    except (ConnectionError, FileNotFoundError) as e:  # a task's dataset: the hub unreachable, a file missing
        raise saved_run.RunError(f"--harness: a task's dataset could not be loaded: {e}. Offline, a hub task needs "
                            "its dataset in the Hugging Face cache (HF_HOME) and HF_DATASETS_OFFLINE=1; a "
                            "local task's data_files must exist") from None
    return [{**result, "step": run["step"], "checkpoint": run["path"]} for result in summarize(out)]


def check_task_names(names, known, include: str | None) -> None:
    """RunError naming the tasks lm-eval does not know (its own, and those in `include`)."""
    unknown = [name for name in names if name not in set(known)]
    if unknown:
        raise saved_run.RunError(f"--harness: no lm-eval task, group or tag named {', '.join(unknown)}"
                            + ("" if include else " (give --harness_include=DIR for your own task YAMLs)"))


def summarize(out: dict) -> list[dict]:
    """lm-eval's results as one flat object per task or group: `task`, `examples` (scored),
    `shots`, `version`, and each metric under its name (`acc`, `acc_stderr`; a metric under a
    filter other than lm-eval's `none` keeps it: `exact_match,strict-match`)."""
    rows = []
    for name, metrics in out["results"].items():
        row = {"task": name, "harness": f"lm-eval {out.get('lm_eval_version', '')}".strip()}
        samples = out.get("n-samples", {}).get(name)
        if samples:
            row["examples"] = samples["effective"]
        if name in out.get("n-shot", {}):
            row["shots"] = out["n-shot"][name]
        if isinstance(out.get("versions", {}).get(name), (int, float)):  # a YAML without one says "Yaml"
            row["version"] = out["versions"][name]
        for key, value in metrics.items():
            if key in ("alias", "name", "sample_len") or value in ("N/A", None):  # sample_len: `examples`
                continue
            metric, _, which = key.partition(",")
            row[metric if which in ("none", "") else key] = value
        rows.append(row)
    return rows


@functools.cache
def run_lm_class():
    """`RunLM(run, tokenizer, batch_size)`: lm-eval's model interface answered by a run. Built on
    first use, since lm-eval is imported only when `--harness` is used."""

    class RunLM(_lm_eval().api.model.LM):
        def __init__(self, run, tokenizer, batch_size: int = 32):
            super().__init__()
            self.run, self.tokenizer, self.batch_size = run, tokenizer, batch_size
            self.cfg = run["config"]

        def loglikelihood(self, requests, disable_tqdm: bool = False):
            return self._answer("loglikelihood", [req.args for req in requests],
                                lambda pairs: score_pairs(self.cfg, self.run, self.tokenizer, pairs))

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            return self._answer("loglikelihood_rolling", [req.args for req in requests],
                                lambda args: score_rolling(self.cfg, self.run, self.tokenizer, [a[0] for a in args]))

        def generate_until(self, requests, disable_tqdm: bool = False):
            return self._answer("generate_until", [req.args for req in requests],
                                lambda args: generate_texts(self.cfg, self.run, self.tokenizer, args, self.batch_size))

        def _answer(self, kind: str, args: list, compute) -> list:
            results = compute(args) if args else []
            for arg, result in zip(args, results):  # lm-eval's --use_cache, when a caller wraps this model
                self.cache_hook.add_partial(kind, arg, result)
            return results

    return RunLM


# ----------------------------------------------------------------------------- the three request types


def _score(cfg, run, tokenizer, sequences, scored, what: str) -> tuple[np.ndarray, np.ndarray]:
    """Packs `sequences` (their last `scored[i]` tokens scored) into the run's batches and scores
    them, with a progress line."""
    from maxlm.runtime.progress import Progress

    packed = tasks_lib.pack(sequences, scored, cfg.seq_len, cfg.batch_size, tokenizer.pad_id)
    with Progress(f"harness {what}", packed.rows.num_batches, "batches") as progress:
        on_batch = lambda tokens: progress.update(advance=1, tokens=(progress.tokens or 0) + tokens)
        return tasks_lib.request_scores(cfg, run["params"], packed, run["mesh"], run["rules"], on_batch)


def score_pairs(cfg, run, tokenizer, pairs) -> list[tuple[float, bool]]:
    """(log-likelihood, greedy) of each (context, continuation), as `--task` scores them."""
    sequences, scored, cut = [], [], 0
    for context, continuation in pairs:
        if context:
            context_ids, continuation_ids = tasks_lib.encode_pair(tokenizer, context, continuation)
        else:  # lm-eval: an empty context is the prefix token alone; here it is bos, as always
            context_ids, continuation_ids = [], tokenizer.encode(continuation).tolist()
        continuation_ids = continuation_ids[-cfg.seq_len:]  # the rest has no position to be scored from
        tokens, was_cut = tasks_lib.framed(tokenizer, context_ids, continuation_ids, cfg.seq_len)
        cut += was_cut
        sequences.append(tokens)
        scored.append(len(continuation_ids))
    if cut:
        log.warning("harness: %d of %d requests cut on the left to seq_len=%d", cut, len(pairs), cfg.seq_len)
    loglik, greedy = _score(cfg, run, tokenizer, sequences, scored, "loglikelihood")
    return [(float(ll), bool(g)) for ll, g in zip(loglik, greedy)]


def rolling_windows(ids: list[int], bos_id: int, seq_len: int) -> list[tuple[list[int], int]]:
    """lm-eval's rolling windows of a text's tokens as (sequence, scored) pairs: every token
    predicted once, the first after `bos`, each window's sequence at most seq_len + 1 long."""
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    windows = map(make_disjoint_window, get_rolling_token_windows(ids, bos_id, seq_len, context_len=1))
    return [([*context, *predicted], len(predicted)) for context, predicted in windows]


def score_rolling(cfg, run, tokenizer, texts) -> list[float]:
    """Each text's summed log-likelihood, conditioned on bos."""
    sequences, scored, owner = [], [], []
    for index, text in enumerate(texts):
        for sequence, count in rolling_windows(tokenizer.encode(text).tolist(), tokenizer.bos_id, cfg.seq_len):
            sequences.append(sequence)
            scored.append(count)
            owner.append(index)
    totals = np.zeros(len(texts))
    if sequences:
        loglik, _ = _score(cfg, run, tokenizer, sequences, scored, "loglikelihood_rolling")
        np.add.at(totals, np.asarray(owner), loglik)
    return [float(total) for total in totals]


def generate_texts(cfg, run, tokenizer, args, batch_size: int) -> list[str]:
    """Each (context, gen_kwargs)'s generated text, cut at its first stop string."""
    from lm_eval.models.utils import normalize_gen_kwargs

    from maxlm.runtime.progress import Progress

    groups: dict[str, tuple[dict, list[int]]] = {}  # requests by their generation settings
    for index, (_, gen_kwargs) in enumerate(args):
        kwargs = normalize_gen_kwargs(dict(gen_kwargs or {}))
        groups.setdefault(json.dumps(kwargs, sort_keys=True, default=str), (kwargs, []))[1].append(index)
    texts = [""] * len(args)
    batches = [(kwargs, indices[first:first + batch_size]) for kwargs, indices in groups.values()
               for first in range(0, len(indices), batch_size)]
    with Progress("harness generate_until", len(batches), "batches") as progress:
        for kwargs, chunk in batches:
            generated = _generate_batch(cfg, run, tokenizer, [args[i][0] for i in chunk], kwargs, batch_size)
            for index, text in zip(chunk, generated):
                texts[index] = text
            progress.update(advance=1)
    return texts


def _generate_batch(cfg, run, tokenizer, contexts, kwargs: dict, batch_size: int) -> list[str]:
    until = kwargs.get("until") or []
    max_new = max(1, min(int(kwargs["max_gen_toks"]), cfg.seq_len - 1))
    max_context = cfg.seq_len - max_new
    prompts = [[tokenizer.bos_id, *tokenizer.encode(c).tolist()][-max_context:] for c in contexts]
    padded_len = min(max_context, max(16, 1 << (max(map(len, prompts)) - 1).bit_length()))
    rows = prompts + [prompts[-1]] * (batch_size - len(prompts))  # one shape per length bucket
    prompt_BP, lengths_B = generate_lib.pad_prompts(rows, tokenizer.pad_id)
    prompt_BP = np.pad(prompt_BP, ((0, 0), (0, padded_len - prompt_BP.shape[1])), constant_values=tokenizer.pad_id)
    # normalize_gen_kwargs has set temperature 0 (greedy) unless the task samples
    settings = generate_lib.settings(seed=0, temperature=float(kwargs.get("temperature") or 0.0),
                                     eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id,
                                     vocab_limit=tokenizer.vocab_size)
    fn = generate_lib.make_generate_fn(cfg, run["mesh"], run["rules"], max_new_tokens=max_new)
    with generate_lib.activation_context(run["mesh"], run["rules"]):
        tokens_BN, counts_B = jax.device_get(fn(run["params"], prompt_BP, lengths_B, settings))
    texts = []
    for row, count in zip(tokens_BN[:len(prompts)], counts_B):
        ids = row[:count].tolist()
        if ids and ids[-1] == tokenizer.eos_id:
            ids = ids[:-1]
        texts.append(cut_at_stop(tokenizer.decode(ids), until))
    return texts


def cut_at_stop(text: str, until) -> str:
    """`text` up to the first occurrence of any stop string."""
    ends = [at for at in (text.find(stop) for stop in until if stop) if at >= 0]
    return text[:min(ends)] if ends else text
