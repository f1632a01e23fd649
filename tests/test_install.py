"""The installs: every lock agrees with itself, with pyproject's ranges and with the jax it pins,
and `make install ACCEL=...` takes the accelerator's lock (or stops at once on an unknown one)."""

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
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
    # the overrides lift a package's declared bound to the runtime lock's own pin, nothing more
    assert pins("requirements-test.overrides").items() <= runtime.items()
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
    assert f"uv pip install --python {venv}/bin/python --quiet --compile-bytecode -r requirements.lock -r locks/{accel}.lock" in dry.stdout
    assert f"echo {accel} > {venv}/.accel" in dry.stdout  # later make commands keep it


def test_make_installs_with_the_uv_release_the_tpu_workers_install():
    """pip puts a pinned uv into the venv, and uv installs the locks: one release here and on TPU
    workers (launch/tpu.py), so a resolver change reaches both at once."""
    dry = subprocess.run(["make", "-n", "install", "VENV=/nonexistent/venv"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    workers = re.search(r'^UV_VERSION = "([0-9.]+)"$', (ROOT / "launch" / "tpu.py").read_text(), re.M)
    assert workers and f"-m pip install --quiet uv=={workers[1]}" in dry.stdout, dry.stdout


@pytest.mark.parametrize("target, packages", [("install-tensorboard", ["tensorboard"]),
                                              ("install-wandb", ["wandb"]),
                                              ("install-hf", ["torch", "transformers"])])
def test_the_optional_pieces_install_at_the_tested_versions(tmp_path, target, packages):
    """The docs' `make install-tensorboard`, `make install-wandb` and `make install-hf` (issue 54: they said
    requirements.lock pinned what only the tests installed): each installs its packages under the
    test lock's pins, which pin every one of them, so the venv gets what CI ran."""
    venv = tmp_path / "venv"
    dry = subprocess.run(["make", "-n", target, f"VENV={venv}"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0, dry.stderr
    line = [line for line in dry.stdout.splitlines() if "pip install" in line][-1]  # after the venv's own
    assert line.endswith("-c requirements.lock -c requirements-test.lock " + " ".join(packages))
    assert set(packages) <= set(pins("requirements-test.lock"))
    for package in packages:  # and what the test tier installed is those pins
        assert importlib.metadata.version(package) == pins("requirements-test.lock")[package]


def test_make_install_refuses_an_unknown_accelerator_before_touching_anything(tmp_path):
    venv = tmp_path / "venv"
    result = subprocess.run(["make", "install", "ACCEL=rocm", f"VENV={venv}"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "ACCEL=rocm: no locks/rocm.lock (cpu, cuda12, cuda13 or tpu)" in result.stdout
    assert not venv.exists()


# --- which Python: launch/find_python.sh, the one rule of the Makefile and the launchers ---------

FIND_PYTHON = ROOT / "launch" / "find_python.sh"
NEW_PYTHON = sys._base_executable  # a real 3.12+: the one this suite runs on


def executable(path, text: str):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


def old_python(path):
    """What a Python 3.11 answers to the version check (exit 1): the machines' own python3."""
    return executable(path, "#!/bin/sh\nexit 1\n")


@pytest.fixture
def machine(tmp_path):
    """A PATH with only the tools the rule and make use, python3 being 3.11 and python3.12 a pyenv
    shim of a version not selected (as on these machines), and an empty pyenv root."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("ls", "sort", "make", "rm", "cat", "sh", "dirname"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    old_python(bin_dir / "python3")
    executable(bin_dir / "python3.12", "#!/bin/sh\necho 'pyenv: python3.12: command not found' >&2\nexit 127\n")
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path / "home"), "PYENV_ROOT": str(tmp_path / "pyenv")}
    return bin_dir, env


def find_python(env: dict, **extra):
    return subprocess.run(["/bin/sh", str(FIND_PYTHON)], env={**env, **extra}, capture_output=True,
                          text=True, timeout=60)


def test_find_python_passes_over_an_old_python3_and_a_failing_shim_to_pyenvs_newest(machine, tmp_path):
    _, env = machine
    for version in ("3.11.7", "3.12.1", "3.13.0"):
        target = tmp_path / "pyenv" / "versions" / version / "bin" / "python3"
        target.parent.mkdir(parents=True)
        old_python(target) if version == "3.11.7" else target.symlink_to(NEW_PYTHON)
    found = find_python(env)
    assert found.returncode == 0, found.stderr
    assert found.stdout.strip() == str(tmp_path / "pyenv" / "versions" / "3.13.0" / "bin" / "python3")


def test_find_python_takes_a_working_python3_13_on_path_first(machine, tmp_path):
    bin_dir, env = machine
    (bin_dir / "python3.13").symlink_to(NEW_PYTHON)
    (tmp_path / "pyenv" / "versions" / "3.12.1" / "bin").mkdir(parents=True)
    (tmp_path / "pyenv" / "versions" / "3.12.1" / "bin" / "python3").symlink_to(NEW_PYTHON)
    assert find_python(env).stdout.strip() == str(bin_dir / "python3.13")


def test_find_python_ends_with_uvs_own_installed_if_need_be(machine, tmp_path):
    _, env = machine
    installed = tmp_path / "uv-installed"
    uv = executable(tmp_path / "uv", f"""#!/bin/sh
echo "$@" >> {tmp_path}/uv-calls
case "$1 $2" in
  "python find") [ -f {installed} ] && echo {NEW_PYTHON} && exit 0; exit 2 ;;
  "python install") : > {installed} ;;
esac
""")
    found = find_python(env, UV=str(uv))
    assert found.returncode == 0 and os.path.samefile(found.stdout.strip(), NEW_PYTHON), found.stderr
    assert (tmp_path / "uv-calls").read_text().splitlines() == ["python find >=3.12", "python install 3.12",
                                                               "python find >=3.12"]


def test_find_python_with_none_says_what_to_install_in_one_line_and_exits_2(machine):
    _, env = machine
    found = find_python(env)
    assert found.returncode == 2 and found.stdout == ""
    assert found.stderr.count("\n") == 1 and "uv python install 3.12" in found.stderr


def test_a_named_python_older_than_3_12_is_an_error_not_passed_over(machine, tmp_path):
    bin_dir, env = machine
    (bin_dir / "python3.13").symlink_to(NEW_PYTHON)
    found = find_python(env, PYTHON=str(bin_dir / "python3"))
    assert found.returncode == 2 and f"PYTHON={bin_dir / 'python3'} is not a Python 3.12" in found.stderr
    assert os.path.samefile(find_python(env, PYTHON=NEW_PYTHON).stdout.strip(), NEW_PYTHON)


def test_make_makes_the_venv_on_the_rules_python_not_on_python3(machine, tmp_path):
    """`make install` from a checkout on a machine whose python3 is 3.11: the venv is pyenv's 3.12
    (pip then fails here, with no index, after the venv was made)."""
    _, env = machine
    (tmp_path / "pyenv" / "versions" / "3.12.1" / "bin").mkdir(parents=True)
    (tmp_path / "pyenv" / "versions" / "3.12.1" / "bin" / "python3").symlink_to(NEW_PYTHON)
    venv = tmp_path / "venv"
    make = subprocess.run(["make", "install", f"VENV={venv}"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**env, "PIP_NO_INDEX": "1", "PIP_CONFIG_FILE": os.devnull})
    assert f"making {venv} with {tmp_path}/pyenv/versions/3.12.1/bin/python3" in make.stdout, make.stderr
    version = subprocess.run([venv / "bin" / "python", "-c", "import sys; print(sys.version_info >= (3, 12))"],
                             capture_output=True, text=True)
    assert version.stdout.strip() == "True"


def test_make_without_a_python_3_12_stops_with_the_rules_line_and_makes_nothing(machine, tmp_path):
    _, env = machine
    venv = tmp_path / "venv"
    make = subprocess.run(["make", "install", f"VENV={venv}"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env=env)
    assert make.returncode == 2 and "maxlm needs Python 3.12 or newer and found none" in make.stderr
    assert not venv.exists()


def test_every_data_file_in_the_package_is_installed_with_it():
    """A wheel carries a non-Python file of maxlm/ only through pyproject's package-data: each one
    (the GPU target descriptions, ...) must match a pattern declared for its own package."""
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    missing = []
    for path in (ROOT / "maxlm").rglob("*"):
        if path.is_file() and path.suffix not in (".py", ".pyc") and "__pycache__" not in path.parts:
            package = ".".join(path.parent.relative_to(ROOT).parts)
            if not any(path.match(pattern) for pattern in declared.get(package, [])):
                missing.append(str(path.relative_to(ROOT)))
    assert missing == []
