"""The training loop's owners, alone: the fault tracker with the loop's decision (plain values, no
orbax, no device), NaN injection as a step wrapper, and the step logger (one step late, throughput
clock). The decision alone, over all its inputs: tests/test_decision.py."""

import dataclasses
import math

import jax
import numpy as np
import pytest

from maxlm import config as config_lib
from maxlm.observe import step_logger
from maxlm.resilience import faults
from maxlm.train import decision


def tracker(clock=None, clock_every=1, broadcast=None, **overrides):
    cfg = config_lib.defaults().checkpoint
    cfg.update(every_steps=10, max_bad_steps=3, max_restores=2, **overrides)
    extra = {k: v for k, v in (("clock", clock), ("broadcast", broadcast)) if v is not None}
    return faults.FaultTracker(cfg, clock_every=clock_every, **extra)


PLAN = decision.Plan(total_steps=40, every_steps=10, max_bad_steps=3)


def at(t: faults.FaultTracker, done: int, bad_streak: int = 0, plan=PLAN, **facts) -> decision.Decision:
    """Step `done`'s decision from the tracker's state, the tracker told of it as the loop tells
    it (a save, a postponed one)."""
    d = decision.decide(plan, decision.Facts(done, owed=t.owed, bad_streak=bad_streak, **facts))
    if d.action is decision.Action.SAVE:
        t.saved(done, d.kind)
    elif d.action is decision.Action.POSTPONE:
        t.postponed(done, d.kind, non_finite=bool(bad_streak))
    return d


def kinds(steps, plan=PLAN, **facts):
    return [decision.save_point(plan, decision.Facts(s, **facts)) for s in steps]


def test_save_points_regular_final_preemption():
    assert kinds((1, 9, 10, 20, 39, 40)) == [None, None, "regular", "regular", None, "final"]
    assert kinds((7, 40), stop=True) == ["preemption", "preemption"]


def test_local_saves_come_between_persistent_ones_and_are_skipped_in_a_streak():
    now = [0.0]
    t = tracker(clock=lambda: now[0], local_dir="/tmp/local", local_every_steps=4)
    local = dataclasses.replace(PLAN, local_every_steps=4)
    assert kinds((4, 8, 10, 12, 20, 40), plan=local) == ["local", "local", "regular", "local", "regular", "final"]
    # in a streak of bad steps a local save is skipped: nothing is owed after it
    assert at(t, 12, bad_streak=1, plan=local).action is decision.Action.CONTINUE and t.owed is None
    now[0] = 100.0
    assert at(t, 16, plan=local) == decision.Decision(decision.Action.SAVE, kind="local")
    assert t.last_save == 0.0  # the minutes count from the last persistent save
    t.saved(20, "regular")
    assert t.last_save == 100.0
    assert kinds((4, 8)) == [None, None]  # no local tier: none


def test_time_based_saves_read_the_clock_at_log_steps_one_period_late():
    """Process 0's clock is read every `clock_every` steps and broadcast; the reading is used a
    period later (no step waits for the collective), and a save discards a reading older than it."""
    now, sent = [0.0], []
    broadcast = lambda flag: sent.append(flag) or flag  # noqa: E731
    t = tracker(clock=lambda: now[0], every_minutes=1.0, clock_every=5, broadcast=broadcast)
    assert [t.exchange_clock(s) for s in (1, 2, 3, 4)] == [False] * 4
    assert sent == []  # not a clock step: nothing read, nothing sent
    now[0] = 61.0
    assert t.exchange_clock(5) is False  # read now (passed), used at the next one
    assert sent == [True]
    assert t.exchange_clock(6) is False
    assert t.exchange_clock(15) is True  # 5's reading
    assert kinds((15,), time_due=True) == ["temporary"]
    t.saved(15, "temporary")
    assert t.exchange_clock(25) is False  # 15's reading was older than the save
    now[0] = 200.0
    assert t.exchange_clock(35) is False  # 25's reading: 0 s since the save
    assert t.exchange_clock(45) is True  # 35's: 139 s since the save at 61 s
    assert sent == [True, True, False, True, True]
    assert tracker(every_minutes=0.0, broadcast=broadcast).exchange_clock(5) is False and len(sent) == 5


def test_a_save_in_a_bad_streak_waits_for_a_good_step(caplog):
    caplog.set_level("INFO", logger="maxlm")
    t = tracker()
    assert at(t, 10, bad_streak=1) == decision.Decision(decision.Action.POSTPONE, kind="regular")
    assert "step 10 was non-finite: its checkpoint waits for a good step" in caplog.text
    assert kinds((11,), owed=t.owed) == ["regular"]  # still owed, as what it was
    assert at(t, 11, bad_streak=2).action is decision.Action.POSTPONE
    assert at(t, 12) == decision.Decision(decision.Action.SAVE, kind="regular")
    assert t.owed is None and kinds((13,), owed=t.owed) == [None]
    # the final step and a preemption save anyway (skipped steps left the state as it was)
    assert at(t, 40, bad_streak=1).kind == "final"
    assert at(t, 17, bad_streak=5, stop=True) == decision.Decision(decision.Action.SAVE, kind="preemption", stop=True)
    # a full streak at a save point restores instead
    assert at(t, 20, bad_streak=3) == decision.Decision(decision.Action.RECOVER, step=20)
    assert at(t, 40, bad_streak=3) == decision.Decision(decision.Action.RECOVER, step=40)


def test_a_save_in_a_loss_spike_waits_unless_forced():
    t = tracker()
    assert at(t, 10, in_spike=True).action is decision.Action.POSTPONE
    assert kinds((11,), owed=t.owed) == ["regular"]
    assert at(t, 11).kind == "regular"
    assert at(t, 40, in_spike=True) == decision.Decision(decision.Action.SAVE, kind="final")
    t.restarted()  # a rollback: nothing stays owed
    assert at(t, 13, in_spike=True, time_due=True) == decision.Decision(decision.Action.POSTPONE, kind="temporary")
    t.restarted()
    assert kinds((14,), owed=t.owed) == [None]


def test_streak_is_read_one_step_late():
    p = tracker()
    verdicts = [p.streak_ended({"bad_streak": np.int32(s)}) for s in (0, 3, 0, 1)]
    assert verdicts == [False, False, True, False]  # step 2's streak, seen after step 3's dispatch

def test_restores_count_until_past_the_failure_then_stop():
    p = tracker()
    assert p.recovering(bad_step=14, newest=10) == 1
    assert p.recovering(bad_step=14, newest=10) == 2
    p.saved(12)  # a save before the failing step: not past it
    with pytest.raises(faults.NonFiniteLossError, match=r"up to step 14, still after 2 restore\(s\).*"
                       r"max_restores=2.*Newest checkpoint: step 10"):
        p.recovering(bad_step=14, newest=10)

def test_getting_past_the_failure_resets_the_restores():
    p = tracker()
    p.recovering(bad_step=14, newest=10)
    p.recovering(bad_step=14, newest=10)
    p.saved(20)  # saved after step 14: the fault is behind us
    assert p.restores == 0
    assert p.recovering(bad_step=33, newest=30) == 1

def test_nan_injection_runs_the_injecting_step_only_where_asked_and_replays_transient_steps_clean():
    debug = config_lib.defaults().debug
    debug.update(nan_at_step=3, nan_steps=2, nan_transient=True)
    calls = []
    clean = lambda state, batch, lr_scale: calls.append((int(state["step"]), "clean"))  # noqa: E731
    injecting = lambda state, batch, lr_scale, inject: calls.append((int(state["step"]), bool(inject)))  # noqa: E731
    injected = set()
    first = faults.with_nan_injection(clean, injecting, debug, injected)
    for s in range(6):
        first({"step": np.int32(s)}, None, 1.0)
    assert calls == [(0, "clean"), (1, "clean"), (2, "clean"), (3, True), (4, True), (5, "clean")]
    calls.clear()
    for s in range(2, 6):  # after a restore to step 2
        first({"step": np.int32(s)}, None, 1.0)
    assert calls == [(s, "clean") for s in range(2, 6)]
    debug.nan_transient = False
    calls.clear()
    persistent = faults.with_nan_injection(clean, injecting, debug, set())
    for s in (3, 3, 5):
        persistent({"step": np.int32(s)}, None, 1.0)
    assert calls == [(3, True), (3, True), (5, "clean")]

class Recorder:
    def __init__(self):
        self.rows = []
    def write(self, step, row):
        self.rows.append((step, dict(row)))

@pytest.fixture
def clock(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(step_logger.time, "perf_counter", lambda: now[0])
    return now

def make_logger(writer, **overrides):
    kwargs = dict(start_step=0, total_steps=6, log_every=2, tokens_per_step=1000,
                  flops_per_token=10.0, peak_flops_per_sec=1e6)
    return step_logger.StepLogger(writer, **{**kwargs, **overrides})

def metrics_of(step):
    return {"loss": np.float32(5.0 - step), "num_tokens": np.float32(1000), "bad_streak": np.int32(0)}

def test_rows_are_read_one_step_late_and_timed_between_read_backs(clock):
    writer = Recorder()
    logger = make_logger(writer)
    step_fn = lambda x: x  # noqa: E731
    logger.call(step_fn, None)  # the first call "compiles"
    for done in range(1, 7):
        clock[0] += 0.5 if done > 1 else 7.0  # the first step includes the compile
        logger.step_done(done, metrics_of(done))
        written = [step for step, _ in writer.rows]
        assert written == [s for s in (2, 4, 6) if s < done]  # a log step appears a step later
    logger.flush()
    steps = [step for step, _ in writer.rows]
    assert steps == [2, 4, 6]
    first, second = writer.rows[0][1], writer.rows[1][1]
    assert "num_tokens" not in first and first["loss"] == 3.0
    assert "compile_sec" in first and "compile_sec" not in second
    # step 1 (7 s with the compile) is outside the clock, which restarted after it: step 2's row,
    # read back after step 3's dispatch, covers 1 s for 1 step
    assert first["tokens_per_sec"] == pytest.approx(1000 / 1.0)
    assert second["tokens_per_sec"] == pytest.approx(2 * 1000 / 1.0)
    assert second["mfu"] == pytest.approx(2000 * 10.0 / 1e6)
    assert logger.first_loss == 4.0 and logger.last_row["step"] == 6

def test_eval_and_restarts_stay_out_of_the_throughput(clock):
    writer = Recorder()
    logger = make_logger(writer, log_every=1)
    logger.call(lambda: None)
    clock[0] += 5.0
    logger.step_done(1, metrics_of(1))  # compile step; logged, its row read at the next step
    clock[0] += 1.0
    logger.step_done(2, metrics_of(2))
    clock[0] += 1.0
    logger.flush()
    clock[0] += 30.0  # an eval
    logger.eval_done(2, {"eval_loss": 2.5, "eval_perplexity": math.exp(2.5)})
    clock[0] += 2.0
    logger.step_done(3, metrics_of(3))
    logger.flush()
    rows = dict((step, row) for step, row in writer.rows if "loss" in row)
    assert rows[3]["tokens_per_sec"] == pytest.approx(1000 / 2.0)
    assert [step for step, row in writer.rows if "eval_loss" in row] == [2]
    logger.restart(1)  # a restore to step 1: nothing pending, the next step is a first again
    clock[0] += 9.0
    logger.step_done(2, metrics_of(2))
    assert logger.first_loss == 4.0  # still this process's first step's
    clock[0] += 1.0
    logger.step_done(3, metrics_of(3))
    assert writer.rows[-1][0] == 2

def test_the_devices_of_each_process_are_grouped_by_process_not_by_position(monkeypatch):
    """`jax.devices()` may interleave processes (as some topologies order them): each row of the
    broadcast's mesh must hold one process's own devices."""
    from types import SimpleNamespace

    devices = [SimpleNamespace(id=i, process_index=i % 2) for i in range(8)]  # interleaved
    monkeypatch.setattr(jax, "devices", lambda: devices)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "local_device_count", lambda: 4)
    monkeypatch.setattr(jax, "local_devices", lambda process_index: [d for d in devices if d.process_index == process_index])
    rows = faults.devices_by_process()
    assert [[d.process_index for d in row] for row in rows] == [[0, 0, 0, 0], [1, 1, 1, 1]]


def test_xla_flag_reads_the_value_xla_takes(monkeypatch):
    """The last setting on the line wins, as in XLA; a bare flag means true."""
    from maxlm.train.loop import xla_flag
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_deterministic_ops=true --xla_a=1 --xla_gpu_deterministic_ops=false --xla_b")
    assert xla_flag("xla_gpu_deterministic_ops") == "false"
    assert xla_flag("xla_b") == "true" and xla_flag("xla_a") == "1" and xla_flag("xla_c") is None
    monkeypatch.delenv("XLA_FLAGS")
    assert xla_flag("xla_gpu_deterministic_ops") is None
