"""`python -m maxlm.train --config=configs/NAME.py --workdir=DIR [--config.KEY=VALUE ...]`.

The command around the training loop (maxlm/train/loop.py): flags, the config validated for this
machine's devices, and the exit status: 0 done, 2 bad config or data (before anything is
compiled or written; or at once, writing nothing more, when another run takes a gs:// workdir's
lease: workdir_lock.py), 3 non-finite steps persist, 143 preempted (SIGTERM) and 130 interrupted
(Ctrl-C), each with a checkpoint committed; 1 for anything else, e.g. a checkpoint storage refused
(one line: the step, why, where, the last good checkpoint).
"""

import os
import sys

import jax
from absl import flags

from maxlm import cli
from maxlm.checkpoint import store as checkpoint, workdir_lock
from maxlm.config import schema
from maxlm.observe import goodput, metrics
from maxlm.resilience import faults
from maxlm.runtime import distributed, paths
from maxlm.train import loop


def main(argv) -> None:
    stopwatch = goodput.Stopwatch.since_process_start()  # start-up counts from the process's start
    try:
        train(cli.start(argv, required=("workdir",)), stopwatch)
    except KeyboardInterrupt:  # Ctrl-C outside the steps (data, compilation), which save on it
        print(f"maxlm: interrupted (Ctrl-C) outside the training steps; the checkpoints committed in "
              f"{checkpoint.checkpoint_dir(flags.FLAGS.workdir)} are intact; rerun the same command to resume",
              file=sys.stderr)
        sys.exit(faults.INTERRUPTED_EXIT)


def train(f, stopwatch: goodput.Stopwatch | None = None) -> None:
    distributed.initialize()  # multi-process runs: from JAX_COORDINATOR_ADDRESS etc.
    cfg = cli.resolved_config(jax.device_count())
    distributed.check_same_program(schema.flatten(cfg.to_dict()))  # before any process acts on its own config
    metrics.check_writers(cfg.metrics)  # an optional writer's package missing: exit 2 here, not after writing
    cli.use_compile_cache(cfg)
    try:
        distributed.check_shared_workdir(f.workdir)  # every process sees the same checkpoints
        # one run per workdir: a second one stops here, having written nothing there, before it
        # reads the checkpoints a live run may be writing
        workdir_lock.hold(f.workdir, on_lost=stop_on_lost_lease)
        # the checkpoint first: a resume it refuses then prepares no packed cache of the data
        loop.check_start(cfg, f.workdir)
        data = loop.load_data(cfg)
    except ValueError as e:  # bad data or a data/config mismatch: the user's to fix
        workdir_lock.abandon()  # exit 2 writes nothing: the workdir is left as it was
        cli.config_error(str(e))
    try:
        last = loop.train_and_evaluate(cfg, f.workdir, data, stopwatch)
    except faults.TrainingDiverged as e:  # non-finite steps or loss spikes past their restores
        print(f"maxlm: {e}", file=sys.stderr)
        sys.exit(3)
    except checkpoint.StorageError as e:  # a full disk, no permission, a bucket that refused
        print(f"maxlm: {e}", file=sys.stderr)
        sys.exit(1)
    except faults.Preempted as e:
        why = "interrupted (Ctrl-C)" if e.interrupted else "preempted (SIGTERM)"
        print(f"maxlm: {why}: checkpoint of step {e.step} committed in "
              f"{checkpoint.checkpoint_dir(f.workdir)}; rerun the same command to resume",
              file=sys.stderr)
        sys.exit(faults.INTERRUPTED_EXIT if e.interrupted else faults.PREEMPTED_EXIT)
    if jax.process_index() == 0:
        if "loss" in last:
            print(f"done at step {last['step']}: loss {last['loss']:.4f} "
                  f"(first step of this run: {last['first_loss']:.4f})")
        else:
            print(f"nothing to do: the checkpoint in {f.workdir} is already at step {cfg.steps}")
        if (record := goodput.read(f.workdir)) is not None:  # all attempts of the workdir
            print(goodput.summary_line(record))
        print(f"checkpoints: {checkpoint.checkpoint_dir(f.workdir)}")
        print(f"metrics:     {paths.workdir_path(f.workdir) / 'metrics.jsonl'}")


def stop_on_lost_lease(message: str) -> None:
    """Another run has taken this gs:// workdir's lease (workdir_lock.py): end at once, writing
    nothing more there (no checkpoint, no metrics: they would mix with that run's). On a
    multi-process job the other processes then fail on the lost process 0."""
    print(f"maxlm: error: {message}", file=sys.stderr, flush=True)
    os._exit(workdir_lock.LEASE_LOST_EXIT)  # called on the heartbeat thread, where sys.exit ends only it


def define_flags() -> None:
    flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and config.json.")


if __name__ == "__main__":
    cli.run(main, define_flags)
