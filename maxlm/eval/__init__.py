"""Evaluating a run: the loss during training and after it (during_training.py), multiple-choice
and generation tasks (tasks.py), lm-evaluation-harness (harness.py), and the `python -m
maxlm.eval` command (__main__.py)."""
