"""Tools that measure and compare, never imported by training: `python -m maxlm.bench`.

`benchmarks.py` (train, checkpoint, attention, and the command's dispatch), `plan.py` (the step
compiled ahead of time: memory, FLOPs, an estimated step time), `targets/` (hardware to compile
for without having it), `throughput.py` (the data pipeline), `compare.py` with `maxtext_peer.py`
and `compare_plan.py` (maxlm beside MaxText).
"""
