"""Traces of chosen training steps with jax.profiler: `profile.start_step`, `profile.num_steps`.

The trace goes to `WORKDIR/profile/plugins/profile/<timestamp>/`: an `.xplane.pb` that TensorBoard's
profile plugin reads (`tensorboard --logdir WORKDIR/profile`) and a `.trace.json.gz` that
https://ui.perfetto.dev opens directly. Only process 0 traces: processes on one host would
otherwise write the same file names, and one host's view is what a step-time question needs.

The profiler writes with the OS's file functions, which know nothing of `gs://`: for a remote
workdir the trace goes to a local temporary directory first and is copied up through
`etils.epath` (maxlm/runtime/paths.py) when it ends.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile

import jax

from maxlm.runtime import paths

log = logging.getLogger("maxlm")


def trace_dir(workdir: str) -> str:
    return os.path.join(workdir, "profile")


class StepProfiler:
    """Starts a trace before step `start_step` runs and stops it once `num_steps` steps are done.

    Steps are dispatched asynchronously, so `after_step` waits for the last traced step's outputs
    before stopping: the trace then holds the device work of every traced step, not only its
    dispatch. `num_steps=0` (the default) never traces.
    """

    def __init__(self, profile_cfg, workdir: str, enabled: bool = True):
        self.start = int(profile_cfg.start_step)
        self.stop = self.start + int(profile_cfg.num_steps)
        self.enabled = enabled and profile_cfg.num_steps > 0
        self.directory = trace_dir(workdir)  # where the trace ends up
        self.remote = paths.is_remote(workdir)
        self.active = False
        self._local = ""  # where the profiler writes: the directory itself, or a temporary one

    def before_step(self, step: int) -> None:
        """Call with the step about to run."""
        if self.enabled and not self.active and self.start <= step < self.stop:
            self._local = tempfile.mkdtemp(prefix="maxlm-profile-") if self.remote else self.directory
            jax.profiler.start_trace(self._local, create_perfetto_trace=True)
            self.active = True
            log.info("profiling steps %d to %d into %s", step, self.stop - 1, self.directory)

    def after_step(self, done: int, outputs) -> bool:
        """Call with the number of steps done and the last step's outputs (waited for).

        True when it ended the trace: step `done` has then finished, and writing the trace took
        time that is not training time (the loop restarts its throughput clock)."""
        if self.active and done >= self.stop:
            jax.block_until_ready(outputs)
            self._stop()
            return True
        return False

    def close(self) -> None:
        """Ends a trace cut short (preemption, error, fewer steps than planned)."""
        if self.active:
            self._stop()

    def _stop(self) -> None:
        jax.profiler.stop_trace()
        if self.remote:
            _copy_up(self._local, self.directory)
            shutil.rmtree(self._local, ignore_errors=True)
        self.active = False
        self.enabled = False  # one trace per run: a restore that repeats steps does not retrace
        log.info("profile written to %s (TensorBoard: --logdir %s; Perfetto: the .trace.json.gz)",
                 self.directory, self.directory)


def _copy_up(local_dir: str, remote_dir: str) -> None:
    """Every file under `local_dir` to the same relative path under `remote_dir` (epath)."""
    destination = paths.workdir_path(remote_dir)
    for root, _, files in os.walk(local_dir):
        for name in files:
            source = os.path.join(root, name)
            target = destination / os.path.relpath(source, local_dir)
            with open(source, "rb") as src, target.open("wb") as dst:
                shutil.copyfileobj(src, dst)
