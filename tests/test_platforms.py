"""Off an accelerator, an installed libtpu or CUDA plugin stays quiet (issue 54: after `make
install ACCEL=tpu` every command printed libtpu's errors, CPU training included)."""

import os
import subprocess
import sys

import pytest

from maxlm.runtime import platforms
from tests.helpers import ROOT, command_env

TARGET_COMPILERS = os.environ.get("MAXLM_TARGET_COMPILERS", str(ROOT / ".venv" / "target-compilers"))


def make_machine(root, files: dict[str, str]):
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    return str(root)


@pytest.mark.parametrize("files, cpu_only", [
    ({"sys/bus/pci/devices/0000:00:01.0/vendor": "0x1af4\n"}, True),  # virtio only: this kind of VM
    ({}, True),
    ({"sys/bus/pci/devices/0000:00:04.0/vendor": "0x1ae0\n"}, False),  # Google's: a TPU chip, maybe
    ({"dev/nvidia0": ""}, False),
    ({"dev/kfd": ""}, False),  # AMD
    ({"dev/accel0": ""}, False),  # a TPU VM's chip
])
def test_cpu_only_reads_the_machines_devices(tmp_path, files, cpu_only):
    assert platforms.cpu_only(make_machine(tmp_path, files)) is cpu_only


@pytest.mark.skipif(not platforms.cpu_only(), reason="this machine may have an accelerator")
@pytest.mark.skipif(not os.path.isdir(os.path.join(TARGET_COMPILERS, "libtpu")), reason="no libtpu here")
def test_a_command_with_libtpu_installed_prints_only_its_own_line(tmp_path):
    """libtpu and the CUDA plugin importable, JAX_PLATFORMS unset, as in a TPU or GPU venv on a
    CPU machine: a refused run prints its one line and nothing of either runtime."""
    env = command_env(tmp_path, devices=None, PYTHONPATH=TARGET_COMPILERS)
    del env["JAX_PLATFORMS"]
    done = subprocess.run([sys.executable, "-m", "maxlm.train", "--config=configs/tiny.py",
                           f"--workdir={tmp_path / 'run'}", "--config.batch_size=-3"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == ["maxlm: config error: batch_size must be a positive int, got -3"]
