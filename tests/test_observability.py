"""What a run shows: grouped TensorBoard scalars and hparams, console lines (ETA, the compile),
the update/parameter ratio, device memory, the profiler trace and `python -m maxlm.plot`.

One short training run (module-scoped) serves the TensorBoard, console, profile and plot checks.
"""

import glob
import json
import logging
import math
import os
import re
import subprocess
import sys
import types

import jax
import numpy as np
import pytest

from maxlm import config as config_lib, plot
from maxlm.observe import flops, metrics, profiler, step_logger
from maxlm.optim import optimizers as optim
from maxlm.sharding import mesh as mesh_lib, state as state_lib
from maxlm.train import loop, step as step_lib
from tests.helpers import ROOT, load_config, metrics_rows, packed_batch, tiny

STEPS = 8


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def run(tmp_path_factory, data_dirs):
    """8 steps of tiny.py: rows every 2 steps, eval every 4, steps 5-6 profiled; its log lines."""
    workdir = tmp_path_factory.mktemp("observed")
    cfg = tiny(**data_dirs, steps=STEPS, log_every_steps=2, **{
        "eval.every_steps": 4, "checkpoint.every_steps": STEPS, "profile.start_step": 5,
        "profile.num_steps": 2})
    logger, handler = logging.getLogger("maxlm"), _Lines()
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        loop.train_and_evaluate(cfg, str(workdir))
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return types.SimpleNamespace(cfg=cfg, workdir=workdir, rows=metrics_rows(workdir), log=handler.lines)


def event_accumulator(logdir):
    from tensorboard.backend.event_processing import event_accumulator as ea

    acc = ea.EventAccumulator(str(logdir), size_guidance={ea.SCALARS: 0, ea.TENSORS: 0})
    acc.Reload()
    return acc


# --- TensorBoard --------------------------------------------------------------


def test_tensorboard_holds_the_jsonl_values_under_groups(run):
    acc = event_accumulator(run.workdir)
    tags = set(acc.Tags()["scalars"])
    expected = {"train/loss", "train/lr", "train/grad_norm", "train/param_norm",
                "train/update_ratio", "train/skipped_steps", "eval/loss", "eval/perplexity",
                "perf/tokens_per_sec", "perf/step_time_sec", "perf/mfu", "perf/compile_sec"}
    assert expected <= tags, sorted(tags)
    assert not any(tag.startswith("memory/") for tag in tags)  # CPU reports no memory: omitted
    assert not any(tag in tags for tag in ("loss", "eval_loss", "tokens_per_sec"))  # flat names

    jsonl = {}  # TensorBoard tag -> {step: value}, from metrics.jsonl
    for row in run.rows:
        for name, value in row.items():
            if name != "step":
                jsonl.setdefault(metrics.tensorboard_tag(name), {})[row["step"]] = value
    assert sorted(jsonl["train/loss"]) == [2, 4, 6, 8] and sorted(jsonl["eval/loss"]) == [4, 8]
    assert set(jsonl) == tags
    for tag in tags:
        events = {e.step: e.value for e in acc.Scalars(tag)}
        assert events == pytest.approx(jsonl[tag], rel=1e-6), tag  # event files hold float32


def test_hyperparameters_are_recorded(run):
    from tensorboard.plugins.hparams import plugin_data_pb2

    content = event_accumulator(run.workdir).PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(
        content["_hparams_/session_start_info"]).session_start_info
    hparams = {k: getattr(v, v.WhichOneof("kind")) for k, v in start.hparams.items()}
    assert hparams == pytest.approx(metrics.flatten_config(run.cfg.to_dict()))
    assert hparams["optim.lr"] == pytest.approx(3e-3) and hparams["steps"] == STEPS
    assert hparams["model.dtype"] == "float32" and hparams["model.scan_layers"] is True
    assert json.loads(hparams["mesh.rules"])[0] == ["batch", ["data", "fsdp", "expert"]]
    experiment = plugin_data_pb2.HParamsPluginData.FromString(
        content["_hparams_/experiment"]).experiment
    assert "optim.lr" in {info.name for info in experiment.hparam_infos}
    assert "eval/loss" in {info.name.tag for info in experiment.metric_infos}


def test_flatten_config():
    flat = metrics.flatten_config({"a": 1, "b": {"c": "x", "d": {"e": True}}, "r": (("x", None),),
                                   "n": None, "f": 0.5})
    assert flat == {"a": 1, "b.c": "x", "b.d.e": True, "r": '[["x", null]]', "n": "null", "f": 0.5}


# --- rows and console ---------------------------------------------------------


def test_rows_carry_the_monitored_quantities(run):
    train_rows = [r for r in run.rows if "loss" in r]
    for row in train_rows:
        assert {"param_norm", "update_ratio", "skipped_steps", "tokens_per_sec", "step_time_sec",
                "mfu", "clipped_grad_norm", "clipped_fraction"} <= set(row)
        assert 0 < row["update_ratio"] < 1 and row["param_norm"] > 0
        assert row["clipped_grad_norm"] == pytest.approx(min(row["grad_norm"], run.cfg.optim.clip_norm))
        assert row["clipped_fraction"] in (0.0, 0.5, 1.0)  # of the 2 steps since the last row
        # the watches on by default that the CPU's rows carry: no memory, no MFU on the CPU
        assert {k for k in row if k.startswith("monitor/")} == {"monitor/grad_norm_out_of_range",
                                                                "monitor/update_ratio_out_of_range"}
        assert not any(k.startswith("memory_") for k in row)  # CPU: memory_stats() is None
    # the compile is reported once, on the first training row after it
    assert [r["step"] for r in run.rows if "compile_sec" in r] == [2]
    assert train_rows[0]["compile_sec"] > 0
    for row in (r for r in run.rows if "eval_loss" in r):
        assert row["eval_perplexity"] == pytest.approx(math.exp(row["eval_loss"]))


def test_the_start_up_log_says_the_run_in_the_guides_units(run):
    """Tokens per batch, total tokens, total training FLOPs and PF-days."""
    per_token = flops.flops_per_token(run.cfg.model, run.cfg.seq_len)
    total = per_token * STEPS * 8 * 64
    assert f"budget: 512 tokens per batch (8 x 64), {STEPS * 512:,} tokens in {STEPS} steps, {total:.3g} training " \
           f"FLOPs = {total / 8.64e19:.3g} PF-days" in run.log


def test_console_announces_the_compile_and_carries_eta(run):
    compiled = [line for line in run.log if line.startswith("compiled the train step in")]
    assert len(compiled) == 1 and re.fullmatch(r"compiled the train step in \d+\.\d s", compiled[0])
    seconds = float(compiled[0].split()[-2])
    first_row = next(r for r in run.rows if "compile_sec" in r)
    assert seconds == pytest.approx(first_row["compile_sec"], abs=0.051)
    step_lines = [line for line in run.log if re.match(r"step +\d+ \| loss ", line)]
    assert len(step_lines) == 4
    for line in step_lines:
        assert re.search(r"\| tokens/s [\d,]+ \| mfu \d+\.\d% \| eta (\d+h\d\dm|\d+m\d\ds|\d+s)$", line), line
    assert step_lines[-1].endswith("eta 0s")  # nothing left after the last step
    assert any(re.match(r"step +4 \| eval_loss \d\.\d{4} \| eval_ppl ", line) for line in run.log)


def test_eta_format():
    assert step_logger.format_eta(3720) == "1h02m"
    assert step_logger.format_eta(3600 * 30) == "30h00m"
    assert step_logger.format_eta(125.4) == "2m05s"
    assert step_logger.format_eta(45) == "45s"
    assert step_logger.format_eta(0) == step_logger.format_eta(-3) == "0s"
    line = step_logger.format_line(100, {"loss": 2.34567, "tokens_per_sec": 41000.0, "mfu": 0.165},
                         eta_sec=3725)
    assert line == "step    100 | loss 2.3457 | tokens/s 41,000 | mfu 16.5% | eta 1h02m"
    eval_line = step_logger.format_line(100, {"eval_loss": 2.5, "eval_perplexity": 12.18, "eval/loss_by_position/0": 2.6,
                                              "eval/loss_by_position/32": 2.41234, "eval/web/loss": 2.71828,
                                              "eval/hellaswag/acc": 0.3125})
    assert eval_line == ("step    100 | eval_loss 2.5000 | eval_ppl 12.18 | eval/web/loss 2.718 | "
                         "eval/hellaswag/acc 0.3125 | loss_by_position 2.600 2.412")  # sets, tasks, buckets after the rest


def test_device_memory_only_where_reported():
    assert step_logger.device_memory(jax.local_devices()[0]) == {}  # CPU: memory_stats() is None
    gpu = types.SimpleNamespace(memory_stats=lambda: {"bytes_in_use": 7, "peak_bytes_in_use": 9,
                                                      "bytes_limit": 100})
    assert step_logger.device_memory(gpu) == {"memory_bytes_in_use": 7, "memory_peak_bytes_in_use": 9,
                                              "memory_peak_fraction": 0.09}
    no_limit = types.SimpleNamespace(memory_stats=lambda: {"bytes_in_use": 7, "peak_bytes_in_use": 9})
    assert step_logger.device_memory(no_limit) == {"memory_bytes_in_use": 7, "memory_peak_bytes_in_use": 9}
    assert step_logger.device_memory(types.SimpleNamespace(memory_stats=lambda: None)) == {}


# --- the update/parameter ratio ------------------------------------------------


def test_update_ratio_is_the_applied_update_over_the_params():
    """||params after - params before|| / ||params before||, in float64 by hand; 0 when skipped."""
    cfg = tiny(**{"optim.warmup_steps": 0})  # a nonzero lr at step 0
    rules, mesh = mesh_lib.rules_of(cfg.mesh), mesh_lib.make_mesh(cfg.mesh)
    tx = optim.make_optimizer(cfg)
    state, shardings = state_lib.create_sharded_state(cfg, tx, mesh, rules, jax.random.key(0))
    train_fn = step_lib.make_train_step(cfg, tx, mesh, rules, shardings, inject_nan=True)
    batch = mesh_lib.global_batch(packed_batch(cfg.batch_size, cfg.seq_len, cfg.model.vocab_size),
                               mesh, rules)
    norm = lambda tree: math.sqrt(sum(float(np.sum(np.square(x, dtype=np.float64)))  # noqa: E731
                                      for x in jax.tree.leaves(tree)))
    with mesh_lib.activate(mesh, rules):
        before = jax.device_get(state["params"])  # the state is donated
        state, applied = train_fn(state, batch, np.float32(1.0), np.bool_(False))
        after = jax.device_get(state["params"])
        state, skipped = train_fn(state, batch, np.float32(1.0), np.bool_(True))  # NaN gradients: not applied
        unchanged = jax.device_get(state["params"])
    update = jax.tree.map(lambda a, b: a.astype(np.float64) - b, after, before)
    expected = norm(update) / norm(before)
    print(float(applied["update_ratio"]), expected)
    assert 1e-4 < expected < 1
    assert float(applied["update_ratio"]) == pytest.approx(expected, rel=1e-4)
    assert int(skipped["skipped_steps"]) == 1 and float(skipped["update_ratio"]) == 0.0
    assert norm(jax.tree.map(lambda a, b: a - b, unchanged, after)) == 0


# --- profiler -------------------------------------------------------------------


def test_profile_trace_is_written(run):
    profile = run.workdir / "profile" / "plugins" / "profile"
    xplanes = glob.glob(str(profile / "*" / "*.xplane.pb"))
    traces = glob.glob(str(profile / "*" / "*.trace.json.gz"))
    assert len(xplanes) == 1 and os.path.getsize(xplanes[0]) > 0
    assert traces and all(os.path.getsize(t) > 0 for t in traces)
    assert any(line.startswith("profiling steps 5 to 6 into ") for line in run.log)


@pytest.mark.parametrize("key, value", [("start_step", -1), ("num_steps", -2), ("num_steps", 1.5),
                                        ("num_steps", True), ("start_step", "5")])
def test_profile_config_is_validated(key, value):
    raw = load_config("tiny").to_dict()  # a JSON-like config, as config.json holds (no type checks)
    raw["profile"][key] = value
    with pytest.raises(config_lib.ConfigError, match=f"profile.{key} must be an int >= 0"):
        config_lib.resolve(config_lib.ml_collections.ConfigDict(raw), jax.device_count())


def profiler_calls(profile_cfg, steps, workdir, monkeypatch):
    """The jax.profiler calls a StepProfiler makes driven through `steps` as the loop drives it:
    [("start", the step about to run, directory), ("stop", the steps done)]."""
    calls, at = [], {}
    monkeypatch.setattr(jax.profiler, "start_trace", lambda d, **_: calls.append(("start", at["step"], d)))
    monkeypatch.setattr(jax.profiler, "stop_trace", lambda: calls.append(("stop", at["done"])))
    trace = profiler.StepProfiler(profile_cfg, str(workdir))
    for step in steps:
        at["step"] = step
        trace.before_step(step)
        at["done"] = step + 1
        trace.after_step(step + 1, np.zeros(()))
    trace.close()
    return calls


def test_a_default_run_traces_nothing_and_a_profile_traces_its_steps_once(tmp_path, monkeypatch):
    """The default config never starts the profiler; profile.start_step=3, num_steps=2 starts it
    before step 3 and stops it once steps 3 and 4 are done, and steps trained again after a
    restore (2 to 6 once more) are not traced again."""
    steps = [*range(0, 7), *range(2, 12)]
    assert profiler_calls(config_lib.defaults().profile, steps, tmp_path, monkeypatch) == []
    profile = config_lib.defaults().profile
    profile.update(start_step=3, num_steps=2)
    assert profiler_calls(profile, steps, tmp_path, monkeypatch) == [
        ("start", 3, str(tmp_path / "profile")), ("stop", 5)]


# --- plots ------------------------------------------------------------------------


def test_plot_of_two_runs_is_a_png(run, tmp_path):
    other = tmp_path / "other_run"  # a second run's metrics: the first's, shifted
    writer = metrics.JsonlWriter(other / "metrics.jsonl")
    for row in run.rows:
        writer.write(row["step"], {k: (v * 1.1 if k in ("loss", "eval_loss") else v)
                                   for k, v in row.items() if k != "step"})
    writer.close()
    out = tmp_path / "plots" / "curves.png"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "MPLCONFIGDIR": str(tmp_path / "mpl")}
    done = subprocess.run([sys.executable, "-m", "maxlm.plot", str(run.workdir), str(other),
                           f"--out={out}"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000
    assert plot.run_labels([str(run.workdir), str(other)]) == [run.workdir.name, "other_run"]

    missing = subprocess.run([sys.executable, "-m", "maxlm.plot", str(run.workdir),
                              str(tmp_path / "nowhere"), f"--out={tmp_path / 'x.png'}"], cwd=ROOT,
                             capture_output=True, text=True, timeout=120, env=env)
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines() == [
        f"maxlm: plot: no metrics.jsonl in {tmp_path / 'nowhere'} (is it a training run's workdir?)"]
    assert not (tmp_path / "x.png").exists()


# --- loss by position ---------------------------------------------------------


def test_eval_loss_by_position_is_each_spans_loss_in_jsonl_tensorboard_and_the_plot(run):
    """eval.position_buckets=8 (the default) at seq_len 64: eval/loss_by_position/0, /8, ..., /56,
    each the mean loss of the validation tokens at those positions in their document, recomputed
    here from the step-8 checkpoint token by token; the same scalars in TensorBoard; the plot's."""
    from maxlm import model
    from maxlm.checkpoint import saved_run
    from maxlm.data import make_dataset

    last = [r for r in run.rows if "eval_loss" in r][-1]
    assert last["step"] == STEPS and run.cfg.eval.position_buckets == 8
    starts = list(range(0, 64, 8))
    got = {int(k.rsplit("/", 1)[1]): v for k, v in last.items() if k.startswith("eval/loss_by_position/")}
    assert sorted(got) == starts
    loaded = saved_run.load_run(str(run.workdir))
    cfg, mesh, rules = loaded["config"], loaded["mesh"], loaded["rules"]
    dataset = make_dataset(cfg, "validation")
    token_losses = jax.jit(lambda p, b: model.token_losses(cfg.model, p, b))
    loss_sums, counts = np.zeros(8), np.zeros(8)
    with mesh_lib.activate(mesh, rules):
        for i in range(cfg.eval.steps):
            batch = mesh_lib.read_batch(dataset, i, mesh, rules)
            per_token = jax.device_get(token_losses(loaded["params"], batch))
            bucket = np.asarray(batch["positions"]) // 8
            np.add.at(loss_sums, bucket, per_token["cross_entropy"] * per_token["weights"])
            np.add.at(counts, bucket, per_token["weights"])
    assert counts.min() > 0
    np.testing.assert_allclose([got[s] for s in starts], loss_sums / counts, rtol=1e-5)
    assert np.isclose(np.dot(loss_sums / counts, counts) / counts.sum(), last["eval_loss"], rtol=1e-5)
    acc = event_accumulator(run.workdir)
    for start in starts:
        assert acc.Scalars(f"eval/loss_by_position/{start}")[-1].value == pytest.approx(got[start], rel=1e-6)
    assert plot.loss_by_position(run.rows) == (STEPS, starts, [got[s] for s in starts])


def test_plot_series_keeps_the_last_row_of_a_step():
    rows = [{"step": 2, "loss": 3.0}, {"step": 1, "loss": "nan"}, {"step": 2, "loss": 2.0},
            {"step": 2, "eval_loss": 9.0}]
    steps, values = plot.series(rows, "loss")
    assert steps == [1, 2] and math.isnan(values[0]) and values[1] == 2.0


def test_plot_without_out_writes_into_the_first_runs_directory(tmp_path):
    """No `--out`: curves.png goes into the first DIR, never into the directory the command runs in."""
    runs = [tmp_path / "first", tmp_path / "second"]
    for i, workdir in enumerate(runs):
        writer = metrics.JsonlWriter(workdir / "metrics.jsonl")
        for step in range(1, 4):
            writer.write(step, {"loss": 5.0 - step - i, "lr": 1e-3})
        writer.close()
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "MPLCONFIGDIR": str(tmp_path / "mpl"),
           "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "maxlm.plot", *map(str, runs)], cwd=cwd, capture_output=True,
                          text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == f"wrote {runs[0] / 'curves.png'}"
    assert (runs[0] / "curves.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert list(cwd.iterdir()) == [] and not (runs[1] / "curves.png").exists()
