"""`python -m maxlm.eval --workdir=DIR [--split=validation] [--step=N] [--eval_steps=N]`.

The command the issue names; the logic lives in `maxlm/evaluate.py` (importable, since `eval` is
also a Python builtin's name).
"""

from maxlm import evaluate

if __name__ == "__main__":
    evaluate.run(evaluate.main, evaluate.define_flags)
