"""`python -m maxlm.eval --workdir=DIR [--split=validation] [--step=N] [--eval_steps=N]`.

The logic lives in `maxlm/evaluate.py` (importable, since `eval` is
also a Python builtin's name).
"""

from maxlm import cli, evaluate

if __name__ == "__main__":
    cli.run(evaluate.main, evaluate.define_flags, config_file=False)
