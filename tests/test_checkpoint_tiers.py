"""The host-local checkpoint tier (checkpoint.local_dir): saved often to each host's disk with a
replica of a neighbour's shards, restored from there or from a peer, bitwise as from the
persistent tier, every process on the same step."""

import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from maxlm.checkpoint import host_shards
from maxlm.checkpoint.local_tier import LocalTier, _rounds
from maxlm.observe import goodput
from tests.helpers import ROOT, command_env, free_port, losses, saved_state, train_rows


def train_flags(workdir, data_dirs, local_dir, steps=10, *extra):
    return ["--config=configs/tiny.py", f"--workdir={workdir}", f"--config.steps={steps}",
            "--config.checkpoint.every_steps=8", f"--config.checkpoint.local_dir={local_dir}",
            "--config.checkpoint.local_every_steps=2", "--config.log_every_steps=1",
            "--config.eval.every_steps=0", "--config.metrics.tensorboard=False",
            *(f"--config.{k}={v}" for k, v in data_dirs.items()), *extra]


# ----------------------------------------------------------------------------- the pieces


def test_a_process_buffer_holds_its_shards_and_rebuilds_the_arrays():
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("fsdp", "tensor"))
    tree = {"w": jax.device_put(np.arange(64 * 6, dtype=np.float32).reshape(64, 6),
                                NamedSharding(mesh, PartitionSpec("fsdp"))),  # replicated over tensor
            "b": jax.device_put(np.arange(8, dtype=np.int32), NamedSharding(mesh, PartitionSpec(("fsdp", "tensor")))),
            "s": jax.device_put(np.float32(3.5), NamedSharding(mesh, PartitionSpec()))}
    entries = host_shards.layout(tree, 0)
    # each distinct shard once: 4 of w (replicas over tensor stored once), 8 of b, 1 of s
    assert [e.leaf for e in entries].count(2) == 4 and len(entries) == 8 + 1 + 4  # leaves b, s, w
    assert host_shards.total_bytes(entries) == 64 * 6 * 4 + 8 * 4 + 4
    buffer = host_shards.pack(tree, entries)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
    back = host_shards.unpack(buffer.copy(), entries, abstract)
    for key in tree:
        assert back[key].sharding == tree[key].sharding
        np.testing.assert_array_equal(np.asarray(back[key]), np.asarray(tree[key]))
    assert host_shards.checksum(buffer) != host_shards.checksum(buffer[::-1].copy())


def test_the_plan_takes_the_newest_step_every_process_can_have():
    # (holder, step, owner): process 0 holds its own and 1's replica, process 1 its own and 0's
    both = [(0, 4, 0), (0, 4, 1), (1, 4, 1), (1, 4, 0)]
    assert LocalTier.plan(both, 2, None, 0) == (4, {0: 0, 1: 1})
    # process 1 lost its disk: its shards come from process 0's replica
    lost = [(0, 6, 0), (0, 6, 1)] + both
    assert LocalTier.plan(lost, 2, None, 0) == (6, {0: 0, 1: 0})
    # nobody has process 1's shards of step 8: not usable; the persistent tier's 6 wins at_least
    assert LocalTier.plan([(0, 8, 0)] + lost, 2, None, 0) == (6, {0: 0, 1: 0})
    assert LocalTier.plan(lost, 2, None, 7) is None
    assert LocalTier.plan(lost, 2, 6, 0) == (4, {0: 0, 1: 1})  # a rollback: below the spike
    # one holder sending to two owners goes in two rounds
    assert _rounds({1: 0, 2: 0, 3: 2}) == [[(1, 0), (3, 2)], [(2, 0)]]


def test_a_local_save_restores_bitwise_and_a_damaged_copy_is_marked_and_skipped(tmp_path):
    """In one process, on 8 devices: save two steps, restore the newest bitwise with its meta;
    damage it, and the restore marks it and takes the other; a rollback's bound is kept."""
    from ml_collections import ConfigDict

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("fsdp", "tensor"))
    sharding = NamedSharding(mesh, PartitionSpec("fsdp", "tensor"))
    state = {"w": jax.device_put(np.arange(64 * 8, dtype=np.float32).reshape(64, 8), sharding),
             "step": jax.device_put(np.int32(0), NamedSharding(mesh, PartitionSpec()))}
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    tier = LocalTier(ConfigDict({"local_dir": str(tmp_path / "local"), "local_max_to_keep": 2}), str(tmp_path / "run"))
    fine = lambda restored, step: None
    for step in (2, 4):
        tier.save(step, dict(state, w=state["w"] + step), {"data_position": step}, {"name": "t"})
    tier.wait()
    restored, meta = tier.restore(abstract, fine)
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.asarray(state["w"]) + 4)
    assert restored["w"].sharding == sharding and meta["step"] == 4 and meta["data_position"] == 4
    assert tier.restore(abstract, fine, below=4)[1]["step"] == 2  # a rollback to before step 4
    with open(os.path.join(tier.root, "4", "p0", "data.bin"), "r+b") as f:
        f.write(b"\x01\x02")
    restored, meta = tier.restore(abstract, fine)
    assert meta["step"] == 2 and os.path.exists(os.path.join(tier.root, "4", "p0.damaged"))
    assert tier.restore(abstract, fine, at_least=3) is None  # the persistent tier's newer: not local


def test_a_local_write_that_fails_for_any_reason_is_one_warning_and_leaves_no_step(tmp_path, monkeypatch, capsys):
    """Issue 55: the write thread ended silently on any exception but an OSError. Each failure is
    the same warning on the run's thread, and the step's partial copy is removed."""
    from ml_collections import ConfigDict

    state = {"w": jax.device_put(np.ones((8, 8), np.float32)), "step": jax.device_put(np.int32(0))}
    tier = LocalTier(ConfigDict({"local_dir": str(tmp_path / "local"), "local_max_to_keep": 2}), str(tmp_path / "run"))
    for step, error in ((2, OSError(28, "No space left on device")), (4, ValueError("a bug's message"))):
        def failing(*args, error=error):
            raise error
        monkeypatch.setattr(tier, "_write", failing)
        tier.save(step, state, {}, {})
        tier.wait()
        assert not os.path.exists(os.path.join(tier.root, str(step)))
    err = capsys.readouterr().err
    assert "local checkpoint not written: No space left on device (" in err
    assert "local checkpoint not written: ValueError: a bug's message (" in err


def test_a_local_dir_on_shared_storage_or_not_below_every_steps_is_exit_2(tmp_path, data_dirs):
    for extra, words in ((["--config.checkpoint.local_dir=gs://bucket/x"], "each host's own disk"),
                         ([f"--config.checkpoint.local_dir={tmp_path}/l", "--config.checkpoint.local_every_steps=8"],
                          "local_every_steps=8 is not below")):
        flags = [f for f in train_flags(tmp_path / "run", data_dirs, tmp_path / "l") if "checkpoint.local" not in f]
        done = subprocess.run([sys.executable, "-m", "maxlm.train", *flags, *extra], cwd=ROOT,
                              capture_output=True, text=True, timeout=120, env=command_env(tmp_path))
        assert done.returncode == 2 and words in done.stderr, done.stderr[-2000:]


# ----------------------------------------------------------------------------- one process


def tier_root(local):
    """The run's folder in a local_dir (named after its workdir), or None before the first save."""
    found = os.listdir(local) if os.path.isdir(local) else []
    assert len(found) <= 1, found
    return os.path.join(local, found[0]) if found else None


@pytest.mark.slow
@pytest.mark.ci
def test_a_resume_from_the_local_tier_equals_the_run_straight_through(tmp_path, data_dirs):
    """Persistent saves at 8 and 10 (the final); local ones at 3, 6 and 9 (two kept: 6, 9).
    Without the persistent 10, the rerun resumes from the local 9, bitwise. With local 9's data
    damaged it is skipped (marked) and the rerun goes on from the persistent 8, saving 9 anew; on
    another mesh the local copies are not used, nor marked. Another workdir given the same
    local_dir never sees this run's saves."""
    run, local = tmp_path / "run", tmp_path / "local"
    flags = train_flags(run, data_dirs, local, 10, "--config.checkpoint.local_every_steps=3")
    done = subprocess.run([sys.executable, "-m", "maxlm.train", *flags], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env=command_env(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    root = tier_root(local)
    assert os.path.basename(root).startswith("run-") and sorted(os.listdir(root)) == ["6", "9"]
    assert os.listdir(os.path.join(root, "9")) == ["p0"]
    want, final = losses(run), saved_state(run, 10)

    for damage, resumed in ((False, "the local tier"), (True, "checkpoints at step 8"),
                            ("mesh", "checkpoints at step 8")):
        shutil.rmtree(run / "checkpoints" / "10")
        (run / "metrics.jsonl").write_text("")
        if damage is True:
            with open(os.path.join(root, "9", "p0", "data.bin"), "r+b") as f:
                f.seek(100)
                f.write(b"\xff\xfe")
        rerun = list(flags)
        if damage == "mesh":  # another layout of the state: the local copies are not used, nor marked
            rerun += ["--config.mesh.data=2", "--config.mesh.fsdp=4"]
        done = subprocess.run([sys.executable, "-m", "maxlm.train", *rerun], cwd=ROOT, capture_output=True,
                              text=True, timeout=300, env=command_env(tmp_path))
        assert done.returncode == 0, done.stderr[-3000:]
        assert resumed in done.stderr, done.stderr[-3000:]
        if damage == "mesh":
            assert "9/p0 not used: saved with another layout" in done.stderr, done.stderr[-3000:]
            assert not os.path.exists(os.path.join(root, "9", "p0.damaged"))
            continue  # its losses differ in the last bits: another mesh reduces in another order
        if damage:
            assert "data.bin fails its check" in done.stderr, done.stderr[:2500]
            assert not os.path.exists(os.path.join(root, "9", "p0.damaged"))  # marked, then replaced by the new save
        got = losses(run)
        assert sorted(got) == ([10] if not damage else [9, 10])
        assert all(got[s] == want[s] for s in got)  # bitwise
        jax.tree.map(np.testing.assert_array_equal, saved_state(run, 10), final)

    other = [f.replace(str(run), str(tmp_path / "other")) for f in flags]
    done = subprocess.run([sys.executable, "-m", "maxlm.train", *other, "--config.steps=6"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=command_env(tmp_path))
    assert done.returncode == 0 and "resumed" not in done.stderr, done.stderr[-3000:]


# ----------------------------------------------------------------------------- two processes


def launch(tmp_path, flags, name):
    """Processes 0 and 1 of one job (4 fake devices each), their stderr in files (a pipe left
    unread while they run could fill and stop them)."""
    port = free_port()
    procs = []
    for i in range(2):
        log = open(tmp_path / f"{name}-{i}.log", "w")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "maxlm.train", *flags], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log,
            text=True, env=command_env(tmp_path, devices=4, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                                       JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i))))
        procs[-1].log = tmp_path / f"{name}-{i}.log"
    return procs


def finish(procs, timeout=300):
    """Waits for both (a hang fails the test); their logs."""
    try:
        codes = [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    logs = [p.log.read_text() for p in procs]
    for code, log in zip(codes, logs):
        assert code == 0, log[-3000:]
    return logs


def kill_after_local_step(procs, local, newer_than: int, timeout=240) -> int:
    """SIGKILLs both processes once each one's local tier holds a complete step above
    `newer_than` (its own shards and its neighbour's); returns that step."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        roots = [tier_root(d) for d in local]
        held = [{int(s) for s in os.listdir(d) if s.isdigit() and {"p0", "p1"} <= set(os.listdir(os.path.join(d, s)))}
                for d in roots if d]
        common = set.intersection(*held) if len(held) == 2 else set()
        if any(s > newer_than for s in common):
            for p in procs:
                p.send_signal(signal.SIGKILL)
            for p in procs:
                p.wait()
            return max(common)
        assert all(p.poll() is None for p in procs), [p.log.read_text()[-2000:] for p in procs]
        time.sleep(0.02)
    raise AssertionError("no local save in time")


@pytest.mark.slow
@pytest.mark.ci
def test_two_processes_resume_from_the_local_tier_and_from_a_peer_bitwise(tmp_path, data_dirs):
    """2 processes x 4 devices, each with its own local dir. SIGKILL after a local save newer than
    any persistent one: the rerun resumes from it. The newest local step damaged in both its
    copies: skipped by both processes alike. One process's local dir deleted: its shards come
    from its neighbour's replica. Every loss and the final state equal the uninterrupted run's."""
    steps = 30
    reference = tmp_path / "reference"
    finish(launch(tmp_path, train_flags(reference, data_dirs, tmp_path / "ref-local-{process}", steps), "reference"))
    want, final = losses(reference), saved_state(reference, steps)

    run, template = tmp_path / "run", str(tmp_path / "local-{process}")
    local = [template.replace("{process}", str(i)) for i in range(2)]
    flags = train_flags(run, data_dirs, template, steps)
    killed = kill_after_local_step(launch(tmp_path, flags, "first"), local, 2)
    reached = [goodput.read(run)["max_step"]]  # the steps the killed attempt had run, to be redone

    # the newest local step damaged in both copies of process 0's shards: both skip it
    for holder in local:
        with open(os.path.join(tier_root(holder), str(killed), "p0", "data.bin"), "r+b") as f:
            f.seek(8)
            f.write(b"\x00\x01\x02")
    procs = launch(tmp_path, flags, "second")
    killed_again = kill_after_local_step(procs, local, killed)
    reached.append(goodput.read(run)["max_step"])
    second = procs[0].log.read_text()  # process 0 logs for the job
    resumed = [line for line in second.splitlines() if "resumed from" in line]
    assert len(resumed) == 1 and "the local tier" in resumed[0], second[-3000:]
    resumed_at = int(resumed[0].split("at step ")[-1])
    assert resumed_at < killed and "skipping local checkpoint" in second
    # process 0's copy fails, then process 1's replica of it: each marks its own, all decide again
    assert f"local step {killed}: a copy could not be used on process(es) 0;" in second
    assert f"local step {killed}: a copy could not be used on process(es) 1;" in second

    # a host replaced: process 1's disk is empty; process 0's replica has its shards
    shutil.rmtree(local[1])
    log = finish(launch(tmp_path, flags, "third"))[0]
    assert f"at step {killed_again}" in log and "resumed from the local tier" in log, log[-3000:]
    assert "process 1 has no usable copy of its shards" in log and "process 0 sends its replica" in log
    got = losses(run)
    assert set(range(killed_again + 1, steps + 1)) <= set(got)
    assert all(got[s] == want[s] for s in got), {s: (got[s], want[s]) for s in got if got[s] != want[s]}
    jax.tree.map(np.testing.assert_array_equal, saved_state(run, steps), final)
    # goodput over the three attempts: the steps redone after each kill are the lost work
    record = goodput.read(run)
    assert record["attempts"] == 3 and record["max_step"] == steps
    assert record["lost_steps"] == (reached[0] - resumed_at) + (reached[1] - killed_again), (record, reached)
    last = train_rows(run)[steps]
    assert abs(last["goodput"] + sum(v for k, v in last.items() if k.startswith("badput/")) - 1) < 0.01
