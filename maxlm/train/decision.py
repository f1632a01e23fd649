"""What the training loop does after a step: one `Decision`, a pure function of the step's `Facts`.

Each iteration of `loop.train_and_evaluate` dispatches a step, gathers its facts (plain values:
no JAX, no I/O here), calls `decide` and carries out the one action it returns:

* CONTINUE: nothing (a local save point that falls in a streak is skipped, not owed: the next
  one comes soon);
* SAVE `kind`: a checkpoint of step `done`; the kinds, first match wins: preemption, final (the
  last step), regular (every `checkpoint.every_steps`), the owed one, temporary (every
  `checkpoint.every_minutes`), local (every `checkpoint.local_every_steps`, with `local_dir`);
* POSTPONE `kind`: the save point fell in a streak of non-finite steps (`bad_streak > 0`) or of
  loss spikes (`in_spike`): the save of `kind` is owed to the next good step, so that every
  checkpoint is one to go back to. A preemption or the final step saves regardless (a skipped
  step leaves the state as the last good step left it);
* RECOVER `step`: a streak of `checkpoint.max_bad_steps` non-finite steps ended with the step
  that completed `step` steps (the step before, read one step late, or step `done` itself at a
  save point): back to the last good checkpoint;
* ROLL_BACK `step`: a streak of `anomaly.max_spikes` loss spikes ended at `step` (`last_spike`,
  anomaly.py's numbering): back to the newest checkpoint from before it, skipping its batches;

and with `stop` (a preemption agreed on this iteration), the run ends after the action: after a
SAVE, of kind preemption; after a RECOVER or ROLL_BACK, at the restored step (saved first unless
it is a checkpoint already). On the run's last step (a good one) a preemption is no stop: the step
saves as the final one and the run ends done.

The multi-host contract: every fact is a value all processes hold alike (the preemption sync
point's answer, the metrics of one global step, process 0's clock reading broadcast, and counters
each process updated alike from such values), and `decide` reads nothing else, so every process
takes the same decision and joins the same collectives (a save's, a restore's) in the same order.
A value one process alone has (its own clock, a signal only it got) must be agreed before it is
a fact: `faults.FaultTracker.exchange_clock`, `faults.PreemptionWatcher.reached`.
"""

from __future__ import annotations

import dataclasses
import enum


class Action(enum.Enum):
    CONTINUE = "continue"
    SAVE = "save"
    POSTPONE = "postpone"
    RECOVER = "recover"
    ROLL_BACK = "roll back"


FORCED = ("preemption", "final")  # saved even in a streak: the state is the last good step's


@dataclasses.dataclass(frozen=True)
class Plan:
    """The run's schedule, from the config: fixed for the run."""

    total_steps: int
    every_steps: int  # regular saves (> 0)
    max_bad_steps: int  # consecutive non-finite steps before a restore (> 0)
    local_every_steps: int = 0  # local-tier saves; 0: no local tier
    eval_every_steps: int = 0  # 0: no periodic eval

    @classmethod
    def of(cls, cfg) -> Plan:
        c = cfg.checkpoint
        return cls(total_steps=cfg.steps, every_steps=c.every_steps, max_bad_steps=c.max_bad_steps,
                   local_every_steps=c.local_every_steps if c.local_dir else 0,
                   eval_every_steps=cfg.eval.every_steps)

    def eval_due(self, done: int) -> bool:
        every = self.eval_every_steps
        return bool(every) and (done % every == 0 or done == self.total_steps)


@dataclasses.dataclass(frozen=True)
class Facts:
    """One iteration's facts, every one of them the same on every process."""

    done: int  # steps completed with the one just dispatched
    stop: bool = False  # a preemption (SIGTERM or Ctrl-C) agreed on this iteration
    streak_ended: bool = False  # step done - 1 ended a streak of max_bad_steps non-finite steps
    # the step whose loss ended a streak of max_spikes loss spikes (read one step late too), as
    # anomaly.Anomalies numbers steps (from 0: done - 2), or None
    last_spike: int | None = None
    in_spike: bool = False  # a loss-spike streak is running: a checkpoint now could hold it
    owed: str | None = None  # the kind of a save postponed earlier ("regular" or "temporary")
    time_due: bool = False  # every_minutes had passed since the last save (process 0's clock)
    # step `done`'s own count of consecutive non-finite steps; reading it waits for the step, so
    # the loop reads it only where `save_point` says one is due (a save waits anyway): None before
    bad_streak: int | None = None


@dataclasses.dataclass(frozen=True)
class Decision:
    """One action for the step, with what carrying it out needs."""

    action: Action
    kind: str | None = None  # SAVE: the checkpoint's kind; POSTPONE: the kind owed from now on
    step: int | None = None  # RECOVER, ROLL_BACK: the streak's last step (see the module's docstring)
    evaluate: bool = False  # run the periodic eval on step `done`'s state first
    stop: bool = False  # end the run (faults.Preempted) once the action is carried out


def save_point(plan: Plan, facts: Facts) -> str | None:
    """The kind of save point step `facts.done` is, or None: none is due, or the step goes back
    instead (a streak ended on the step before). Does not read `facts.bad_streak`."""
    done = facts.done
    if facts.streak_ended or facts.last_spike is not None:
        return None
    if facts.stop:
        return "preemption"
    if done == plan.total_steps:
        return "final"
    if done % plan.every_steps == 0:
        return "regular"
    if facts.owed:
        return facts.owed
    if facts.time_due:
        return "temporary"
    if plan.local_every_steps and done % plan.local_every_steps == 0:
        return "local"
    return None


def decide(plan: Plan, facts: Facts) -> Decision:
    """The one thing to do after step `facts.done` (see the module's docstring). Pure: the same
    facts give the same decision on every process. Raises ValueError when a save point is due
    and `facts.bad_streak` was not read (None)."""
    if facts.streak_ended:
        return Decision(Action.RECOVER, step=facts.done - 1, stop=facts.stop)
    if facts.last_spike is not None:
        return Decision(Action.ROLL_BACK, step=facts.last_spike, stop=facts.stop)
    evaluate = plan.eval_due(facts.done)
    kind = save_point(plan, facts)
    if kind is None:  # `stop` always makes a save point: nothing to stop for here
        return Decision(Action.CONTINUE, evaluate=evaluate)
    if facts.bad_streak is None:
        raise ValueError(f"step {facts.done} is a {kind} save point: its bad_streak must be read")
    streak, stop = facts.bad_streak, facts.stop
    if streak >= plan.max_bad_steps and kind != "preemption":  # the streak ends here: go back
        return Decision(Action.RECOVER, step=facts.done, evaluate=evaluate)
    if (streak or facts.in_spike) and kind not in FORCED:
        if kind == "local":  # skipped, not owed: the next local save comes soon
            return Decision(Action.CONTINUE, evaluate=evaluate)
        # an owed save stays what it was; a regular or temporary one becomes owed as itself
        owed = facts.owed or ("regular" if kind == "regular" else "temporary")
        return Decision(Action.POSTPONE, kind=owed, evaluate=evaluate)
    if stop and facts.done == plan.total_steps and streak < plan.max_bad_steps:
        # the run's last step: the run is done, not preempted (exit 0: a launcher must not requeue it)
        kind, stop = "final", False
    return Decision(Action.SAVE, kind=kind, evaluate=evaluate, stop=stop)
