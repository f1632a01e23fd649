"""Loss-spike recovery, PaLM's recipe for steps that are finite but abnormal (`anomaly.*`).

A non-finite step is skipped inside the jitted step and counted in a streak of its own
(`faults.FaultTracker`, maxlm/train/decision.py). A loss *spike* is finite, so its update is
applied; PaLM's answer (Chowdhery et al. 2022, section 5.1) is to go back to a checkpoint from
before the spike and skip the batches around it. Here:

* `SpikeDetector` keeps running statistics of the training loss on the host, from the rows the
  loop reads back one step late: exponential moving averages of its mean and variance (decay
  `anomaly.ema`). After `anomaly.warmup` losses, a loss above mean + `anomaly.spike_sigma` × the
  deviation is a spike and is kept out of the statistics; any other loss ends a streak of spikes.
* After `anomaly.max_spikes` consecutive spikes, the loop restores the newest checkpoint from
  before the first of them (step k) and the stream skips batches: from step k on, each step reads
  the batch `anomaly.skip_batches` further on (at least far enough to skip every batch up to the
  last spike). Checkpoints written after the spike began hold its state: they are removed, since
  the steps are trained again.
* The skips are a list of `(step, batches)`: the batch of step `s` is the one at data position
  `s + Σ batches over the skips with step <= s` (`data_position`), a pure function of the config,
  `s` and that list. The list, the detector's statistics and the counters go into every
  checkpoint's meta (`Anomalies.meta`), so a resumed run reads the same batches and decides the
  same spikes as the uninterrupted one.
* `anomaly.max_rollbacks` rollbacks without a checkpoint saved past the spike stop the run
  (`LossSpikeError`, exit 3), as persistent non-finite steps do.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from maxlm.resilience import faults


class LossSpikeError(faults.TrainingDiverged):
    """Loss spikes kept coming back after `anomaly.max_rollbacks` rollbacks (exit 3)."""


def data_position(step: int, skips) -> int:
    """The data position (batch index of the stream) that step `step` reads, given the skips
    `[(from_step, batches), ...]`."""
    return step + sum(batches for start, batches in skips if start <= step)


@dataclasses.dataclass
class SpikeStats:
    """The detector's state, plain numbers (JSON round-trips them exactly)."""

    mean: float = 0.0
    var: float = 0.0
    count: int = 0  # losses folded into mean and var
    streak: int = 0  # consecutive spikes so far
    first: int = -1  # the step of the streak's first spike (-1: no streak)


class SpikeDetector:
    """Running mean and deviation of the loss; says when a streak of spikes calls for a rollback.

    `anomaly_cfg`: the config's `anomaly` section. Feed every applied step's loss in step order
    (`observe`); a skipped (non-finite) step's loss is not a sample."""

    def __init__(self, anomaly_cfg, stats: SpikeStats | None = None):
        self.cfg = anomaly_cfg
        self.stats = stats or SpikeStats()

    def threshold(self) -> float:
        """The loss above which a step is a spike (inf during the warmup)."""
        s = self.stats
        if s.count < self.cfg.warmup:
            return math.inf
        return s.mean + self.cfg.spike_sigma * math.sqrt(s.var)

    def observe(self, step: int, loss: float) -> bool:
        """Records step `step`'s loss; True when it is a spike. `rollback_due` then says whether
        the streak is long enough."""
        s = self.stats
        if loss > self.threshold():
            s.streak += 1
            s.first = step if s.streak == 1 else s.first
            return True
        s.streak, s.first = 0, -1
        if s.count == 0:
            s.mean = loss
        else:  # the EMA of the mean, and of the squared deviation from it
            decay, delta = self.cfg.ema, loss - s.mean
            s.mean += (1 - decay) * delta
            s.var = decay * (s.var + (1 - decay) * delta * delta)
        s.count += 1
        return False

    def rollback_due(self) -> bool:
        return self.stats.streak >= self.cfg.max_spikes


class Anomalies:
    """The loop's loss-spike bookkeeping for one run: the detector, the skip list, the counters.

    Built from the meta of the checkpoint the run starts from (`meta`, {} for a fresh start)."""

    def __init__(self, anomaly_cfg, meta: dict | None = None):
        self.cfg = anomaly_cfg
        recorded = (meta or {}).get("anomaly", {})
        self.skips: list[tuple[int, int]] = [tuple(s) for s in recorded.get("skips", [])]
        self.spikes = int(recorded.get("spikes", 0))  # spike steps seen, all of the run's history
        self.rollbacks = int(recorded.get("rollbacks", 0))
        self.recent_rollbacks = 0  # since a checkpoint past the latest spike was saved
        self.last_spike = -1
        self.restored(meta)

    @property
    def enabled(self) -> bool:
        return self.cfg.enabled

    def position(self, step: int) -> int:
        return data_position(step, self.skips)

    def rebase(self, step: int, position: int) -> None:
        """From `step` on, the stream reads from data `position` (a resume that changed the data
        on purpose: maxlm/resilience/data_position.py): a skip of the batches between (maybe < 0)."""
        if (jump := position - self.position(step)) != 0:
            self.skips.append((step, jump))

    def meta(self) -> dict:
        """What a checkpoint records: `{"anomaly": {...}}` ({} when off, so meta stays as it was).

        The detector reads each loss one step late, so at a save it has not seen the last step's:
        that loss is recorded (`pending`, read now: the save waits for the step anyway) and a run
        resuming there reads it first, as the uninterrupted run does."""
        if not self.enabled:  # the skip list still holds deliberate jumps (`rebase`)
            return {"anomaly": {"skips": [list(s) for s in self.skips]}} if self.skips else {}
        pending = None
        if self._previous is not None:
            step, metrics = self._previous
            pending = [step, float(metrics["loss"]), int(metrics["bad_streak"]), int(metrics["applied"])]
        return {"anomaly": {"skips": [list(s) for s in self.skips], "spikes": self.spikes,
                            "rollbacks": self.rollbacks, "stats": dataclasses.asdict(self.detector.stats),
                            "pending": pending}}

    def counters(self) -> dict:
        """Added to every training row while on."""
        return {"spikes": self.spikes, "rollbacks": self.rollbacks} if self.enabled else {}

    def spiked(self, step: int, step_metrics) -> int | None:
        """Called with each step's metrics (`step`: its index) right after dispatching it: reads
        the *previous* step's loss (finished by now) into the detector. Returns that step when it
        completed a streak of `max_spikes` spikes (a rollback is due), else None."""
        previous, self._previous = self._previous, (step, step_metrics)
        if not self.enabled or previous is None:
            return None
        prev_step, metrics = previous
        loss, applied = float(metrics["loss"]), bool(int(metrics["applied"]))
        if not (applied and math.isfinite(loss)):  # a skipped step: the non-finite streak's to handle
            return None
        if self.detector.observe(prev_step, loss):
            self.spikes += 1
            self.last_spike = prev_step
            return prev_step if self.detector.rollback_due() else None
        return None

    def in_streak(self) -> bool:
        """A spike streak is running: a checkpoint now could hold its state, so saves wait."""
        return self.enabled and self.detector.stats.streak > 0

    def saved(self, step: int) -> None:
        if step > self.last_spike:  # got past the spike: rollbacks count afresh
            self.recent_rollbacks = 0

    def check_rollback(self, last_spike: int) -> None:
        """Counts a rollback after the streak ending at `last_spike`; raises LossSpikeError past
        `max_rollbacks` (before anything is restored or removed)."""
        self.recent_rollbacks += 1
        if self.recent_rollbacks > self.cfg.max_rollbacks:
            raise LossSpikeError(
                f"{self.cfg.max_spikes} consecutive loss spikes up to step {last_spike}, still after "
                f"{self.recent_rollbacks - 1} rollback(s) (anomaly.max_rollbacks={self.cfg.max_rollbacks}); "
                "stopped")

    def rolled_back(self, last_spike: int, restored_step: int, restored_meta: dict | None) -> int:
        """Records a rollback after the streak ending at `last_spike` to the checkpoint of
        `restored_step` (`restored_meta`: its meta; None: the initial state), whose statistics the
        detector takes back. Returns the batches skipped from `restored_step` on."""
        self.rollbacks += 1
        self.restored(restored_meta)
        batches = max(self.cfg.skip_batches, last_spike + 1 - restored_step)
        self.skips.append((restored_step, batches))
        return batches

    def restored(self, restored_meta: dict | None) -> None:
        """The loop went back to a checkpoint (`restored_meta`: its meta; None: the initial state):
        the detector's statistics are that checkpoint's, so a resume from it decides alike."""
        recorded = (restored_meta or {}).get("anomaly", {})
        self.detector = SpikeDetector(self.cfg, SpikeStats(**recorded.get("stats", {})))
        pending = recorded.get("pending")  # (step, device metrics) of the step dispatched last
        if pending is not None:  # checkpoints from before `applied` was recorded: bad_streak 0 meant it
            applied = pending[3] if len(pending) > 3 else int(pending[2] == 0)
            self._previous = (pending[0], {"loss": pending[1], "bad_streak": pending[2], "applied": applied})
        else:
            self._previous = None


def with_spike_injection(train_fn, debug_cfg, position):
    """Fault injection (`debug.spike_at_batch`): a `(state, batch, lr_scale)` step that runs
    `train_fn` with the learning rate times `debug.spike_lr_scale` on the batches at data positions
    spike_at_batch ... spike_at_batch + spike_batches - 1, as it is elsewhere. Tied to the
    data, as a bad stretch of data would be: once a rollback skips those batches, they are not
    read again. `position(step)`: the data position of a step. Reads the state's step back from the
    device, a sync a debugging knob can afford."""
    first, count = debug_cfg.spike_at_batch, debug_cfg.spike_batches

    def step_fn(state, batch, lr_scale):
        hit = first <= position(int(state["step"])) < first + count
        return train_fn(state, batch, np.float32(lr_scale * debug_cfg.spike_lr_scale) if hit else lr_scale)

    return step_fn
