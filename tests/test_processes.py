"""maxlm/runtime/processes.py in one process: each function run as process 0 and then as process 1 of a
two-process job, whose collectives are answered with what process 0 sent (the real collectives:
tests/test_multihost.py)."""

import numpy as np
import pytest

from maxlm.data.errors import DataError
from maxlm.runtime import processes
from maxlm.runtime.errors import UserError


def as_two_processes(monkeypatch, fn):
    """[fn()'s result or exception as process 0, as process 1]: process 1's broadcasts get process
    0's arrays, after checking that process 1 asks with the same shapes (else a real job hangs)."""
    sent, results = [], []
    monkeypatch.setattr(processes, "process_count", lambda: 2)
    for index in (0, 1):
        replay = iter(list(sent))

        def broadcast(array, index=index, replay=replay):
            if index == 0:
                sent.append(array.copy())
                return array
            theirs = next(replay)
            assert (array.shape, array.dtype) == (theirs.shape, theirs.dtype)
            return theirs

        monkeypatch.setattr(processes, "process_index", lambda index=index: index)
        monkeypatch.setattr(processes, "broadcast", broadcast)
        try:
            results.append(fn())
        except Exception as e:  # the test looks at it
            results.append(e)
        assert next(replay, None) is None  # as many collectives on both
    return results


def test_process_0_reads_and_every_process_gets_the_bytes(monkeypatch):
    reads = []
    payload = bytes(range(256)) * 40  # past the smallest broadcast: padded to the next power of two

    def read():
        reads.append(processes.process_index())
        return payload

    assert as_two_processes(monkeypatch, lambda: processes.from_process_0(read)) == [payload, payload]
    assert reads == [0]
    empty = as_two_processes(monkeypatch, lambda: processes.from_process_0(lambda: b""))
    assert empty == [b"", b""]


def test_any_failure_of_process_0_reaches_every_process(monkeypatch):
    """A storage error: process 0 raises its own (type and traceback), the others ProcessFailed
    with its one line. Bad input (a ValueError: DataError, ConfigError): the others raise a
    UserError with its message, which the commands end on with exit 2."""
    error = OSError(5, "Input/output error\nfrom gcsfs")

    def fail():
        raise error

    mine, theirs = as_two_processes(monkeypatch, lambda: processes.from_process_0(fail))
    assert mine is error and mine.__traceback__ is not None
    assert isinstance(theirs, processes.ProcessFailed)
    assert str(theirs) == ("process 0 failed: OSError: [Errno 5] Input/output error from gcsfs; its own "
                           "output has the traceback")

    def bad_data():
        raise DataError("not a JSON line", "tasks/x.jsonl", 3)

    mine, theirs = as_two_processes(monkeypatch, lambda: processes.from_process_0(bad_data))
    assert type(mine) is DataError and type(theirs) is UserError
    assert str(mine) == str(theirs) == "tasks/x.jsonl:3: not a JSON line"


def test_a_keyboard_interrupt_is_not_passed_on(monkeypatch):
    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(processes, "process_count", lambda: 2)
    monkeypatch.setattr(processes, "process_index", lambda: 0)
    monkeypatch.setattr(processes, "broadcast", lambda array: pytest.fail("a collective"))
    with pytest.raises(KeyboardInterrupt):
        processes.from_process_0(interrupted)


def test_a_single_process_does_no_collective(monkeypatch):
    monkeypatch.setattr(processes, "broadcast", lambda array: pytest.fail("a collective"))
    monkeypatch.setattr(processes, "allgather", lambda array: pytest.fail("a collective"))
    assert processes.from_process_0(lambda: b"mine") == b"mine"
    with pytest.raises(OSError, match="gone"):
        processes.from_process_0(lambda: (_ for _ in ()).throw(OSError("gone")))
    assert processes.blind(True) == [] and processes.blind(False) == [0]


def test_blind_names_the_processes_that_cannot_see(monkeypatch):
    monkeypatch.setattr(processes, "process_count", lambda: 3)
    monkeypatch.setattr(processes, "allgather", lambda array: np.array([[1], [0], [0]], np.int32))
    assert processes.blind(True) == [1, 2]


def test_the_checkpoint_every_process_restores_is_the_one_process_0_resolved(monkeypatch, tmp_path):
    """Issue 55: each host resolved `checkpoint.restore_from`, and the commands' (eval, generate,
    export) newest checkpoint, from its own listing; a step committing between two hosts' listings
    had them restore different steps into one array, with no error. Process 1 here listed before
    step 6 committed: both take process 0's step 6."""
    from maxlm.checkpoint import saved_run, store as checkpoint

    newest = str(tmp_path / "checkpoints" / "6")
    listings = {0: [(3, str(tmp_path / "checkpoints" / "3")), (6, newest)],
                1: [(3, str(tmp_path / "checkpoints" / "3"))]}
    monkeypatch.setattr(checkpoint, "complete_steps", lambda directory: (
        listings[processes.process_index()] if directory.endswith("checkpoints") else []))
    assert as_two_processes(monkeypatch, lambda: checkpoint.resolve_restore_from(str(tmp_path))) == [newest] * 2
    assert as_two_processes(monkeypatch, lambda: saved_run.checkpoint_path(str(tmp_path))) == [newest] * 2
