"""The training spine: `python -m maxlm.train` (`__main__.py`) runs `loop.train_and_evaluate`.

A step, end to end: `mesh.py` (the device mesh, logical axis rules, this process's rows of a
global batch) → `state.py` (the train state and its shardings) → `step.py` (the jitted step, with
`optim.py` and `loss_scale.py`) → `step_logger.py` and `metrics.py` (what is logged; `monitor.py`
watches the guides' ranges on it) →
`evaluate.py` (eval rows, named sets, `tasks.py`) → `checkpoint.py` (orbax saves, retention,
resume) under `faults.py` (preemption, non-finite steps) and `anomaly.py` (loss spikes).
`distributed.py` starts multi-process runs, `workdir_lock.py` keeps one run per workdir,
`runs.py` reads a finished run back, `flops.py` and `profiler.py` measure.
"""
