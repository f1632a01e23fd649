"""Validation: every user error ends with a message naming the key and the numbers."""

import json
import subprocess
import sys

import pytest

from maxlm import config as config_lib
from tests.helpers import ROOT, load_config, with_overrides


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
        ({"batch_size": 6, "mesh.data": 4, "mesh.fsdp": -1}, "batch_size=6 must be divisible by mesh.data x mesh.fsdp = 4 x 2 = 8"),
        ({"model.num_heads": 6, "model.num_kv_heads": 4}, "model.num_heads=6 must be divisible by model.num_kv_heads=4"),
        ({"model.d_model": 66, "model.num_heads": 4}, "model.d_model=66 must be divisible by model.num_heads=4"),
        ({"optim.lr": 0.0}, "optim.lr must be a positive number, got 0.0"),
        ({"optim.lr": -1e-3}, "optim.lr must be a positive number"),
        ({"steps": 0}, "steps must be a positive number, got 0"),
        ({"seq_len": -5}, "seq_len must be a positive number, got -5"),
        ({"batch_size": 0}, "batch_size must be a positive number"),
        ({"optim.warmup_steps": 50, "steps": 20}, "optim.warmup_steps=50 is longer than steps=20"),
        ({"model.dtype": "float16"}, "model.dtype must be one of"),
        ({"optim.b2": 1.0}, "optim.b2 must be in [0, 1)"),
        ({"mesh.tensor": 8, "mesh.fsdp": 1, "batch_size": 8}, "must be divisible by mesh.tensor=8"),
        ({"mesh.rules": (("batch", "nope"),)}, "unknown mesh axis 'nope'"),
    ],
)
def test_config_errors(overrides, expected):
    with pytest.raises(config_lib.ConfigError, match=None) as info:
        resolve(**overrides)
    assert expected in str(info.value)


def test_to_json_round_trips():
    cfg = resolve()
    data = json.loads(config_lib.to_json(cfg))
    assert data["model"]["num_layers"] == cfg.model.num_layers
    assert data["mesh"]["fsdp"] == 8


@pytest.mark.parametrize(
    "flag, expected",
    [
        ("--config.mesh.data=3", "mesh data=3 x fsdp=1 x tensor=1 has 3 devices"),
        ("--config.optim.lr=-1", "optim.lr must be a positive number, got -1"),
        ("--config.model.num_kv_heads=3", "model.num_heads=4 must be divisible by model.num_kv_heads=3"),
        ("--config.model.nope=3", "unknown config key 'nope'"),
        ("--config.steps=abc", "flag --config.steps=abc: invalid literal for int()"),
        ("--config=configs/missing.py", "No such file or directory: 'configs/missing.py'"),
    ],
)
def test_cli_config_error_exits_2_without_traceback(tmp_path, flag, expected):
    config = [] if flag.startswith("--config=") else ["--config=configs/tiny.py", "--config.mesh.fsdp=1"]
    result = subprocess.run(
        [sys.executable, "-m", "maxlm.train", f"--workdir={tmp_path / 'run'}", *config, flag],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu", "HOME": str(tmp_path)},
    )
    assert result.returncode == 2, result.stderr
    assert expected in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()  # nothing written before validation passes
