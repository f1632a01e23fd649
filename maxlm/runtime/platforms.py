"""Whether this machine could have an accelerator, read from its device files before JAX starts.

A venv with libtpu (`make install ACCEL=tpu`) or JAX's CUDA plugin loads that runtime at JAX's
first call wherever it runs, and off its hardware each prints lines of errors (libtpu: "Failed to
find host bounds for accelerator type", a worker-hostname error; CUDA: a failed cuInit) before JAX
falls back to the CPU. Where no accelerator can be present, `cpu_only()` says so, and the commands
then run JAX on the CPU from the start (maxlm/cli.py).
"""

from __future__ import annotations

import glob
import os

GOOGLE_PCI_VENDOR = "0x1ae0"  # TPU chips (and, on Compute Engine, its virtual NICs)
GPU_DEVICE_FILES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg", "/dev/kfd")  # NVIDIA, WSL2, AMD


def cpu_only(root: str = "/") -> bool:
    """True when no GPU device file and no Google PCI device (so no TPU chip) is present under
    `root`. Conservative: a Compute Engine VM's Google NIC counts as a possible TPU, leaving JAX to
    look there, as it does by itself."""
    def at(path: str) -> str:
        return os.path.join(root, path.lstrip("/"))

    if any(os.path.exists(at(p)) for p in GPU_DEVICE_FILES) or glob.glob(at("/dev/accel*")):
        return False
    for vendor in glob.glob(at("/sys/bus/pci/devices/*/vendor")):
        try:
            with open(vendor) as f:
                if f.read().strip() == GOOGLE_PCI_VENDOR:
                    return False
        except OSError:
            return False  # unreadable: not known to be absent
    return True
