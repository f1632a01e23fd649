"""Named eval sets and zero-/few-shot tasks: a trained tiny run logs `eval/<set>/loss` and
`eval/<task>/acc` at each eval; it beats chance on a task built from the built-in corpus where an
untrained model does not; scoring equals a direct computation (log-likelihoods from
`model.apply`, greedy targets from `generate`); acc vs acc_norm, cloze metrics, k-shot prompts,
packing and bad task lines on hand-made cases; where local-file eval sets come from."""

import functools
import json
import math
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

from maxlm import generate as gen, model
from maxlm.checkpoint import saved_run
from maxlm.data import sources
from maxlm.data.errors import DataError
from maxlm.data.tokenizers import ByteTokenizer
from maxlm.eval import during_training, tasks
from maxlm.sharding import mesh as mesh_lib, state as state_lib
from maxlm.train import loop
from tests.helpers import ROOT, command_env, metrics_rows, tiny

STEPS, CHANCE = 100, 0.25


def continuation_task(docs, path, n=400, width=2, num_choices=4, seed=0):
    """Multiple choice from Python source lines: a line's start, and its last `width` characters
    against the last `width` of other lines (all choices as long, so length favours none), the
    right one at a random place. (A tiny model learns line endings first: after 100 steps it
    beats chance by about 7 standard errors at width 2, 3 at width 4.)"""
    lines = [line for doc in docs for line in doc.splitlines() if len(line.strip()) >= 16 and line.isascii()]
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for i in rng.choice(len(lines), size=n, replace=False):
            others = rng.choice(len(lines), size=num_choices - 1, replace=False)
            choices = [lines[i][-width:]] + [lines[j][-width:] for j in others]
            order = rng.permutation(num_choices)
            f.write(json.dumps({"context": lines[i][:-width], "choices": [choices[k] for k in order],
                                "answer": int(np.flatnonzero(order == 0)[0])}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, data_dirs):
    """100 steps of tiny.py evaluated at 50 and 100 with two named sets (the built-in corpus, and
    local files held out whole) and a multiple-choice task."""
    root = tmp_path_factory.mktemp("evalx")
    docs = sources.read_documents(tiny(**data_dirs).data, "validation")  # held out from training
    (root / "held").mkdir()
    (root / "held" / "code.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[:20]))
    task = continuation_task(docs, root / "cont.jsonl")
    cfg = tiny(**data_dirs, steps=STEPS, **{
        "eval.every_steps": 50, "checkpoint.every_steps": 50, "metrics.tensorboard": False,
        "eval.sets": (("stdlib", "tfds:python_stdlib"), ("held", str(root / "held"))),
        "eval.tasks": (task,)})
    loop.train_and_evaluate(cfg, str(root / "run"))
    return cfg, root, {r["step"]: r for r in metrics_rows(root / "run") if "eval_loss" in r}, docs


@pytest.mark.slow  # the trained run
def test_sets_and_tasks_are_logged_at_each_eval(trained):
    cfg, root, evals, docs = trained
    assert sorted(evals) == [50, 100]
    for row in evals.values():
        assert set(row) == {"step", "eval_loss", "eval_perplexity", "eval/stdlib/loss", "eval/stdlib/perplexity",
                            "eval/held/loss", "eval/held/perplexity", "eval/cont/acc", "eval/cont/acc_norm",
                            *(f"eval/loss_by_position/{start}" for start in range(0, cfg.seq_len, cfg.seq_len // 8))}
        assert row["eval/stdlib/loss"] == row["eval_loss"]  # the same batches through the same step
        assert row["eval/held/perplexity"] == pytest.approx(math.exp(row["eval/held/loss"]))
        assert row["eval/cont/acc"] == row["eval/cont/acc_norm"]  # equal lengths: nothing to normalize
    assert evals[100]["eval/held/loss"] < evals[50]["eval/held/loss"]
    # local files held out whole: every document packed, not data.validation_percent of them
    held = during_training.load_eval_sets(cfg)["held"]
    tokens = sum(len(d.encode()) + 1 for d in docs[:20])
    assert held.num_rows == -(-tokens // cfg.seq_len)


@pytest.mark.slow  # the trained run
def test_trained_model_beats_chance_and_untrained_does_not(trained):
    cfg, root, evals, _ = trained
    result, = during_training.evaluate_tasks(str(root / "run"), [str(root / "cont.jsonl")])
    assert result["step"] == 100 and result["examples"] == 400 and result["shots"] == 0
    assert result["acc"] == evals[100]["eval/cont/acc"]  # the loop's own scores
    assert result["acc"] > CHANCE + 3 * result["acc_stderr"], result
    untrained = tasks.score(cfg, fresh_params(cfg), tasks.prepare(
        tasks.load_task(str(root / "cont.jsonl")), ByteTokenizer(), cfg.seq_len, cfg.batch_size), *mesh_of(cfg))
    assert abs(untrained["acc"] - CHANCE) < 3 * untrained["acc_stderr"], untrained
    assert abs(untrained["acc_norm"] - CHANCE) < 3 * untrained["acc_norm_stderr"], untrained


def mesh_of(cfg):
    return mesh_lib.make_mesh(cfg.mesh), mesh_lib.rules_of(cfg.mesh)


def fresh_params(cfg):
    """An untrained model: parameters randomly initialised straight into their shards."""
    mesh, rules = mesh_of(cfg)
    init = jax.jit(functools.partial(model.init_params, cfg.model),
                   out_shardings=state_lib.param_shardings(cfg.model, mesh, rules))
    with mesh_lib.activate(mesh, rules):
        return init(jax.random.key(cfg.seed))


def direct_scores(cfg, params, pairs):
    """(log-likelihood, greedy) of each (context, continuation) from model.apply, each sequence
    alone in a row of seq_len (causal: the zeros after it change nothing before them)."""
    tokenizer = ByteTokenizer()
    inputs, spans = np.zeros((8, cfg.seq_len), np.int32), []
    for row, (context, continuation) in enumerate(pairs):
        context_ids, continuation_ids = tasks.encode_pair(tokenizer, context, continuation)
        seq = [tokenizer.bos_id, *context_ids, *continuation_ids]
        inputs[row, :len(seq)] = seq
        spans.append(range(len(seq) - len(continuation_ids), len(seq)))  # the continuation's tokens
    batch = {"inputs": inputs, "segment_ids": np.ones_like(inputs),
             "positions": np.broadcast_to(np.arange(cfg.seq_len), inputs.shape)}
    logp = np.asarray(jax.nn.log_softmax(jax.jit(functools.partial(model.apply, cfg.model))(params, batch)))
    loglik = [sum(logp[row, k - 1, inputs[row, k]] for k in span) for row, span in enumerate(spans)]
    greedy = [all(logp[row, k - 1].argmax() == inputs[row, k] for k in span) for row, span in enumerate(spans)]
    return np.array(loglik), greedy


@pytest.mark.slow  # the trained run
def test_cloze_and_choice_scores_equal_a_direct_computation(trained, tmp_path):
    """Cloze: a target is correct exactly when greedy decoding (the KV-cached `generate`, and the
    argmax of model.apply) writes it; perplexity and each choice's log-likelihood as model.apply
    gives them."""
    cfg, root, _, _ = trained
    run = saved_run.load_run(str(root / "run"))
    params = jax.device_get(run["params"])
    tokenizer = ByteTokenizer()
    contexts = ["    def __init__(self", "        return sel", "import o"]
    greedy = gen.generate(cfg, params, [[tokenizer.bos_id, *tokenizer.encode(c).tolist()] for c in contexts],
                          max_new_tokens=3)
    assert min(min(ids) for ids in greedy) >= 3, greedy  # bytes only: each decodes to itself
    written = [tokenizer.decode(ids) for ids in greedy]
    targets = [written[0], written[1][:2] + ("#" if written[1][2] != "#" else "@"), "s"]  # right, wrong, ?
    path = tmp_path / "cloze.jsonl"
    path.write_text("".join(json.dumps({"context": c, "target": t}) + "\n" for c, t in zip(contexts, targets)))
    result, = during_training.evaluate_tasks(str(root / "run"), [str(path)])
    loglik, correct = direct_scores(cfg, params, list(zip(contexts, targets)))
    assert correct[:2] == [True, False] and correct[2] == written[2].startswith("s")
    assert result["kind"] == "cloze" and result["acc"] == pytest.approx(np.mean(correct))
    assert result["perplexity"] == pytest.approx(math.exp(-np.mean(loglik)), rel=1e-4)

    choices = (" return", " import", "xyz")
    prepared = tasks.prepare(tasks.Task("mc", "-", tasks.MULTIPLE_CHOICE, (tasks.Example("def f(x):\n   ", choices, 1),)),
                             tokenizer, cfg.seq_len, cfg.batch_size)
    loglik, _ = tasks.request_scores(cfg, run["params"], prepared.packed, run["mesh"], run["rules"])
    expected, _ = direct_scores(cfg, params, [("def f(x):\n   ", c) for c in choices])
    assert loglik == pytest.approx(expected, rel=1e-4)


@pytest.mark.slow  # the trained run, a subprocess
def test_task_cli(trained):
    """`--task` as a comma list and repeated: one JSON object per task, the loop's numbers."""
    cfg, root, evals, _ = trained
    other = root / "other.jsonl"
    other.write_text((root / "cont.jsonl").read_text().splitlines()[0] + "\n")
    done = subprocess.run([sys.executable, "-m", "maxlm.eval", f"--workdir={root / 'run'}",
                           f"--task={root / 'cont.jsonl'},{other}", f"--task={other}", "--step=50"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=command_env(os.environ.get("HOME", "/tmp"), devices=8))
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(line) for line in done.stdout.strip().splitlines()]
    assert [r["task"] for r in results] == ["cont", "other", "other"]
    assert results[0]["step"] == 50 and results[0]["checkpoint"].endswith("checkpoints/50")
    assert results[0]["acc"] == pytest.approx(evals[50]["eval/cont/acc"])
    assert results[1] == results[2] and results[1]["examples"] == 1


# ----------------------------------------------------------------------------- lm-evaluation-harness

HARNESS_YAMLS = {  # lm-eval task YAMLs over local JSON files (dataset_path: json), offline
    "h_cont": """output_type: multiple_choice
doc_to_text: "{{context}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
target_delimiter: ""
metric_list: [{metric: acc, aggregation: mean, higher_is_better: true},
              {metric: acc_norm, aggregation: mean, higher_is_better: true}]""",
    "h_cloze": """output_type: loglikelihood
doc_to_text: "{{context}}"
doc_to_target: "{{target}}"
target_delimiter: ""
metric_list: [{metric: perplexity, aggregation: perplexity, higher_is_better: false},
              {metric: acc, aggregation: mean, higher_is_better: true}]""",
    "h_rolling": """output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list: [{metric: byte_perplexity, aggregation: weighted_perplexity, higher_is_better: false}]""",
    "h_gen": """output_type: generate_until
doc_to_text: "{{context}}"
doc_to_target: "{{target}}"
target_delimiter: ""
generation_kwargs: {until: ["\\n"], max_gen_toks: 6}
metric_list: [{metric: exact_match, aggregation: mean, higher_is_better: true}]""",
}


def harness_tasks(root, docs, cont_file) -> str:
    """A directory of the four task YAMLs: `h_cont` over the trained run's own task file, the
    others over cloze lines and texts made from held-out documents."""
    lines = [line for doc in docs for line in doc.splitlines() if len(line.strip()) >= 12 and line.isascii()][:40]
    (root / "cloze.jsonl").write_text("".join(json.dumps({"context": x[:-3], "target": x[-3:]}) + "\n" for x in lines))
    (root / "texts.jsonl").write_text("".join(json.dumps({"text": d[:300]}) + "\n" for d in docs[:6]))
    data = {"h_cont": cont_file, "h_cloze": root / "cloze.jsonl", "h_rolling": root / "texts.jsonl",
            "h_gen": root / "cloze.jsonl"}
    include = root / "harness"
    include.mkdir(exist_ok=True)
    for name, body in HARNESS_YAMLS.items():
        (include / f"{name}.yaml").write_text(f"task: {name}\ndataset_path: json\n"
                                              f"dataset_kwargs: {{data_files: {{test: {data[name]}}}}}\n"
                                              f"test_split: test\n{body}\n")
    return str(include)


@pytest.mark.slow  # the trained run
def test_harness_scores_as_the_task_scorer_does(trained, monkeypatch, tmp_path):
    """lm-eval's own task YAMLs over local JSON, in process: the multiple-choice and cloze numbers
    are those of maxlm's `--task` scorer on the same examples."""
    from maxlm.eval import harness

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    cfg, root, _, docs = trained
    include = harness_tasks(root, docs, root / "cont.jsonl")
    results = {r["task"]: r for r in harness.evaluate_harness(str(root / "run"), ["h_cont", "h_cloze"], include,
                                                              limit=40, builtin_tasks=False)}
    first40 = tmp_path / "cont40.jsonl"
    first40.write_text("".join((root / "cont.jsonl").read_text().splitlines(keepends=True)[:40]))
    ours, cloze = during_training.evaluate_tasks(str(root / "run"), [str(first40), str(root / "cloze.jsonl")])
    assert results["h_cont"]["examples"] == 40 and results["h_cont"]["step"] == 100
    for metric in ("acc", "acc_norm", "acc_stderr", "acc_norm_stderr"):
        assert results["h_cont"][metric] == pytest.approx(ours[metric], abs=1e-12), metric
    assert results["h_cloze"]["acc"] == cloze["acc"]
    assert results["h_cloze"]["perplexity"] == pytest.approx(cloze["perplexity"], rel=1e-12)


@pytest.mark.ci  # the trained run and a subprocess: 24 s (the in-process test above stays in make test)
def test_harness_cli_scores_as_the_task_scorer_does(trained):
    """`--harness` through the CLI: its multiple-choice and cloze numbers are those of maxlm's
    `--task` scorer on the same examples (the loop's logged acc at step 100), and the rolling and
    generation request types run."""
    cfg, root, evals, docs = trained
    include = harness_tasks(root, docs, root / "cont.jsonl")
    done = subprocess.run([sys.executable, "-m", "maxlm.eval", f"--workdir={root / 'run'}", "--harness=h_cont,h_cloze",
                           "--harness=h_rolling,h_gen", f"--harness_include={include}", "--harness_limit=40"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=command_env(root / "home", devices=8, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    results = {r["task"]: r for r in map(json.loads, done.stdout.strip().splitlines())}
    assert sorted(results) == ["h_cloze", "h_cont", "h_gen", "h_rolling"]
    assert results["h_cont"]["step"] == 100 and results["h_cont"]["examples"] == 40
    ours, = during_training.evaluate_tasks(str(root / "run"), [str(root / "cont.jsonl")])
    first40 = root / "cont40.jsonl"
    first40.write_text("".join((root / "cont.jsonl").read_text().splitlines(keepends=True)[:40]))
    ours40, cloze = during_training.evaluate_tasks(str(root / "run"), [str(first40), str(root / "cloze.jsonl")])
    assert ours["acc"] == evals[100]["eval/cont/acc"]
    for metric in ("acc", "acc_norm", "acc_stderr", "acc_norm_stderr"):
        assert results["h_cont"][metric] == pytest.approx(ours40[metric], abs=1e-12), metric
    assert results["h_cloze"]["acc"] == cloze["acc"]
    assert results["h_cloze"]["perplexity"] == pytest.approx(cloze["perplexity"], rel=1e-12)
    assert results["h_rolling"]["byte_perplexity"] > 1 and results["h_gen"]["examples"] == 40


@pytest.mark.slow  # the trained run
def test_harness_requests_equal_a_direct_computation(trained, monkeypatch, capfd):
    """The model class's three request types: rolling log-likelihoods of texts longer than
    seq_len as model.apply gives them window by window, an empty context scored after bos alone,
    and generation as `generate`'s greedy tokens cut at the stop string; each with its progress
    line (every poll prints, here)."""
    from lm_eval.api.instance import Instance

    from maxlm.eval import harness

    monkeypatch.setenv("MAXLM_PROGRESS_SECONDS", "1e-6")
    cfg, root, _, docs = trained
    run = saved_run.load_run(str(root / "run"))
    params, tokenizer = jax.device_get(run["params"]), ByteTokenizer()
    lm = harness.run_lm_class()(run, tokenizer, 4)
    ask = lambda kind, *args: [Instance(kind, {}, a, i) for i, a in enumerate(args)]
    texts = [docs[0][:150], docs[1][:40]]
    rolling = lm.loglikelihood_rolling(ask("loglikelihood_rolling", *[(t,) for t in texts]))
    for text, got in zip(texts, rolling):
        windows = harness.rolling_windows(tokenizer.encode(text).tolist(), tokenizer.bos_id, cfg.seq_len)
        assert got == pytest.approx(sum(direct_window_loglik(cfg, params, w, n) for w, n in windows), rel=1e-4)
    (empty, _), = lm.loglikelihood(ask("loglikelihood", ("", texts[1])))
    assert empty == pytest.approx(rolling[1], rel=1e-5)  # one window: bos then the text
    prompts = ["    def __init__(self", "import o", "class A"]
    got = lm.generate_until(ask("generate_until", *[(p, {"until": ["(", "\n"], "max_gen_toks": 5}) for p in prompts]))
    greedy = gen.generate(cfg, params, [[tokenizer.bos_id, *tokenizer.encode(p).tolist()] for p in prompts],
                          max_new_tokens=5, eos_id=tokenizer.eos_id, vocab_limit=tokenizer.vocab_size)
    assert got == [harness.cut_at_stop(tokenizer.decode(ids), ["(", "\n"]) for ids in greedy]
    err = capfd.readouterr().err
    assert re.search(r"maxlm: harness loglikelihood_rolling: 1/1 batches \(100%\), \d+ tokens", err), err[-2000:]
    assert "maxlm: harness generate_until: 1/1 batches (100%)" in err


def direct_window_loglik(cfg, params, sequence, scored) -> float:
    """The summed log-probability of a token sequence's last `scored` tokens, from model.apply."""
    inputs = np.zeros((8, cfg.seq_len), np.int32)
    inputs[0, :len(sequence) - 1] = sequence[:-1]
    batch = {"inputs": inputs, "segment_ids": np.ones_like(inputs),
             "positions": np.broadcast_to(np.arange(cfg.seq_len), inputs.shape)}
    logp = np.asarray(jax.nn.log_softmax(jax.jit(functools.partial(model.apply, cfg.model))(params, batch)))[0]
    return float(sum(logp[k - 1, sequence[k]] for k in range(len(sequence) - scored, len(sequence))))


def test_rolling_windows_predict_each_token_once_with_all_the_context_that_fits():
    from maxlm.eval.harness import rolling_windows

    windows = rolling_windows(list(range(10, 20)), bos_id=1, seq_len=4)
    assert windows == [([1, 10, 11, 12, 13], 4), ([13, 14, 15, 16, 17], 4), ([15, 16, 17, 18, 19], 2)]
    assert rolling_windows([], 1, 4) == []


def test_harness_refuses_unknown_tasks_and_mixed_flags(tmp_path):
    from maxlm.eval import harness

    with pytest.raises(saved_run.RunError, match="no lm-eval task, group or tag named no_such_task .*--harness_include"):
        harness.check_task_names(["arc_easy", "no_such_task"], ["arc_easy", "hellaswag"], None)
    harness.check_task_names(["arc_easy"], ["arc_easy"], None)
    with pytest.raises(saved_run.RunError, match="--harness_limit=0 must be >= 1"):
        harness.evaluate_harness(str(tmp_path), ["arc_easy"], limit=0)
    done = subprocess.run([sys.executable, "-m", "maxlm.eval", f"--workdir={tmp_path}", "--harness=x", "--task=y.jsonl"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, env=command_env(tmp_path, devices=None))
    assert done.returncode == 2 and "give one of them" in done.stderr


# ----------------------------------------------------------------------------- hand-made cases


def test_acc_and_acc_norm_on_a_hand_made_case():
    """acc takes the highest log-likelihood; acc_norm divides it by the choice's characters first."""
    metrics = tasks.multiple_choice_metrics(
        [[-4.0, -6.0], [-6.0, -20.0, -2.5]], [["ab", "abcdef"], ["a", "abcdefghi", "ab"]], [1, 2])
    # example 1: acc picks 0 (-4 > -6), acc_norm picks 1 (-1 > -2); example 2: both pick 2
    assert metrics["acc"] == 0.5 and metrics["acc_norm"] == 1.0
    assert metrics["acc_stderr"] == pytest.approx(0.5) and metrics["acc_norm_stderr"] == 0.0


def test_cloze_metrics_on_a_hand_made_case():
    metrics = tasks.cloze_metrics([-1.0, -3.0], [True, False])
    assert metrics["acc"] == 0.5 and metrics["perplexity"] == pytest.approx(math.exp(2.0))


def test_text_lines_split_their_last_word_as_the_target(tmp_path):
    path = tmp_path / "lambada.jsonl"
    path.write_text('{"text": "the cat sat on the  mat \\n"}\n\n{"context": "a b", "target": " c"}\n')
    task = tasks.load_task(str(path))
    assert task.name == "lambada" and task.kind == tasks.CLOZE
    assert [(e.context, e.continuations, e.line) for e in task.examples] == [
        ("the cat sat on the", ("  mat",), 1), ("a b", (" c",), 3)]


def test_few_shot_prompts_are_seeded_and_exclude_the_example():
    examples = tuple(tasks.Example(f"q{i}:", (" no", " yes"), i % 2) for i in range(6))
    task = tasks.Task("t", "t.jsonl", tasks.MULTIPLE_CHOICE, examples)
    for index in range(6):
        for seed in range(10):
            drawn = tasks.shot_indices(6, index, 3, seed)
            assert len(set(drawn)) == 3 and index not in drawn and all(0 <= i < 6 for i in drawn)
            assert tasks.prompt(task, index, 3, seed) == tasks.prompt(task, index, 3, seed)
    assert len({tuple(tasks.shot_indices(6, 0, 3, seed)) for seed in range(10)}) > 1  # the seed matters
    first, second = tasks.shot_indices(6, 2, 2, seed=7)
    assert tasks.prompt(task, 2, 2, seed=7) == (f"{examples[first].context}{examples[first].continuations[first % 2]}\n\n"
                                                f"{examples[second].context}{examples[second].continuations[second % 2]}\n\nq2:")
    assert tasks.prompt(task, 4, 0, seed=7) == "q4:"
    tasks.shot_indices(6, 5, 5, seed=0)  # every other example
    with pytest.raises(DataError, match=r"t.jsonl: 6 shots \(--shots, eval.task_shots\) need 7 examples; the task has 6"):
        tasks.check_shots(task, 6)


def test_requests_are_packed_in_order_into_whole_batches():
    arrays = tasks.pack_requests([[1, 5, 6, 7], [1, 8, 9], [1, 4, 4, 4, 4, 4]], [2, 1, 3], seq_len=6, batch_size=4)
    assert {k: v.shape for k, v in arrays.items()} == dict.fromkeys(
        ("inputs", "targets", "segment_ids", "positions", "owner"), (4, 6))
    assert arrays["inputs"][:2].tolist() == [[1, 5, 6, 1, 8, 0], [1, 4, 4, 4, 4, 0]]
    assert arrays["targets"][:2].tolist() == [[5, 6, 7, 8, 9, 0], [4, 4, 4, 4, 4, 0]]
    assert arrays["segment_ids"][:2].tolist() == [[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 1, 0]]
    assert arrays["positions"][:2].tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 0]]
    assert arrays["owner"][:2].tolist() == [[-1, 0, 0, -1, 1, -1], [-1, -1, 2, 2, 2, -1]]
    assert not arrays["segment_ids"][2:].any() and (arrays["owner"][2:] == -1).all()  # padding rows


def test_contexts_are_cut_on_the_left_to_seq_len():
    task = tasks.Task("t", "t.jsonl", tasks.CLOZE, (tasks.Example("abcdefgh", ("xy",)),))
    prepared = tasks.prepare(task, ByteTokenizer(), seq_len=6, batch_size=2)
    encode = lambda s: (ByteTokenizer().encode(s)).tolist()
    assert prepared.truncated == 1
    assert prepared.packed.rows.arrays["inputs"][0].tolist() == encode("defghx")  # bos and "abc" cut
    assert prepared.packed.owner_RL[0].tolist() == [-1, -1, -1, -1, 0, 0]
    with pytest.raises(DataError, match=r"t.jsonl:0: continuation 'xyz' is 3 tokens; it must be 1 to seq_len=2"):
        tasks.prepare(tasks.Task("t", "t.jsonl", tasks.CLOZE, (tasks.Example("a", ("xyz",)),)),
                      ByteTokenizer(), seq_len=2, batch_size=2)


@pytest.mark.parametrize("lines, where, expected", [
    (['{"context": "a", "choices": ["x", "y"], "answer": 0}', "{broken"], 2, "not a JSON line"),
    (['[1, 2]'], 1, "expected a JSON object, got list"),
    (['{"context": "a", "choices": ["x"], "answer": 0}'], 1, "'choices' must be a list of at least two non-empty strings"),
    (['{"context": "a", "choices": ["x", ""], "answer": 0}'], 1, "'choices' must be a list of at least two"),
    (['{"context": "a", "choices": ["x", "y"], "answer": 2}'], 1, "'answer' must be the index of the right choice, 0 to 1, got 2"),
    (['{"context": "a", "choices": ["x", "y"], "answer": true}'], 1, "'answer' must be the index"),
    (['{"choices": ["x", "y"], "answer": 0}'], 1, "'context' must be a string, got None"),
    (['{"context": "a", "target": ""}'], 1, "'target' must be a non-empty string"),
    (['{"text": "single"}'], 1, "'text' must be a string of at least two words"),
    (['{"question": "a"}'], 1, "expected {context, choices, answer} (multiple choice), {context, target} or {text}"),
    (['{"text": "a b"}', "", '{"context": "a", "choices": ["x", "y"], "answer": 0}'], 3,
     "a multiple_choice example in a cloze task"),
])
def test_bad_task_lines_name_file_and_line(tmp_path, lines, where, expected):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError) as info:
        tasks.load_task(str(path))
    assert str(info.value).startswith(f"{path}:{where}: {expected}"), str(info.value)


def test_missing_or_empty_task_files(tmp_path):
    with pytest.raises(DataError, match=f"{tmp_path}/none.jsonl: no such task file"):
        tasks.load_task(str(tmp_path / "none.jsonl"))
    (tmp_path / "empty.jsonl").write_text("\n \n")
    with pytest.raises(DataError, match="empty.jsonl: no examples"):
        tasks.load_task(str(tmp_path / "empty.jsonl"))


# ----------------------------------------------------------------------------- where eval sets come from


def test_local_eval_sets_are_held_out_whole_unless_they_are_a_training_source(tmp_path):
    for name in ("train/a.jsonl", "train/b.jsonl", "held/c.jsonl"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text('{"text": "x"}\n')
    cfg = tiny(**{"data.source": str(tmp_path / "train")})
    percent = lambda source: during_training.eval_set_config(cfg, source).data.validation_percent
    assert percent(str(tmp_path / "held")) == 100.0  # other files: every document
    assert percent(str(tmp_path / "train")) == 2.0  # the training source: the share it holds out
    assert percent("tfds:python_stdlib") == 2.0  # its own validation split (the percent is unused)
    with pytest.raises(DataError, match=r"1 of its files \(.*train/a.jsonl, \.\.\.\) are in the training source"):
        during_training.eval_set_config(cfg, str(tmp_path / "train" / "a.jsonl"))
    mixed = tiny(**{"data.mixture": (("web", str(tmp_path / "train" / "*.jsonl"), 1.0),)})
    assert during_training.eval_set_config(mixed, str(tmp_path / "train" / "*.jsonl")).data.validation_percent == 2.0
    with pytest.raises(DataError, match="2 of its files"):
        during_training.eval_set_config(mixed, str(tmp_path / "train"))


def test_bad_eval_data_fails_before_training(tmp_path, data_dirs):
    bad_set = tiny(**data_dirs, **{"eval.sets": (("web", str(tmp_path / "nowhere")),)})
    with pytest.raises(DataError, match=r"^eval.sets 'web': data.source='.*nowhere': no such file"):
        loop.load_data(bad_set)
    (tmp_path / "t.jsonl").write_text('{"context": "a", "choices": ["x", "y"], "answer": 5}\n')
    bad_task = tiny(**data_dirs, **{"eval.tasks": (str(tmp_path / "t.jsonl"),)})
    with pytest.raises(DataError, match=r"t.jsonl:1: 'answer' must be"):
        loop.load_data(bad_task)
