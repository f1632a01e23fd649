"""Validation: every user error ends with a message naming the key and the numbers."""

import json
import re
import subprocess
import sys

import pytest

from maxlm import config as config_lib
from tests.helpers import ROOT, command_env, load_config, with_overrides


def resolve(num_devices=8, **overrides):
    return config_lib.resolve(with_overrides(load_config("tiny"), overrides), num_devices)


def test_mesh_fill():
    cfg = resolve(**{"mesh.data": 2, "mesh.fsdp": -1, "mesh.tensor": 2})
    assert (cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor) == (2, 2, 2)
    assert cfg.model.head_dim == 64 // 4
    assert cfg.optim.decay_steps == cfg.steps


@pytest.mark.parametrize(
    "overrides, expected",
    [
        ({"mesh.data": 3, "mesh.fsdp": 1, "mesh.tensor": 1}, "has 3 devices but 8 are available"),
        ({"mesh.data": -1, "mesh.fsdp": -1}, "only one mesh axis may be -1"),
        ({"mesh.data": 3, "mesh.fsdp": -1}, "other axes multiply to 3"),
        ({"mesh.tensor": 0}, "mesh.tensor must be a positive int or -1"),
        ({"batch_size": 6, "mesh.data": 4, "mesh.fsdp": -1}, "batch_size=6 must be divisible by mesh.data x mesh.fsdp x mesh.expert = 4 x 2 x 1 = 8"),
        ({"model.num_heads": 6, "model.num_kv_heads": 4}, "model.num_heads=6 must be divisible by model.num_kv_heads=4"),
        ({"model.d_model": 66, "model.num_heads": 4}, "model.d_model=66 must be divisible by model.num_heads=4"),
        # the weights' d_model dim is split over fsdp and sequence (ZeRO-3 over both)
        ({"model.d_model": 260, "model.head_dim": 64, "mesh.fsdp": 2, "mesh.sequence": 4},
         "model.d_model=260 must be divisible by mesh.fsdp x mesh.sequence = 2 x 4 = 8"),
        ({"optim.lr": 0.0}, "optim.lr must be a positive finite number, got 0.0"),
        ({"optim.lr": -1e-3}, "optim.lr must be a positive finite number"),
        ({"steps": 0}, "steps must be a positive int, got 0"),
        ({"seq_len": -5}, "seq_len must be a positive int, got -5"),
        ({"batch_size": 0}, "batch_size must be a positive int"),
        ({"optim.warmup_steps": 50, "steps": 20}, "optim.warmup_steps=50 is longer than steps=20"),
        ({"model.dtype": "float8"}, "model.dtype must be one of ('float32', 'bfloat16', 'float16')"),
        ({"optim.b2": 1.0}, "optim.b2 must be in [0, 1)"),
        ({"mesh.tensor": 8, "mesh.fsdp": 1, "batch_size": 8}, "must be divisible by mesh.tensor=8"),
        ({"mesh.rules": (("batch", "nope"),)}, "unknown mesh axis 'nope'"),
        ({"mesh.data": 2, "mesh.dcn_data": 4}, "mesh.dcn_data=4 must divide mesh.data=2"),
        ({"mesh.fsdp": -1, "mesh.dcn_fsdp": 3}, "mesh.dcn_fsdp=3 must divide mesh.fsdp=8"),
        ({"mesh.dcn_data": 0}, "mesh.dcn_data must be a positive int, got 0"),
        ({"eval.sets": ("web", "/data")}, "eval.sets entries are (name, source) with a name like 'web', got 'web'"),
        ({"eval.sets": (("my-web", "/data"),)}, "eval.sets entries are (name, source)"),
        ({"eval.sets": (("web", ""),)}, "eval.sets entries are (name, source)"),
        ({"eval.sets": (("a", "/x"), ("a", "/y"))}, "eval.sets names and eval.tasks file stems must all differ, got ['a', 'a']"),
        ({"eval.sets": (("hs", "/x"),), "eval.tasks": ("t/hs.jsonl",)}, "must all differ, got ['hs', 'hs']"),
        ({"eval.tasks": ("t/hs.json",)}, "eval.tasks entries are paths of .jsonl task files, got 't/hs.json'"),
        ({"eval.task_shots": -1}, "eval.task_shots must be an int >= 0, got -1"),
        ({"eval.position_buckets": 65}, "eval.position_buckets=65 is more than seq_len=64"),
        ({"model.positions": "alibi"}, "model.positions must be one of ('rope', 'sinusoidal', 'learned'), got 'alibi'"),
        ({"model.max_positions": -1}, "model.max_positions must be an int >= 0, got -1"),
        ({"model.head_dim": 15}, "model.head_dim=15 must be even for RoPE (model.positions='rope')"),
        ({"model.positions": "sinusoidal", "model.d_model": 63, "model.head_dim": 16},
         "model.d_model=63 must be even for model.positions='sinusoidal'"),
        ({"model.positions": "learned", "model.max_positions": 32},
         "seq_len=64 is longer than model.max_positions=32, the learned position table's length"),
        ({"model.rope_scaling": "yarn", "model.rope_scaling_factor": 1.0, "model.rope_original_max_len": 64},
         "model.rope_scaling_factor=1.0 must be > 1 with model.rope_scaling='yarn'"),
        ({"model.rope_scaling": "llama3", "model.rope_scaling_factor": 4.0},
         "model.rope_original_max_len must be set with model.rope_scaling='llama3'"),
        ({"model.rope_scaling_factor": 4.0}, "model.rope_scaling_factor=4.0 is read by model.rope_scaling='linear', "
                                             "'llama3' or 'yarn' only, got model.rope_scaling='none'"),
        ({"model.rope_original_max_len": 64}, "model.rope_original_max_len=64 is read by model.rope_scaling="),
        ({"model.rope_scaling": "llama3", "model.rope_scaling_factor": 4.0, "model.rope_original_max_len": 64,
          "model.rope_low_freq_factor": 4.0}, "model.rope_high_freq_factor=4.0 must be more than model.rope_low_freq_factor=4.0"),
        ({"model.rope_scaling": "yarn", "model.rope_scaling_factor": 4.0, "model.rope_original_max_len": 64,
          "model.rope_beta_slow": 40.0}, "model.rope_beta_fast=32.0 must be more than model.rope_beta_slow=40.0"),
        ({"model.rope_scaling": "yarn", "model.rope_scaling_factor": 4.0, "model.rope_original_max_len": 64,
          "model.positions": "sinusoidal"}, "model.rope_scaling='yarn' scales RoPE's frequencies, and model.positions='sinusoidal'"),
        ({"model.rope_scaling": "ntk"}, "model.rope_scaling must be one of ('none', 'linear', 'llama3', 'yarn'), got 'ntk'"),
    ],
)
def test_config_errors(overrides, expected):
    with pytest.raises(config_lib.ConfigError, match=None) as info:
        resolve(**overrides)
    assert expected in str(info.value)


def test_eval_sets_and_tasks_resolve():
    cfg = resolve(**{"eval.sets": (("web", "/data/web"), ["code", "tfds:python_stdlib"]),
                     "eval.tasks": ("tasks/hellaswag.jsonl",), "eval.task_shots": 5})
    assert cfg.eval.sets[1][0] == "code" and cfg.eval.task_shots == 5
    assert resolve().eval.sets == () and resolve().eval.tasks == ()
    recorded = load_config("tiny").to_dict()
    recorded["eval"]["tasks"] = "t/hs.jsonl"  # a config.json written by hand: not a tuple
    with pytest.raises(config_lib.ConfigError, match="eval.tasks must be a tuple, got 't/hs.jsonl'"):
        config_lib.resolve(config_lib.ml_collections.ConfigDict(recorded), 8)


def test_position_encodings_resolve():
    """A learned table's length defaults to seq_len; only RoPE needs an even head_dim."""
    assert resolve(**{"model.positions": "learned"}).model.max_positions == 64
    assert resolve(**{"model.positions": "learned", "model.max_positions": 100}).model.max_positions == 100
    assert resolve().model.max_positions == 0  # no table: left as given
    for positions in ("sinusoidal", "learned"):
        assert resolve(**{"model.positions": positions, "model.head_dim": 15}).model.head_dim == 15


def test_dcn_factors_must_multiply_to_the_granule_count():
    cfg = load_config("tiny")
    cfg.mesh.update(data=2, fsdp=-1, dcn_data=2, dcn_fsdp=2)
    resolved = config_lib.resolve(cfg, 8, num_granules=4)  # 4 processes (or slices) of 2 devices
    assert (resolved.mesh.fsdp, resolved.mesh.dcn_data, resolved.mesh.dcn_fsdp) == (4, 2, 2)
    with pytest.raises(config_lib.ConfigError, match=r"mesh.dcn_data x mesh.dcn_fsdp x mesh.dcn_expert = 2 x 2 x 1 = 4 "
                       r"must equal the number of granules, 2 \(TPU slices; processes on GPU/CPU\)"):
        config_lib.resolve(cfg, 8, num_granules=2)
    assert resolve().mesh.dcn_data == 1
    config_lib.resolve(load_config("tiny"), 8, num_granules=4)  # no dcn split: any granule count


def test_to_json_round_trips():
    cfg = resolve()
    data = json.loads(config_lib.to_json(cfg))
    assert data["model"]["num_layers"] == cfg.model.num_layers
    assert data["mesh"]["fsdp"] == 8


@pytest.mark.parametrize(
    "flag, expected",
    [
        ("--config.mesh.data=3", "mesh stage=1 x data=3 x fsdp=1 x expert=1 x sequence=1 x tensor=1 has 3 devices"),
        ("--config.optim.lr=-1", "optim.lr must be a positive finite number, got -1"),
        ("--config.model.num_kv_heads=3", "model.num_heads=4 must be divisible by model.num_kv_heads=3"),
        ("--config.model.nope=3", "unknown config key model.nope: did you mean model.norm?"),
        ("--config.mesh.dcn_fsdp=2", "mesh.dcn_fsdp=2 must divide mesh.fsdp=1"),
        ("--config.model.rope_scaling=yarn --config.model.rope_scaling_factor=0.5 --config.model.rope_original_max_len=64",
         "model.rope_scaling_factor=0.5 must be > 1"),
        ("--config.steps=abc", "flag --config.steps=abc: invalid literal for int()"),
        ("--config=configs/missing.py", "No such file or directory: 'configs/missing.py'"),
    ],
)
def test_cli_config_error_exits_2_without_traceback(tmp_path, flag, expected):
    config = [] if flag.startswith("--config=") else ["--config=configs/tiny.py", "--config.mesh.fsdp=1"]
    result = subprocess.run(
        [sys.executable, "-m", "maxlm.train", f"--workdir={tmp_path / 'run'}", *config, *flag.split()],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env=command_env(tmp_path, devices=None),
    )
    assert result.returncode == 2, result.stderr
    assert expected in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()  # nothing written before validation passes


def test_cli_dcn_split_without_the_granules_exits_2(tmp_path):
    """Two devices in one process: mesh.dcn_data=2 asks for two processes (or TPU slices)."""
    result = subprocess.run(
        [sys.executable, "-m", "maxlm.train", f"--workdir={tmp_path / 'run'}", "--config=configs/tiny.py",
         "--config.mesh.data=2", "--config.mesh.fsdp=1", "--config.mesh.dcn_data=2"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env=command_env(tmp_path, devices=2),
    )
    assert result.returncode == 2, result.stderr
    assert "mesh.dcn_data x mesh.dcn_fsdp x mesh.dcn_expert = 2 x 1 x 1 = 2 must equal the number of granules, 1" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "run").exists()


def test_expected_platform_and_device_count(tmp_path):
    """A GPU or TPU job never trains on the CPU by accident: `platform` and `num_devices` are
    checked against what JAX finds (the launchers set the platform), through the CLI too."""
    cfg = load_config("tiny")
    assert config_lib.resolve(cfg, 8, platform="cpu").platform == ""  # "" = wherever JAX runs
    cfg.platform = "gpu"
    with pytest.raises(config_lib.ConfigError, match=r"platform='gpu' but JAX runs on 'cpu' here"):
        config_lib.resolve(cfg, 8, platform="cpu")
    assert config_lib.resolve(cfg, 8).platform == "gpu"  # no platform given: not checked
    cfg.platform, cfg.num_devices = "cpu", 4
    with pytest.raises(config_lib.ConfigError, match="num_devices=4 but JAX sees 8 devices here"):
        config_lib.resolve(cfg, 8, platform="cpu")
    cfg.platform = "cuda"
    with pytest.raises(config_lib.ConfigError, match="platform must be one of"):
        config_lib.resolve(cfg, 8)
    result = subprocess.run(
        [sys.executable, "-m", "maxlm.train", f"--workdir={tmp_path / 'run'}", "--config=configs/tiny.py",
         "--config.platform=tpu"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env=command_env(tmp_path, devices=None))
    assert result.returncode == 2 and "platform='tpu' but JAX runs on 'cpu'" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "run").exists()


def leaves() -> dict:
    """{dotted key: default} of every leaf of the defaults."""
    def flat(d, prefix=""):
        for k, v in d.items():
            if isinstance(v, dict):
                yield from flat(v, f"{prefix}{k}.")
            else:
                yield f"{prefix}{k}", v
    return dict(flat(config_lib.defaults().to_dict()))


def numeric_keys():
    """(key, default) of every int or float key of the defaults."""
    return [(k, v) for k, v in leaves().items() if isinstance(v, (int, float)) and not isinstance(v, bool)]


def test_every_number_and_bool_declares_its_domain_beside_its_default():
    """`s.key = key(default, DOMAIN, doc)` in maxlm/config/*_keys.py: a number or bool declared
    without one is refused there, each domain names a key of the defaults, and each default is in
    its own domain."""
    domains, defaults = config_lib.domains(), leaves()
    assert [k for k, v in defaults.items() if isinstance(v, (bool, int, float)) and k not in domains] == []
    assert set(domains) <= set(defaults)
    assert [k for k, domain in domains.items() if not domain.test(defaults[k])] == []
    with pytest.raises(TypeError, match="config key 3 .* needs a domain"):
        config_lib.schema.key(3, doc="a count")
    assert isinstance(config_lib.defaults().optim.lr, float)  # plain values: the domains stay out of config.json


@pytest.mark.parametrize("key", [k for k, v in leaves().items() if k in config_lib.domains() and isinstance(v, (bool, str))])
def test_every_bool_and_choice_key_refuses_other_values(key):
    """A string where a bool belongs can come only from a config.json written by hand (ConfigDict
    refuses it in a config file or flag), so the value is set in the recorded dict."""
    recorded = load_config("tiny").to_dict()
    *path, last = key.split(".")
    node = recorded
    for part in path:
        node = node[part]
    node[last] = "nope"
    with pytest.raises(config_lib.ConfigError, match=re.escape(f"{key} must be ")):
        config_lib.resolve(config_lib.ml_collections.ConfigDict(recorded), 8)


@pytest.mark.parametrize("key, default", numeric_keys())
def test_every_numeric_key_refuses_values_outside_its_domain(key, default):
    """NaN, infinities and a huge negative number are in no key's domain (ints: the negative one;
    a float key given NaN or inf would start a run that ends in non-finite steps, or never)."""
    values = [-10**9] if isinstance(default, int) else [float("nan"), float("inf"), float("-inf"), -1e9]
    for value in values:
        with pytest.raises(config_lib.ConfigError, match=re.escape(key)):
            config_lib.resolve(with_overrides(load_config("tiny"), {key: value}), 8)


@pytest.mark.parametrize("flag", ["--config.optim.lr=nan", "--config.optim.lr=inf", "--config.optim.eps=-1e-8"])
def test_out_of_domain_values_exit_2_before_training(tmp_path, flag):
    result = subprocess.run(
        [sys.executable, "-m", "maxlm.train", f"--workdir={tmp_path / 'run'}", "--config=configs/tiny.py", flag],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env=command_env(tmp_path, devices=None))
    key = flag.split("=")[0].removeprefix("--config.")
    assert result.returncode == 2 and f"maxlm: config error: {key} must be" in result.stderr, result.stderr[-2000:]
    assert not (tmp_path / "run").exists()
