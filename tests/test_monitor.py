"""The guides' ranges, watched (maxlm/observe/monitor.py): warnings and markers after `patience`
logged rows out of range, once per excursion, and the line when a quantity is back; the clipping
metrics; the guides' units (`batch_tokens`, `optim.warmup_fraction`) resolved to the keys the run
reads; the start-up budget line."""

import logging
import subprocess
import sys

import jax
import numpy as np
import pytest

from maxlm import config as config_lib
from maxlm.observe import monitor, step_logger
from tests.helpers import ROOT, command_env, load_config, packed_batch, train_metrics, with_overrides

GRAD = monitor.marker("grad_norm")


def watching(accelerator=False, **overrides):
    """The Monitor of the defaults with `overrides` (warmup: optim.warmup_steps = 10)."""
    cfg = with_overrides(config_lib.defaults(), {"optim.warmup_steps": 10, "monitor.patience": 3, **overrides})
    return monitor.Monitor.from_config(cfg, accelerator=accelerator)


def feed(mon, rows):
    """[(step, markers, [(warning?, text)])] for rows {step: row}."""
    out = []
    for step, row in rows.items():
        markers, notes = mon.observe(step, row)
        out.append((step, markers, [(n.warning, n.text) for n in notes]))
    return out


def test_a_range_warns_after_patience_rows_once_and_says_when_it_is_back():
    mon = watching(**{"monitor.update_ratio_low": 0.0, "monitor.update_ratio_high": 0.0})  # grad_norm only
    norms = {5: 9.0, 10: 9.0,  # the warmup: not watched
             20: 3.0, 30: 2.5, 40: 2.1,  # 3 rows above 2: the warning, at the third
             50: 5.0, 60: 0.6,  # still out (no second warning), then back
             70: 0.4, 80: 0.3, 90: 1.0,  # 2 rows below: under the patience, no warning
             100: 0.1, 110: 0.2, 120: 0.3}  # 3 rows below: the next excursion warns again
    got = feed(mon, {s: {"grad_norm": v, "applied": 1.0} for s, v in norms.items()})
    markers = {step: m[GRAD] for step, m, _ in got}
    assert markers == {5: 0, 10: 0, 20: 0, 30: 0, 40: 1, 50: 1, 60: 0, 70: 0, 80: 0, 90: 0, 100: 0, 110: 0, 120: 1}
    notes = [(step, n) for step, _, ns in got for n in ns]
    assert [(step, warning) for step, (warning, _) in notes] == [(40, True), (60, False), (120, True)]
    assert notes[0][1][1].startswith("step 40: grad_norm 2.1 has been outside [0.5, 2] for 3 logged rows "
                                     "(since step 20): growing gradients often come before a loss spike")
    assert notes[0][1][1].endswith("(docs/observability.md#the-guides-ranges-watched)")
    assert notes[1][1][1] == "step 60: grad_norm 0.6 is back in [0.5, 2] (outside from step 20 to step 50)"
    assert "small gradients" in notes[2][1][1] and "since step 100" in notes[2][1][1]
    assert set(got[0][1]) == {GRAD}  # every row carries the marker of each watch that is on


def test_skipped_steps_neither_count_nor_end_an_excursion():
    mon = watching()
    rows = {20: {"grad_norm": 3.0, "update_ratio": 0.01, "applied": 1.0},
            30: {"grad_norm": float("nan"), "update_ratio": 0.0, "applied": 0.0},  # skipped: ignored
            40: {"grad_norm": 3.0, "update_ratio": 0.01, "applied": 1.0},
            50: {"grad_norm": 3.0, "update_ratio": 0.01, "applied": 1.0}}
    got = feed(mon, rows)
    assert [m[GRAD] for _, m, _ in got] == [0, 0, 0, 1]
    assert [m[monitor.marker("update_ratio")] for _, m, _ in got] == [0, 0, 0, 0]  # 0 skipped: not "too low"
    assert [step for step, _, notes in got if notes] == [50]


def test_the_update_ratio_memory_and_mfu_watches():
    mon = watching(accelerator=True)
    row = {"grad_norm": 1.0, "update_ratio": 0.05, "memory_peak_fraction": 0.97, "mfu": 0.05, "applied": 1.0}
    got = feed(mon, {s: row for s in (20, 30, 40)})
    assert got[-1][1] == {GRAD: 0, monitor.marker("update_ratio"): 1, monitor.marker("memory_peak_fraction"): 1,
                          monitor.marker("mfu"): 1}
    texts = [text for _, _, notes in got for _, text in notes]
    assert texts[0].startswith("step 40: update_ratio 0.05 has been outside [0.0001, 0.03] for 3 logged rows")
    assert "optim.lr may be too high" in texts[0]
    assert texts[1].startswith("step 40: memory_peak_fraction 97.0% has been above 95.0% for 3 logged rows")
    assert texts[2].startswith("step 40: mfu 5.0% has been below 20.0% for 3 logged rows")
    back = feed(mon, {50: dict(row, update_ratio=0.01, memory_peak_fraction=0.5, mfu=0.5)})[0][2]
    assert [text.split(" (")[0] for _, text in back] == [
        "step 50: update_ratio 0.01 is back in [0.0001, 0.03]", "step 50: memory_peak_fraction 50.0% is back at or "
        "below 95.0%", "step 50: mfu 50.0% is back at or above 20.0%"]
    # the CPU: no MFU watch, and no memory in the rows, so neither marker
    got = feed(watching(), {s: {k: v for k, v in row.items() if k != "memory_peak_fraction"} for s in (20, 30, 40)})
    assert set(got[-1][1]) == {GRAD, monitor.marker("update_ratio")}


def test_off_switches():
    assert watching(**{"monitor.enabled": False}).watches == []
    names = [w.name for w in watching(accelerator=True, **{"monitor.grad_norm_low": 0.0, "monitor.grad_norm_high": 0.0,
                                                          "monitor.memory_high": 0.0, "monitor.mfu_low": 0.0}).watches]
    assert names == ["update_ratio"]
    one_sided = watching(**{"monitor.grad_norm_low": 0.0}).watches[0]  # no lower bound
    assert one_sided.outside_text() == "above 2" and not one_sided.is_outside(1e-9) and one_sided.is_outside(2.5)
    with pytest.raises(config_lib.ConfigError, match=r"monitor.grad_norm_low=3 must be below monitor.grad_norm_high=2"):
        config_lib.resolve(with_overrides(load_config("tiny"), {"monitor.grad_norm_low": 3.0}), 8)


class Recorder:
    def __init__(self):
        self.rows = []

    def write(self, step, row):
        self.rows.append((step, dict(row)))


def test_the_step_logger_writes_the_clipped_fraction_and_the_markers_and_warns_after_the_line(
        monkeypatch, caplog, capsys):
    monkeypatch.setattr(step_logger.time, "perf_counter", iter(np.arange(100.0, 200.0)).__next__)
    caplog.set_level(logging.INFO, logger="maxlm")
    writer = Recorder()
    logger = step_logger.StepLogger(writer, start_step=0, total_steps=8, log_every=2, tokens_per_step=1000,
                                    flops_per_token=10.0, peak_flops_per_sec=1e6,
                                    monitor=watching(**{"optim.warmup_steps": 0, "monitor.patience": 2}))
    clipped = [1, 0, 1, 1, 0, 0, 1, 0]
    for done in range(1, 9):
        norm = 3.0 if done <= 4 else 1.0
        logger.step_done(done, {"loss": np.float32(2.0), "num_tokens": np.float32(1000), "bad_streak": np.int32(0),
                                "applied": np.int32(1), "grad_norm": np.float32(norm), "update_ratio": np.float32(0.01),
                                "clipped": np.int32(clipped[done - 1]),
                                "clipped_grad_norm": np.float32(min(norm, 1.0))})
    logger.flush()
    rows = dict(writer.rows)
    assert [rows[s]["clipped_fraction"] for s in (2, 4, 6, 8)] == [0.5, 1.0, 0.0, 0.5]  # the steps since the last row
    assert "clipped" not in rows[2] and rows[2]["clipped_grad_norm"] == 1.0
    assert [rows[s][GRAD] for s in (2, 4, 6, 8)] == [0, 1, 0, 0]
    assert "step 4: grad_norm 3 has been outside [0.5, 2] for 2 logged rows (since step 2)" in capsys.readouterr().err
    lines = [r.getMessage() for r in caplog.records]
    back = lines.index("step 6: grad_norm 1 is back in [0.5, 2] (outside from step 2 to step 4)")
    assert lines[back - 1].startswith("step      6 | loss")  # after the row's line


def test_the_step_reports_the_clipped_norm_and_whether_it_clipped():
    cfg = config_lib.resolve(with_overrides(load_config("tiny"), {"optim.warmup_steps": 0, "optim.clip_norm": 0.575}), 1)
    rows, _ = train_metrics(cfg, 3, lambda s: packed_batch(cfg.batch_size, cfg.seq_len, cfg.model.vocab_size, seed=s),
                            devices=jax.devices()[:1])
    for row in rows:
        norm = float(row["grad_norm"])
        assert int(row["clipped"]) == (norm > 0.575)
        assert float(row["clipped_grad_norm"]) == pytest.approx(min(norm, 0.575))
    assert {int(row["clipped"]) for row in rows} == {0, 1}, [float(r["grad_norm"]) for r in rows]
    no_clip = config_lib.resolve(with_overrides(load_config("tiny"), {"optim.clip_norm": 0.0}), 1)
    from maxlm.optim import optimizers as optim
    from maxlm.sharding import state as state_lib
    from maxlm.train import step as step_lib

    tx = optim.make_optimizer(no_clip)
    state = jax.eval_shape(lambda: state_lib.init_state(no_clip, tx, jax.random.key(0)))
    batch = packed_batch(no_clip.batch_size, no_clip.seq_len, no_clip.model.vocab_size)
    _, shapes = jax.eval_shape(lambda s, b: step_lib.train_step(no_clip, tx, optim.learning_rate_schedule(no_clip), s, b,
                                                                1.0), state, batch)
    assert "clipped" not in shapes and "clipped_grad_norm" not in shapes


# --- the guides' units ----------------------------------------------------------------------


def resolve(**overrides):
    return config_lib.resolve(with_overrides(config_lib.defaults(), overrides), 8)


def test_warmup_fraction_resolves_to_warmup_steps():
    assert resolve().optim.warmup_steps == 100 and resolve().optim.warmup_fraction == 0.0
    assert resolve(**{"optim.warmup_fraction": 0.02}).optim.warmup_steps == 20  # of steps=1000
    assert resolve(**{"optim.warmup_fraction": 0.025, "steps": 100}).optim.warmup_steps == 3  # rounded half up
    assert resolve(**{"optim.warmup_fraction": 1e-4}).optim.warmup_steps == 1  # at least one step
    assert resolve(**{"optim.warmup_fraction": 1.0}).optim.warmup_steps == 1000
    by_fraction = resolve(**{"optim.warmup_fraction": 0.02}).to_dict()
    by_fraction["optim"]["warmup_fraction"] = 0.0
    assert by_fraction == resolve(**{"optim.warmup_steps": 20}).to_dict()  # what the run reads: the same
    resolved = resolve(**{"optim.warmup_fraction": 0.03})
    again = config_lib.resolve(config_lib.from_recorded(resolved.to_dict()), 8)  # config.json resolves again
    assert again.optim.warmup_steps == 30 and again.optim.decay_steps == 1000
    with pytest.raises(config_lib.ConfigError, match=r"^optim.warmup_fraction=0.02 \(= 20 of steps=1000\) and "
                       r"optim.warmup_steps=50 are both set \(both in the config file, or both on the command "
                       r"line\): give one of them$"):
        resolve(**{"optim.warmup_fraction": 0.02, "optim.warmup_steps": 50})
    with pytest.raises(config_lib.ConfigError, match=r"optim.warmup_fraction must be in \[0, 1\], got 1.5"):
        resolve(**{"optim.warmup_fraction": 1.5})


def test_batch_tokens_resolve_to_batch_size():
    cfg = resolve(batch_tokens=4096)  # seq_len 256
    assert cfg.batch_size == 16 and cfg.batch_tokens == 4096
    assert dict(cfg.to_dict(), batch_tokens=0) == resolve(batch_size=16).to_dict()  # what the run reads: the same
    assert config_lib.resolve(config_lib.from_recorded(cfg.to_dict()), 8).batch_size == 16
    assert resolve(batch_tokens=4096, batch_size=16).batch_size == 16  # agreeing: fine
    assert resolve().batch_size == 8
    with pytest.raises(config_lib.ConfigError, match=r"^batch_tokens=4000 must be divisible by seq_len=256: the batch "
                       r"is whole sequences \(3840 or 4096 tokens\)$"):
        resolve(batch_tokens=4000)
    with pytest.raises(config_lib.ConfigError, match=r"^batch_tokens=4096 \(= 16 sequences of seq_len=256\) and "
                       r"batch_size=32 are both set \(both in the config file, or both on the command line\): give "
                       r"one of them$"):
        resolve(batch_tokens=4096, batch_size=32)
    # the resolved batch meets the batch_size rules: 2 sequences over 8 devices
    with pytest.raises(config_lib.ConfigError, match="batch_size=2 must be divisible by"):
        resolve(batch_tokens=512)


@pytest.mark.parametrize("flags, expected", [
    (["--config.batch_tokens=100"], "batch_tokens=100 must be divisible by seq_len=64"),
    # two warmups on the command line (configs/tiny.py's own warmup_steps=5 would give way to the flag)
    (["--config.optim.warmup_fraction=0.1", "--config.optim.warmup_steps=7"],
     "optim.warmup_fraction=0.1 (= 2 of steps=20) and optim.warmup_steps=7 are both set"),
])
def test_the_units_errors_exit_2_through_the_cli(tmp_path, flags, expected):
    result = subprocess.run(
        [sys.executable, "-m", "maxlm.train", f"--workdir={tmp_path / 'run'}", "--config=configs/tiny.py", *flags],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env=command_env(tmp_path, devices=None))
    assert result.returncode == 2 and f"maxlm: config error: {expected}" in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr and not (tmp_path / "run").exists()


def test_the_budget_line():
    # as `--config.batch_tokens=4096` gives it, over the file's batch_size
    cfg = config_lib.resolve(with_overrides(load_config("quickstart"), {"batch_tokens": 4096}), 1, flags=["batch_tokens"])
    assert cfg.batch_size == 32  # 4096 tokens of seq_len 128
    flops = 5.31e6  # training FLOPs per token
    assert step_logger.budget_line(cfg, flops) == (
        "budget: 4,096 tokens per batch (32 x 128), 1,228,800 tokens in 300 steps, "
        f"{flops * 1_228_800:.3g} training FLOPs = {flops * 1_228_800 / 8.64e19:.3g} PF-days")
    assert f"{flops * 1_228_800:.3g}" == "6.52e+12" and f"{flops * 1_228_800 / 8.64e19:.3g}" == "7.55e-08"
