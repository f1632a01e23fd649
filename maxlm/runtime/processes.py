"""What one process decides for a job of several: process 0 looks once, and every process learns
what it found, so that the processes go on together or raise together.

A process that decides alone (a file its host cannot see, a build that failed there only) stops
while the others wait for it in the job's next collective: a hang on a pod. So:

- `from_process_0(read)` runs `read()` on process 0 only and gives every process its result (the
  bytes of a file, the path of what it built), or its failure: process 0 raises its own exception;
  the others raise a `UserError` with its message when it was a `ValueError` (bad input, which the
  commands end on with exit 2 and one line), else `ProcessFailed` naming it (exit 1, one line:
  process 0's output has the traceback). A `KeyboardInterrupt` or `SystemExit` is not passed on.
- `blind(sees)`: the processes that cannot see something every process checked itself (shared
  storage that is not shared), the same list on every process.

A single-process run does no collective at all, and does not start JAX's runtime to learn that it
is one: the data command runs without it.
"""

from __future__ import annotations

import sys
from typing import Callable

import numpy as np

from maxlm.runtime.errors import UserError

_OK, _BAD_INPUT, _FAILED = 0, 1, 2
_MIN_PAYLOAD = 4096  # bytes; payloads are padded to a power of two, so few shapes compile
_MAX_MESSAGE = 2000  # characters of process 0's error passed on


class ProcessFailed(RuntimeError):
    """Process 0 failed with an error that is not bad input (an OSError, a Beam failure); raised on
    the other processes, with its one line. Process 0 raised the error itself, traceback and all."""


def process_count() -> int:
    """The job's processes; 1 without JAX imported (the data command and the tests use the data
    package without JAX's runtime)."""
    return sys.modules["jax"].process_count() if "jax" in sys.modules else 1


def process_index() -> int:
    return sys.modules["jax"].process_index() if "jax" in sys.modules else 0


def broadcast(array: np.ndarray) -> np.ndarray:
    """Process 0's `array` on every process (the same shape and dtype on each); a collective."""
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.broadcast_one_to_all(array))


def allgather(array: np.ndarray) -> np.ndarray:
    """Every process's `array`, stacked in process order; a collective."""
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(array))


def from_process_0(read: Callable[[], bytes]) -> bytes:
    """`read()`'s bytes, read by process 0 alone and given to every process; its exception raised
    on every process (see the module's docstring). Every process of the job must call this at the
    same point; on a single process it is `read()`."""
    if process_count() == 1:
        return read()
    kind, payload, failure = _OK, b"", None
    if process_index() == 0:
        try:
            payload = read()
        except Exception as e:  # everything but KeyboardInterrupt and SystemExit reaches the others
            failure = e
            kind = _BAD_INPUT if isinstance(e, ValueError) else _FAILED
            message = str(e) if kind == _BAD_INPUT else f"{type(e).__name__}: {e}"
            payload = " ".join(message.split())[:_MAX_MESSAGE].encode()
    kind, size = (int(x) for x in broadcast(np.array([kind, len(payload)], np.int32)))
    padded = np.zeros(max(_MIN_PAYLOAD, 1 << (size - 1).bit_length()), np.uint8)
    padded[:len(payload)] = np.frombuffer(payload, np.uint8)
    payload = broadcast(padded)[:size].tobytes()
    if failure is not None:
        raise failure
    if kind == _BAD_INPUT:
        raise UserError(payload.decode(errors="replace"))
    if kind == _FAILED:
        raise ProcessFailed(f"process 0 failed: {payload.decode(errors='replace')}; its own output has "
                            "the traceback")
    return payload


def blind(sees: bool) -> list[int]:
    """The processes whose own check failed (`sees`: this process's), on every process; a
    collective on several processes."""
    if process_count() == 1:
        return [] if sees else [0]
    seen = allgather(np.array([sees], np.int32)).reshape(-1)
    return [int(i) for i in np.flatnonzero(seen == 0)]
