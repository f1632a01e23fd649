"""The loop's decision after a step (maxlm/train/decision.py), over every combination of its facts:
each invariant the loop relies on is checked on all of them, then a few rows spell the table out."""

import dataclasses
import itertools

import pytest

from maxlm.train import decision
from maxlm.train.decision import Action, Facts, Plan

MAX_BAD = 2
# small domains that reach every branch: plain steps, local and eval multiples, a regular save
# point (10), the last step (20); streaks below, at and above max_bad_steps
PLANS = [Plan(total_steps=20, every_steps=10, max_bad_steps=MAX_BAD, local_every_steps=local,
              eval_every_steps=every) for local in (0, 4) for every in (0, 5)]
DOMAINS = {"done": range(1, 21), "stop": (False, True), "streak_ended": (False, True),
           "last_spike": (None, "done - 2"), "in_spike": (False, True),
           "owed": (None, "regular", "temporary"), "time_due": (False, True),
           "bad_streak": (0, 1, MAX_BAD, MAX_BAD + 1)}
GOING_BACK = (Action.RECOVER, Action.ROLL_BACK)


def every_case():
    """(plan, facts, decision) for every combination, as the loop builds them: the step's own
    streak is read only at a save point."""
    for plan in PLANS:
        for values in itertools.product(*DOMAINS.values()):
            given = dict(zip(DOMAINS, values))
            if given["last_spike"]:  # the step before's, as anomaly.Anomalies numbers steps (from 0)
                given["last_spike"] = given["done"] - 2
            facts = Facts(**given)
            if decision.save_point(plan, facts) is None:
                facts = dataclasses.replace(facts, bad_streak=None)
            yield plan, facts, decision.decide(plan, facts)


CASES = list(every_case())


def violations(check):
    """The cases where `check(plan, facts, decision)` is false, the first few of them."""
    return [(f, d) for plan, f, d in CASES if not check(plan, f, d)][:3]


def ended(f):
    return f.streak_ended or f.last_spike is not None


def full_streak(plan, f):
    return f.bad_streak is not None and f.bad_streak >= plan.max_bad_steps


def test_the_domains_reach_every_action_and_kind():
    assert {d.action for _, _, d in CASES} == set(Action)
    assert {d.kind for _, _, d in CASES if d.action is Action.SAVE} == \
        {"preemption", "final", "regular", "temporary", "local"}
    assert {(d.action, d.stop) for _, _, d in CASES} >= {(a, True) for a in (Action.SAVE, *GOING_BACK)}


def test_exactly_one_action_with_the_fields_it_needs():
    def consistent(plan, f, d):
        return (isinstance(d.action, Action)
                and (d.kind is not None) == (d.action in (Action.SAVE, Action.POSTPONE))
                and (d.step is not None) == (d.action in GOING_BACK))
    assert violations(consistent) == []


def finished(plan, f):
    """The run's last step, a good one: the run is done whatever else happened on it."""
    return f.done == plan.total_steps and not ended(f) and not full_streak(plan, f)


def test_a_preemption_is_never_lost():
    """Agreed on any iteration but a finished run's last, it ends the run after the action: a
    preemption checkpoint of the step, or, when the step goes back, at the restored step (which the
    loop saves unless it is a checkpoint already)."""
    assert violations(lambda plan, f, d: d.stop == (f.stop and not finished(plan, f))) == []
    assert violations(lambda plan, f, d: not f.stop or finished(plan, f) or d.action in GOING_BACK
                      or (d.action is Action.SAVE and d.kind == "preemption")) == []
    # even where the step completes a full non-finite streak: the state is the last good one
    assert violations(lambda plan, f, d: not (f.stop and not ended(f)) or finished(plan, f)
                      or (d.action is Action.SAVE and d.kind == "preemption")) == []


def test_the_final_step_always_saves_unless_it_goes_back():
    """A preemption agreed on it too: the run is done (exit 0), not requeued to do nothing."""
    assert violations(lambda plan, f, d: not finished(plan, f)
                      or (d.action is Action.SAVE and d.kind == "final" and not d.stop)) == []
    assert violations(lambda plan, f, d: f.done != plan.total_steps or ended(f) or not full_streak(plan, f)
                      or d.action is Action.RECOVER or (f.stop and d.kind == "preemption")) == []


def test_nothing_is_saved_in_an_open_streak_but_a_forced_save():
    """A save holds a good step (no non-finite streak, no spike streak running) unless it is a
    preemption or the final step, whose state is the last good step's; never a full streak's
    state but a preemption's."""
    def good(plan, f, d):
        if d.action is not Action.SAVE:
            return True
        if f.bad_streak is None:
            return False
        if full_streak(plan, f) and d.kind != "preemption":
            return False
        return (f.bad_streak == 0 and not f.in_spike) or d.kind in decision.FORCED
    assert violations(good) == []


def test_an_owed_save_is_never_forgotten():
    """While a save is owed, every step is a save point: it saves (the owed kind, or a save point
    of its own, persistent, which settles the debt), postpones it again as what it was, or goes
    back (the checkpoint gone back to is the last save)."""
    def kept(plan, f, d):
        if not f.owed:
            return True
        if d.action is Action.POSTPONE:
            return d.kind == f.owed
        return d.action in GOING_BACK or (d.action is Action.SAVE and d.kind != "local")
    assert violations(kept) == []
    # at the first good step, it is paid
    assert violations(lambda plan, f, d: not (f.owed and not ended(f) and f.bad_streak == 0 and not f.in_spike)
                      or d.action is Action.SAVE) == []


def test_a_save_point_in_a_streak_is_owed_and_a_local_one_skipped():
    def postponed(plan, f, d):
        kind = decision.save_point(plan, f)
        if kind is None or kind in decision.FORCED or full_streak(plan, f) or not (f.bad_streak or f.in_spike):
            return True
        if kind == "local":
            return d.action is Action.CONTINUE
        return d.action is Action.POSTPONE and d.kind == (f.owed or kind)
    assert violations(postponed) == []
    assert violations(lambda plan, f, d: d.action is not Action.POSTPONE or (f.bad_streak or f.in_spike)) == []


def test_a_spike_rollback_comes_before_any_save():
    """The spiking state is never saved on the iteration that rolls back, not even for a
    preemption or the final step: a non-finite streak ending too goes back (restoring) instead."""
    assert violations(lambda plan, f, d: not (f.last_spike is not None and not f.streak_ended)
                      or (d.action is Action.ROLL_BACK and d.step == f.last_spike)) == []
    assert violations(lambda plan, f, d: d.action is not Action.ROLL_BACK or f.last_spike is not None) == []


def test_recover_only_when_a_streak_ended():
    def only(plan, f, d):
        if f.streak_ended:
            return d.action is Action.RECOVER and d.step == f.done - 1
        if d.action is Action.RECOVER:  # the step itself completed the streak, at a save point
            return full_streak(plan, f) and d.step == f.done and not f.stop
        return True
    assert violations(only) == []


def test_eval_runs_on_the_schedule_unless_the_step_goes_back_on_the_one_before():
    assert violations(lambda plan, f, d: d.evaluate == (plan.eval_due(f.done) and not ended(f))) == []


def test_the_steps_own_streak_is_read_only_at_a_save_point():
    """Elsewhere the decision does not depend on it, so the loop never waits for the step (the
    metrics are read back one step late); at a save point, not reading it is an error."""
    for plan, f, d in CASES:
        if f.bad_streak is None:
            for streak in DOMAINS["bad_streak"]:
                assert decision.decide(plan, dataclasses.replace(f, bad_streak=streak)) == d, f
        else:
            with pytest.raises(ValueError, match="bad_streak must be read"):
                decision.decide(plan, dataclasses.replace(f, bad_streak=None))


PLAN = Plan(total_steps=20, every_steps=10, max_bad_steps=MAX_BAD, local_every_steps=4, eval_every_steps=5)


@pytest.mark.parametrize("facts, expected", [
    (Facts(3), decision.Decision(Action.CONTINUE)),
    (Facts(5), decision.Decision(Action.CONTINUE, evaluate=True)),
    (Facts(4, bad_streak=0), decision.Decision(Action.SAVE, kind="local")),
    (Facts(4, bad_streak=1), decision.Decision(Action.CONTINUE)),  # local: skipped, not owed
    (Facts(10, bad_streak=0), decision.Decision(Action.SAVE, kind="regular", evaluate=True)),
    (Facts(10, bad_streak=1), decision.Decision(Action.POSTPONE, kind="regular", evaluate=True)),
    (Facts(11, owed="regular", bad_streak=0), decision.Decision(Action.SAVE, kind="regular")),
    (Facts(13, time_due=True, in_spike=True, bad_streak=0), decision.Decision(Action.POSTPONE, kind="temporary")),
    (Facts(10, owed="temporary", bad_streak=1), decision.Decision(Action.POSTPONE, kind="temporary", evaluate=True)),
    (Facts(10, bad_streak=2), decision.Decision(Action.RECOVER, step=10, evaluate=True)),
    (Facts(20, bad_streak=1), decision.Decision(Action.SAVE, kind="final", evaluate=True)),
    (Facts(20, bad_streak=2), decision.Decision(Action.RECOVER, step=20, evaluate=True)),
    (Facts(7, stop=True, bad_streak=5), decision.Decision(Action.SAVE, kind="preemption", stop=True)),
    (Facts(20, stop=True, bad_streak=0), decision.Decision(Action.SAVE, kind="final", evaluate=True)),
    (Facts(20, stop=True, bad_streak=2), decision.Decision(Action.SAVE, kind="preemption", evaluate=True, stop=True)),
    (Facts(7, stop=True, streak_ended=True), decision.Decision(Action.RECOVER, step=6, stop=True)),
    (Facts(10, stop=True, last_spike=8), decision.Decision(Action.ROLL_BACK, step=8, stop=True)),
    (Facts(20, last_spike=18), decision.Decision(Action.ROLL_BACK, step=18)),
    (Facts(2, last_spike=0), decision.Decision(Action.ROLL_BACK, step=0)),  # step 0 is a step, not None
])
def test_rows_of_the_table(facts, expected):
    assert decision.decide(PLAN, facts) == expected


def test_the_plan_reads_the_config():
    from maxlm import config as config_lib

    cfg = config_lib.defaults()
    cfg.steps, cfg.eval.every_steps = 50, 7
    cfg.checkpoint.update(every_steps=10, max_bad_steps=4, local_every_steps=3)
    assert Plan.of(cfg) == Plan(total_steps=50, every_steps=10, max_bad_steps=4, local_every_steps=0,
                                eval_every_steps=7)  # no local_dir: no local tier
    cfg.checkpoint.local_dir = "/tmp/local"
    assert Plan.of(cfg).local_every_steps == 3
