"""Restarts as users meet them: a checkpoint that does not fit the config is refused, not damaged;
Ctrl-C saves like a preemption."""

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from ml_collections import ConfigDict

from maxlm.checkpoint import compatibility, store as checkpoint
from maxlm.optim import optimizers as optim
from maxlm.resilience import faults
from maxlm.runtime.errors import ConfigError
from maxlm.sharding import state as state_lib
from maxlm.train import loop
from tests.helpers import ROOT, command_env, tiny

pytestmark = pytest.mark.slow

BASE = {"steps": 4, "eval.every_steps": 0, "log_every_steps": 1, "metrics.tensorboard": False,
        "checkpoint.every_steps": 2, "optim.warmup_steps": 1}


@pytest.fixture(scope="module")
def two_layer_run(tmp_path_factory, data_dirs):
    workdir = tmp_path_factory.mktemp("two_layers")
    loop.train_and_evaluate(tiny(data_dirs, BASE), str(workdir))
    return workdir


def listing(workdir) -> dict[str, float]:
    """Every file under the workdir's checkpoints/ with its modification time."""
    out = {}
    for root, _, files in os.walk(workdir / "checkpoints"):
        for name in files:
            path = os.path.join(root, name)
            out[os.path.relpath(path, workdir)] = os.stat(path).st_mtime_ns
    return out


def test_a_rerun_with_more_layers_exits_2_naming_the_key_and_touches_nothing(two_layer_run, data_dirs):
    before = listing(two_layer_run)
    metrics_before = (two_layer_run / "metrics.jsonl").read_text()
    result = subprocess.run(
        [sys.executable, "-m", "maxlm.train", "--config=configs/tiny.py", f"--workdir={two_layer_run}",
         *(f"--config.{k}={v}" for k, v in {**data_dirs, **BASE}.items()), "--config.steps=8",
         "--config.model.num_layers=3"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=command_env(two_layer_run, devices=None))
    assert result.returncode == 2, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("maxlm:")]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "model.num_layers=3 (checkpoint: 2)" in lines[0] and "does not fit" in lines[0]
    assert listing(two_layer_run) == before  # no checkpoint renamed, written or removed
    assert not [p for p in (two_layer_run / "checkpoints").iterdir() if not p.name.isdigit()]
    assert (two_layer_run / "metrics.jsonl").read_text() == metrics_before


def test_another_width_is_refused_before_anything_compiles(two_layer_run, data_dirs):
    wider = tiny(data_dirs, BASE, **{"model.d_model": 128})
    with pytest.raises(ConfigError, match=r"model.d_model=128 \(checkpoint: 64\)"):
        loop.check_start(wider, str(two_layer_run))
    loop.check_start(tiny(data_dirs, BASE, steps=8), str(two_layer_run))  # the same model resumes


def test_restoring_a_checkpoint_that_does_not_fit_raises_and_sets_nothing_aside(two_layer_run, data_dirs):
    """The restore itself (reached when a start check is bypassed, or by a recovery) refuses a
    checkpoint of other shapes with a ConfigError; only unreadable data counts as damaged."""
    cfg = tiny(data_dirs, BASE, **{"model.num_layers": 3})
    tx = optim.make_optimizer(cfg)
    abstract = state_lib.abstract_state(cfg, tx, jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    before = listing(two_layer_run)
    ckpt = checkpoint.Checkpointer(str(two_layer_run), cfg.checkpoint)
    with pytest.raises(ConfigError, match="does not fit this run: .* arrays saved"):
        ckpt.restore_latest(abstract)
    ckpt.close()
    assert listing(two_layer_run) == before


def test_restore_params_only_keeps_its_documented_use(two_layer_run, data_dirs, tmp_path):
    """Another optimizer from a run's parameters is the documented deliberate change; parameters of
    another shape are refused there too."""
    other_optimizer = tiny(data_dirs, BASE, **{"optim.name": "lion", "checkpoint.restore_from": str(two_layer_run),
                                         "checkpoint.restore_params_only": True})
    loop.check_start(other_optimizer, str(tmp_path / "new"))
    bigger = tiny(data_dirs, BASE, **{"model.num_layers": 3, "checkpoint.restore_from": str(two_layer_run),
                                "checkpoint.restore_params_only": True})
    with pytest.raises(ConfigError, match=r"model.num_layers=3 \(checkpoint: 2\)"):
        loop.check_start(bigger, str(tmp_path / "new"))


def long_run(tmp_path, data_dirs, every_steps: int):
    """(command, env) of a `maxlm.train` that runs until stopped, saving every `every_steps`."""
    command = [sys.executable, "-m", "maxlm.train", "--config=configs/tiny.py", f"--workdir={tmp_path / 'run'}",
               *(f"--config.{k}={v}" for k, v in {**data_dirs, **BASE}.items()),
               "--config.steps=100000", f"--config.checkpoint.every_steps={every_steps}"]
    return command, command_env(tmp_path, devices=None)


def wait_until(proc, ready) -> None:
    """Polls `ready()` while `proc` runs (at most 240 s)."""
    deadline = time.monotonic() + 240
    while not ready():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.1)


@pytest.mark.ci  # make test keeps within its 12 minutes (CI runs it: make test-ci)
def test_ctrl_c_saves_at_the_step_boundary_and_exits_130(tmp_path, data_dirs):
    """The first Ctrl-C behaves as a preemption: the step finishes, its checkpoint commits, one
    line says so, exit 130; the rerun resumes from it."""
    workdir = tmp_path / "run"
    command, env = long_run(tmp_path, data_dirs, every_steps=100000)
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(proc, lambda: rows_at_least(workdir, 3))
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 130, err[-3000:]  # 128 + SIGINT, as shells report a Ctrl-C
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    line = re.search(r"maxlm: interrupted \(Ctrl-C\): checkpoint of step (\d+) committed in (\S+); rerun", err)
    assert line, err[-3000:]
    step = int(line.group(1))
    assert step >= 3 and compatibility.verify_one(str(workdir / "checkpoints" / str(step))) is None
    resumed = subprocess.run([*command[:-2], f"--config.steps={step + 1}"], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0 and f"at step {step}" in resumed.stderr, resumed.stderr[-3000:]


def rows_at_least(workdir, step: int) -> bool:
    metrics = workdir / "metrics.jsonl"
    return metrics.exists() and any(f'"step": {step},' in line for line in metrics.read_text().splitlines())


def test_a_second_ctrl_c_is_left_to_the_default_action():
    """After the first Ctrl-C the watcher hands SIGINT back to its default action, so a second one
    ends the process at once (orbax's tmp directory keeps the earlier checkpoints whole); leaving
    the loop restores the handlers it found."""
    found = signal.getsignal(signal.SIGINT)
    with faults.PreemptionWatcher() as watcher:
        assert not watcher.reached(0)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # Python runs the handler between bytecodes
        assert watcher.reached(1) and watcher.interrupted
        assert signal.getsignal(signal.SIGINT) is signal.SIG_DFL
    assert signal.getsignal(signal.SIGINT) is found


def test_a_time_based_checkpoint_stays_temporary_after_a_restart(tmp_path):
    """Retention reads each checkpoint's recorded kind: after a restart, an earlier time-based
    (temporary) save does not count as a regular checkpoint and evict a real one."""
    cfg = ConfigDict({"max_to_keep": 2, "keep_period": 0, "local_dir": ""})

    def save(ckpt, step, kind):
        ckpt.save(step, {"step": jnp.int32(step), "w": jnp.ones(3)}, {}, {}, kind=kind)

    first = checkpoint.Checkpointer(str(tmp_path), cfg)
    save(first, 10, "regular")
    save(first, 12, "temporary")
    first.close()
    restarted = checkpoint.Checkpointer(str(tmp_path), cfg)  # a new process: nothing in memory
    save(restarted, 20, "regular")
    restarted.close()
    assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir()) == [10, 20]


def test_a_non_finite_state_is_never_saved(tmp_path):
    """The checkpointer checks every leaf before it writes: a NaN anywhere in the state (here the
    optimizer's) is refused with the exit-3 error, and nothing of that step reaches the disk."""
    ckpt = checkpoint.Checkpointer(str(tmp_path), ConfigDict({"max_to_keep": 2, "keep_period": 0, "local_dir": ""}))
    ckpt.save(1, {"step": jnp.int32(1), "params": jnp.ones(3), "opt_state": jnp.zeros(2)}, {}, {})
    with pytest.raises(faults.NonFiniteLossError, match="state of step 2 holds non-finite values: not saved"):
        ckpt.save(2, {"step": jnp.int32(2), "params": jnp.ones(3), "opt_state": jnp.array([0.0, jnp.nan])}, {}, {})
    ckpt.close()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["1"]


def schedule_counts(opt_state) -> list[int]:
    nodes = jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByScheduleState))
    return [int(n.count) for n in nodes if isinstance(n, optax.ScaleByScheduleState)]


@pytest.mark.parametrize("skips", ["nan", "float16_overflow"])
def test_the_schedule_applied_after_skipped_steps_is_the_logged_one(tmp_path, data_dirs, skips):
    """Skipped steps (NaN gradients; float16 overflows) roll the optimizer state back but not the
    schedule's count: it stays the step, so the rate applied is `schedule(step)`, the `lr` logged,
    and the decay ends when planned. Adam's own count (bias correction) counts applied updates."""
    overrides = {"steps": 6, "checkpoint.every_steps": 6}
    if skips == "nan":
        overrides.update({"debug.nan_at_step": 2, "debug.nan_steps": 2})
    else:
        overrides.update({"model.dtype": "float16", "optim.loss_scale_init": 2.0**40})
    workdir = tmp_path / "run"
    loop.train_and_evaluate(tiny(data_dirs, BASE, **overrides), str(workdir))
    path = str(workdir / "checkpoints" / "6")
    state, _ = checkpoint.restore_state(path, compatibility.expected_state(checkpoint.read_json(path, "config")))
    skipped = int(state["skipped_steps"]) + int(state.get("overflow_steps", 0))
    assert skipped >= 2 and int(state["step"]) == 6
    assert schedule_counts(state["opt_state"]) == [6]
    adam = [n for n in jax.tree.leaves(state["opt_state"], is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
            if isinstance(n, optax.ScaleByAdamState)]
    assert [int(n.count) for n in adam] == [6 - skipped]


def test_a_float16_overflow_step_is_not_a_sample_of_the_spike_detector():
    """The step reports `applied`; an overflow skip (bad_streak unchanged at 0) is not applied, so
    its loss, however large, is neither a spike nor a sample."""
    from maxlm.resilience import anomaly

    cfg = ConfigDict({"enabled": True, "warmup": 2, "ema": 0.9, "spike_sigma": 3.0, "max_spikes": 1,
                      "skip_batches": 1, "max_rollbacks": 1})
    anomalies = anomaly.Anomalies(cfg)
    steps = [(1, 2.0, 1), (2, 2.1, 1), (3, 2.0, 1), (4, 1e6, 0), (5, 2.0, 1), (6, 2.0, 1)]
    spikes = [anomalies.spiked(step, {"loss": loss, "bad_streak": 0, "applied": applied})
              for step, loss, applied in steps]
    assert spikes == [None] * 6 and anomalies.spikes == 0
    assert anomalies.detector.stats.count == 4  # steps 1, 2, 3 and 5: the last one is still pending


def test_a_restore_after_non_finite_steps_reuses_the_compiled_step(tmp_path, data_dirs, caplog, capsys):
    """The lowered learning rate after a restore is an argument of the step, not a new program:
    the run compiles its step once, restore included, and the rate logged after it is lowered."""
    cfg = tiny(data_dirs, BASE, **{"steps": 8, "checkpoint.every_steps": 2, "debug.nan_at_step": 5,
                             "debug.nan_steps": 3, "checkpoint.max_bad_steps": 3,
                             "checkpoint.restore_lr_scale": 0.5})
    with caplog.at_level(logging.INFO, logger="maxlm"):
        last = loop.train_and_evaluate(cfg, str(tmp_path))
    assert last["step"] == 8 and "restored step 4" in capsys.readouterr().err
    assert caplog.text.count("compiled the train step") == 1
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    lr_at_6 = [r["lr"] for r in rows if r["step"] == 6]  # before the restore, and after it
    assert len(lr_at_6) == 2 and lr_at_6[1] == pytest.approx(0.5 * lr_at_6[0], rel=1e-6)


@pytest.mark.ci  # make test keeps within its 12 minutes (CI runs it: make test-ci)
def test_a_resume_never_initialises_a_second_state(two_layer_run, data_dirs, monkeypatch, tmp_path):
    """A resume restores straight into the abstract state: no fresh state is built beside the
    restored one (params and optimizer state held twice would make a run filling 60% of HBM
    resumable only by OOM). A fresh start does initialise."""
    resumable = tmp_path / "copy"
    shutil.copytree(two_layer_run, resumable)
    created = []
    real = state_lib.create_sharded_state
    monkeypatch.setattr(state_lib, "create_sharded_state", lambda *a, **k: created.append(1) or real(*a, **k))
    loop.train_and_evaluate(tiny(data_dirs, BASE, steps=5), str(resumable))
    assert created == []
    loop.train_and_evaluate(tiny(data_dirs, BASE, steps=1), str(tmp_path / "fresh"))
    assert created == [1]


@pytest.mark.ci
def test_a_second_run_on_a_live_workdir_exits_2_naming_the_holder_and_a_dead_ones_lock_is_taken_over(
        tmp_path, data_dirs):
    workdir = tmp_path / "run"
    command, env = long_run(tmp_path, data_dirs, every_steps=2)
    first = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(first, lambda: (workdir / "checkpoints" / "2").is_dir())
        before = sorted(p.name for p in workdir.iterdir())
        second = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert second.returncode == 2, second.stderr[-3000:]
        assert re.search(rf"maxlm: config error: the workdir {re.escape(str(workdir))} is in use by host \S+, "
                         rf"pid {first.pid}, started \S+: one run per workdir", second.stderr), second.stderr[-2000:]
        assert "Traceback" not in second.stderr
        assert first.poll() is None  # the live run goes on
        assert sorted(p.name for p in workdir.iterdir()) == before
    finally:
        first.kill()  # SIGKILL: no cleanup, the kernel releases the lock
        first.wait()
    resumed = subprocess.run([*command[:-2], "--config.steps=3"], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=300)
    assert resumed.returncode == 0 and "resumed from" in resumed.stderr, resumed.stderr[-3000:]


@pytest.mark.ci  # make test keeps within its 12 minutes (CI runs it: make test-ci)
def test_the_preemption_sync_point_is_asked_every_iteration_with_an_increasing_id(tmp_path, data_dirs, monkeypatch):
    """JAX's preemption sync point must be reached by every process at the same ids: the loop asks
    it on every iteration, a restore's included, with an id that never goes back (the step does)."""
    asked = []

    class Recording(faults.PreemptionWatcher):
        def reached(self, step):
            asked.append(step)
            return super().reached(step)

    monkeypatch.setattr(faults, "PreemptionWatcher", Recording)
    cfg = tiny(data_dirs, BASE, **{"steps": 8, "checkpoint.every_steps": 2, "debug.nan_at_step": 5,
                             "debug.nan_steps": 3, "checkpoint.max_bad_steps": 3})
    loop.train_and_evaluate(cfg, str(tmp_path))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    iterations = len([r for r in rows if "loss" in r])  # log_every_steps=1: a row per iteration
    assert iterations > 8  # the restore replayed steps
    assert asked == list(range(1, iterations + 1))


@pytest.mark.parametrize("stop_at", [8, pytest.param(9, marks=pytest.mark.ci)])  # 9: ci, 12 s
def test_a_preemption_agreed_around_a_restore_stops_at_a_committed_checkpoint(tmp_path, data_dirs, monkeypatch, stop_at):
    """Whether the agreed stop falls on the iteration that restores (9 here) or the one before
    it (8, inside the non-finite streak), the run stops at a step whose checkpoint is committed."""
    class StopAt(faults.PreemptionWatcher):
        def reached(self, step):
            return step >= stop_at

    monkeypatch.setattr(faults, "PreemptionWatcher", StopAt)
    cfg = tiny(data_dirs, BASE, **{"steps": 12, "checkpoint.every_steps": 2, "debug.nan_at_step": 5,
                             "debug.nan_steps": 3, "checkpoint.max_bad_steps": 3})
    with pytest.raises(faults.Preempted) as stopped:
        loop.train_and_evaluate(cfg, str(tmp_path))
    assert compatibility.verify_one(str(tmp_path / "checkpoints" / str(stopped.value.step))) is None


def test_a_preemption_on_the_last_step_ends_the_run_done_not_preempted(tmp_path, data_dirs, monkeypatch):
    """Issue 55: a SIGTERM during the last step saved a preemption checkpoint and exited 143, so a
    launcher requeued a finished run. The last step saves as the final one and the run ends (exit 0)."""
    class StopAtTheEnd(faults.PreemptionWatcher):
        def reached(self, step):
            return step >= 4

    monkeypatch.setattr(faults, "PreemptionWatcher", StopAtTheEnd)
    cfg = tiny(data_dirs, BASE, **{"steps": 4, "checkpoint.every_steps": 3})
    last = loop.train_and_evaluate(cfg, str(tmp_path))  # no faults.Preempted
    assert last["step"] == 4 and checkpoint.complete_steps(str(tmp_path / "checkpoints"))[-1][0] == 4
    assert compatibility.verify_one(str(tmp_path / "checkpoints" / "4")) is None


def test_a_resume_with_another_batch_size_is_refused_naming_it_or_continues_after_the_rows_read(
        two_layer_run, data_dirs, tmp_path):
    """The data position is a batch index: with another batch_size the same position holds other
    rows. Refused by default (exit 2 naming the key); data.resume_position=tokens continues after
    the rows already read (a batch ramp-up: exact), =start reads the new stream from its start."""
    ramped = tiny(data_dirs, BASE, steps=6, batch_size=16)
    with pytest.raises(ConfigError, match=r"batch_size=16 \(checkpoint: 8\).*data.resume_position=tokens"):
        loop.check_start(ramped, str(two_layer_run))
    assert checkpoint.read_json(str(two_layer_run / "checkpoints" / "4"), "meta")["data"]["rows"] == 4 * 8

    from maxlm.data import make_dataset
    before, after = make_dataset(tiny(data_dirs, BASE), "train"), make_dataset(ramped, "train")
    read = [before.row_ids(s) for s in range(4)]  # steps 0-3 read rows 0..31 of the stream
    next_rows = np.concatenate([before.row_ids(4), before.row_ids(5)])  # what batch 8 would have read next
    for mode, position in (("tokens", 2), ("start", 0)):
        workdir = tmp_path / mode
        shutil.copytree(two_layer_run, workdir)
        cfg = tiny(data_dirs, BASE, steps=6, batch_size=16, **{"data.resume_position": mode})
        loop.check_start(cfg, str(workdir))
        loop.train_and_evaluate(cfg, str(workdir))
        meta = checkpoint.read_json(str(workdir / "checkpoints" / "6"), "meta")
        assert meta["data_position"] == position + 2 and meta["data"]["keys"]["batch_size"] == 16, mode
        assert meta["data"]["rows"] == after.first_row(position + 2)
        assert meta["anomaly"]["skips"] == [[4, position - 4]]  # the jump, so later resumes read the same
    assert np.array_equal(after.row_ids(2), next_rows)  # tokens: exactly the rows after those read
    assert not set(np.concatenate(read)) & set(after.row_ids(2))


EXTENDED = {"seq_len": 128, "model.rope_scaling": "llama3", "model.rope_scaling_factor": 2.0,
            "model.rope_original_max_len": 64}  # two_layer_run's 64 tokens, twice as long


def test_seq_len_and_the_position_encoding_change_on_resume_only_together(two_layer_run, data_dirs):
    """A seq_len change with the checkpoint's position encoding is an accident: exit 2 naming
    seq_len whatever data.resume_position says. With a new rope scaling or theta it is a context
    extension, and data.resume_position decides where the data goes on (same: refused, naming
    seq_len). A new encoding at the same seq_len is refused too (issue 54: the loss jumped)."""
    for mode in ("same", "tokens", "start"):
        with pytest.raises(ConfigError, match=r"seq_len=128 but the checkpoint .* was trained at seq_len=64, with the "
                                              r"same position encoding .*model.rope_scaling='none'"):
            loop.check_start(tiny(data_dirs, BASE, seq_len=128, **{"data.resume_position": mode}), str(two_layer_run))
    with pytest.raises(ConfigError, match=r"seq_len=128 \(checkpoint: 64\).*data.resume_position=tokens"):
        loop.check_start(tiny(data_dirs, BASE, **EXTENDED), str(two_layer_run))
    for extension in (EXTENDED, {"seq_len": 128, "model.rope_theta": 5e5}):
        loop.check_start(tiny(data_dirs, BASE, **extension, **{"data.resume_position": "tokens"}), str(two_layer_run))
    with pytest.raises(ConfigError, match=r"model.rope_theta=500000.0 \(checkpoint: 10000.0\).*same seq_len=64"):
        loop.check_start(tiny(data_dirs, BASE, steps=8, **{"model.rope_theta": 5e5}), str(two_layer_run))


@pytest.mark.ci  # make test keeps within its 12 minutes (CI runs it: make test-ci)
def test_a_context_extension_resumes_as_a_fresh_run_from_the_checkpoint_would_start(two_layer_run, data_dirs, tmp_path):
    """Resuming two_layer_run (step 4, 32 rows of 64 tokens read) at seq_len 128 with llama3
    scaling: the step and optimizer state go on, the data after the 2048 tokens read (16 rows of
    128: data position 2), and the losses are bit for bit those of a fresh workdir started from the
    same checkpoint with the new config (checkpoint.restore_from, full state)."""
    extended = {**EXTENDED, "steps": 6, "data.resume_position": "tokens"}
    resumed = tmp_path / "resumed"
    shutil.copytree(two_layer_run, resumed)
    loop.train_and_evaluate(tiny(data_dirs, BASE, **extended), str(resumed))
    fresh = tmp_path / "fresh"
    loop.train_and_evaluate(tiny(data_dirs, BASE, **extended, **{"checkpoint.restore_from": str(two_layer_run / "checkpoints" / "4")}),
                            str(fresh))

    def losses(workdir):
        return {r["step"]: r["loss"] for r in map(json.loads, (workdir / "metrics.jsonl").read_text().splitlines())
                if "loss" in r and r["step"] > 4}

    assert losses(resumed) == losses(fresh) and sorted(losses(resumed)) == [5, 6]
    assert all(np.isfinite(list(losses(resumed).values())))
    meta = checkpoint.read_json(str(resumed / "checkpoints" / "6"), "meta")
    assert meta["data_position"] == 2 + 2 and meta["data"]["keys"]["seq_len"] == 128
    assert meta["data"]["encoding"]["model.rope_scaling"] == "llama3"
    cfg = tiny(data_dirs, BASE, **extended)
    tx = optim.make_optimizer(cfg)
    abstract = state_lib.abstract_state(cfg, tx, jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    state, _ = checkpoint.restore_state(str(resumed / "checkpoints" / "6"), abstract)
    assert int(state["step"]) == 6 and schedule_counts(state["opt_state"]) == [6]


def test_a_first_run_and_its_resume_print_no_line_that_reads_like_failure(tmp_path):
    """A run that builds the corpus and prepares its cache, then its resume: no TFDS download
    line where nothing is downloaded, a `prepared` line without its zero counts, and no orbax
    `Metadata file does not exist` about the state item (which never has that file)."""
    fresh = {"data.tfds_dir": str(tmp_path / "tfds"), "data.cache_dir": str(tmp_path / "packed")}
    command = [sys.executable, "-m", "maxlm.train", "--config=configs/tiny.py", f"--workdir={tmp_path / 'run'}",
               *(f"--config.{k}={v}" for k, v in {**fresh, **BASE}.items())]
    env = command_env(tmp_path, devices=None)
    first = subprocess.run([*command, "--config.steps=2"], cwd=ROOT, capture_output=True, text=True,
                           timeout=300, env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "built python_stdlib" in first.stderr
    assert "ownload" not in first.stderr + first.stdout, first.stderr[-3000:]
    prepared = [line for line in first.stderr.splitlines() if " prepared tfds:python_stdlib[train]" in line]
    assert len(prepared) == 1 and ": 0" not in prepared[0] and "filtered" not in prepared[0], prepared
    assert "skipped {'empty_documents': " in prepared[0]  # the stdlib has empty files: a nonzero count shows
    resumed = subprocess.run([*command, "--config.steps=3"], cwd=ROOT, capture_output=True, text=True,
                             timeout=300, env=env)
    assert resumed.returncode == 0 and "at step 2" in resumed.stderr, resumed.stderr[-3000:]
    assert "Metadata file does not exist" not in resumed.stderr, resumed.stderr[-3000:]
