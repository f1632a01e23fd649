"""Tests for maxlm.metrics: FLOPs accounting, peak FLOP/s, MFU, writers."""

import glob
import json
import math
import os
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from maxlm import config as config_lib
from maxlm.observe import flops, metrics
from maxlm.runtime.errors import UserError


def model_cfg(**overrides):
    """The default model keys (a dense model) with these shapes."""
    cfg = config_lib.defaults().model.to_dict()
    cfg.update(num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, head_dim=16,
               mlp_dim=128, vocab_size=100, tie_embeddings=False)
    cfg.update(overrides)
    return ml_collections.ConfigDict(cfg)


# Llama-2-7B shapes; HF reports 6,738,415,616 parameters for it.
LLAMA2_7B = dict(num_layers=32, d_model=4096, num_heads=32, num_kv_heads=32, head_dim=0,
                 mlp_dim=11008, vocab_size=32000, tie_embeddings=False)
LLAMA2_7B_PARAMS = 6_738_415_616


# --- FLOPs ------------------------------------------------------------------


def test_tiny_config_matches_hand_formula():
    L, d, H, K, Dh, F, V, T = 2, 64, 4, 2, 16, 128, 100, 32
    per_layer = (2 * d * H * Dh          # q
                 + 2 * 2 * d * K * Dh    # k, v
                 + 2 * H * Dh * d        # out
                 + 3 * 2 * d * F         # gate, up, down
                 + 2 * 2 * T * H * Dh / 2)  # QK^T + AV, causal half
    forward = L * per_layer + 2 * d * V
    parts = flops.forward_flops_breakdown(model_cfg(), T)
    print(parts)
    assert parts["total"] == forward
    assert parts["total"] == sum(v for k, v in parts.items() if k != "total")
    assert flops.flops_per_token(model_cfg(), T) == 3 * forward


def test_a_sliding_window_counts_the_keys_each_query_sees():
    """With model.sliding_window = W, query i sees min(i + 1, W) keys: W - W²/2T on average over T
    positions (to within the causal convention's T/2), so attention shrinks as T / (2W - W²/T)."""
    T, W = 4096, 512
    full = flops.forward_flops_breakdown(model_cfg(), T)["attention"]
    windowed = flops.forward_flops_breakdown(model_cfg(sliding_window=W), T)["attention"]
    exact_mean = sum(min(i + 1, W) for i in range(T)) / T
    assert windowed / full == pytest.approx((W - W * W / (2 * T)) / (T / 2))
    assert windowed / full == pytest.approx(exact_mean / (T / 2), rel=2e-3)  # the +1/2 per query of the convention
    assert flops.forward_flops_breakdown(model_cfg(sliding_window=T), T)["attention"] == full


def test_head_dim_zero_means_d_model_over_heads():
    explicit = flops.forward_flops_breakdown(model_cfg(head_dim=16), 32)
    derived = flops.forward_flops_breakdown(model_cfg(head_dim=0), 32)
    assert explicit == derived


def test_llama2_7b_non_attention_is_six_times_matmul_params():
    cfg = model_cfg(**LLAMA2_7B)
    d, L, V = cfg.d_model, cfg.num_layers, cfg.vocab_size
    # Everything except the input embedding table and the 2L+1 RMSNorm scales;
    # the (untied) LM head stays in.
    matmul_params = LLAMA2_7B_PARAMS - V * d - (2 * L + 1) * d
    assert matmul_params == 6_607_077_376
    T = 4096
    parts = flops.forward_flops_breakdown(cfg, T)
    print(parts)
    assert 3 * (parts["total"] - parts["attention"]) == 6 * matmul_params
    # PaLM appendix B: 6N + 12*L*H*Dh*T (attention unhalved); we count half of it.
    palm = 6 * matmul_params + 12 * L * cfg.num_heads * 128 * T
    assert flops.flops_per_token(cfg, T) == palm - 6 * L * cfg.num_heads * 128 * T
    assert flops.flops_per_token(cfg, T) == pytest.approx(42.9e9, rel=1e-3)


def test_tied_embeddings_do_not_change_flops():
    assert (flops.flops_per_token(model_cfg(tie_embeddings=True), 32)
            == flops.flops_per_token(model_cfg(tie_embeddings=False), 32))


def test_gqa_reduces_only_kv_flops():
    mha = flops.forward_flops_breakdown(model_cfg(num_kv_heads=4), 32)
    gqa = flops.forward_flops_breakdown(model_cfg(num_kv_heads=1), 32)
    assert gqa["kv_proj"] == mha["kv_proj"] / 4
    for name in ("q_proj", "out_proj", "mlp", "attention", "lm_head"):
        assert gqa[name] == mha[name]
    with pytest.raises(ValueError):
        flops.forward_flops_breakdown(model_cfg(num_kv_heads=3), 32)


def test_attention_is_halved_for_causality_and_linear_in_seq_len():
    cfg = model_cfg()
    full = 2 * 2 * 32 * cfg.num_heads * cfg.head_dim * cfg.num_layers
    assert flops.forward_flops_breakdown(cfg, 32)["attention"] == full / 2
    assert (flops.forward_flops_breakdown(cfg, 64)["attention"]
            == 2 * flops.forward_flops_breakdown(cfg, 32)["attention"])


# --- Peak FLOP/s and MFU ----------------------------------------------------


def fake_devices(kind, n, platform="tpu"):
    return [types.SimpleNamespace(device_kind=kind, platform=platform, id=i) for i in range(n)]


@pytest.mark.parametrize("kind, dtype, per_device", [
    ("TPU v5 lite", "bfloat16", 197e12),
    ("TPU v5 lite", "float32", 197e12),  # TPU f32 matmuls are bf16 passes
    ("TPU v5", "bfloat16", 459e12),       # v5p
    ("TPU v4", "bf16", 275e12),
    ("TPU v6 lite", "bfloat16", 918e12),
    ("NVIDIA H100 80GB HBM3", "bfloat16", 989e12),
    ("nvidia h100 80gb hbm3", "float16", 989e12),
    ("NVIDIA H200", "bfloat16", 989e12),
    ("NVIDIA A100-SXM4-80GB", "bfloat16", 312e12),
])
def test_table_lookup(kind, dtype, per_device):
    peak = flops.peak_flops(fake_devices(kind, 4), dtype)
    assert peak == {
        "total_flops_per_sec": 4 * per_device,
        "per_device_flops_per_sec": per_device,
        "source": "table",
        "device_kind": kind,
        "num_devices": 4,
        "platform": "tpu",
    }


def test_nvidia_float32_peak_follows_matmul_precision():
    devices = fake_devices("NVIDIA H100 80GB HBM3", 1, platform="gpu")
    # JAX's default GPU precision runs f32 matmuls on TF32 tensor cores.
    assert flops.peak_flops(devices, "float32")["total_flops_per_sec"] == 495e12
    with jax.default_matmul_precision("highest"):
        assert flops.peak_flops(devices, "float32")["total_flops_per_sec"] == 67e12


def test_mixed_kinds_and_bad_dtype_rejected():
    with pytest.raises(ValueError):
        flops.peak_flops(fake_devices("TPU v4", 1) + fake_devices("TPU v5 lite", 1), "bf16")
    with pytest.raises(ValueError):
        flops.peak_flops(fake_devices("TPU v4", 1), "int8")


def test_cpu_probe_is_measured_cached_and_not_multiplied_by_fake_devices(monkeypatch):
    monkeypatch.delenv(flops.PEAK_ENV, raising=False)
    devices = jax.devices()
    assert len(devices) == 8 and devices[0].platform == "cpu"
    first = flops.peak_flops(devices, "float32")
    print(first)
    assert first["source"] == "measured"
    assert first["platform"] == "cpu" and first["num_devices"] == 8
    total = first["total_flops_per_sec"]
    assert math.isfinite(total) and total > 0
    # The 8 fake devices share one host: total is the host rate, not 8x it.
    assert total == flops.measure_matmul_flops_per_sec(devices[0], "float32")
    assert first["per_device_flops_per_sec"] == total / 8

    hits = flops.measure_matmul_flops_per_sec.cache_info().hits
    assert flops.peak_flops(devices, "fp32") == first
    assert flops.measure_matmul_flops_per_sec.cache_info().hits == hits + 1


def test_a_given_peak_takes_the_probes_place_and_not_the_tables(monkeypatch):
    monkeypatch.setenv(flops.PEAK_ENV, "2.5e11")
    hits, misses = flops.measure_matmul_flops_per_sec.cache_info()[:2]
    assert flops.peak_flops(jax.devices(), "bfloat16") == {
        "total_flops_per_sec": 2.5e11, "per_device_flops_per_sec": 2.5e11 / 8, "source": flops.PEAK_ENV,
        "device_kind": jax.devices()[0].device_kind, "num_devices": 8, "platform": "cpu"}
    assert flops.measure_matmul_flops_per_sec.cache_info()[:2] == (hits, misses)  # no probe
    unknown = flops.peak_flops(fake_devices("Some accelerator", 2, platform="gpu"), "bfloat16")
    assert unknown["total_flops_per_sec"] == 5e11 and unknown["source"] == flops.PEAK_ENV
    assert flops.peak_flops(fake_devices("TPU v4", 2), "bf16")["total_flops_per_sec"] == 2 * 275e12
    for bad in ("", "fast", "0", "-1e9", "inf", "nan"):
        monkeypatch.setenv(flops.PEAK_ENV, bad)
        with pytest.raises(UserError, match=f"{flops.PEAK_ENV} must be a positive number of FLOP/s, got {bad!r}"):
            flops.peak_flops(jax.devices(), "float32")


def test_cpu_peak_is_the_float32_probe_whatever_the_model_dtype(monkeypatch):
    # XLA:CPU runs bfloat16 matmuls as float32 ones: dividing by its slower bfloat16 kernel's
    # rate gave MFU above 1
    monkeypatch.delenv(flops.PEAK_ENV, raising=False)
    devices = jax.devices()
    assert flops.peak_flops(devices, "bfloat16") == flops.peak_flops(devices, "float32")


def test_bench_reads_the_peak_between_its_timed_steps():
    from maxlm import config as config_lib
    from maxlm.bench import benchmarks as bench

    cfg = config_lib.resolve(config_lib.load_file("configs/tiny.py"), jax.device_count())
    result = bench.bench_train(cfg, warmup_steps=1, timed_steps=3)
    probe = result["peak_probe_tflops_per_sec"]
    assert probe["count"] == 3 and 0 < probe["min"] <= probe["median"] <= probe["max"]
    assert result["peak_tflops_per_sec"] == probe["median"]
    assert result["peak_source"] == "measured between the timed steps"
    # each step against the probe read after it: between the MFUs of the extreme probes
    achieved = result["model_tflops_per_sec"]
    slowest, fastest = result["step_sec_max"], result["step_sec_min"]
    median_step = result["step_sec_median"]
    low = achieved * median_step / slowest / probe["max"]
    high = achieved * median_step / fastest / probe["min"]
    assert low <= result["mfu"] <= high


def test_mfu_arithmetic():
    assert flops.mfu(1000.0, 6e9, 12e12) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        flops.mfu(1000.0, 6e9, 0.0)


# --- Writers ----------------------------------------------------------------


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_jsonl_appends_across_instances_and_every_line_parses(tmp_path):
    path = tmp_path / "metrics.jsonl"
    first = metrics.JsonlWriter(path)
    first.write(1, {"loss": np.float32(2.5), "lr": jnp.asarray(1e-3),
                    "tokens": np.int64(4096), "nan": float("nan")})
    first.close()
    second = metrics.JsonlWriter(path)  # a resumed run
    second.write(2, {"loss": jnp.asarray(2.0, jnp.bfloat16), "inf": np.float64("inf"),
                     "neg_inf": -math.inf})
    second.close()

    rows = read_jsonl(path)
    assert rows[0] == {"step": 1, "loss": 2.5, "lr": pytest.approx(1e-3),
                       "tokens": 4096, "nan": "nan"}
    assert rows[1] == {"step": 2, "loss": 2.0, "inf": "inf", "neg_inf": "-inf"}
    assert type(rows[0]["tokens"]) is int and type(rows[0]["loss"]) is float
    assert math.isnan(float(rows[0]["nan"]))


def test_jsonl_recovers_from_torn_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')  # killed mid-write
    writer = metrics.JsonlWriter(path)
    writer.write(3, {"loss": 1.0})
    writer.close()
    lines = path.read_text().splitlines()
    assert json.loads(lines[-1]) == {"step": 3, "loss": 1.0}


def test_jsonl_rejects_non_scalars_and_step_key(tmp_path):
    writer = metrics.JsonlWriter(tmp_path / "m.jsonl")
    with pytest.raises(ValueError):
        writer.write(1, {"v": np.zeros(3)})
    with pytest.raises(ValueError):
        writer.write(1, {"step": 5})
    writer.close()


def test_tensorboard_writer_creates_events_file(tmp_path):
    logdir = tmp_path / "tb"
    writer = metrics.TensorBoardWriter(logdir)
    writer.write(1, {"loss": jnp.asarray(2.5), "nan": float("nan")})
    writer.flush()
    writer.close()
    files = glob.glob(str(logdir / "events.out.tfevents*"))
    assert len(files) == 1 and os.path.getsize(files[0]) > 0
    assert "tensorflow" not in sys.modules  # tensorboardX must not pull TF in


def test_tensorboard_writer_leaves_torch_unimported_and_importable(tmp_path):
    """tensorboardX imports torch when installed (seconds of every run's start); the writer hides
    it during that import, and a later `import torch` still works."""
    pytest.importorskip("torch")
    code = ("import sys; from maxlm.observe import metrics; metrics.TensorBoardWriter(sys.argv[1]).close(); "
            "print('torch' in sys.modules); import torch; print(torch.ones(1).item())")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "1.0"], out.stderr[-2000:]


def test_tensorboard_writer_groups_names_and_records_hparams(tmp_path):
    from tensorboard.backend.event_processing import event_accumulator as ea
    from tensorboard.plugins.hparams import plugin_data_pb2

    writer = metrics.TensorBoardWriter(tmp_path)
    writer.write_hparams({"optim.lr": 3e-4, "model.dtype": "bfloat16", "model.fp8": False, "steps": 10})
    writer.write(3, {"loss": 2.5, "eval_loss": 2.75, "mfu": 0.25, "memory_peak_bytes_in_use": 2**30,
                     "loss_scale": 1024.0, "custom_thing": 1.0, "eval/web/loss": 3.0})
    writer.close()
    acc = ea.EventAccumulator(str(tmp_path), size_guidance={ea.SCALARS: 0, ea.TENSORS: 0})
    acc.Reload()
    scalars = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    assert scalars == {"train/loss": [(3, 2.5)], "eval/loss": [(3, 2.75)], "perf/mfu": [(3, 0.25)],
                       "memory/peak_bytes_in_use": [(3, 2.0**30)], "train/loss_scale": [(3, 1024.0)],
                       "custom_thing": [(3, 1.0)],  # a name without a group keeps its name ...
                       "eval/web/loss": [(3, 3.0)]}  # ... as eval.sets' names do: in the eval/ group
    start = plugin_data_pb2.HParamsPluginData.FromString(
        acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]).session_start_info
    assert {k: getattr(v, v.WhichOneof("kind")) for k, v in start.hparams.items()} == {
        "optim.lr": pytest.approx(3e-4), "model.dtype": "bfloat16", "model.fp8": False, "steps": 10}
    assert "tensorflow" not in sys.modules


class Recorder:
    def __init__(self):
        self.calls = []

    def write(self, step, metrics):
        self.calls.append(("write", step, dict(metrics)))

    def write_hparams(self, hparams):
        self.calls.append(("hparams", dict(hparams)))

    def flush(self):
        self.calls.append(("flush",))

    def close(self):
        self.calls.append(("close",))


def test_multiwriter_fans_out():
    a, b = Recorder(), Recorder()
    writer = metrics.MultiWriter([a, b])
    assert isinstance(writer, metrics.MetricWriter)
    assert isinstance(a, metrics.MetricWriter)  # the protocol a new sink implements
    writer.write_hparams({"optim.lr": 0.1})
    writer.write(7, {"loss": 1.0})
    writer.flush()
    writer.close()
    expected = [("hparams", {"optim.lr": 0.1}), ("write", 7, {"loss": 1.0}), ("flush",), ("close",)]
    assert a.calls == expected and b.calls == expected


def test_non_primary_writes_nothing(tmp_path):
    writer = metrics.make_writers(tmp_path / "run", is_primary=False, tensorboard=True)
    assert isinstance(writer, metrics.MetricWriter)
    writer.write_hparams({"seed": 0})
    writer.write(1, {"loss": 1.0})
    writer.flush()
    writer.close()
    assert os.listdir(tmp_path) == []


def test_primary_writes_jsonl_and_tensorboard(tmp_path):
    workdir = tmp_path / "run"
    writer = metrics.make_writers(workdir, is_primary=True, tensorboard=True)
    writer.write_hparams({"seed": 0})  # TensorBoard only: config.json already has them
    writer.write(1, {"loss": 3.0})
    writer.close()
    assert read_jsonl(workdir / "metrics.jsonl") == [{"step": 1, "loss": 3.0}]  # flat names
    assert glob.glob(str(workdir / "events.out.tfevents*"))

    jsonl_only = tmp_path / "run2"
    metrics.make_writers(jsonl_only, is_primary=True, tensorboard=False).close()
    assert os.listdir(jsonl_only) == ["metrics.jsonl"]
