"""Goodput (maxlm/observe/goodput.py): the stopwatch's tiling on a fake clock, redone steps counted
as lost, goodput.json across attempts, the plot's panel, and a run through the command: killed
back to an older checkpoint and resumed, its redone steps counted."""

import json
import shutil
import subprocess
import sys

import jax
import pytest

from maxlm import config as config_lib, plot
from maxlm.observe import goodput, metrics
from maxlm.train import loop
from tests.helpers import ROOT, command_env, load_config, metrics_rows, with_overrides


class FakeClock:
    def __init__(self, now=100.0):
        self.now = now

    def __call__(self):
        return self.now

    def tick(self, seconds):
        self.now += seconds


def test_the_categories_tile_the_wall_time_exactly():
    clock = FakeClock()
    watch = goodput.Stopwatch(clock=clock, start=90.0)  # the process started 10 s before
    clock.tick(0.5)
    assert watch.switch("data") == "startup"
    clock.tick(0.25)
    watch.switch("compile")
    clock.tick(4.0)
    watch.switch("productive")
    clock.tick(1.5)
    watch.switch("productive")  # switching to the current category changes nothing
    clock.tick(1.0)
    assert watch.elapsed() == {**dict.fromkeys(goodput.CATEGORIES, 0.0), "startup": 10.5, "data": 0.25,
                               "compile": 4.0, "productive": 2.5}
    assert sum(watch.elapsed().values()) == clock.now - 90.0
    assert watch.seconds["productive"] == 1.5  # closed intervals only; elapsed adds the open one
    with pytest.raises(ValueError, match="unknown goodput category 'io'"):
        watch.switch("io")


def test_a_phase_returns_to_the_category_before_it_even_nested_or_raising():
    clock = FakeClock()
    watch = goodput.Stopwatch("productive", clock=clock)
    with watch.phase("eval"):
        clock.tick(2.0)
        with watch.phase("checkpoint"):
            clock.tick(1.0)
        assert watch.current == "eval"
        clock.tick(0.5)
    assert watch.current == "productive"
    with pytest.raises(RuntimeError), watch.phase("restore"):
        clock.tick(3.0)
        raise RuntimeError
    assert watch.current == "productive"
    timed = watch.timed("data", lambda n: clock.tick(n) or n)
    assert timed(0.25) == 0.25 and watch.current == "productive"
    clock.tick(1.0)
    seconds = watch.elapsed()
    assert (seconds["eval"], seconds["checkpoint"], seconds["restore"], seconds["data"], seconds["productive"]) == \
        (2.5, 1.0, 3.0, 0.25, 1.0)


def test_steps_up_to_the_recorded_max_step_are_lost_and_the_first_call_is_compile(tmp_path):
    (tmp_path / "goodput.json").write_text(json.dumps(
        {"attempts": 1, "max_step": 5, "lost_steps": 0, "seconds": {"productive": 6.0, "startup": 2.0}}))
    clock = FakeClock()
    gp = goodput.Goodput(goodput.Stopwatch(clock=clock), str(tmp_path), primary=True)
    categories = []
    for step in range(4, 8):  # resumed from a checkpoint at step 3: 4 and 5 are redone
        with gp.step(step, compiling=step == 4):
            categories.append(gp.stopwatch.current)
            clock.tick(1.0)
        categories.append(gp.stopwatch.current)  # the device's time for the step, until the next switch
        clock.tick(1.0)
    assert categories == ["compile", "lost", "lost", "lost", "productive", "productive", "productive", "productive"]
    assert (gp.lost_steps, gp.max_step) == (2, 7)
    seconds = gp.seconds()
    assert (seconds["compile"], seconds["lost"], seconds["productive"], seconds["startup"]) == (1.0, 3.0, 10.0, 2.0)


def test_goodput_json_round_trip_and_the_rows_shares(tmp_path):
    clock = FakeClock()
    first = goodput.Goodput(goodput.Stopwatch(clock=clock), str(tmp_path), primary=True)
    assert goodput.read(str(tmp_path))["attempts"] == 1  # on record from the start
    clock.tick(2.0)
    with first.step(1, compiling=True):
        clock.tick(3.0)
    clock.tick(5.0)
    row = first.counters()  # written as the row's values are taken
    assert row == {"goodput": 0.5, "badput/compile": 0.3, "badput/checkpoint": 0.0, "badput/data": 0.0,
                   "badput/eval": 0.0, "badput/restore": 0.0, "badput/lost": 0.0, "badput/startup": 0.2,
                   "lost_steps": 0}
    assert goodput.read(str(tmp_path)) == first.record() == {
        "attempts": 1, "max_step": 1, "lost_steps": 0,
        "seconds": {**dict.fromkeys(goodput.CATEGORIES, 0.0), "startup": 2.0, "compile": 3.0, "productive": 5.0}}
    assert not list(tmp_path.glob("*.tmp"))  # replaced, not left behind

    second = goodput.Goodput(goodput.Stopwatch(clock=clock), str(tmp_path), primary=True)  # the next attempt
    clock.tick(10.0)
    with second.step(1, compiling=True):  # redone from scratch
        second.close()
    record = goodput.read(str(tmp_path))
    assert record["attempts"] == 2 and record["max_step"] == 1 and record["lost_steps"] == 1
    assert record["seconds"]["startup"] == 12.0 and sum(record["seconds"].values()) == 20.0
    assert goodput.summary_line(record) == (
        "goodput 25.0% of 20.0s over 2 attempts (compile 15.0%, checkpoint 0.0%, data 0.0%, eval 0.0%, "
        "restore 0.0%, lost 0.0%, startup 60.0%; 1 step redone)")


def test_other_processes_and_a_file_that_does_not_parse(tmp_path, capsys):
    other = goodput.Goodput(goodput.Stopwatch(clock=FakeClock()), str(tmp_path), primary=False)
    other.counters()
    other.close()
    assert list(tmp_path.iterdir()) == []  # only process 0 writes
    (tmp_path / "goodput.json").write_text('{"attempts": 3, "max_')  # cut short by hand
    assert goodput.read(str(tmp_path)) is None
    assert "goodput.json does not parse" in capsys.readouterr().err
    assert goodput.Goodput(goodput.Stopwatch(), str(tmp_path), primary=True).attempts == 1


def test_the_timed_checkpointer_times_its_blocking_calls_and_passes_the_rest():
    clock = FakeClock()
    watch = goodput.Stopwatch("productive", clock=clock)

    class Checkpointer:
        directory = "/run/checkpoints"

        def save(self, step, **kwargs):
            clock.tick(2.0)
            return step

        def restore_latest(self, abstract):
            clock.tick(4.0)

        def discard_after(self, step):
            clock.tick(16.0)

        def latest_step(self):
            clock.tick(8.0)
            return 3

    ckpt = goodput.TimedCheckpointer(Checkpointer(), watch)
    assert ckpt.save(7, kind="local") == 7 and ckpt.directory == "/run/checkpoints"
    ckpt.restore_latest(None)
    ckpt.discard_after(3)  # a rollback's
    assert ckpt.latest_step() == 3  # not timed: the category current
    seconds = watch.elapsed()
    assert (seconds["checkpoint"], seconds["restore"], seconds["productive"]) == (2.0, 20.0, 8.0)


def test_process_age_and_the_stopwatch_from_the_process_start():
    age = goodput.process_age()
    assert age is not None and 0 <= age < 3600  # Linux: the test process started this long ago
    assert goodput.Stopwatch.since_process_start().elapsed()["startup"] >= age - 0.05


def test_tensorboard_groups_goodput():
    assert metrics.tensorboard_tag("goodput") == "goodput/goodput"
    assert metrics.tensorboard_tag("badput/eval") == "badput/eval"


def test_the_plot_stacks_each_runs_wall_time(tmp_path):
    runs = []
    for name, n in (("a", 4), ("b", 2), ("c", 3)):
        run = tmp_path / name
        run.mkdir()
        rows = [{"step": s, "loss": 3.0, "goodput": 0.5, **{f"badput/{c}": 0.5 / len(goodput.BADPUT)
                                                          for c in goodput.BADPUT}} for s in range(1, n + 1)]
        rows.append({"step": 2, "eval_loss": 3.0})  # an eval row has none
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        runs.append(str(run))
    steps, shares = plot.wall_time_shares(metrics.read_metrics(runs[0]))
    assert steps == [1, 2, 3, 4] and list(shares) == list(goodput.CATEGORIES)
    assert [sum(column) for column in zip(*shares.values())] == pytest.approx([1.0] * 4)
    (tmp_path / "none").mkdir()
    (tmp_path / "none" / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')  # from before goodput
    out = tmp_path / "curves.png"
    plot.plot_runs([*runs, str(tmp_path / "none")], str(out))  # four runs: a third row of panels
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ----------------------------------------------------------------------------- runs


@pytest.mark.slow
@pytest.mark.ci
def test_steps_replayed_after_a_restore_in_the_run_are_lost(tmp_path, data_dirs):
    """NaN gradients at steps 6-8: at the save point of step 8 the run goes back to the checkpoint
    of step 4, and steps 5-8 are trained again."""
    cfg = config_lib.resolve(with_overrides(load_config("tiny"), {
        **data_dirs, "steps": 10, "log_every_steps": 1, "eval.every_steps": 0, "metrics.tensorboard": False,
        "checkpoint.every_steps": 4, "debug.nan_at_step": 5, "debug.nan_steps": 3}), jax.device_count())
    loop.train_and_evaluate(cfg, str(tmp_path))
    record = goodput.read(tmp_path)
    assert (record["attempts"], record["max_step"], record["lost_steps"]) == (1, 10, 4)
    assert record["seconds"]["lost"] > 0 and record["seconds"]["restore"] > 0
    rows = [(row["step"], row["lost_steps"]) for row in metrics_rows(tmp_path) if "loss" in row]
    assert rows == [*((s, 0) for s in range(1, 9)), (5, 1), (6, 2), (7, 3), (8, 4), (9, 4), (10, 4)]


# ----------------------------------------------------------------------------- through the command


def train(workdir, data_dirs, steps):
    flags = {**data_dirs, "steps": steps, "log_every_steps": 1, "checkpoint.every_steps": 2, "eval.every_steps": 0,
             "metrics.tensorboard": False, "optim.warmup_steps": 1}
    return subprocess.run([sys.executable, "-m", "maxlm.train", "--config=configs/tiny.py", f"--workdir={workdir}",
                           *(f"--config.{k}={v}" for k, v in flags.items())],
                          cwd=ROOT, env=command_env(workdir.parent, devices=None), capture_output=True, text=True,
                          timeout=300)


@pytest.mark.slow
@pytest.mark.ci  # make test keeps within its 12 minutes (CI runs it: make test-ci)
def test_a_run_reports_goodput_and_counts_the_steps_a_resume_redoes(tmp_path, data_dirs):
    run = tmp_path / "run"
    first = train(run, data_dirs, 4)
    assert first.returncode == 0, first.stderr[-3000:]
    rows = [row for row in metrics_rows(run) if "loss" in row]
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    for row in rows:  # the shares tile the wall time
        assert sum(row[f"badput/{c}"] for c in goodput.BADPUT) + row["goodput"] == pytest.approx(1.0, abs=1e-6)
        assert row["lost_steps"] == 0 and 0 < row["goodput"] < 1
    assert rows[0]["badput/compile"] > 0 and rows[-1]["badput/checkpoint"] > 0  # step 2's save is in step 3's
    record = goodput.read(run)
    assert (record["attempts"], record["max_step"], record["lost_steps"]) == (1, 4, 0)
    assert record["seconds"]["startup"] > 0 and record["seconds"]["productive"] > 0
    lines = first.stdout.splitlines()
    assert lines[0].startswith("done at step 4") and lines[1].startswith("goodput ") and "over 1 attempt (" in lines[1]

    # the checkpoint of step 4 lost (a kill before it committed): the resume goes back to step 2
    shutil.rmtree(run / "checkpoints" / "4")
    second = train(run, data_dirs, 5)
    assert second.returncode == 0, second.stderr[-3000:]
    record = goodput.read(run)
    assert (record["attempts"], record["max_step"], record["lost_steps"]) == (2, 5, 4 - 2)
    assert record["seconds"]["lost"] > 0 and record["seconds"]["restore"] > 0
    resumed = [row for row in metrics_rows(run) if "loss" in row][4:]
    assert [(row["step"], row["lost_steps"]) for row in resumed] == [(3, 1), (4, 2), (5, 2)]
    assert "over 2 attempts" in second.stdout and "; 2 steps redone)" in second.stdout
