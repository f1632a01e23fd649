"""A real SLURM cluster of N simulated nodes on this machine, for the tests.

Debian's slurm-wlm (slurmctld, slurmd) and munge run as root without systemd, with every file in
one temporary directory: a munge daemon with its own key and socket, one slurmctld, and one
`slurmd -N nodeK` per node, each with a port of its own on 127.0.0.1 (`SlurmdParameters=
config_overrides` lets the nodes claim CPUs the machine shares). JAX's SLURM detection takes the
coordinator from the first node *name* of a job step, so the node names are added to /etc/hosts
as 127.0.0.1 (and removed afterwards). `cred_expire=5` and `sched_interval=2` let a requeued job
start again in seconds. The packages are installed with apt-get when missing.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from pathlib import Path

from tests.helpers import free_port

PACKAGES = ("slurm-wlm", "munge")
HOSTS = Path("/etc/hosts")


def unavailable_reason() -> str | None:
    """Why no local SLURM cluster can run here, or None."""
    if os.geteuid() != 0:
        return "a local SLURM cluster needs root (slurmd runs jobs as any user)"
    if not shutil.which("apt-get") and not shutil.which("slurmctld"):
        return "slurm-wlm is not installed and there is no apt-get to install it"
    return None


def ensure_installed() -> None:
    """apt-get installs slurm-wlm and munge when slurmctld is missing (raises if that fails)."""
    if shutil.which("slurmctld") and shutil.which("munged"):
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]
    if subprocess.run(install, env=env, capture_output=True).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, check=True)
        subprocess.run(install, env=env, capture_output=True, check=True)


def _config(root: Path, nodes: list[str], cpus: int, ports: dict[str, int]) -> str:
    lines = [
        "ClusterName=maxlmtest", "SlurmctldHost=localhost", f"SlurmctldPort={ports['ctld']}",
        f"SlurmdPort={ports['slurmd']}", "AuthType=auth/munge", "CryptoType=crypto/munge",
        f"AuthInfo=socket={root}/munge.socket,cred_expire=5", "SlurmUser=root", "SlurmdUser=root",
        f"StateSaveLocation={root}/state", f"SlurmdSpoolDir={root}/spool/%n",
        f"SlurmctldPidFile={root}/slurmctld.pid", f"SlurmdPidFile={root}/slurmd-%n.pid",
        f"SlurmctldLogFile={root}/slurmctld.log", f"SlurmdLogFile={root}/slurmd-%n.log",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU", "SlurmdParameters=config_overrides", "JobRequeue=1",
        "ReturnToService=2", "MpiDefault=none", "SchedulerType=sched/backfill",
        "SchedulerParameters=sched_interval=2", "KillWait=10", "InactiveLimit=0", "MinJobAge=300",
    ]
    lines += [f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={ports[n]} CPUs={cpus} "
              "RealMemory=4000 State=UNKNOWN" for n in nodes]
    lines.append(f"PartitionName=debug Nodes={','.join(nodes)} Default=YES MaxTime=INFINITE State=UP "
                 "OverSubscribe=YES")
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def local_slurm(root: Path, nodes: int = 2, cpus: int = 4):
    """A running cluster of `nodes` nodes; yields the environment for sbatch, srun, scancel (the
    caller's environment plus SLURM_CONF)."""
    ensure_installed()
    names = [f"maxlmnode{i + 1}" for i in range(nodes)]
    ports = {"ctld": free_port(), "slurmd": free_port(), **{n: free_port() for n in names}}
    for sub in ("state", "spool", *(f"spool/{n}" for n in names)):
        (root / sub).mkdir(parents=True, exist_ok=True)
    (root / "slurm.conf").write_text(_config(root, names, cpus, ports))
    env = {**os.environ, "SLURM_CONF": str(root / "slurm.conf")}
    key = root / "munge.key"
    key.write_bytes(os.urandom(128))
    key.chmod(0o400)
    tag = "  # maxlm tests"  # a line left by a run that was killed is dropped too
    hosts = "".join(line for line in HOSTS.read_text().splitlines(keepends=True) if tag not in line)
    daemons = []
    try:
        HOSTS.write_text(hosts.rstrip("\n") + "\n127.0.0.1 " + " ".join(names) + tag + "\n")
        subprocess.run(["munged", "--force", f"--socket={root}/munge.socket", f"--key-file={key}",
                        f"--pid-file={root}/munged.pid", f"--log-file={root}/munged.log",
                        f"--seed-file={root}/munged.seed"], check=True, capture_output=True)
        daemons.append(root / "munged.pid")
        subprocess.run(["slurmctld"], env=env, check=True, capture_output=True)
        daemons.append(root / "slurmctld.pid")
        for name in names:
            subprocess.run(["slurmd", "-N", name], env=env, check=True, capture_output=True)
            daemons.append(root / f"slurmd-{name}.pid")
        _wait_idle(env, nodes, root)
        yield env
    finally:
        for pid_file in reversed(daemons):
            with contextlib.suppress(OSError, ValueError):
                os.kill(int(pid_file.read_text()), 15)
        HOSTS.write_text(hosts)


def _wait_idle(env, nodes: int, root: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], env=env, capture_output=True,
                                text=True).stdout.split()
        if states.count("idle") == nodes:
            return
        time.sleep(0.5)
    logs = "\n".join(p.read_text()[-1500:] for p in root.glob("*.log"))
    raise RuntimeError(f"the local SLURM cluster did not come up: sinfo says {states}\n{logs}")


def wait_for_job(env, job: str, timeout: float = 300) -> str:
    """Waits until `job` has left the queue; its final state (sacct is not configured: scontrol)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True,
                             text=True).stdout
        state = next((w.split("=", 1)[1] for w in out.split() if w.startswith("JobState=")), "")
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            return state
        time.sleep(0.5)
    raise TimeoutError(f"job {job} still not done after {timeout:.0f} s")
