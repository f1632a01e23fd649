"""A real SLURM cluster of N simulated nodes on this machine, for the tests.

Debian's slurm-wlm (slurmctld, slurmd) and munge run as root without systemd, with every file in
one temporary directory: a munge daemon with its own key and socket, one slurmctld, and one
`slurmd -N nodeK` per node, each with a port of its own on 127.0.0.1 (`SlurmdParameters=
config_overrides` lets the nodes claim CPUs the machine shares). JAX's SLURM detection takes the
coordinator from the first node *name* of a job step, so the node names are added to /etc/hosts
as 127.0.0.1 (and removed afterwards). `cred_expire=5` and `sched_interval=2` let a requeued job
start again in seconds. The packages are installed with apt-get when missing.

Clusters may run side by side (two xdist workers, two sessions on one machine), so each owns what
would otherwise be shared:
- its job ids. JAX's SLURM detection puts a job's coordinator on port `job_id % 4096 + 61440` of
  the job's first node, and every node here is 127.0.0.1. Job ids restarting at 1 in every fresh
  cluster put two clusters' job 1 on one port, where gRPC (SO_REUSEPORT) lets both coordinators
  listen and the kernel spreads the tasks' connections over them: a 2-node job's task 1 registering
  at a 1-task job's coordinator fails with "Unexpected task registered with task=1". Each cluster
  takes a block of 64 job ids (FirstJobId..MaxJobId) whose 64 ports no other cluster holds (a lock
  file per block, held while it runs) and nothing listens on (a process a killed run left);
- its line in /etc/hosts, added and removed under a lock, the file replaced whole (never
  truncated under a reader), so one cluster's restore cannot drop another's names or `localhost`.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from tests.helpers import free_port

PACKAGES = ("slurm-wlm", "munge")
HOSTS = Path("/etc/hosts")
LOCKS = Path(tempfile.gettempdir())  # one machine's clusters share /etc/hosts and the ports
HOSTS_TAG = "  # maxlm tests"  # then the pid of the process whose cluster the line is for
JOB_ID_BLOCK = 64  # job ids a cluster owns: its jobs' coordinator ports are 64 consecutive ones
JAX_SLURM_PORTS = 4096  # JAX's SLURM coordinator port: job_id % 4096 + 61440


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


def _config(root: Path, nodes: list[str], cpus: int, ports: dict[str, int], first_job_id: int) -> str:
    lines = [
        "ClusterName=maxlmtest", "SlurmctldHost=localhost", f"SlurmctldPort={ports['ctld']}",
        f"FirstJobId={first_job_id}", f"MaxJobId={first_job_id + JOB_ID_BLOCK - 1}",
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
    with contextlib.ExitStack() as stack:
        first_job_id = stack.enter_context(_job_id_block())
        (root / "slurm.conf").write_text(_config(root, names, cpus, ports, first_job_id))
        env = {**os.environ, "SLURM_CONF": str(root / "slurm.conf")}
        key = root / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o400)
        stack.enter_context(_hosts_line("127.0.0.1 " + " ".join(names)))
        daemons = []
        try:
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


@contextlib.contextmanager
def _locked(path: Path, blocking: bool = True):
    """An exclusive flock on `path` (None when `blocking` is False and another process holds it);
    the kernel releases it when its holder dies."""
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            yield None
            return
        yield f


@contextlib.contextmanager
def _job_id_block():
    """A FirstJobId no other cluster on this machine uses, held while the cluster runs: the start
    of a block of JOB_ID_BLOCK ids (from 4096 on: never a fresh cluster's default 1) whose JAX
    coordinator ports nothing is listening on."""
    blocks = list(range(JAX_SLURM_PORTS // JOB_ID_BLOCK))
    random.shuffle(blocks)
    for block in blocks:
        first = JAX_SLURM_PORTS + block * JOB_ID_BLOCK
        with _locked(LOCKS / f"maxlm-slurm-job-ids-{block}.lock", blocking=False) as held:
            if held is None or not all(_port_free(first + i) for i in range(JOB_ID_BLOCK)):
                continue
            yield first
            return
    raise RuntimeError(f"no block of {JOB_ID_BLOCK} SLURM job ids whose JAX coordinator ports are all "
                       f"free ({JAX_SLURM_PORTS // JOB_ID_BLOCK} tried): too many clusters, or "
                       "processes of killed runs still listening on ports 61440-65535")


def _port_free(job_id: int) -> bool:
    """Whether JAX's coordinator port for `job_id` is free (a plain bind, without SO_REUSEPORT,
    fails where a gRPC server listens)."""
    port = job_id % JAX_SLURM_PORTS + 65536 - JAX_SLURM_PORTS
    for family, host in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            s = socket.socket(family)
        except OSError:
            continue  # no IPv6 here
        with s:
            try:
                s.bind((host, port))
            except OSError:
                return False
    return True


@contextlib.contextmanager
def _hosts_line(entry: str):
    """`entry` as a line of /etc/hosts while the cluster runs, tagged with this process's pid;
    lines of processes that are gone (killed runs) are dropped on the way."""
    line = f"{entry}{HOSTS_TAG} {os.getpid()}\n"
    _edit_hosts(lambda lines: [*lines, line])
    try:
        yield
    finally:
        _edit_hosts(lambda lines: [l for l in lines if l != line])


def _edit_hosts(edit) -> None:
    """/etc/hosts edited under a lock that every cluster takes: `edit` maps its lines, without the
    tagged lines of dead processes, to the new ones. The file is replaced by a rename where it can
    be (a reader never sees it truncated), else rewritten in place (a bind-mounted /etc/hosts)."""
    def alive(line: str) -> bool:
        pid = line.rsplit(HOSTS_TAG, 1)[1].strip()
        if not pid.isdigit():
            return False  # a line of the old format, from before the pid
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True

    with _locked(LOCKS / "maxlm-slurm-hosts.lock"):
        text = HOSTS.read_text()
        lines = [l for l in text.splitlines(keepends=True) if HOSTS_TAG not in l or alive(l)]
        if lines and not lines[-1].endswith("\n"):
            lines[-1] += "\n"
        new = "".join(edit(lines))
        if new == text:
            return
        tmp = HOSTS.with_name(f".hosts.maxlm-{os.getpid()}")
        tmp.write_text(new)
        shutil.copymode(HOSTS, tmp)
        try:
            os.replace(tmp, HOSTS)
        except OSError:
            tmp.unlink()
            HOSTS.write_text(new)


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
