"""`python -m maxlm.eval` and `python -m maxlm.generate`: eval equals the training loop's own
eval; the KV-cached decode equals `model.apply` (logits, greedy tokens) for scanned and unrolled
parameters with grouped-query attention, and for every position encoding; a learned position table
is not run past its end; EOS, top-k, top-p and seeds; both CLIs end to end."""

import functools
import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxlm import config as config_lib, generate as gen, model
from maxlm.checkpoint import saved_run
from maxlm.data import make_dataset
from maxlm.data.tokenizers import ByteTokenizer
from maxlm.eval import during_training as evaluate_lib
from maxlm.sharding import mesh as mesh_lib, state as state_lib
from maxlm.train import loop
from tests.helpers import ROOT, command_env, load_config, metrics_rows, with_overrides

# ----------------------------------------------------------------------------- a trained run


@pytest.fixture(scope="module")
def run(tmp_path_factory, data_dirs):
    """A 10-step tiny run evaluated and checkpointed at steps 5 and 10 (mesh fsdp=8)."""
    workdir = tmp_path_factory.mktemp("run")
    overrides = {**data_dirs, "steps": 10, "checkpoint.every_steps": 5, "eval.every_steps": 5,
                 "metrics.tensorboard": False}
    cfg = config_lib.resolve(with_overrides(load_config("tiny"), overrides), jax.device_count())
    loop.train_and_evaluate(cfg, str(workdir))
    eval_losses = {r["step"]: r["eval_loss"] for r in metrics_rows(workdir) if "eval_loss" in r}
    assert sorted(eval_losses) == [5, 10]
    return cfg, workdir, eval_losses


def _cli(module: str, *args: str, devices: int = 1):
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env=command_env(os.environ.get("HOME", "/tmp"), devices))


def test_eval_equals_the_training_loops_eval(run):
    cfg, workdir, eval_losses = run
    newest = evaluate_lib.evaluate_run(str(workdir))
    assert newest["step"] == 10 and newest["split"] == "validation"
    assert newest["batches"] == cfg.eval.steps == 2
    assert newest["loss"] == pytest.approx(eval_losses[10], rel=1e-6)
    assert newest["perplexity"] == pytest.approx(math.exp(newest["loss"]), rel=1e-12)
    assert 0 <= newest["accuracy"] <= 1 and newest["accuracy"] > 0.05  # it learned something
    assert newest["tokens"] > 0.9 * cfg.eval.steps * cfg.batch_size * cfg.seq_len
    older = evaluate_lib.evaluate_run(str(workdir), step=5)
    assert older["step"] == 5 and older["loss"] == pytest.approx(eval_losses[5], rel=1e-6)
    assert older["loss"] > newest["loss"]
    more = evaluate_lib.evaluate_run(str(workdir), split="train", eval_steps=3)
    assert more["split"] == "train" and more["batches"] == 3


def test_eval_on_another_mesh_and_device_count(run):
    """The checkpoint (written on fsdp=8) lands on data=2 x fsdp=2 x tensor=2 with the same loss;
    a config recorded for 8 devices re-resolves for 4 or 1."""
    cfg, workdir, eval_losses = run
    for devices in (4, 1):
        mesh_cfg = saved_run.read_config(str(workdir), devices).mesh
        assert (mesh_cfg.data, mesh_cfg.fsdp, mesh_cfg.tensor) == (1, devices, 1)
    other = with_overrides(saved_run.read_config(str(workdir)),
                           {"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2})
    other = config_lib.resolve(other, jax.device_count())
    rules, mesh = mesh_lib.rules_of(other.mesh), mesh_lib.make_mesh(other.mesh)
    params, _ = saved_run.restore_params(saved_run.checkpoint_path(str(workdir)), other, mesh, rules)
    assert tuple(params["layers"]["attn"]["wq"].sharding.spec)[1:3] == (("fsdp", "sequence"), "tensor")
    result = evaluate_lib.evaluate(other, params, make_dataset(other, "validation"), mesh, rules, 2)
    assert result["loss"] == pytest.approx(eval_losses[10], rel=1e-5)


def test_eval_errors(run, tmp_path):
    cfg, workdir, _ = run
    with pytest.raises(saved_run.RunError, match="no config.json in"):
        evaluate_lib.evaluate_run(str(tmp_path))
    (tmp_path / "config.json").write_text((workdir / "config.json").read_text())
    with pytest.raises(saved_run.RunError, match="no complete checkpoint in"):
        evaluate_lib.evaluate_run(str(tmp_path))
    with pytest.raises(saved_run.RunError, match=r"--step=7: .*\(steps: 5, 10\)"):
        evaluate_lib.evaluate_run(str(workdir), step=7)
    with pytest.raises(saved_run.RunError, match="--split='test': expected one of train, validation"):
        evaluate_lib.evaluate_run(str(workdir), split="test")


def test_eval_cli(run, tmp_path):
    """One run on a single device: the mesh re-resolves (the run had 8) and the loss is the same."""
    cfg, workdir, eval_losses = run
    done = _cli("maxlm.eval", f"--workdir={workdir}")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1, done.stdout
    result = json.loads(lines[0])
    assert {"step", "split", "loss", "perplexity", "accuracy", "tokens", "batches"} <= set(result)
    assert result["step"] == 10 and result["batches"] == 2
    assert result["loss"] == pytest.approx(eval_losses[10], rel=1e-5)
    bad = _cli("maxlm.eval", f"--workdir={tmp_path}")
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [f"maxlm: config error: no config.json in {tmp_path}"
                                               " (is --workdir a training run's workdir?)"]


# ----------------------------------------------------------------------------- the KV cache


@functools.lru_cache(maxsize=None)
def small(scan: bool = True, positions: str = "rope", qk_norm: str = "none", placement: str = "pre", window: int = 0,
          kinds: tuple = ()):
    """A random model with grouped-query attention (4 heads, 2 kv heads) whose logits are far
    from ties (larger init), float32; its mesh is fsdp=4 x tensor=2. A learned position table
    has seq_len = 64 rows."""
    cfg = with_overrides(load_config("tiny"), {"model.init_std": 0.2, "model.vocab_size": 64,
                                               "model.num_heads": 4, "model.num_kv_heads": 2,
                                               "model.scan_layers": scan, "mesh.fsdp": 4,
                                               "mesh.tensor": 2, "model.positions": positions,
                                               "model.qk_norm": qk_norm, "model.norm_placement": placement,
                                               "model.sliding_window": window,
                                               **{f"model.{k}": v for k, v in kinds}})
    cfg = config_lib.resolve(cfg, jax.device_count())
    params = model.init_params(cfg.model, jax.random.key(1))
    rng = np.random.default_rng(2)

    def nonzero_biases(path, x):  # they start at zero, where a bias left out of the cache's path would not show
        name = str(path[-1].key)
        return x + 0.1 * rng.standard_normal(x.shape).astype(x.dtype) if name.startswith("b") else x
    return cfg, jax.tree_util.tree_map_with_path(nonzero_biases, params)


# both layer layouts with RoPE; the absolute position encodings (added to the embeddings) scanned;
# qk-norm over each head scanned, over all heads unrolled (with OLMo 2's norms after each sublayer);
# Gemma's sandwich norms scanned; a sliding window of 4 tokens unrolled
LAYOUTS_AND_POSITIONS = pytest.mark.parametrize(
    "scan, positions, qk_norm, placement, window",
    [(True, "rope", "none", "pre", 0), (False, "rope", "none", "pre", 0), (True, "sinusoidal", "none", "pre", 0),
     (True, "learned", "none", "pre", 0), (True, "rope", "per_head", "pre", 0), (False, "rope", "full", "post", 0),
     (True, "rope", "per_head", "sandwich", 0), (False, "rope", "none", "pre", 4)],
    ids=["scanned", "unrolled", "sinusoidal", "learned", "qk_per_head", "qk_full_post_norm", "sandwich_norm",
         "sliding_window"])
# GPT-2's block (LayerNorm, GeLU, biases, learned positions); Qwen2's query/key/value biases with GeGLU
KINDS = pytest.mark.parametrize("kinds", [
    (("norm", "layernorm"), ("mlp_activation", "gelu"), ("use_bias", True), ("positions", "learned")),
    (("qkv_bias", True), ("mlp_activation", "geglu"))], ids=["gpt2_like", "qkv_bias_geglu"])


@LAYOUTS_AND_POSITIONS
def test_cached_logits_equal_apply(scan, positions, qk_norm, placement, window, kinds=()):
    """Teacher-forced through the cache (prefill of ragged prompts, then one token at a time),
    every position's logits equal model.apply's on the whole sequence."""
    cfg, params = small(scan, positions, qk_norm, placement, window, kinds)
    assert ("layers" in params) == scan
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, 64, (2, 12)), jnp.int32)
    batch = {"inputs": tokens, "segment_ids": jnp.ones_like(tokens),
             "positions": jnp.broadcast_to(jnp.arange(12), (2, 12))}
    expected = jax.jit(functools.partial(model.apply, cfg.model))(params, batch)
    lengths = np.array([5, 3])
    prompt = np.asarray(tokens[:, :5]).copy()
    prompt[1, 3:] = 0  # row 1's prompt is 3 tokens, padded
    prefill = jax.jit(functools.partial(gen.prefill, cfg.model, max_len=12))
    decode = jax.jit(functools.partial(gen.decode_step, cfg.model))
    logits, cache = prefill(params, prompt)
    for b, n in enumerate(lengths):
        np.testing.assert_allclose(logits[b, :n], expected[b, :n], atol=1e-5, rtol=0)
    for t in range(7):
        positions = jnp.asarray(lengths + t, jnp.int32)
        logits, cache = decode(params, tokens[jnp.arange(2), positions], positions, cache)
        np.testing.assert_allclose(logits, expected[jnp.arange(2), positions], atol=1e-5, rtol=0)


@KINDS
def test_cached_logits_equal_apply_for_other_blocks(kinds):
    test_cached_logits_equal_apply(True, dict(kinds).get("positions", "rope"), "none", "pre", 0,
                                   tuple(kv for kv in kinds if kv[0] != "positions"))


@pytest.mark.parametrize("scan", [True, False], ids=["scanned", "unrolled"])
def test_cached_logits_equal_apply_with_a_layer_pattern(scan):
    """Gemma 3's block on 7 layers of local, local, global (a window of 4 tokens, the local RoPE
    base), scores soft-capped, norms scaling by 1 + w, embeddings by √D: the cache's logits are
    model.apply's at every position."""
    gemma = (("layer_pattern", "LLG"), ("num_layers", 7), ("rope_theta_local", 100.0), ("attn_logit_softcap", 2.0),
             ("norm_plus_one", True), ("scale_embeddings", True), ("mlp_activation", "geglu"))
    test_cached_logits_equal_apply(scan, "rope", "per_head", "sandwich", 4, gemma)


def greedy_without_cache(cfg, params, prompt, n):
    """Greedy tokens recomputing model.apply over the whole growing sequence for each token (the
    sequence padded to a fixed length: causal attention never reads the tail)."""
    apply = jax.jit(functools.partial(model.apply, cfg.model))
    seq = np.zeros((1, len(prompt) + n), np.int32)
    seq[0, : len(prompt)] = prompt
    batch = {"segment_ids": np.ones_like(seq), "positions": np.arange(seq.shape[1])[None]}
    for t in range(len(prompt), len(prompt) + n):
        logits = apply(params, {**batch, "inputs": seq})
        seq[0, t] = int(jnp.argmax(logits[0, t - 1]))
    return seq[0, len(prompt):].tolist()


@pytest.mark.parametrize("scan", [True, False], ids=["scanned", "unrolled"])
def test_greedy_with_cache_equals_without(scan):
    """Grouped-query attention, sharded (fsdp=4 x tensor=2), jitted, two ragged prompts in one batch.
    (Each position encoding and qk-norm's cached logits: test_cached_logits_equal_apply.)"""
    cfg, params = small(scan)
    rules, mesh = mesh_lib.rules_of(cfg.mesh), mesh_lib.make_mesh(cfg.mesh)
    params = jax.device_put(params, state_lib.param_shardings(cfg.model, mesh, rules))
    prompts = [[1, 10, 20, 30, 40], [1, 7, 8]]
    got = gen.generate(cfg, params, prompts, mesh=mesh, rules=rules, max_new_tokens=10)
    assert got == [greedy_without_cache(cfg, params, p, 10) for p in prompts]


def test_learned_positions_stop_at_the_table():
    """A learned table of 64 positions: prompt + max_new_tokens up to 64 fit, one more is a
    clear error before anything compiles."""
    cfg, params = small(positions="learned")
    gen.check_length(cfg.model, 54, 10)
    with pytest.raises(ValueError, match=r"prompt \(55 tokens\) \+ max_new_tokens=10 = 65 positions is "
                                         r"more than model.max_positions=64"):
        gen.check_length(cfg.model, 55, 10)
    with pytest.raises(ValueError, match="model.max_positions=64"):
        gen.generate(cfg, params, [[1] * 60], max_new_tokens=8)
    gen.check_length(small()[0].model, 55, 1000)  # RoPE has no table to run out of


def test_eos_stops_a_row():
    cfg, params = small()
    prompts = [[1, 10, 20, 30, 40], [1, 7, 8]]
    free = gen.generate(cfg, params, prompts, max_new_tokens=12)
    assert [len(r) for r in free] == [12, 12]
    j = next(j for j in range(1, 12) if free[0][j] not in free[0][:j])  # a first occurrence
    eos = free[0][j]
    stopped = gen.generate(cfg, params, prompts, max_new_tokens=12, eos_id=eos, pad_id=0)
    assert stopped[0] == free[0][: j + 1]  # up to and including EOS
    cut = free[1].index(eos) + 1 if eos in free[1] else 12
    assert stopped[1] == free[1][:cut]  # the other row goes on
    tokens, counts = gen.make_generate_fn(cfg, max_new_tokens=12)(
        params, *gen.pad_prompts(prompts), gen.settings(eos_id=eos, pad_id=0))
    assert int(counts[0]) == j + 1 and tokens[0, j + 1:].tolist() == [0] * (11 - j)  # pad after EOS


def test_sampling_seeds_top_k_top_p():
    cfg, params = small()
    prompts = [[1, 10, 20, 30, 40], [1, 7, 8]]
    greedy = gen.generate(cfg, params, prompts, max_new_tokens=12)
    top1 = gen.generate(cfg, params, prompts, max_new_tokens=12, temperature=0.8, top_k=1, seed=5)
    assert top1 == greedy
    tiny_nucleus = gen.generate(cfg, params, prompts, max_new_tokens=12, temperature=1.0, top_p=1e-6)
    assert tiny_nucleus == greedy  # only the most likely token is left
    draw = lambda seed: gen.generate(cfg, params, prompts, max_new_tokens=12, temperature=1.0,
                                     top_p=0.95, seed=seed)
    assert draw(3) == draw(3)
    assert draw(3) != draw(4)
    assert draw(3) != greedy


def test_sample_filters():
    logits = jnp.log(jnp.array([[0.4, 0.3, 0.2, 0.1]]))
    many = jax.jit(jax.vmap(gen.sample, in_axes=(None, 0, None, None, None)))
    keys = jax.random.split(jax.random.key(0), 400)
    draws = lambda top_k=0, top_p=1.0: set(np.asarray(many(logits, keys, 1.0, top_k, top_p)).ravel().tolist())
    assert draws() == {0, 1, 2, 3}
    assert draws(top_k=2) == {0, 1}
    assert draws(top_p=0.5) == {0, 1}  # 0.4 < 0.5: the second token is needed to reach it
    assert draws(top_p=0.75) == {0, 1, 2}
    assert draws(top_k=3, top_p=0.5) == {0, 1}
    assert gen.sample(logits, jax.random.key(0), 0.0).tolist() == [0]


# ----------------------------------------------------------------------------- generate's CLI


def test_generate_cli(run):
    """Greedy from the trained run: the CLI (8 devices, the run's mesh) prints the tokens that
    generate() gives in this process, and decodes them with the run's byte tokenizer."""
    cfg, workdir, _ = run
    loaded = saved_run.load_run(str(workdir))
    tokenizer = ByteTokenizer()
    prompt = "def main("
    prompt_ids = [tokenizer.bos_id, *tokenizer.encode(prompt).tolist()]
    expected = gen.generate(loaded["config"], loaded["params"], [prompt_ids], mesh=loaded["mesh"],
                            rules=loaded["rules"], max_new_tokens=24, eos_id=tokenizer.eos_id,
                            vocab_limit=tokenizer.vocab_size)[0]
    done = _cli("maxlm.generate", f"--workdir={workdir}", f"--prompt={prompt}", "--max_new_tokens=24",
                "--temperature=0", "--num_samples=2", "--json", devices=8)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["token_ids"] == expected and result["prompt_ids"] == prompt_ids
    assert result["completion"] == tokenizer.decode(expected) and result["step"] == 10
    assert 1 <= result["num_tokens"] <= 24 and result["tokens_per_sec"] > 0
    assert result["stopped_at_eos"] == (expected[-1] == tokenizer.eos_id)
    first = {k: result[k] for k in ("completion", "token_ids", "num_tokens", "stopped_at_eos")}
    assert result["samples"] == [first, first]  # greedy: both samples alike
    content = expected[:-1] if result["stopped_at_eos"] else expected  # EOS is not generated text
    assert result["distinct_1"] == gen.distinct_n([content, content], 1) == len(set(content)) / (2 * len(content))
    assert result["distinct_2"] == gen.distinct_n([content, content], 2)


def test_generate_past_the_runs_seq_len_warns_and_generates(run):
    """Positions past seq_len were never trained: one warning on stderr, then the tokens (issue 54:
    the warning called a function that does not exist and the command crashed)."""
    cfg, workdir, _ = run
    done = _cli("maxlm.generate", f"--workdir={workdir}", "--prompt=x", f"--max_new_tokens={cfg.seq_len}",
                "--temperature=0", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"longer than the run's seq_len={cfg.seq_len}: positions past it were never trained" in done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1])["num_tokens"] >= 1


def test_distinct_n_on_a_hand_made_case():
    """Distinct n-grams over all n-grams of every sample; an n-gram never spans two samples."""
    samples = [[1, 2, 3, 1, 2], [1, 2]]
    assert gen.distinct_n(samples, 1) == 3 / 7  # 1 2 3 1 2 1 2: three distinct
    assert gen.distinct_n(samples, 2) == 3 / 5  # (1,2) (2,3) (3,1) (1,2) | (1,2); not (2,1) across samples
    assert gen.distinct_n([[7, 7, 7, 7]], 2) == 1 / 3
    assert gen.distinct_n([[5], []], 2) is None  # no sample has two tokens


def test_samples_of_one_prompt_differ():
    """--num_samples draws rows of one batch: each row its own draw, the same for the same seed."""
    cfg, params = small()
    draw = lambda seed: gen.generate(cfg, params, [[1, 10, 20]] * 3, max_new_tokens=12, temperature=1.0, seed=seed)
    rows = draw(3)
    assert len({tuple(r) for r in rows}) == 3 and draw(3) == rows


def test_eval_reads_each_validation_row_at_most_once(run):
    """More eval batches than the split holds stop at its end: past it the rows would come round
    again and count twice."""
    cfg, workdir, _ = run
    loaded = saved_run.load_run(str(workdir))
    big = config_lib.resolve(with_overrides(load_config("tiny"), {**{k: cfg.data[k.split(".")[1]] for k in
                                                                     ("data.tfds_dir", "data.cache_dir")},
                                                                  "batch_size": 2048}), jax.device_count())
    dataset = make_dataset(big, "validation")
    whole = dataset.steps_per_epoch
    assert 1 <= whole < 10
    capped = evaluate_lib.evaluate(big, loaded["params"], dataset, loaded["mesh"], loaded["rules"], whole + 3)
    exact = evaluate_lib.evaluate(big, loaded["params"], dataset, loaded["mesh"], loaded["rules"], whole)
    assert capped == exact and capped["batches"] == whole
