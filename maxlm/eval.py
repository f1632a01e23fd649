"""`python -m maxlm.eval --workdir=DIR [--split=validation] [--step=N] [--eval_steps=N]`, or
`--task=FILE.jsonl[,...] [--shots=K] [--seed=S]`: one JSON object per result.

What the numbers are is documented with the code that computes them, maxlm/train/evaluate.py.
"""

import json

import jax

from maxlm import cli
from maxlm.train import distributed, evaluate


def main(argv) -> None:
    f = cli.start(argv, required=("workdir",))
    task_paths = [path for flag in f.task or () for path in flag.split(",") if path]
    if task_paths and (f["split"].present or f["eval_steps"].present):
        cli.config_error("--split and --eval_steps set the loss's batches; --task scores tasks instead")
    distributed.initialize()
    try:
        if task_paths:
            results = evaluate.evaluate_tasks(f.workdir, task_paths, f.shots, f.seed, f.step)
        else:
            results = [evaluate.evaluate_run(f.workdir, f.split, f.step, f.eval_steps)]
    except ValueError as e:  # RunError, DataError: the user's to fix
        cli.config_error(str(e))
    if jax.process_index() == 0:
        for result in results:
            print(json.dumps(result), flush=True)


def define_flags() -> None:
    from absl import flags

    flags.DEFINE_string("workdir", None, "A training run's workdir (config.json, checkpoints/).")
    flags.DEFINE_string("split", "validation", "Data split: validation or train.")
    flags.DEFINE_integer("step", None, "Checkpoint step (default: the newest complete one).")
    flags.DEFINE_integer("eval_steps", None, "Batches to evaluate (default: the config's eval.steps).")
    flags.DEFINE_multi_string("task", None, "A task .jsonl file to score instead of the loss (repeat "
                              "the flag or give a comma list); one JSON object per task.")
    flags.DEFINE_integer("shots", None, "Few-shot examples before each one (default: the run's "
                         "eval.task_shots).")
    flags.DEFINE_integer("seed", None, "Seed that draws the few-shot examples (default: the run's seed).")



if __name__ == "__main__":
    cli.run(main, define_flags, config_file=False)
