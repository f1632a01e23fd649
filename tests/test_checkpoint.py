"""Checkpoints: non-finite steps, damaged and incomplete checkpoints, keep policies, verify/list,
restore onto another mesh, restore_from. In-process runs of configs/tiny.py (eval off)."""

import json
import logging
import math
import re
import shutil

import jax
import jax.numpy as jnp
import pytest
from ml_collections import ConfigDict

from maxlm import config as config_lib
from maxlm.checkpoint import __main__ as checkpoint_command, compatibility, store as checkpoint
from maxlm.resilience import faults
from maxlm.train import loop
from tests.helpers import saved_meta, saved_state, tiny, train_rows

BASE = {"eval.every_steps": 0, "log_every_steps": 1, "metrics.tensorboard": False,
        "checkpoint.every_steps": 5}


def steps_in(workdir):
    return sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory, data_dirs):
    workdir = tmp_path_factory.mktemp("clean")
    loop.train_and_evaluate(tiny(data_dirs, BASE), str(workdir))
    return workdir


pytestmark = pytest.mark.slow


def test_clean_run_checkpoints(clean_run, monkeypatch):
    assert steps_in(clean_run) == [10, 15, 20]  # every 5, max_to_keep 3
    meta = saved_meta(clean_run, 20)
    assert meta["step"] == meta["data_position"] == 20 and meta["seed"] == 0
    assert meta["kind"] == "final" and meta["lr_scale"] == 1.0
    assert checkpoint_command.main(["verify", str(clean_run)]) == 0
    monkeypatch.chdir(clean_run.parent)  # a relative DIR, as users type it
    assert checkpoint_command.main(["verify", clean_run.name]) == 0


def test_nan_step_skipped_counted_never_saved(tmp_path, data_dirs, clean_run, caplog):
    """Step 14's gradients are NaN: the update is skipped inside the step, counted, and the
    time-based save that falls on it waits for the next good step. (With every_minutes this small
    and a log row every step, process 0's clock says a save is due at every step; it is read one
    step late and a save restarts it: temporary saves fall on 12, 14, 17, 19.)"""
    caplog.set_level(logging.INFO, logger="maxlm")
    cfg = tiny(data_dirs, BASE, **{"debug.nan_at_step": 13, "checkpoint.every_minutes": 1e-5})
    last = loop.train_and_evaluate(cfg, str(tmp_path))
    rows = train_rows(tmp_path)
    assert not math.isfinite(float(rows[14]["grad_norm"])) and rows[14]["skipped_steps"] == 1
    assert rows[14]["param_norm"] == rows[13]["param_norm"]  # not applied
    assert "step 14 was non-finite: its checkpoint waits for a good step" in caplog.text
    assert last["skipped_steps"] == 1 and last["bad_streak"] == 0
    clean = train_rows(clean_run)
    assert [rows[s]["loss"] for s in range(1, 15)] == [clean[s]["loss"] for s in range(1, 15)]
    assert rows[20]["loss"] != clean[20]["loss"]
    # temporary (every_minutes) saves were replaced by the next one; regular ones kept
    assert steps_in(tmp_path) == [10, 15, 20]
    assert checkpoint_command.main(["verify", str(tmp_path)]) == 0


def test_bad_streak_restores_last_good_checkpoint(tmp_path, data_dirs, clean_run, capsys):
    """3 consecutive NaN steps (a transient fault) → back to step 10, replay: the clean losses."""
    cfg = tiny(data_dirs, BASE, **{"debug.nan_at_step": 11, "debug.nan_steps": 3,
                             "checkpoint.restore_lr_scale": 0.5})
    last = loop.train_and_evaluate(cfg, str(tmp_path))
    err = capsys.readouterr().err
    assert "3 consecutive non-finite steps up to step 14: restored step 10" in err
    assert "lr scale 0.5" in err
    assert last["step"] == 20 and last["skipped_steps"] == 0
    meta = saved_meta(tmp_path, 20)
    assert meta["lr_scale"] == 0.5  # recorded, so a resume continues with it
    rows, clean = train_rows(tmp_path), train_rows(clean_run)
    assert rows[11]["loss"] == clean[11]["loss"]  # same weights, same batch: the replay
    assert rows[12]["lr"] == pytest.approx(clean[12]["lr"] / 2)


@pytest.mark.ci
def test_persistent_nan_stops_and_keeps_last_good(tmp_path, data_dirs):
    cfg = tiny(data_dirs, BASE, **{"debug.nan_at_step": 11, "debug.nan_steps": 3,
                             "debug.nan_transient": False, "checkpoint.max_to_keep": 1})
    with pytest.raises(faults.NonFiniteLossError, match=r"still after 2 restore\(s\).*step 10"):
        loop.train_and_evaluate(cfg, str(tmp_path))
    assert steps_in(tmp_path) == [10]  # the only good one, kept whatever max_to_keep says
    assert checkpoint_command.main(["verify", str(tmp_path)]) == 0


def test_damaged_and_incomplete_checkpoints_are_skipped(tmp_path, clean_run, data_dirs, capsys):
    run = tmp_path / "run"
    shutil.copytree(clean_run, run)
    ckpts = run / "checkpoints"
    data_file = max((ckpts / "20" / "state").rglob("d/*"), key=lambda p: p.stat().st_size)
    with open(data_file, "r+b") as f:  # truncated array data
        f.truncate(50)
    (ckpts / "15" / "_CHECKPOINT_METADATA").write_text("{not json")  # unreadable metadata
    shutil.copytree(ckpts / "10", ckpts / "25.orbax-checkpoint-tmp")  # an interrupted write
    assert checkpoint_command.main(["verify", str(run)]) == 1
    out = capsys.readouterr().out
    assert "unreadable _CHECKPOINT_METADATA" in out and "does not restore" in out
    (run / "metrics.jsonl").write_text("")

    last = loop.train_and_evaluate(tiny(data_dirs, BASE, steps=20), str(run))
    err = capsys.readouterr().err
    assert f"ignoring incomplete checkpoint {ckpts / '25.orbax-checkpoint-tmp'}" in err
    assert f"skipping damaged checkpoint {ckpts / '15'}: unreadable _CHECKPOINT_METADATA" in err
    assert f"skipping damaged checkpoint {ckpts / '20'}: does not restore" in err
    assert len([line for line in err.splitlines() if "skipping damaged checkpoint" in line]) == 2
    assert last["step"] == 20
    replayed, clean = train_rows(run), train_rows(clean_run)
    assert sorted(replayed) == list(range(11, 21))  # resumed from 10
    assert all(replayed[s]["loss"] == clean[s]["loss"] for s in replayed)  # bit for bit
    # marked, not renamed (a rename copies the whole tree on Cloud Storage); kept until the run
    # saved those steps again
    assert f"replacing damaged checkpoint {ckpts / '15'}" in err and f"replacing damaged checkpoint {ckpts / '20'}" in err
    assert steps_in(run) == [10, 15, 20] and not list(ckpts.glob("*.damaged*"))
    (ckpts / "15.damaged").write_text("unreadable\n")
    capsys.readouterr()  # drop what the run printed
    assert checkpoint_command.main(["list", str(run)]) == 0
    listing = capsys.readouterr().out
    assert re.search(r"^15 +damaged", listing, re.M) and "final" in listing and ("MB" in listing or "KB" in listing)


def test_keep_policies(tmp_path):
    cfg = ConfigDict({"max_to_keep": 2, "keep_period": 4, "local_dir": ""})
    ckpt = checkpoint.Checkpointer(str(tmp_path), cfg)
    state = {"step": jnp.zeros((), jnp.int32), "w": jnp.ones((4,))}
    for step in range(1, 11):
        kind = "regular" if step % 2 == 0 else "temporary"
        ckpt.save(step, dict(state, step=jnp.int32(step)), {}, {}, kind=kind)
    ckpt.close()
    # regular: the newest 2 (8, 10) + multiples of 4 (4, 8); temporaries gone once replaced
    assert steps_in(tmp_path) == [4, 8, 10]


def test_restore_from_another_run(tmp_path, clean_run, data_dirs):
    full = tmp_path / "full"
    cfg = tiny(data_dirs, BASE, **{"checkpoint.restore_from": str(clean_run / "checkpoints" / "10")})
    loop.train_and_evaluate(cfg, str(full))
    rows, clean = train_rows(full), train_rows(clean_run)
    assert sorted(rows) == list(range(11, 21))  # the full state: step, optimizer, data position
    assert all(rows[s]["loss"] == clean[s]["loss"] for s in rows)

    params_only = tmp_path / "params"
    cfg = tiny(data_dirs, BASE, steps=3, **{"checkpoint.restore_from": str(clean_run), "optim.warmup_steps": 1,
                                      "checkpoint.restore_params_only": True})
    loop.train_and_evaluate(cfg, str(params_only))
    rows = train_rows(params_only)
    assert sorted(rows) == [1, 2, 3]  # from step 0
    assert rows[1]["loss"] < clean[1]["loss"] - 1.0  # but trained weights
    assert optimizer_counts(params_only, 3) == {3} and optimizer_counts(clean_run, 20) == {20}  # a fresh optimizer


def optimizer_counts(workdir, step):
    """The update counts in the optimizer state checkpointed at `step` (Adam's, the schedule's)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(saved_state(workdir, step)["opt_state"])
    return {int(leaf) for path, leaf in flat if "count" in jax.tree_util.keystr(path)}


def test_restore_from_nothing_is_a_config_error(tmp_path):
    with pytest.raises(ValueError, match="holds no complete checkpoint"):
        checkpoint.resolve_restore_from(str(tmp_path))


def test_expected_state_holds_a_learned_position_table():
    """verify and restore build the state from the recorded config: a learned-positions run's
    holds its table (and its Adam moments); a config recorded before `model.positions` existed
    is a RoPE model's, without one."""
    recorded = json.loads(config_lib.to_json(tiny({"model.positions": "learned"})))
    expected = compatibility.expected_state(recorded)
    assert expected["params"]["pos_embed"].shape == (64, 64)  # [seq_len, d_model]
    assert len([leaf for leaf in jax.tree.leaves(expected["opt_state"]) if leaf.shape == (64, 64)]) == 2
    older = json.loads(config_lib.to_json(tiny()))
    del older["model"]["positions"], older["model"]["max_positions"]
    assert "pos_embed" not in compatibility.expected_state(older)["params"]


def test_another_position_encoding_does_not_resume(clean_run, data_dirs, tmp_path):
    """Resuming (or restore_from) with another model.positions is one clear error before anything
    compiles, not every checkpoint set aside as damaged."""
    loop.check_start(tiny(data_dirs, BASE), str(clean_run))  # the same encoding resumes
    learned = tiny(data_dirs, BASE, **{"model.positions": "learned"})
    with pytest.raises(ValueError, match=r"^model.positions='learned', model.max_positions=64, but the "
                       r"checkpoint .*/20 was written with model.positions='rope': its parameters do not fit"):
        loop.check_start(learned, str(clean_run))
    from_run = tiny(data_dirs, BASE, **{"model.positions": "sinusoidal", "checkpoint.restore_from": str(clean_run),
                                  "checkpoint.restore_params_only": True})
    with pytest.raises(ValueError, match="was written with model.positions='rope'"):
        loop.check_start(from_run, str(tmp_path))


def test_the_command_takes_its_workdir_as_a_flag_or_alone(tmp_path):
    """`--workdir=DIR` and `--workdir DIR` as every other command takes it, or DIR alone; any other
    flag is a usage error (exit 2), not a directory of that name."""
    import subprocess
    import sys

    from tests.helpers import ROOT, command_env

    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    run = str(tmp_path / "run")
    for args in ([f"--workdir={run}"], ["--workdir", run], [run]):
        done = subprocess.run([sys.executable, "-m", "maxlm.checkpoint", "list", *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=120, env=command_env(tmp_path, devices=None))
        assert done.returncode == 0, (args, done.stderr[-2000:])
        assert done.stdout.splitlines() == [f"{run}/checkpoints: 0 checkpoint(s)"], args
    done = subprocess.run([sys.executable, "-m", "maxlm.checkpoint", "list", f"--wrokdir={run}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env=command_env(tmp_path, devices=None))
    assert done.returncode == 2 and done.stderr.startswith("maxlm: config error: usage:"), done.stderr
