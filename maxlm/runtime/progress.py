"""Progress lines for long work that is not a training step (prepare, tokenizer training, harness
evaluation): units done / total, documents, tokens, tokens/s, elapsed and ETA, every
`MAXLM_PROGRESS_SECONDS` (default 10; 0 = off), on stderr, from process 0 only.

    maxlm: prepare python_stdlib[train]: 12/40 units (30%), 1,234 documents, 5.6M tokens, 1.2M tokens/s, elapsed 1m02s, ETA 2m25s

A terminal gets one line rewritten in place; a log file (anything not a TTY) gets plain lines.
The period is a display setting, not a run setting, so it is an environment variable: it never
reaches the config or its fingerprint. stdout stays the commands' own (their JSON).
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import threading
import time
from collections.abc import Callable

from maxlm.runtime import processes

ENV = "MAXLM_PROGRESS_SECONDS"
DEFAULT_SECONDS = 10.0
# A poller never polls more often than this (a tiny period would spin) nor less often (a line
# would come late).
POLL_FLOOR_SECONDS, POLL_CEILING_SECONDS = 0.1, 1.0
_CLEAR_TO_END = "\x1b[K"


def period_seconds() -> float:
    """Seconds between progress lines: `MAXLM_PROGRESS_SECONDS` (default 10); 0 when off, which a
    value <= 0 asks for and every process but process 0 of a job is (one line per job, not per host)."""
    try:
        seconds = float(os.environ.get(ENV, DEFAULT_SECONDS))
    except ValueError:  # a display setting: a typo must not stop the work it watches
        seconds = DEFAULT_SECONDS
    return seconds if seconds > 0 and math.isfinite(seconds) and processes.process_index() == 0 else 0.0


def format_duration(seconds: float) -> str:
    """A duration, to the minute past an hour: 45s, 12m05s, 1h02m, 30h00m."""
    seconds = max(int(round(seconds)), 0)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


def format_count(n: float) -> str:
    """A large count in short: 950, 1.2K, 5.6M, 3.0B, 175.0T (the corpus sizes' units)."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= scale:
            return f"{n / scale:.1f}{suffix}"
    return f"{n:.0f}"


class Progress:
    """Counts of one piece of work, printed every `every_s` seconds (default `period_seconds()`;
    0: never) to `stream` (default stderr) when `update` is called; thread-safe, so a poller
    thread may call it (`polling`). `total`: units of the whole work (None: unknown, no ETA).

    `close` (or leaving its `with`) prints a last line, ending in `done` (`stopped` after a
    failure), if the work printed a line or took longer than one period; quick work stays quiet."""

    def __init__(self, what: str, total: int | None, unit: str = "units", *, every_s: float | None = None,
                 stream=None):
        self.what, self.total, self.unit = what, total, unit
        self.every_s = period_seconds() if every_s is None else max(every_s, 0.0)
        self.stream = stream if stream is not None else sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        self._tty = bool(isatty and isatty())
        self._lock = threading.Lock()  # counts and the line printed together, from any thread
        self._start = self._last_line = time.monotonic()
        self._printed = self._closed = False
        self.done: float = 0
        self.documents: int | None = None
        self.tokens: int | None = None

    @property
    def enabled(self) -> bool:
        return self.every_s > 0

    def update(self, done: float | None = None, *, advance: float = 0, documents: int | None = None,
               tokens: int | None = None) -> None:
        """Set (done=, documents=, tokens= are running totals) or advance the counts; prints when
        every_s has passed since the last line."""
        self._count(done, advance, documents, tokens)
        with self._lock:
            now = time.monotonic()
            if self.enabled and not self._closed and now - self._last_line >= self.every_s:
                self._print(self.line(now - self._start), final=False)
                self._last_line = now

    def _count(self, done: float | None = None, advance: float = 0, documents: int | None = None,
               tokens: int | None = None) -> None:
        """`update`'s counting, without a line."""
        with self._lock:
            if done is not None:
                self.done = done
            self.done += advance
            if documents is not None:
                self.documents = documents
            if tokens is not None:
                self.tokens = tokens

    def line(self, elapsed: float, end: str | None = None) -> str:
        """The line of the counts as they stand after `elapsed` seconds; `end` ("done", "stopped")
        ends a last line in place of the ETA."""
        parts = []
        if self.total is not None:
            share = self.done / self.total if self.total else 1.0
            parts.append(f"{math.floor(self.done):,}/{self.total:,} {self.unit} ({math.floor(share * 100)}%)")  # 100% once done
        elif self.done:
            parts.append(f"{math.floor(self.done):,} {self.unit}")
        if self.documents is not None:
            parts.append(f"{self.documents:,} documents")
        if self.tokens is not None:
            parts.append(f"{format_count(self.tokens)} tokens")
            if elapsed > 0:
                parts.append(f"{format_count(self.tokens / elapsed)} tokens/s")
        parts.append(f"elapsed {format_duration(elapsed)}")
        if end:
            parts.append(end)
        elif self.total is not None and 0 < self.done < self.total:
            parts.append(f"ETA {format_duration(elapsed * (self.total - self.done) / self.done)}")
        return f"maxlm: {self.what}: {', '.join(parts)}"

    def _print(self, line: str, final: bool) -> None:
        if self._tty:  # one line, rewritten in place; a newline when the work ends
            self.stream.write(f"\r{line}{_CLEAR_TO_END}" + ("\n" if final else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
        self._printed = True

    def close(self, finished: bool = True) -> None:
        """Ends the line: a last one, `done` (`stopped` when not `finished`), if any was printed or
        the work took longer than one period."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            elapsed = time.monotonic() - self._start
            if self.enabled and (self._printed or elapsed >= self.every_s):
                self._print(self.line(elapsed, "done" if finished else "stopped"), final=True)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, kind, value, traceback) -> None:
        self.close(finished=kind is None)  # a failure's last line says how far it got


@contextlib.contextmanager
def polling(progress: Progress, poll: Callable[[], dict] | None = None):
    """While the block runs, a thread calls `progress.update(**poll())` about every second (at most
    every period): counts kept by work that cannot call `update` itself (other processes' files, a
    loop inside a library). `poll=None` is a heartbeat: the elapsed time of opaque work. A last
    poll when the block succeeds gives `close` the final counts. A slow poll (remote storage) is
    spaced out: never more than half the time goes to polling."""
    if not progress.enabled:
        yield progress
        return
    base = min(max(progress.every_s, POLL_FLOOR_SECONDS), POLL_CEILING_SECONDS)
    stop = threading.Event()

    def poll_once() -> float:
        start = time.monotonic()
        progress.update(**(poll() if poll else {}))
        return time.monotonic() - start

    def last_poll() -> None:  # counts only: `close` prints them, once
        if poll:
            progress._count(**poll())

    def run() -> None:
        wait = base
        while not stop.wait(wait):
            wait = max(base, 2 * poll_once())

    thread = threading.Thread(target=run, name=f"progress: {progress.what}", daemon=True)
    thread.start()
    try:
        yield progress
    finally:
        stop.set()
        thread.join()
    last_poll()
