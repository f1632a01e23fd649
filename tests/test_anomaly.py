"""Loss-spike recovery (maxlm/resilience/anomaly.py): the detector's arithmetic, the skip list, and real
in-process runs of configs/tiny.py where an injected spike (the batch at data position 13 trained
at 1000x the lr) is rolled back, its batches skipped, and a resume after it is bitwise exact."""

import json
import math
import re
import shutil

import jax
import numpy as np
import pytest

from maxlm import config as config_lib
from maxlm.resilience import anomaly
from maxlm.runtime.errors import ConfigError
from maxlm.train import loop
from tests.helpers import metrics_rows, saved_meta, saved_state, tiny, train_rows

SPIKE = {"eval.every_steps": 0, "log_every_steps": 1, "metrics.tensorboard": False,
         "checkpoint.every_steps": 5, "anomaly.enabled": True, "anomaly.warmup": 8, "anomaly.ema": 0.9,
         "anomaly.spike_sigma": 3.0, "anomaly.max_spikes": 2, "anomaly.skip_batches": 3,
         "debug.spike_at_batch": 13, "debug.spike_lr_scale": 1000.0}


def anomaly_cfg(**overrides):
    cfg = config_lib.defaults().anomaly
    cfg.update({"enabled": True, **overrides})
    return cfg


def test_detector_flags_a_spike_after_warmup_and_keeps_it_out_of_the_statistics():
    detector = anomaly.SpikeDetector(anomaly_cfg(warmup=3, ema=0.5, spike_sigma=2.0, max_spikes=2))
    assert [detector.observe(s, x) for s, x in enumerate([4.0, 2.0, 100.0])] == [False] * 3  # warmup
    # after 4, 2, 100: mean 4 → 3 → 51.5; var 0 → 0.5·(0 + 0.5·2²) = 1 → 0.5·(1 + 0.5·97²) = 2352.75
    assert detector.stats.mean == 51.5 and detector.stats.var == 2352.75
    assert detector.threshold() == 51.5 + 2 * math.sqrt(2352.75)
    assert detector.observe(3, 200.0) and detector.stats.streak == 1 and detector.stats.first == 3
    assert detector.stats.mean == 51.5 and detector.stats.count == 3  # a spike is not a sample
    assert not detector.rollback_due()
    assert detector.observe(4, 300.0) and detector.rollback_due() and detector.stats.first == 3
    assert not detector.observe(5, 50.0) and detector.stats.streak == 0 and detector.stats.first == -1


def test_data_position_is_the_step_plus_the_skips_before_it():
    skips = [(10, 6), (10, 2), (30, 5)]
    assert [anomaly.data_position(s, skips) for s in (0, 9, 10, 29, 30, 31)] == [0, 9, 18, 37, 43, 44]
    assert anomaly.data_position(7, []) == 7


def test_rollbacks_stop_after_max_rollbacks_without_progress():
    anomalies = anomaly.Anomalies(anomaly_cfg(max_rollbacks=1, skip_batches=4))
    anomalies.check_rollback(last_spike=17)
    assert anomalies.rolled_back(17, restored_step=10, restored_meta=None) == 8  # through the spike
    with pytest.raises(anomaly.LossSpikeError, match=r"still after 1 rollback\(s\).*max_rollbacks=1"):
        anomalies.check_rollback(last_spike=19)
    anomalies.saved(20)  # a checkpoint past the spike: rollbacks count afresh
    anomalies.check_rollback(last_spike=33)


def test_meta_round_trips_the_skips_statistics_and_the_unread_loss():
    anomalies = anomaly.Anomalies(anomaly_cfg(warmup=0))
    for step, loss in enumerate([3.0, 2.5, 2.25]):
        anomalies.spiked(step, {"loss": np.float32(loss), "bad_streak": np.int32(0), "applied": np.int32(1)})
    anomalies.skips.append((1, 5))
    meta = json.loads(json.dumps(anomalies.meta()))
    again = anomaly.Anomalies(anomaly_cfg(warmup=0), meta)
    assert again.skips == [(1, 5)] and again.detector.stats == anomalies.detector.stats
    assert meta["anomaly"]["pending"] == [2, 2.25, 0, 1]  # the last loss, not yet read into the stats
    # a checkpoint from before `applied` was recorded: bad_streak 0 meant an applied step
    older = dict(meta["anomaly"], pending=[2, 2.25, 0])
    assert anomaly.Anomalies(anomaly_cfg(warmup=0), {"anomaly": older})._previous[1]["applied"] == 1
    assert anomaly.Anomalies(anomaly_cfg(enabled=False)).meta() == {}


@pytest.mark.parametrize("overrides, message", [
    ({"anomaly.ema": 1.0}, "anomaly.ema must be in (0, 1)"),
    ({"anomaly.max_spikes": 0}, "anomaly.max_spikes must be a positive int"),
    ({"debug.spike_at_batch": -3}, "debug.spike_at_batch must be a data position"),
])
def test_bad_anomaly_keys_are_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        tiny(overrides, devices=8)


@pytest.fixture(scope="module")
def spike_run(tmp_path_factory, data_dirs):
    workdir = tmp_path_factory.mktemp("spike")
    loop.train_and_evaluate(tiny(data_dirs, SPIKE), str(workdir))
    return workdir


pytestmark = pytest.mark.slow


def test_a_spike_rolls_back_and_skips_its_batches(spike_run, capsys):
    """The update of step 13 (index) runs at 1000x the lr: the losses of steps 14 and 15 spike (rows
    15 and 16), so the run goes back to the checkpoint of step 10 and reads from there the batches
    6 further on (3 asked for, 6 to get past the spike), the spiked checkpoint of step 15 removed."""
    written = [row for row in metrics_rows(spike_run) if "loss" in row]  # steps after the rollback twice
    assert [row["step"] for row in written] == [*range(1, 17), *range(11, 21)]
    assert written[15]["loss"] > 3 * written[13]["loss"] and written[15]["spikes"] == 0  # read late
    r = train_rows(spike_run)
    assert r[20]["spikes"] == 2 and r[20]["rollbacks"] == 1 and r[14]["rollbacks"] == 1
    assert math.isfinite(r[20]["loss"]) and r[20]["loss"] < r[14]["loss"]
    meta = saved_meta(spike_run, 20)
    assert meta["anomaly"]["skips"] == [[10, 6]] and meta["data_position"] == 26
    meta15 = saved_meta(spike_run, 15)  # written again after the rollback: it reads batch 21 next
    assert meta15["data_position"] == 21 and meta15["anomaly"]["rollbacks"] == 1


@pytest.mark.parametrize("keep", [pytest.param(10, marks=pytest.mark.ci), 15])
def test_resume_before_and_after_the_rollback_is_bitwise_exact(spike_run, tmp_path, data_dirs, keep):
    """From the checkpoint of step 10 (before the spike: it spikes and rolls back again) and from
    step 15 (after the rollback: the skip list and the detector come from its meta), the run ends
    with the uninterrupted run's state and losses, bit for bit."""
    run = tmp_path / "run"
    shutil.copytree(spike_run, run)
    for step in (10, 15, 20):
        if step > keep:
            shutil.rmtree(run / "checkpoints" / str(step))
    (run / "metrics.jsonl").write_text("")
    loop.train_and_evaluate(tiny(data_dirs, SPIKE), str(run))
    resumed, clean = train_rows(run), train_rows(spike_run)
    assert [resumed[s]["loss"] for s in range(keep + 1, 21)] == [clean[s]["loss"] for s in range(keep + 1, 21)]
    assert resumed[20]["rollbacks"] == 1 and resumed[20]["spikes"] == 2
    jax.tree.map(np.testing.assert_array_equal, saved_state(run, 20), saved_state(spike_run, 20))
    assert saved_meta(run, 20)["anomaly"] == saved_meta(spike_run, 20)["anomaly"]


@pytest.mark.ci
def test_off_by_default_the_spike_stays(data_dirs, tmp_path):
    cfg = tiny(data_dirs, SPIKE, **{"anomaly.enabled": False, "steps": 16})
    loop.train_and_evaluate(cfg, str(tmp_path))
    r = train_rows(tmp_path)
    # the spike stays: worse than the untrained model's first step and over twice step 14's loss
    # (2.6x on jax 0.12; a fixed 3x held on jax 0.10 only), and nothing flagged
    assert r[16]["loss"] > max(r[1]["loss"], 2 * r[14]["loss"]) and "spikes" not in r[16]
    meta = saved_meta(tmp_path, 16)
    assert "anomaly" not in meta and meta["data_position"] == 16
