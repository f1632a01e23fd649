"""The installs: every lock agrees with itself, with pyproject's ranges and with the jax it pins,
and `make install ACCEL=...` takes the accelerator's lock (or stops at once on an unknown one)."""

import importlib.metadata
import re
import subprocess
import tomllib

import pytest
from packaging.requirements import Requirement

from tests.helpers import ROOT

ACCELERATORS = ("cuda12", "cuda13", "tpu")


def pins(path) -> dict[str, str]:
    """name -> version of a lock file's `name==version` lines (names normalised as pip does)."""
    lines = (line.split("#")[0].strip() for line in (ROOT / path).read_text().splitlines())
    return {re.sub(r"[-_.]+", "-", n).lower(): v for n, v in (line.split("==") for line in lines if line)}


def test_the_runtime_and_test_locks_are_disjoint_and_within_pyproject_ranges():
    runtime, test = pins("requirements.lock"), pins("requirements-test.lock")
    assert not set(runtime) & set(test)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = [*project["dependencies"], *project["optional-dependencies"]["test"]]
    for requirement in map(Requirement, declared):
        name = re.sub(r"[-_.]+", "-", requirement.name).lower()
        version = runtime.get(name) or test.get(name)
        assert version and requirement.specifier.contains(version), (requirement, version)
    # the venv CI tests in is the locked one
    assert importlib.metadata.version("jaxlib") == runtime["jaxlib"] == runtime["jax"]


@pytest.mark.parametrize("accel", ACCELERATORS)
def test_each_accelerator_lock_pins_what_the_locked_jax_asks_for(accel):
    """jax's own extra names the plugin (or libtpu) of its release: the lock must pin that one."""
    lock = pins(f"locks/{accel}.lock")
    asked = [Requirement(r) for r in importlib.metadata.requires("jax") if f'extra == "{accel}"' in r]
    plugins = [r for r in asked if r.name not in ("jaxlib", "requests")]
    assert plugins
    for requirement in plugins:
        assert requirement.specifier.contains(lock[requirement.name]), (requirement, lock)
    if accel.startswith("cuda"):  # the PJRT plugin comes with the same version
        assert lock[f"jax-{accel}-pjrt"] == lock[f"jax-{accel}-plugin"]
        assert any(name.startswith("nvidia-cudnn") for name in lock)
    assert not set(lock) & set(pins("requirements.lock"))


@pytest.mark.parametrize("accel", ACCELERATORS)
def test_make_install_takes_the_accelerators_lock(tmp_path, accel):
    venv = tmp_path / "venv"
    dry = subprocess.run(["make", "-n", "install", f"ACCEL={accel}", f"VENV={venv}"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0, dry.stderr
    assert f"pip install --quiet -r requirements.lock -r locks/{accel}.lock" in dry.stdout
    assert f"echo {accel} > {venv}/.accel" in dry.stdout  # later make commands keep it


def test_make_install_refuses_an_unknown_accelerator_before_touching_anything(tmp_path):
    venv = tmp_path / "venv"
    result = subprocess.run(["make", "install", "ACCEL=rocm", f"VENV={venv}"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "ACCEL=rocm: no locks/rocm.lock (cpu, cuda12, cuda13 or tpu)" in result.stdout
    assert not venv.exists()
