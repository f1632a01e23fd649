"""`python -m maxlm.generate --workdir=DIR --prompt="..." [--max_new_tokens=64] [--temperature=0.8]
[--top_k=0] [--top_p=1.0] [--seed=0] [--num_samples=1] [--step=N] [--json]`.

Loads the run like `python -m maxlm.eval` (DIR/config.json, a checkpoint's parameters sharded by
the config's mesh rules), tokenizes the prompt with the run's tokenizer as training framed a
document (`[bos] + tokens`, positions from 0), and samples (maxlm/generate/__init__.py). Prompt +
--max_new_tokens past a learned position table is refused (exit 2). `--num_samples=N` draws N
samples of the prompt at once (N rows of one batch). Prints the completion(s), or with --json one
object: prompt, completion, token_ids, num_tokens, stopped_at_eos (of the first sample), step,
tokens_per_sec (generation only, compilation excluded), compile_sec, distinct_1 and distinct_2
(`distinct_n`, over every sample), and with N > 1 `samples` (each sample's completion, token_ids,
num_tokens, stopped_at_eos).
"""

from __future__ import annotations

import json
import time

import jax

from maxlm import cli
from maxlm.checkpoint import saved_run
from maxlm.generate import activation_context, check_length, distinct_n, make_generate_fn, pad_prompts, settings
from maxlm.runtime import console, distributed


def _check_flags(f) -> None:
    if f.max_new_tokens < 1:
        cli.config_error(f"--max_new_tokens={f.max_new_tokens} must be >= 1")
    if f.temperature < 0:
        cli.config_error(f"--temperature={f.temperature} must be >= 0 (0 = greedy)")
    if f.top_k < 0:
        cli.config_error(f"--top_k={f.top_k} must be >= 0 (0 = off)")
    if not 0 < f.top_p <= 1:
        cli.config_error(f"--top_p={f.top_p} must be in (0, 1] (1 = off)")
    if f.seed < 0:
        cli.config_error(f"--seed={f.seed} must be >= 0")
    if f.num_samples < 1:
        cli.config_error(f"--num_samples={f.num_samples} must be >= 1")


def main(argv) -> None:
    from maxlm.data.tokenizers import config_tokenizer

    f = cli.start(argv, required=("workdir",))
    _check_flags(f)
    distributed.initialize()
    try:
        run = saved_run.load_run(f.workdir, f.step)
        cfg = run["config"]
        tokenizer = config_tokenizer(cfg.data, job=True)
    except ValueError as e:  # RunError, a missing tokenizer file
        cli.config_error(str(e))
    prompt_ids = [tokenizer.bos_id, *tokenizer.encode(f.prompt).tolist()]
    try:
        check_length(cfg.model, len(prompt_ids), f.max_new_tokens)
    except ValueError as e:
        cli.config_error(str(e))
    if len(prompt_ids) + f.max_new_tokens > cfg.seq_len:
        console.warn(f"prompt ({len(prompt_ids)} tokens) + --max_new_tokens={f.max_new_tokens} is "
                 f"longer than the run's seq_len={cfg.seq_len}: positions past it were never trained")
    mesh, rules = run["mesh"], run["rules"]
    prompt_BP, lengths_B = pad_prompts([prompt_ids] * f.num_samples, tokenizer.pad_id)
    fn = make_generate_fn(cfg, mesh, rules, max_new_tokens=f.max_new_tokens)
    args = (run["params"], prompt_BP, lengths_B,
            settings(seed=f.seed, temperature=f.temperature, top_k=f.top_k, top_p=f.top_p,
                     eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id, vocab_limit=tokenizer.vocab_size))
    with activation_context(mesh, rules):
        start = time.perf_counter()
        compiled = fn.lower(*args).compile()
        compile_sec = time.perf_counter() - start
        start = time.perf_counter()
        tokens_BN, counts_B = jax.device_get(compiled(*args))
        seconds = time.perf_counter() - start
    samples = [sample_json(tokens_BN[b, : counts_B[b]].tolist(), tokenizer) for b in range(f.num_samples)]
    if jax.process_index() != 0:
        return
    if f.json:
        generated = [s["token_ids"][:-1] if s["stopped_at_eos"] else s["token_ids"] for s in samples]
        num_tokens = sum(s["num_tokens"] for s in samples)
        print(json.dumps({
            "prompt": f.prompt, **samples[0], "prompt_ids": prompt_ids, "step": run["step"],
            "tokens_per_sec": num_tokens / max(seconds, 1e-9), "compile_sec": compile_sec,
            "distinct_1": distinct_n(generated, 1), "distinct_2": distinct_n(generated, 2),
            **({"samples": samples} if f.num_samples > 1 else {}),
        }), flush=True)
    elif f.num_samples == 1:
        print(samples[0]["completion"], flush=True)
    else:
        for i, s in enumerate(samples):
            print(f"--- sample {i} ---\n{s['completion']}", flush=True)


def sample_json(ids: list[int], tokenizer) -> dict:
    """One sample's completion, token_ids, num_tokens and stopped_at_eos."""
    return {"completion": tokenizer.decode(ids), "token_ids": ids, "num_tokens": len(ids),
            "stopped_at_eos": bool(ids) and ids[-1] == tokenizer.eos_id}


def define_flags() -> None:
    from absl import flags

    flags.DEFINE_string("workdir", None, "A training run's workdir (config.json, checkpoints/).")
    flags.DEFINE_string("prompt", "", "Text to continue (encoded after the tokenizer's bos).")
    flags.DEFINE_integer("max_new_tokens", 64, "Tokens to generate at most (fewer at EOS).")
    flags.DEFINE_float("temperature", 0.8, "Softmax temperature; 0 = greedy.")
    flags.DEFINE_integer("top_k", 0, "Sample among the k most likely tokens (0 = all).")
    flags.DEFINE_float("top_p", 1.0, "Nucleus sampling: the smallest set with this probability (1 = all).")
    flags.DEFINE_integer("seed", 0, "Sampling seed: same seed, same sample.")
    flags.DEFINE_integer("num_samples", 1, "Samples of the prompt, drawn together (rows of one batch).")
    flags.DEFINE_integer("step", None, "Checkpoint step (default: the newest complete one).")
    flags.DEFINE_bool("json", False, "Print one JSON object instead of the completion.")


if __name__ == "__main__":
    cli.run(main, define_flags, config_file=False)
