"""Checkpoints: orbax saves and restores (store.py), which saved state fits the config on
resume (compatibility.py), the node-local tier (local_tier.py) and per-host data shards
(host_shards.py), the lock that keeps one run per workdir (workdir_lock.py), reading a finished
run back for eval, generate and export (saved_run.py), and `python -m maxlm.checkpoint`."""
