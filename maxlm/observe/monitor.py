"""The pretraining guides' ranges, watched: a warning and a TensorBoard marker when a logged
quantity stays out of its range (`monitor.*`; docs/observability.md#the-guides-ranges-watched).

`StepLogger.flush` hands each training row to `Monitor.observe` once it has been read back, one
step late like every metric, so watching adds no device sync. Each watch counts the consecutive
logged rows outside its range; after `monitor.patience` of them it warns once (console.warn) and
its marker `monitor/<name>_out_of_range` goes from 0 to 1; the row where the quantity is back in
range says so (a log line) and sets the marker back to 0. Every row carries the marker of each
watch that is on, so TensorBoard draws each excursion as a step of height 1.

The watches: `grad_norm` and `update_ratio` after the warmup (the learning rate ramps up from 0
and the gradient norm falls from its first values then; the ranges are the stable phase's), on
applied steps only (a skipped step's gradient is non-finite and its update 0); the peak memory's
share of the device where the platform reports it (GPU, TPU); MFU on accelerators.
"""

from __future__ import annotations

import dataclasses
import logging
import math

from maxlm.runtime import console

log = logging.getLogger("maxlm")

DOCS = "docs/observability.md#the-guides-ranges-watched"


def marker(name: str) -> str:
    """The 0/1 metric of a watch: 1 while `name` is in an excursion that has warned."""
    return f"monitor/{name}_out_of_range"


@dataclasses.dataclass
class Watch:
    """One quantity of the training rows (`name`) and its range, [low, high]; a bound of 0 is no
    bound. Rows at steps up to `after_step` are not watched; with `applied_only`, neither are
    skipped steps' (`applied` 0). `above`/`below`: what the warning adds in each direction."""

    name: str
    low: float
    high: float
    patience: int
    above: str = ""
    below: str = ""
    after_step: int = 0
    applied_only: bool = False
    percent: bool = False  # show the value and bounds as percentages (fractions in the rows)
    outside: list = dataclasses.field(default_factory=list)  # the current excursion's steps
    warned: bool = False

    def outside_text(self) -> str:
        """Where the quantity has been: "outside [0.5, 2]", "above 95.0%", "below 20.0%"."""
        if self.low and self.high:
            return f"outside [{self.format(self.low)}, {self.format(self.high)}]"
        return f"below {self.format(self.low)}" if self.low else f"above {self.format(self.high)}"

    def inside_text(self) -> str:
        """Where it is back: "in [0.5, 2]", "at or below 95.0%", "at or above 20.0%"."""
        if self.low and self.high:
            return f"in [{self.format(self.low)}, {self.format(self.high)}]"
        return f"at or above {self.format(self.low)}" if self.low else f"at or below {self.format(self.high)}"

    def format(self, value: float) -> str:
        return f"{value:.1%}" if self.percent else f"{value:.3g}"

    def is_outside(self, value: float) -> bool:
        return (self.low > 0 and value < self.low) or (self.high > 0 and value > self.high)

    def observe(self, step: int, row: dict) -> tuple[int | None, Note | None]:
        """Takes the row of `step`: (the marker's value, or None where the row does not carry the
        quantity, not reported on this platform; what to say, if anything)."""
        if self.name not in row:
            return None, None
        value, note = float(row[self.name]), None
        watched = (step > self.after_step and math.isfinite(value)
                   and not (self.applied_only and row.get("applied", 1) == 0))
        if not watched:  # neither counts nor ends an excursion
            return int(self.warned), None
        if self.is_outside(value):
            self.outside.append(step)
            if len(self.outside) >= self.patience and not self.warned:
                self.warned = True
                hint = self.above if self.high > 0 and value > self.high else self.below
                note = Note(True, f"step {step}: {self.name} {self.format(value)} has been "
                                  f"{self.outside_text()} for {len(self.outside)} logged rows (since step "
                                  f"{self.outside[0]})" + (f": {hint}" if hint else "") + f" ({DOCS})")
        else:
            if self.warned:
                note = Note(False, f"step {step}: {self.name} {self.format(value)} is back {self.inside_text()} "
                                   f"(outside from step {self.outside[0]} to step {self.outside[-1]})")
            self.outside, self.warned = [], False
        return int(self.warned), note


@dataclasses.dataclass(frozen=True)
class Note:
    """What a watch says about a row: a warning (it left its range), or that it is back."""

    warning: bool
    text: str

    def say(self) -> None:
        if self.warning:
            console.warn(self.text)
        else:
            log.info(self.text)


class Monitor:
    """The run's watches (`monitor.*`); `observe(step, row)` gives the row's markers and notes."""

    def __init__(self, watches: list[Watch]):
        self.watches = watches

    @classmethod
    def from_config(cls, cfg, accelerator: bool) -> Monitor:
        """The watches `cfg.monitor` turns on; MFU's only on an `accelerator` (a CPU's peak is a
        measured matmul, and its MFU says little about the run)."""
        m = cfg.monitor
        if not m.enabled:
            return cls([])
        warmup, patience = cfg.optim.warmup_steps, m.patience
        watches = [
            Watch("grad_norm", m.grad_norm_low, m.grad_norm_high, patience, after_step=warmup, applied_only=True,
                  above="growing gradients often come before a loss spike (a lower optim.lr, a longer warmup, "
                        "the data at these steps)",
                  below="small gradients: the model learns little per step (converged, or optim.lr too low)"),
            Watch("update_ratio", m.update_ratio_low, m.update_ratio_high, patience, after_step=warmup,
                  applied_only=True, above="the weights move fast for their size: optim.lr may be too high",
                  below="the weights barely move: optim.lr may be too low (expected where the schedule "
                        "takes the lr towards 0)"),
            Watch("memory_peak_fraction", 0.0, m.memory_high, patience, percent=True,
                  above="close to running out of memory (model.remat, model.logits_chunk_size, "
                        "optim.grad_accum_steps)"),
        ]
        if accelerator:
            watches.append(Watch("mfu", m.mfu_low, 0.0, patience, percent=True,
                                 below="the devices are underused (docs/performance.md: the profile, "
                                       "the batch per device, remat)"))
        return cls([w for w in watches if w.low > 0 or w.high > 0])

    def observe(self, step: int, row: dict) -> tuple[dict[str, int], list[Note]]:
        """({marker: 0 or 1} of each watch whose quantity the row carries, the notes to say after
        the row's console line)."""
        markers, notes = {}, []
        for watch in self.watches:
            value, note = watch.observe(step, row)
            if value is not None:
                markers[marker(watch.name)] = value
            if note is not None:
                notes.append(note)
        return markers, notes
