"""`python -m maxlm.eval --workdir=DIR [--split=validation] [--step=N] [--eval_steps=N]`, or
`--task=FILE.jsonl[,...] [--shots=K] [--seed=S]`, or `--harness=TASK[,...] [--harness_include=DIR]
[--shots=K] [--harness_limit=N] [--seed=S]`: one JSON object per result.

What the numbers are is documented with the code that computes them: maxlm/eval/during_training.py
(the loss), maxlm/eval/tasks.py (`--task`), maxlm/eval/harness.py (`--harness`, lm-evaluation-harness).
"""

import json

import jax

from maxlm import cli
from maxlm.eval import during_training
from maxlm.runtime import distributed


def main(argv) -> None:
    f = cli.start(argv, required=("workdir",))
    task_paths = [path for flag in f.task or () for path in flag.split(",") if path]
    harness = [name for flag in f.harness or () for name in flag.split(",") if name]
    if task_paths and harness:
        cli.config_error("--task scores maxlm's task files, --harness lm-eval's tasks: give one of them")
    if (task_paths or harness) and (f["split"].present or f["eval_steps"].present):
        cli.config_error("--split and --eval_steps set the loss's batches; --task and --harness score tasks instead")
    harness_only = [name for name in ("harness_include", "harness_limit", "harness_batch_size") if f[name].present]
    if harness_only and not harness:
        cli.config_error(f"--{harness_only[0]} applies to --harness only")
    distributed.initialize()
    try:
        if harness:
            from maxlm.eval import harness as harness_lib

            results = harness_lib.evaluate_harness(f.workdir, harness, f.harness_include, f.shots, f.harness_limit,
                                                   f.seed, f.step, f.harness_batch_size)
        elif task_paths:
            results = during_training.evaluate_tasks(f.workdir, task_paths, f.shots, f.seed, f.step)
        else:
            results = [during_training.evaluate_run(f.workdir, f.split, f.step, f.eval_steps)]
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
                         "eval.task_shots; with --harness, the task's own).")
    flags.DEFINE_integer("seed", None, "Seed that draws the few-shot examples (default: the run's seed; "
                         "with --harness, lm-eval's seeds).")
    flags.DEFINE_multi_string("harness", None, "lm-evaluation-harness tasks, groups or tags to run instead "
                              "of the loss (repeat the flag or give a comma list); one JSON object per task.")
    flags.DEFINE_string("harness_include", None, "--harness: a directory of extra lm-eval task YAMLs.")
    flags.DEFINE_integer("harness_limit", None, "--harness: score only the first N examples of each task.")
    flags.DEFINE_integer("harness_batch_size", 32, "--harness: prompts generated together (generate_until "
                         "tasks; scoring uses the run's batch_size).")



if __name__ == "__main__":
    cli.run(main, define_flags, config_file=False)
