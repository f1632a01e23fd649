"""Zero- and few-shot tasks: multiple-choice and cloze examples scored by log-likelihood.

A task is a `.jsonl` file (local or at a URL such as `gs://bucket/tasks/x.jsonl`), one example per
line, all of one kind; its name is the file's stem:

    multiple choice  {"context": str, "choices": [str, ...], "answer": int}
    cloze            {"context": str, "target": str}, or {"text": str} (the target: its last word)

Scoring follows lm-evaluation-harness. A request is a (context, continuation) pair, tokenized as
lm-eval's `_encode_pair` does (the context's trailing whitespace moves to the continuation; the
whole is encoded at once and the continuation is what follows the context's own encoding), framed
as training framed a document (`[bos] + context + continuation`, cut on the left to seq_len + 1
tokens), and scored by the summed log-likelihood of the continuation's tokens.

* Multiple choice: one request per choice, the choice appended to the context verbatim (write the
  space in the choice: " Paris"). `acc`: the choice of highest log-likelihood is the answer;
  `acc_norm`: the same with each log-likelihood divided by the choice's length in characters
  (`len(choice)`, lm-eval's `completion_len`). Ties go to the first choice (`np.argmax`).
* Cloze (LAMBADA's form): `acc` counts an example when every target token is the argmax of its
  position (greedy decoding would write the target); `perplexity` is lm-eval's:
  exp(-mean over examples of the target's summed log-likelihood), per target, not per token.

With k shots, each example's context is preceded by k other examples of the same task, drawn
with `(seed, example index)`, each written as its context followed by its right continuation, and
separated by a blank line (lm-eval's `fewshot_delimiter`).

Requests are packed into rows as training packs documents (one segment each, positions from 0,
attention inside a segment), rows into batches of the run's `[batch_size, seq_len]`, scored by
one jitted `model.token_losses` on the run's mesh: every batch has that shape, so it compiles once.

Shape suffixes as in model.py, plus R (packed rows).
"""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import logging
import math
import os
import re

import jax
import ml_collections
import numpy as np
from etils import epath

from maxlm import model
from maxlm.data.errors import DataError
from maxlm.data.prefetch import batch_parts_key
from maxlm.runtime import processes
from maxlm.sharding import mesh as mesh_lib, state as state_lib

log = logging.getLogger(__name__)

MULTIPLE_CHOICE, CLOZE = "multiple_choice", "cloze"
SHOT_SEPARATOR = "\n\n"  # between few-shot examples (lm-eval's fewshot_delimiter)
METRICS = {MULTIPLE_CHOICE: ("acc", "acc_norm"), CLOZE: ("acc", "perplexity")}  # logged in training
_LAST_WORD = re.compile(r"(.*\S)(\s+\S+)\s*", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class Example:
    context: str
    continuations: tuple[str, ...]  # multiple choice: the choices; cloze: (the target,)
    answer: int = 0  # index of the right continuation
    line: int = 0  # in the task file, for errors


@dataclasses.dataclass(frozen=True)
class Task:
    name: str  # the file's stem
    path: str
    kind: str  # MULTIPLE_CHOICE or CLOZE
    examples: tuple[Example, ...]


def task_name(path: str) -> str:
    """A task's name: its file's stem (`hellaswag` for `data/hellaswag.jsonl`)."""
    return os.path.splitext(os.path.basename(path))[0]


# ----------------------------------------------------------------------------- reading a task


def load_task(path: str) -> Task:
    """The task in `path` (`~` expanded; local or a URL). Raises DataError naming FILE:LINE for a
    bad line. Every process of the job calls this together: process 0 alone reads the file (a file
    one host lacks stops every process, not that one alone) and every process gets its bytes."""
    path = os.path.expanduser(path)
    data = processes.from_process_0(lambda: _task_bytes(path))
    kind, examples = None, []
    with io.BytesIO(data) as f:
        for line, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            line_kind, example = parse_example(raw, path, line)
            if kind is not None and line_kind != kind:
                raise DataError(f"a {line_kind} example in a {kind} task (a task's lines are all "
                                "of one kind)", path, line)
            kind = line_kind
            examples.append(example)
    if not examples:
        raise DataError("no examples (empty task file)", path)
    return Task(task_name(path), path, kind, tuple(examples))


def _task_bytes(path: str) -> bytes:
    file = epath.Path(path)
    if not file.is_file():
        raise DataError("no such task file", path)
    return file.read_bytes()


def parse_example(raw: bytes, path: str, line: int) -> tuple[str, Example]:
    """(kind, example) of one line of a task file."""

    def fail(message: str):
        raise DataError(message, path, line)

    try:
        obj = json.loads(raw)
    except ValueError as e:  # broken JSON, or bytes that are not UTF-8
        fail(f"not a JSON line ({e})")
    if not isinstance(obj, dict):
        fail(f"expected a JSON object, got {type(obj).__name__}")
    if "choices" in obj:
        return MULTIPLE_CHOICE, _multiple_choice(obj, line, fail)
    if "target" in obj:
        return CLOZE, _cloze(obj.get("context"), obj["target"], line, fail)
    if "text" in obj:
        if not isinstance(obj["text"], str) or not (m := _LAST_WORD.fullmatch(obj["text"])):
            fail(f"'text' must be a string of at least two words (the last is the target), "
                 f"got {obj['text']!r:.80}")
        return CLOZE, _cloze(m[1], m[2], line, fail)
    fail(f"expected {{context, choices, answer}} (multiple choice), {{context, target}} or {{text}} "
         f"(cloze); got fields {sorted(obj)[:8]}")


def _multiple_choice(obj: dict, line: int, fail) -> Example:
    context, choices, answer = obj.get("context"), obj["choices"], obj.get("answer")
    if not isinstance(context, str):
        fail(f"'context' must be a string, got {context!r:.80}")
    if not (isinstance(choices, list) and len(choices) >= 2
            and all(isinstance(c, str) and c for c in choices)):
        fail(f"'choices' must be a list of at least two non-empty strings, got {choices!r:.80}")
    if not (isinstance(answer, int) and not isinstance(answer, bool) and 0 <= answer < len(choices)):
        fail(f"'answer' must be the index of the right choice, 0 to {len(choices) - 1}, got {answer!r}")
    return Example(context, tuple(choices), answer, line)


def _cloze(context, target, line: int, fail) -> Example:
    if not isinstance(context, str):
        fail(f"'context' must be a string, got {context!r:.80}")
    if not (isinstance(target, str) and target):
        fail(f"'target' must be a non-empty string, got {target!r:.80}")
    return Example(context, (target,), 0, line)


# ----------------------------------------------------------------------------- prompts


def check_shots(task: Task, shots: int) -> None:
    """DataError unless the task has `shots` examples besides each one."""
    if shots >= len(task.examples):
        raise DataError(f"{shots} shots (--shots, eval.task_shots) need {shots + 1} examples; the task "
                        f"has {len(task.examples)}", task.path)


def shot_indices(num_examples: int, index: int, shots: int, seed: int) -> list[int]:
    """`shots` distinct example indices other than `index`, drawn with (seed, index): the same
    prompt for an example every time, whatever else is scored."""
    drawn = np.random.default_rng([seed, index]).choice(num_examples - 1, size=shots, replace=False)
    return [int(i) + (i >= index) for i in drawn]  # skip `index` itself


def demonstration(example: Example) -> str:
    """A few-shot example as the prompt shows it: its context and its right continuation."""
    return example.context + example.continuations[example.answer]


def prompt(task: Task, index: int, shots: int, seed: int) -> str:
    """Example `index`'s context after `shots` demonstrations of other examples."""
    before = [demonstration(task.examples[i]) for i in shot_indices(len(task.examples), index, shots, seed)]
    return "".join(text + SHOT_SEPARATOR for text in before) + task.examples[index].context


# ----------------------------------------------------------------------------- tokens and rows


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) as lm-eval's `_encode_pair`: a tokenizer that merges a
    space with the word after it sees them together, as in running text."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation).tolist()
    context_ids = tokenizer.encode(context).tolist()
    return context_ids, whole[len(context_ids):]


class Rows:
    """Fixed packed rows served as global batches of `batch_size` rows, with `TokenDataset.batch`'s
    signature, so `mesh.read_batch` gives each process the rows its devices hold."""

    def __init__(self, arrays: dict[str, np.ndarray], batch_size: int):
        self.arrays, self.batch_size = arrays, batch_size
        self.num_batches = len(arrays["inputs"]) // batch_size

    def batch(self, step: int, process_index=0, process_count: int = 1) -> dict[str, np.ndarray]:
        per_process = self.batch_size // process_count
        first = step * self.batch_size
        ids = np.concatenate([np.arange(per_process) + first + part * per_process
                              for part in batch_parts_key(process_index)])
        return {key: array[ids] for key, array in self.arrays.items()}


@dataclasses.dataclass
class Packed:
    """Requests (token sequences whose last tokens are scored) packed into whole batches."""

    rows: Rows
    owner_RL: np.ndarray  # the request whose continuation a target slot is; -1 elsewhere
    num_requests: int


@dataclasses.dataclass
class PreparedTask:
    """A task's requests packed into batches, ready to score many times (each eval)."""

    task: Task
    shots: int
    seed: int
    packed: Packed
    first_request: np.ndarray  # example e's requests are first_request[e] .. first_request[e+1]-1
    truncated: int  # requests whose context was cut on the left to fit seq_len


def prepare(task: Task, tokenizer, seq_len: int, batch_size: int, shots: int = 0,
            seed: int = 0) -> PreparedTask:
    """Tokenizes and packs every request of `task` (`shots` demonstrations drawn with `seed`) into
    rows of `seq_len`, padded to whole batches of `batch_size`. Raises DataError (FILE:LINE) on a
    continuation that does not fit."""
    check_shots(task, shots)
    sequences, scored, first_request, truncated = [], [], [0], 0
    for index, example in enumerate(task.examples):
        context = prompt(task, index, shots, seed)
        for continuation in example.continuations:
            context_ids, continuation_ids = encode_pair(tokenizer, context, continuation)
            if not 0 < len(continuation_ids) <= seq_len:
                raise DataError(f"continuation {continuation!r:.40} is {len(continuation_ids)} tokens; "
                                f"it must be 1 to seq_len={seq_len}", task.path, example.line)
            tokens, cut = framed(tokenizer, context_ids, continuation_ids, seq_len)
            truncated += cut
            sequences.append(tokens)
            scored.append(len(continuation_ids))
        first_request.append(len(sequences))
    if truncated:
        log.warning("task %s: %d of %d requests cut on the left to seq_len=%d", task.name, truncated,
                    len(sequences), seq_len)
    return PreparedTask(task, shots, seed, pack(sequences, scored, seq_len, batch_size, tokenizer.pad_id),
                        np.asarray(first_request), truncated)


def framed(tokenizer, context_ids, continuation_ids, seq_len: int) -> tuple[list[int], bool]:
    """(`[bos] + context + continuation` cut on the left to seq_len + 1 tokens, whether it was cut):
    a request framed as training framed a document."""
    tokens = [tokenizer.bos_id, *context_ids, *continuation_ids]
    return tokens[-(seq_len + 1):], len(tokens) > seq_len + 1


def pack(sequences, scored, seq_len: int, batch_size: int, pad_id: int = 0) -> Packed:
    """`pack_requests` as batches of `batch_size` rows, ready to score."""
    arrays = pack_requests(sequences, scored, seq_len, batch_size, pad_id)
    owner_RL = arrays.pop("owner")
    return Packed(Rows(arrays, batch_size), owner_RL, len(sequences))


def pack_requests(sequences, scored, seq_len: int, batch_size: int, pad_id: int = 0) -> dict:
    """Token sequences (each at most seq_len + 1 long, its last `scored[i]` tokens the
    continuation) laid into rows in order, a sequence starting a new row when it does not fit in
    what is left of the current one; rows padded to a multiple of `batch_size`. Returns int32
    `inputs, targets, segment_ids, positions` and `owner` (request i at its continuation's
    target slots, -1 elsewhere), each [R, seq_len]."""
    starts, row, col = [], 0, 0  # (row, column) where each sequence's first pair goes
    for tokens in sequences:
        if col + len(tokens) - 1 > seq_len:
            row, col = row + 1, 0
        starts.append((row, col))
        col += len(tokens) - 1
    num_rows = -(-(row + 1) // batch_size) * batch_size
    arrays = {key: np.zeros((num_rows, seq_len), np.int32) for key in ("segment_ids", "positions")}
    arrays.update(inputs=np.full((num_rows, seq_len), pad_id, np.int32),
                  targets=np.full((num_rows, seq_len), pad_id, np.int32),
                  owner=np.full((num_rows, seq_len), -1, np.int32))
    for i, (tokens, (r, c)) in enumerate(zip(sequences, starts)):
        n = len(tokens) - 1
        arrays["inputs"][r, c:c + n] = tokens[:-1]
        arrays["targets"][r, c:c + n] = tokens[1:]
        arrays["segment_ids"][r, c:c + n] = arrays["segment_ids"][r, c - 1] + 1 if c else 1
        arrays["positions"][r, c:c + n] = np.arange(n)
        arrays["owner"][r, c + n - scored[i]:c + n] = i
    return arrays


# ----------------------------------------------------------------------------- scoring


def score_step(model_cfg, params, batch) -> dict:
    """Per-token cross-entropy and argmax-is-target, [B, L]."""
    per_token = model.token_losses(model_cfg, params, batch)
    return {"cross_entropy": per_token["cross_entropy"], "correct": per_token["correct"]}


def make_score_step(model_cfg, mesh, rules):
    """`score_step` jitted with the parameters' and batch's shardings, its outputs replicated
    (every process reads them whole); one function per model and mesh, so it compiles once."""
    return _score_step(json.dumps(model_cfg.to_dict(), sort_keys=True), mesh, rules)


@functools.lru_cache(maxsize=8)
def _score_step(model_json: str, mesh, rules):
    model_cfg = ml_collections.ConfigDict(json.loads(model_json))
    return jax.jit(functools.partial(score_step, model_cfg),
                   in_shardings=(state_lib.param_shardings(model_cfg, mesh, rules),
                                 mesh_lib.batch_sharding(mesh, rules)),
                   out_shardings=mesh_lib.replicated(mesh))


def request_scores(cfg, params, packed: Packed, mesh, rules, on_batch=None) -> tuple[np.ndarray, np.ndarray]:
    """(log-likelihood, greedy) per request: the continuation's summed log-probability, and
    whether every one of its tokens is the argmax of its position. `on_batch(tokens)` is called
    as each batch's scores come back, with the batch's tokens (padding left out): progress."""
    step_fn = make_score_step(cfg.model, mesh, rules)
    num_requests = packed.num_requests
    loglik, wrong = np.zeros(num_requests), np.zeros(num_requests)
    B = packed.rows.batch_size

    def add(index: int, out) -> None:
        out = jax.device_get(out)
        owner = packed.owner_RL[index * B:(index + 1) * B]
        mine = owner >= 0
        loglik[:] -= np.bincount(owner[mine], out["cross_entropy"][mine], num_requests)
        wrong[:] += np.bincount(owner[mine], 1.0 - out["correct"][mine], num_requests)
        if on_batch is not None:
            on_batch(int(np.count_nonzero(packed.rows.arrays["segment_ids"][index * B:(index + 1) * B])))

    pending = None
    with mesh_lib.activate(mesh, rules):
        for index in range(packed.rows.num_batches):  # read batch i-1 back once i is queued
            out = step_fn(params, mesh_lib.read_batch(packed.rows, index, mesh, rules))
            if pending is not None:
                add(*pending)
            pending = (index, out)
        if pending is not None:
            add(*pending)
    return loglik, wrong == 0


def multiple_choice_metrics(loglik_per_example, choices_per_example, answers) -> dict:
    """`acc` (argmax of log-likelihood) and `acc_norm` (argmax of log-likelihood / len(choice)
    in characters), with their standard errors, over examples."""
    hits, hits_norm = [], []
    for loglik, choices, answer in zip(loglik_per_example, choices_per_example, answers):
        loglik = np.asarray(loglik, np.float64)
        hits.append(int(np.argmax(loglik)) == answer)
        hits_norm.append(int(np.argmax(loglik / np.array([len(c) for c in choices]))) == answer)
    return {"acc": _mean(hits), "acc_stderr": _stderr(hits),
            "acc_norm": _mean(hits_norm), "acc_norm_stderr": _stderr(hits_norm)}


def cloze_metrics(loglik, greedy) -> dict:
    """`acc` (share of targets greedy decoding writes) and `perplexity` = exp(-mean target
    log-likelihood)."""
    try:
        perplexity = math.exp(-float(np.mean(loglik)))
    except OverflowError:
        perplexity = math.inf
    return {"acc": _mean(greedy), "acc_stderr": _stderr(greedy), "perplexity": perplexity}


def _mean(values) -> float:
    return float(np.mean(np.asarray(values, np.float64)))


def _stderr(values) -> float:
    """The standard error of a mean (sample standard deviation / sqrt(n)), as lm-eval reports."""
    values = np.asarray(values, np.float64)
    return float(np.std(values, ddof=1) / math.sqrt(len(values))) if len(values) > 1 else 0.0


def score(cfg, params, prepared: PreparedTask, mesh, rules) -> dict:
    """The task's result: task, file, kind, examples, shots, seed, truncated, and its metrics."""
    task = prepared.task
    loglik, greedy = request_scores(cfg, params, prepared.packed, mesh, rules)
    if task.kind == MULTIPLE_CHOICE:
        bounds = prepared.first_request
        metrics = multiple_choice_metrics(
            [loglik[bounds[e]:bounds[e + 1]] for e in range(len(task.examples))],
            [e.continuations for e in task.examples], [e.answer for e in task.examples])
    else:
        metrics = cloze_metrics(loglik, greedy)
    return {"task": task.name, "file": task.path, "kind": task.kind, "examples": len(task.examples),
            "shots": prepared.shots, "seed": prepared.seed, "truncated": prepared.truncated, **metrics}


def metrics_row(result: dict) -> dict:
    """A task's result as metrics-row names: `eval/<task>/acc`, ... (`METRICS`)."""
    return {f"eval/{result['task']}/{name}": result[name] for name in METRICS[result["kind"]]}
