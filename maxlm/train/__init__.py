"""The training spine: `python -m maxlm.train` (`__main__.py`) runs `loop.train_and_evaluate`.

The loop (`loop.py`) feeds batches to the jitted step (`step.py`: loss, gradients, the optimizer
update of maxlm/optim/), logs and evaluates (maxlm/observe/, maxlm/eval/), and saves
(maxlm/checkpoint/) when the fault handling of maxlm/resilience/ says so.
"""
