"""One run per gs:// workdir: the lease object WORKDIR/.maxlm-lock (maxlm/checkpoint/workdir_lock.py),
against the Cloud Storage stand-in of tests/gcs.py, which checks generation preconditions as
Cloud Storage does. (The local flock: tests/test_restart.py.)"""

import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
from etils import epath

from maxlm.checkpoint import workdir_lock
from maxlm.runtime import gcs
from maxlm.runtime.errors import ConfigError
from tests.helpers import ROOT, command_env


@pytest.fixture
def workdir():
    from tests.gcs import BUCKET, fake_gcs

    with fake_gcs():
        try:
            yield f"gs://{BUCKET}/run"
        finally:
            workdir_lock.release()


def lease_url(workdir: str) -> str:
    return f"{workdir}/{workdir_lock.LOCK_NAME}"


def stored_lease(workdir: str) -> tuple[dict, int]:
    body, generation = gcs.read(lease_url(workdir))
    return json.loads(body), generation


def write_lease(workdir: str, expires: float, holder: str = "host gone, pid 1, started then") -> None:
    """Another run's lease, as it left it."""
    gcs.write(lease_url(workdir), json.dumps({"holder": holder, "token": "another", "expires": expires}).encode())


def eventually(condition, seconds: float = 30.0) -> bool:
    """Whether `condition()` turns true within `seconds` (for what a thread does in its time)."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_a_second_run_on_a_live_lease_is_refused_naming_the_holder_and_touches_nothing(workdir):
    workdir_lock.hold(workdir)
    lease, generation = stored_lease(workdir)
    assert lease["holder"].startswith(f"host {socket.gethostname()}, pid {os.getpid()}, started ")
    with pytest.raises(ConfigError, match=rf"the workdir {workdir} is in use by host {socket.gethostname()}, "
                                          rf"pid {os.getpid()}, started \S+ \(its lease expires in \d+ s unless "
                                          r"renewed\): one run per workdir"):
        workdir_lock.hold(workdir)  # a second run: another lease, another token
    assert stored_lease(workdir) == (lease, generation)


def test_an_expired_lease_is_taken_over_and_released_at_the_end(workdir):
    write_lease(workdir, expires=time.time() - 1)  # a run killed: it renews no more
    workdir_lock.hold(workdir)
    lease, _ = stored_lease(workdir)
    assert f"pid {os.getpid()}" in lease["holder"] and lease["expires"] > time.time()
    workdir_lock.release()
    assert gcs.read(lease_url(workdir)) is None


@pytest.mark.parametrize("left", ["nothing", "an expired lease"])
def test_of_two_runs_taking_the_same_lease_exactly_one_wins(workdir, left):
    """Both read the workdir's lease object (none, or a dead run's), then both write it: the
    generation precondition lets the first write through and refuses the second."""
    if left != "nothing":
        write_lease(workdir, expires=time.time() - 1)
    first, second = (workdir_lock.Lease(lease_url(workdir)) for _ in range(2))
    seen_by_first, seen_by_second = first.read(), second.read()
    try:
        assert first.claim(*seen_by_first) is None
        assert "its lease expires in" in second.claim(*seen_by_second)
        assert stored_lease(workdir)[0]["token"] == first.token
    finally:
        first.release()
        second.release()


def test_of_two_runs_taking_the_lease_at_once_exactly_one_wins(workdir):
    leases = [workdir_lock.Lease(lease_url(workdir)) for _ in range(2)]
    results = [None, None]
    ready = threading.Barrier(2)

    def take(i):
        ready.wait()
        results[i] = leases[i].take()

    threads = [threading.Thread(target=take, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert sorted(r is None for r in results) == [False, True]
        winner = leases[results.index(None)]
        assert stored_lease(workdir)[0]["token"] == winner.token
    finally:
        for lease in leases:
            lease.release()


def test_the_heartbeat_renews_the_lease(workdir):
    lease = workdir_lock.Lease(lease_url(workdir), seconds=0.6)  # renewed every 0.2 s
    assert lease.take() is None
    try:
        first, generation = stored_lease(workdir)
        assert eventually(lambda: stored_lease(workdir)[1] != generation)
        renewed, _ = stored_lease(workdir)
        assert renewed["token"] == lease.token and renewed["expires"] > first["expires"]
    finally:
        lease.release()
    assert gcs.read(lease_url(workdir)) is None


def test_a_lease_taken_by_another_run_is_reported_lost_and_left_to_it(workdir):
    lost = []
    lease = workdir_lock.Lease(lease_url(workdir), seconds=60, on_lost=lost.append)
    assert lease.take() is None
    try:
        write_lease(workdir, expires=time.time() + 60, holder="host thief, pid 7, started now")
        assert not lease.renew()
        assert len(lost) == 1 and "lost the lease" in lost[0] and "host thief, pid 7" in lost[0]
    finally:
        lease.release()
    assert stored_lease(workdir)[0]["token"] == "another"  # not ours to delete


HOLDING = """
import sys
from maxlm.checkpoint import workdir_lock
from maxlm.train.__main__ import stop_on_lost_lease
workdir_lock.LEASE_SECONDS = float(sys.argv[2])
workdir_lock.hold(sys.argv[1], on_lost=stop_on_lost_lease)  # as maxlm.train does
print("held", flush=True)
sys.stdin.readline()
"""


def holding_process(workdir: str, tmp_path, lease_seconds: float) -> subprocess.Popen:
    """A process that holds the workdir's lease as `maxlm.train` does, until a line comes on its stdin."""
    stand_in = {k: os.environ[k] for k in ("STORAGE_EMULATOR_HOST", "NO_GCE_CHECK")}  # set by fake_gcs
    env = command_env(tmp_path, devices=None, **stand_in)
    proc = subprocess.Popen([sys.executable, "-c", HOLDING, workdir, str(lease_seconds)], cwd=ROOT, env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "held\n", proc.communicate()[1][-3000:]
    return proc


@pytest.mark.slow
def test_a_process_releases_its_lease_when_it_exits_and_stops_at_once_when_it_loses_it(workdir, tmp_path):
    proc = holding_process(workdir, tmp_path, lease_seconds=60)
    try:
        assert f"pid {proc.pid}," in stored_lease(workdir)[0]["holder"]
        _, err = proc.communicate("\n", timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0 and gcs.read(lease_url(workdir)) is None, err[-3000:]

    proc = holding_process(workdir, tmp_path, lease_seconds=0.6)
    try:
        write_lease(workdir, expires=time.time() + 60, holder="host thief, pid 7, started now")
        proc.wait(timeout=120)  # stdin left open: only the lost lease ends it
    finally:
        proc.kill()
    err = proc.stderr.read()
    assert proc.returncode == workdir_lock.LEASE_LOST_EXIT, err[-3000:]
    assert f"maxlm: error: this run lost the lease {lease_url(workdir)} to host thief, pid 7" in err
    assert stored_lease(workdir)[0]["holder"] == "host thief, pid 7, started now"


@pytest.mark.slow
def test_maxlm_train_on_a_leased_gs_workdir_exits_2_naming_the_holder(workdir, tmp_path, data_dirs):
    write_lease(workdir, expires=time.time() + 600, holder="host busy, pid 42, started earlier")
    stand_in = {k: os.environ[k] for k in ("STORAGE_EMULATOR_HOST", "NO_GCE_CHECK")}
    second = subprocess.run([sys.executable, "-m", "maxlm.train", "--config=configs/tiny.py", f"--workdir={workdir}",
                             *(f"--config.{k}={v}" for k, v in data_dirs.items())],
                            check=False, cwd=ROOT, env=command_env(tmp_path, devices=None, **stand_in), capture_output=True,
                            text=True, timeout=300)
    assert second.returncode == 2, second.stderr[-3000:]
    assert (f"maxlm: config error: the workdir {workdir} is in use by host busy, pid 42, started earlier (its "
            "lease expires in") in second.stderr and "Traceback" not in second.stderr
    assert [p.name for p in epath.Path(workdir).iterdir()] == [workdir_lock.LOCK_NAME]  # nothing else written
