"""What each training step reports: metrics rows read one step late, throughput, ETA, console.

The loop hands every step's device metrics to `StepLogger.step_done` right after dispatching
that step. A log step's row is read back (`float()`, which waits for the step) only after the
next step has been dispatched, so logging never stalls the device: the device already has work
queued while the host writes. Throughput is measured between such read-backs; compilation, eval,
checkpointing and trace writing are kept out of it (`restart_clock`).
"""

from __future__ import annotations

import logging
import math
import time

import jax

from maxlm.observe import flops, metrics, router_metrics
from maxlm.observe.monitor import Monitor
from maxlm.runtime.progress import format_duration as format_eta  # one duration format for every ETA line

log = logging.getLogger("maxlm")

# (metrics key, console label, format), in console order
CONSOLE = (("loss", "loss", "{:.4f}"), ("eval_loss", "eval_loss", "{:.4f}"),
           ("eval_perplexity", "eval_ppl", "{:.2f}"), ("lr", "lr", "{:.2e}"),
           ("grad_norm", "grad_norm", "{:.3f}"), ("loss_scale", "loss_scale", "{:g}"),
           ("tokens_per_sec", "tokens/s", "{:,.0f}"), ("mfu", "mfu", "{:.1%}"))


def format_line(step: int, row: dict, eta_sec: float | None = None) -> str:
    """One console line: `step 100 | loss 2.3456 | ... | tokens/s 41,000 | mfu 16.5% | eta 1h02m`."""
    parts = [f"step {step:>6}"]
    parts += [f"{label} " + fmt.format(row[key]) for key, label, fmt in CONSOLE if key in row]
    by_position = [f"{value:.3f}" for key, value in row.items() if key.startswith(metrics.LOSS_BY_POSITION + "/")]
    parts += [f"{key} {value:.4g}" for key, value in row.items()  # sets, tasks
              if key.startswith("eval/") and not key.startswith(metrics.LOSS_BY_POSITION + "/")]
    if by_position:  # one field: the buckets' losses in position order
        parts.append("loss_by_position " + " ".join(by_position))
    if eta_sec is not None:
        parts.append(f"eta {format_eta(eta_sec)}")
    return " | ".join(parts)


PF_DAY = 1e15 * 86400  # FLOPs: a petaFLOP/s for a day, the unit of the scaling-law papers


def budget_line(cfg, flops_per_token: float) -> str:
    """What the run is in the guides' units, for its start-up log: tokens per batch, total tokens
    (steps x tokens per batch, padding included), total training FLOPs (flops_per_token x total
    tokens; the convention of maxlm/observe/flops.py) and PF-days."""
    batch_tokens = cfg.batch_size * cfg.seq_len
    tokens = cfg.steps * batch_tokens
    total = flops_per_token * tokens
    return (f"budget: {batch_tokens:,} tokens per batch ({cfg.batch_size} x {cfg.seq_len}), {tokens:,} tokens in "
            f"{cfg.steps:,} steps, {total:.3g} training FLOPs = {total / PF_DAY:.3g} PF-days")


def device_memory(device=None) -> dict[str, float]:
    """`memory_bytes_in_use` and `memory_peak_bytes_in_use` of one local device (default the
    first), as its platform reports them, and `memory_peak_fraction`, the peak over the memory
    the platform lets JAX use (`bytes_limit`); {} where it reports nothing (CPU)."""
    device = device if device is not None else jax.local_devices()[0]
    try:
        stats = device.memory_stats()
    except Exception:  # some backends raise instead of returning None
        stats = None
    out = {}
    for key in ("bytes_in_use", "peak_bytes_in_use"):
        if stats and key in stats:
            out[f"memory_{key}"] = int(stats[key])
    if stats and stats.get("bytes_limit") and "peak_bytes_in_use" in stats:
        out["memory_peak_fraction"] = stats["peak_bytes_in_use"] / stats["bytes_limit"]
    return out


class StepLogger:
    """Training rows for `writer` (a metrics.MetricWriter) and the console, one step late.

    `tokens_per_step`, `flops_per_token` and `peak_flops_per_sec` (total) give tokens/s and MFU;
    `total_steps` the ETA; rows are kept every `log_every` steps and at the last step.
    `counters()`: host-side values added to each row, taken when its step is dispatched.
    `monitor`: the guides' ranges (maxlm/observe/monitor.py), watched on each row once read back.
    """

    def __init__(self, writer, *, start_step: int, total_steps: int, log_every: int,
                 tokens_per_step: int, flops_per_token: float, peak_flops_per_sec: float,
                 counters=dict, monitor: Monitor | None = None):
        self.writer, self.total_steps, self.log_every = writer, total_steps, log_every
        self.tokens_per_step, self.flops_per_token = tokens_per_step, flops_per_token
        self.peak = peak_flops_per_sec
        self.first_loss = math.nan  # the loss of this process's first step
        self.last_row: dict = {}  # the last training row written, with "step" and "first_loss"
        self._pending = None  # (step, device metrics) of a log step not yet read back
        self._extra: dict = {}  # added to the next training row written (compile_sec)
        self._compiled: set = set()  # step functions already called once
        self.counters = counters  # host-side counts added to each row (maxlm/resilience/anomaly.py's)
        self.monitor = monitor or Monitor([])
        self.restart(start_step)

    def restart(self, step: int) -> None:
        """The run (re)starts at `step` (a restore): nothing pending, its next step is a first."""
        self._pending, self._fresh = None, True
        self._clipped: list = []  # each step's `clipped` flag (a device scalar) since the last row
        self.restart_clock(step)

    def restart_clock(self, finished_step: int) -> None:
        """Time from now on is training time again (after compiling, eval, a save, a trace)."""
        self._clock = (time.perf_counter(), finished_step)

    def compiles(self, step_fn) -> bool:
        """Whether `call(step_fn, ...)` traces and compiles it: its first call."""
        return step_fn not in self._compiled

    def call(self, step_fn, *args):
        """`step_fn(*args)`; its first call traces and compiles, and is timed (`compile_sec`)."""
        if step_fn in self._compiled:
            return step_fn(*args)
        start = time.perf_counter()
        out = step_fn(*args)
        self._compiled.add(step_fn)
        self._extra["compile_sec"] = time.perf_counter() - start
        log.info("compiled the train step in %.1f s", self._extra["compile_sec"])
        return out

    def step_done(self, done: int, step_metrics: dict) -> None:
        """After dispatching the step that made `done` steps: writes the previous log step's row
        (finished by now, or soon) and keeps this step's metrics if `done` is a log step."""
        self.flush()
        if "clipped" in step_metrics:  # kept on the device: summed when the row is read back
            self._clipped.append(step_metrics["clipped"])
        if self._fresh:  # its call compiled: keep it out of the throughput
            self._fresh = False
            if math.isnan(self.first_loss):
                self.first_loss = float(step_metrics["loss"])  # waits for the step
            if done % self.log_every:
                self.restart_clock(done)
        if done % self.log_every == 0 or done == self.total_steps:
            self._pending = (done, step_metrics, self.counters(), self._clipped)
            self._clipped = []

    def flush(self) -> None:
        """Reads back and writes the pending log step's row, if any."""
        if self._pending is None:
            return
        step, device_metrics, counters, clipped = self._pending
        self._pending = None
        # waits for the step; the earlier steps' clipping flags are done by then
        got, clipped = jax.device_get((device_metrics, clipped))
        row = {k: float(v) for k, v in got.items()}
        now = time.perf_counter()
        started, clock_step = self._clock
        steps_timed = max(step - clock_step, 1)  # 0 only when the compile step is logged
        tokens_per_sec = self.tokens_per_step * steps_timed / (now - started)
        self._clock = (now, step)
        row.update(
            tokens_per_sec=tokens_per_sec,
            step_time_sec=self.tokens_per_step / tokens_per_sec,
            mfu=flops.mfu(tokens_per_sec, self.flops_per_token, self.peak),
            **device_memory(),  # nothing where the platform reports nothing (CPU)
            **self._extra,
            **counters,
        )
        self._extra.clear()
        del row["num_tokens"]
        if "clipped" in row:  # the share of the steps since the last row whose gradient was clipped
            del row["clipped"]
            row["clipped_fraction"] = sum(float(c) for c in clipped) / max(len(clipped), 1)
        markers, notes = self.monitor.observe(step, row)
        row.update(markers)
        self.writer.write(step, row)
        log.info(format_line(step, row, eta_sec=row["step_time_sec"] * (self.total_steps - step)))
        if moe_line := router_metrics.console_line(step, row):  # an MoE model's worst layers
            log.info(moe_line)
        for note in notes:  # a watched range left or come back to
            note.say()
        self.last_row = dict(row, step=step, first_loss=self.first_loss)

    def eval_done(self, step: int, row: dict) -> None:
        """Writes an eval row; eval time is not training time. (Call `flush` before evaluating,
        so the pending training row is timed and written first.)"""
        self.writer.write(step, row)
        log.info(format_line(step, row))
        self.restart_clock(step)
