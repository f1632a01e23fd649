"""Where a run's wall time goes: goodput (steps trained for the first time) and badput by cause.

A `Stopwatch` tiles time: at any moment the run is in exactly one category, and `switch` gives the
time since the last switch to the category that was current, so the categories' seconds always
sum to the wall time watched. `Goodput` adds the step accounting (a step at or below the highest
step any attempt of the workdir dispatched is redone: `lost`, not `productive`) and keeps the totals
over all attempts in `DIR/goodput.json` (process 0 only). docs/checkpoints.md#goodput says what
each category holds and what is not seen.
"""

from __future__ import annotations

import contextlib
import json
import os
import time

from maxlm.runtime import console, paths

# the metric keys: `goodput` is productive's share of the wall time, `badput/<category>` the others'
CATEGORIES = ("productive", "compile", "checkpoint", "data", "eval", "restore", "lost", "startup")
BADPUT = tuple(c for c in CATEGORIES if c != "productive")
FILE = "goodput.json"


def process_age() -> float | None:
    """Seconds since this process started (Linux: /proc/self/stat's start time against
    /proc/uptime, both since boot, to 1/100 s); None where /proc does not say."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rpartition(")")[2].split()  # after the command name, which may hold spaces
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        age = uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime, in clock ticks
    except (OSError, ValueError, IndexError):
        return None
    return age if age >= 0 else None


class Stopwatch:
    """Tiles time into `CATEGORIES`, starting in `category` at `start` (a `clock()` reading;
    default now). `since_process_start()` starts at the process's start, in `startup`."""

    def __init__(self, category: str = "startup", *, clock=time.monotonic, start: float | None = None):
        self.clock = clock
        self.seconds = dict.fromkeys(CATEGORIES, 0.0)  # closed intervals, by category
        self.current = category
        self._since = clock() if start is None else start

    @classmethod
    def since_process_start(cls) -> Stopwatch:
        now, age = time.monotonic(), process_age()
        return cls("startup", start=now - age if age is not None else now)

    def switch(self, category: str) -> str:
        """From now on the run is in `category`; returns the category it was in."""
        if category not in self.seconds:
            raise ValueError(f"unknown goodput category {category!r} (one of {', '.join(CATEGORIES)})")
        now = self.clock()
        self.seconds[self.current] += now - self._since
        self._since = now
        previous, self.current = self.current, category
        return previous

    @contextlib.contextmanager
    def phase(self, category: str):
        """`with stopwatch.phase("eval"):` the block is `category`'s; then back to the category before."""
        previous = self.switch(category)
        try:
            yield
        finally:
            self.switch(previous)

    def timed(self, category: str, fn):
        """`fn`, its calls in `category` (as `phase`)."""
        def timed_fn(*args, **kwargs):
            with self.phase(category):
                return fn(*args, **kwargs)
        return timed_fn

    def elapsed(self) -> dict[str, float]:
        """Seconds by category up to now, the current category's open interval included."""
        out = dict(self.seconds)
        out[self.current] += self.clock() - self._since
        return out


class TimedCheckpointer:
    """A checkpoint.Checkpointer whose blocking calls are timed, wherever the loop makes them:
    `save`, `wait` and `close` as `checkpoint` (an async save: only what blocks the loop);
    `restore_latest`, and `discard_after` (a rollback's removal of newer checkpoints), as
    `restore`. Every other attribute is the Checkpointer's own."""

    TIMED = {"save": "checkpoint", "wait": "checkpoint", "close": "checkpoint", "restore_latest": "restore",
             "discard_after": "restore"}

    def __init__(self, checkpointer, stopwatch: Stopwatch):
        self.checkpointer, self.stopwatch = checkpointer, stopwatch

    def __getattr__(self, name):
        attr = getattr(self.checkpointer, name)
        return self.stopwatch.timed(self.TIMED[name], attr) if name in self.TIMED else attr


def read(workdir) -> dict | None:
    """The workdir's goodput.json ({"attempts", "max_step", "lost_steps", "seconds": {category:
    s}}), None when there is none; one that does not parse is reported and read as none."""
    path = paths.workdir_path(workdir) / FILE
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text())
        return {"attempts": int(record["attempts"]), "max_step": int(record["max_step"]),
                "lost_steps": int(record["lost_steps"]),
                "seconds": {c: float(record["seconds"].get(c, 0.0)) for c in CATEGORIES}}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        console.warn(f"{path} does not parse ({e}): goodput is counted from this attempt on")
        return None


def fractions(seconds: dict[str, float]) -> dict[str, float]:
    """Each category's share of the wall time (their sum); {} before any time has passed."""
    wall = sum(seconds.values())
    return {c: seconds[c] / wall for c in CATEGORIES} if wall > 0 else {}


def summary_line(record: dict) -> str:
    """`goodput 87.3% of 12m05s over 2 attempts (compile 5.1%, ..., startup 1.0%; 10 steps redone)`."""
    shares, wall = fractions(record["seconds"]), sum(record["seconds"].values())
    if not shares:
        return "goodput: no time recorded"
    attempts = record["attempts"]
    lost = record["lost_steps"]
    redone = f"; {lost} step{'s' if lost != 1 else ''} redone" if lost else ""
    return (f"goodput {shares['productive']:.1%} of {format_seconds(wall)} over {attempts} "
            f"attempt{'s' if attempts != 1 else ''} ("
            + ", ".join(f"{c} {shares[c]:.1%}" for c in BADPUT) + f"{redone})")


def format_seconds(seconds: float) -> str:
    """4.2s, 12m05s, 3h02m."""
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{seconds:.1f}s"


class Goodput:
    """One attempt's goodput accounting on `stopwatch`, on top of the workdir's earlier attempts
    (goodput.json, read and written by the `primary` process only: written at once, so the
    attempt is on record before its first log step)."""

    def __init__(self, stopwatch: Stopwatch, workdir, primary: bool):
        self.stopwatch, self.primary = stopwatch, primary
        self.path = paths.workdir_path(workdir) / FILE
        self.remote = paths.is_remote(workdir)
        earlier = read(workdir) if primary else None
        earlier = earlier or {"attempts": 0, "max_step": 0, "lost_steps": 0, "seconds": dict.fromkeys(CATEGORIES, 0.0)}
        self.earlier_seconds, self.attempts = earlier["seconds"], earlier["attempts"] + 1
        self.max_step, self.lost_steps = earlier["max_step"], earlier["lost_steps"]
        self._written_at = float("-inf")
        self._write_failed = False
        self.write()

    def timed(self, category: str, fn):
        return self.stopwatch.timed(category, fn)

    def step_category(self, step: int) -> str:
        """Counts the step that makes `step` steps, about to be dispatched: `lost` when some
        attempt had dispatched it already (redone), else `productive`."""
        if step <= self.max_step:
            self.lost_steps += 1
            return "lost"
        self.max_step = step
        return "productive"

    @contextlib.contextmanager
    def step(self, step: int, compiling: bool):
        """`with gp.step(n, compiling):` the call of the train step that makes `n` steps, in `compile`
        when the call compiles it, else in the step's category (`step_category`); afterwards in the
        step's category: the device runs it asynchronously, and the host's waits for it (the
        metrics read back a step late, before an eval or a save) are its time, until the next
        switch."""
        category = self.step_category(step)
        self.stopwatch.switch("compile" if compiling else category)
        try:
            yield
        finally:
            self.stopwatch.switch(category)

    def seconds(self) -> dict[str, float]:
        """Seconds by category over all attempts, up to now."""
        now = self.stopwatch.elapsed()
        return {c: self.earlier_seconds[c] + now[c] for c in CATEGORIES}

    def record(self) -> dict:
        """goodput.json's content now."""
        return {"attempts": self.attempts, "max_step": self.max_step, "lost_steps": self.lost_steps,
                "seconds": self.seconds()}

    def counters(self) -> dict[str, float]:
        """The training row's values (`goodput`, `badput/<category>`, `lost_steps`), written to
        goodput.json as they are taken (process 0), so the file and the row agree."""
        record = self.record()
        self.write(record)
        shares = fractions(record["seconds"])
        if not shares:
            return {"lost_steps": self.lost_steps}
        return {"goodput": shares["productive"], **{f"badput/{c}": shares[c] for c in BADPUT},
                "lost_steps": self.lost_steps}

    def write(self, record: dict | None = None, force: bool = False) -> None:
        """goodput.json (process 0): locally through a temporary file and a rename, so a kill
        leaves the old file or the new one; an object store's object at most every
        paths.REMOTE_FLUSH_SECONDS unless `force` (Cloud Storage takes about one write a second
        to one object). A failure warns once: the file is a report, never a reason to stop."""
        if not self.primary:
            return
        if self.remote and not force and time.monotonic() - self._written_at < paths.REMOTE_FLUSH_SECONDS:
            return
        text = json.dumps(record or self.record(), indent=1) + "\n"
        try:
            if self.remote:
                self.path.write_text(text)
            else:
                tmp = f"{self.path}.tmp"
                with open(tmp, "w") as f:
                    f.write(text)
                os.replace(tmp, self.path)
            self._written_at = time.monotonic()
        except Exception as e:  # any storage error: the run goes on
            if not self._write_failed:
                console.warn(f"could not write {self.path} ({e}); training goes on without it")
            self._write_failed = True

    def close(self) -> None:
        """The attempt ends: its totals up to now written."""
        self.write(force=True)
