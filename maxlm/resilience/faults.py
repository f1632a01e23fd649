"""Fault tolerance: the state behind the loop's saves, postponed saves, restores and stops;
preemption; NaN injection.

`FaultTracker` holds the plain values the loop's decisions need from one step to the next (the
owed save, the restore count, the clock); the decisions themselves are a pure function,
maxlm/train/decision.py. Both are testable without orbax or a device:

* a step whose update came out non-finite is skipped inside the jitted step (maxlm/train/step.py);
  after `checkpoint.max_bad_steps` consecutive ones the loop restores the last good checkpoint,
  with the learning rate times `checkpoint.restore_lr_scale`; after `checkpoint.max_restores`
  such restores without getting past the failure it stops (`NonFiniteLossError`, exit 3);
* a save point (every `checkpoint.every_steps`, the last step, every `checkpoint.every_minutes`,
  a preemption) that falls in a streak of non-finite steps is postponed to the next good step,
  so every checkpoint is a good one to restore (a local save, every `checkpoint.local_every_steps`,
  is skipped instead); the minutes are read off process 0's clock at log steps only, without a
  host sync (`broadcast_later`, in `FaultTracker.exchange_clock`, which every process joins);
* SIGTERM (`PreemptionWatcher`) saves at the current step and ends the run with `Preempted`
  (exit `PREEMPTED_EXIT`); every process agrees on that step. Ctrl-C (SIGINT) does the same
  (exit `INTERRUPTED_EXIT`); a second Ctrl-C kills the process at once, which loses only the
  save in progress (orbax writes into a tmp directory, so the earlier checkpoints stay whole).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time

import jax
import numpy as np

from maxlm.runtime import console, processes

log = logging.getLogger("maxlm")

# "Preempted, checkpoint committed": 128 + SIGTERM, what schedulers already read as "terminated
# by SIGTERM" and retry (Kubernetes/GKE Job restart and podFailurePolicy rules, SLURM requeue
# scripts); 0 would tell them the run is finished and stop the requeue.
PREEMPTED_EXIT = 143
INTERRUPTED_EXIT = 130  # 128 + SIGINT: the user's Ctrl-C, the checkpoint committed


class TrainingDiverged(RuntimeError):
    """Training cannot get past a failure of the model's numbers (exit 3): the base of
    NonFiniteLossError and anomaly.LossSpikeError."""


class NonFiniteLossError(TrainingDiverged):
    """Non-finite steps kept coming back after restoring the last good checkpoint (exit 3)."""


class Preempted(Exception):
    """SIGTERM (or, with `interrupted`, Ctrl-C) arrived; a checkpoint of `step` has been committed."""

    def __init__(self, step: int, interrupted: bool = False):
        super().__init__(step)
        self.step, self.interrupted = step, interrupted


def devices_by_process() -> np.ndarray:
    """[process, local device] of every device, each row one process's own devices: grouped by
    asking each process's devices, as `jax.devices()`'s order need not put a process's together."""
    return np.array([jax.local_devices(process_index=p) for p in range(jax.process_count())])


def broadcast_later(flag: bool):
    """Process 0's `flag` on every process, as a value to read later with `bool(read(...))`: a tiny
    collective dispatched now, which runs after the steps already queued. Reading it at once would
    wait for those steps (no dispatch-ahead); read a clock period later, it has long finished."""
    if jax.process_count() == 1:
        return flag
    import jax.numpy as jnp
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(devices_by_process(), ("processes", "local_devices"))
    mine = np.array([flag and jax.process_index() == 0], np.int32)  # only process 0 contributes
    spread = multihost_utils.host_local_array_to_global_array(mine, mesh, PartitionSpec("processes"))
    with jax.set_mesh(mesh):
        return jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, PartitionSpec()))(spread)


def read(value) -> bool:
    """A `broadcast_later` value as a bool (this process's copy of a replicated array)."""
    return bool(np.asarray(value.addressable_data(0)) if isinstance(value, jax.Array) else value)


class FaultTracker:
    """What the loop's fault handling carries from step to step, as plain values (no orbax, no
    device): the save owed since a save point fell in a streak, the restores since the latest
    failure, the time of the last save and process 0's clock reading in flight, and the previous
    step's metrics (a streak is read one step late). The decisions made from them are
    maxlm/train/decision.py's.

    `checkpoint_cfg`: the config's `checkpoint` section; `clock`: seconds, monotonic; process 0's
    clock is read every `clock_every` steps and `broadcast` carries the reading to every process,
    used one such period later (`exchange_clock`, the tracker's one collective)."""

    def __init__(self, checkpoint_cfg, clock_every: int = 1, clock=time.monotonic,
                 broadcast=broadcast_later):
        self.cfg, self.clock = checkpoint_cfg, clock
        self.clock_every, self.broadcast = clock_every, broadcast
        self._minutes_passed = None  # process 0's clock reading at the last clock step, in flight
        self.restores = 0  # restores after bad streaks without getting past the failure since
        self.failed_at = -1  # the last step of the latest such streak
        self.owed: str | None = None  # the kind of a save point that fell in a streak
        self.last_save = clock()
        self._previous = None  # the previous step's metrics: its streak is read one step late

    def streak_ended(self, step_metrics) -> bool:
        """Called with each step's metrics right after dispatching it: whether the step *before*
        it ended a streak of `max_bad_steps` non-finite steps (read now, when it has finished)."""
        previous, self._previous = self._previous, step_metrics
        return previous is not None and int(previous["bad_streak"]) >= self.cfg.max_bad_steps

    def exchange_clock(self, done: int) -> bool:
        """A collective: every process calls it once per iteration, whatever the iteration then
        does, so that all of them join the same broadcasts. At a clock step (every `clock_every`
        steps, with `every_minutes` set) it sends process 0's reading (have `every_minutes` passed
        since the last save?) to every process without waiting for it, and returns the reading
        sent at the previous clock step: whether a temporary save is due, the same answer on every
        process. False at other steps, and when a save came after that reading."""
        minutes = self.cfg.every_minutes
        if not minutes or done % self.clock_every:
            return False
        due = self._minutes_passed
        self._minutes_passed = self.broadcast(self.clock() - self.last_save >= 60 * minutes)
        return due is not None and read(due)

    def postponed(self, done: int, kind: str, non_finite: bool) -> None:
        """A save point at step `done` fell in a streak (`non_finite`: of non-finite steps, else
        of loss spikes): a save of `kind` is owed to the next good step."""
        if not self.owed:
            log.info("step %d was %s: its checkpoint waits for a good step", done,
                     "non-finite" if non_finite else "in a loss spike")
        self.owed = kind

    def saved(self, done: int, kind: str = "regular") -> None:
        if kind != "local":  # the minutes count from the last save to the persistent tier
            self.owed, self.last_save, self._minutes_passed = None, self.clock(), None
        if done > self.failed_at >= 0:  # got past the failure: restores start counting afresh
            self.restores, self.failed_at = 0, -1

    def restarted(self) -> None:
        """The loop went back to a checkpoint: no save is owed, no streak is being read."""
        self.owed, self._previous = None, None

    def recovering(self, bad_step: int, newest: int | None) -> int:
        """Counts a restore after the streak ending at `bad_step` (`newest`: the newest checkpoint,
        for the message); raises NonFiniteLossError past `max_restores`. Returns the count."""
        self.restarted()
        self.restores += 1
        if self.restores > self.cfg.max_restores:
            raise NonFiniteLossError(
                f"{self.cfg.max_bad_steps} consecutive non-finite steps up to step {bad_step}, "
                f"still after {self.restores - 1} restore(s) of the last good checkpoint "
                f"(checkpoint.max_restores={self.cfg.max_restores}); stopped. Newest checkpoint: "
                f"{f'step {newest}' if newest is not None else 'none'}, all finite"
            )
        self.failed_at = max(self.failed_at, bad_step)
        return self.restores


class PreemptionWatcher:
    """Has a preemption notice (SIGTERM) or a Ctrl-C arrived? Every process gets the same answer
    per step.

    Multi-process: JAX's preemption sync point (the coordination service catches SIGTERM and
    all processes agree on the first step at which to stop); a Ctrl-C is passed on to it as a
    SIGTERM to this process. Single process: our own handlers. After the first Ctrl-C, SIGINT is
    back to its default action: a second one ends the process at once.
    """

    def __init__(self):
        self.flag = self.interrupted = False
        self.multi = jax.process_count() > 1
        self._previous = {}

    def __enter__(self):
        with contextlib.suppress(ValueError):  # not the main thread: no handlers
            if not self.multi:
                self._previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._handle)
            self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._interrupt)
        return self

    def _handle(self, signum, frame):
        self.flag = True

    def _interrupt(self, signum, frame):
        self.interrupted = True
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        console.warn("Ctrl-C: saving a checkpoint at the end of this step; Ctrl-C again stops at once without it")
        if self.multi:
            os.kill(os.getpid(), signal.SIGTERM)  # to JAX's handler, which agrees on a step
        else:
            self.flag = True

    def __exit__(self, *exc):
        for signum, previous in self._previous.items():
            if previous is not None:
                signal.signal(signum, previous)

    def agreed_interrupted(self) -> bool:
        """Whether a Ctrl-C, not a SIGTERM, stopped the run, on any process: the same answer on
        every process (a collective on several: call it on each once the stop is agreed), so all
        exit 130 or all 143, not only the process that got the Ctrl-C."""
        return bool(processes.blind(not self.interrupted))  # the processes a Ctrl-C reached

    def reached(self, step: int) -> bool:
        if self.multi:
            from jax.experimental import multihost_utils

            return multihost_utils.reached_preemption_sync_point(step)
        return self.flag


def with_nan_injection(train_fn, injecting_fn, debug_cfg, injected: set[int]):
    """Fault injection (`debug.nan_at_step`): a `(state, batch, lr_scale)` step that runs `train_fn`, except
    in steps nan_at_step ... nan_at_step + nan_steps - 1 (with `nan_transient` only the first time
    each of them runs in this process: `injected` records them, shared by the steps built for one
    run, so a restore replays them clean), which run `injecting_fn(state, batch, True)` (made with
    `step.make_train_step(..., inject_nan=True)`): NaN gradients. Good steps run the very program
    a run without injection runs (another program could fuse differently and round differently);
    the flag is an argument so that the bad step's skip is a runtime select, as in a real fault.
    Reads the state's step back from the device, a sync a debugging knob can afford."""
    first, count, transient = debug_cfg.nan_at_step, debug_cfg.nan_steps, debug_cfg.nan_transient

    def step_fn(state, batch, lr_scale):
        step = int(state["step"])
        if first <= step < first + count and not (transient and step in injected):
            injected.add(step)
            return injecting_fn(state, batch, lr_scale, np.bool_(True))
        return train_fn(state, batch, lr_scale)

    return step_fn
