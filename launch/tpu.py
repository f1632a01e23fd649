"""Train on a Cloud TPU VM, pod slice or several slices with `gcloud`: create, install, start
everywhere, follow until done (restarting after preemptions), collect, delete.

    python launch/tpu.py --name=maxlm-v5p --zone=us-east5-a --accelerator=v5p-64 --spot --queued -- \
        --config=configs/llama_1b_v5p64.py --workdir=gs://bucket/runs/llama_1b

Every step is one `gcloud compute tpus ...` command, printed before it runs; `--dry_run` prints
them and runs nothing. The code shipped is `git archive HEAD` of this checkout (commit first). On
each worker `uv` (installed with the image's pip) makes a virtualenv on the Python 3.12+ that
launch/find_python.sh finds there, a managed one when the image's is older (cached in
~/.local/share/uv, so `--reuse` installs fast), with the runtime lock and `locks/tpu.lock` (libtpu). `launch/tpu_worker.sh` then starts the same training
command on every worker, detached from ssh (a dropped connection does not stop it), with
`MAXLM_DISTRIBUTED=auto`: each host calls `jax.distributed.initialize()`, which reads the pod's
topology.

The launcher then follows worker 0's log until the training ends. Exit 0 is done. Exit 143 (a
preemption's SIGTERM: a checkpoint was committed) or a slice that is gone (a spot slice
preempted) starts the run again, on a re-created slice when needed, and it resumes from its
checkpoint; at most `--max_restarts` times. Any other status is a failure and is returned.
`--detach` returns once the training has started; `--attach` (same command line) follows it
again later, with the same restarts.

`--num_slices=N` (multislice) requests N slices as one queued resource; every worker gets the
MEGASCALE_* variables (coordinator: slice 0's first worker) and the mesh splits across slices
with `--config.mesh.dcn_data` / `dcn_fsdp` (docs/launching.md).

The workdir must be one every worker shares: a `gs://bucket/run` URL (every workdir write goes
through etils.epath and its pinned gcsfs), Filestore/NFS, or a bucket mounted with gcsfuse. Each worker's log is copied to WORKDIR/logs/HOSTNAME.log when its training ends.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
import time

DEFAULT_RUNTIME = {"v4": "tpu-ubuntu2204-base", "v5litepod": "v2-alpha-tpuv5-lite",
                   "v5p": "v2-alpha-tpuv5", "v6e": "v2-alpha-tpuv6e"}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARBALL = "maxlm.tar.gz"
LOG = "maxlm-run/train.log"  # on each worker, under ~ (launch/tpu_worker.sh)
UV_VERSION = "0.13.8"
MEGASCALE_PORT = 8080
PREEMPTED, NO_RUN, SSH_FAILED = 143, 75, 255  # tpu_worker.sh wait's statuses, and ssh's own
READY_STATES = {"READY", "ACTIVE"}  # a TPU VM's, a queued resource's


def runtime_for(accelerator: str) -> str:
    family = accelerator.rsplit("-", 1)[0]
    if family not in DEFAULT_RUNTIME:
        raise SystemExit(f"tpu.py: no default --runtime for {accelerator!r}; pass --runtime")
    return DEFAULT_RUNTIME[family]


class Pod:
    """The gcloud commands for one TPU (a single slice) or queued resource (one or more slices)."""

    def __init__(self, args):
        self.args = args
        self.queued = args.queued or args.num_slices > 1  # multislice exists only as queued resources

    def gcloud(self, *words: str) -> list[str]:
        command = ["gcloud", "compute", "tpus", *words, f"--zone={self.args.zone}"]
        return command + ([f"--project={self.args.project}"] if self.args.project else [])

    def create(self) -> list[str]:
        a = self.args
        runtime = a.runtime or runtime_for(a.accelerator)
        if self.queued:  # queued resources: wait in line for capacity instead of failing at once
            nodes = ([f"--node-count={a.num_slices}", f"--node-prefix={a.name}"] if a.num_slices > 1
                     else [f"--node-id={a.name}"])
            command = self.gcloud("queued-resources", "create", a.name, *nodes,
                                  f"--accelerator-type={a.accelerator}", f"--runtime-version={runtime}")
        else:
            command = self.gcloud("tpu-vm", "create", a.name, f"--accelerator-type={a.accelerator}",
                                  f"--version={runtime}")
        return command + (["--spot"] if a.spot else [])

    def delete(self) -> list[str]:
        if self.queued:
            return self.gcloud("queued-resources", "delete", self.args.name, "--force", "--quiet")
        return self.gcloud("tpu-vm", "delete", self.args.name, "--quiet")

    def describe_state(self) -> list[str]:
        if self.queued:
            return self.gcloud("queued-resources", "describe", self.args.name, "--format=value(state.state)")
        return self.gcloud("tpu-vm", "describe", self.args.name, "--format=value(state)")

    def ssh(self, remote: str, node: str = "all", worker: str = "all") -> list[str]:
        if self.queued:
            return self.gcloud("queued-resources", "ssh", self.args.name, f"--node={node}",
                               f"--worker={worker}", f"--command={remote}")
        return self.gcloud("tpu-vm", "ssh", self.args.name, f"--worker={worker}", f"--command={remote}")

    def scp_to_all(self, local: str) -> list[str]:
        nodes = ["--node=all"] if self.queued else []
        kind = "queued-resources" if self.queued else "tpu-vm"
        return self.gcloud(kind, "scp", local, f"{self.args.name}:~/", *nodes, "--worker=all")

    def scp_from_first(self, remote: str, local: str) -> list[str]:
        nodes = ["--node=0"] if self.queued else []
        kind = "queued-resources" if self.queued else "tpu-vm"
        return self.gcloud(kind, "scp", f"{self.args.name}:~/{remote}", local, *nodes, "--worker=0")


def install_command(args) -> str:
    """Unpack the shipped code and make its virtualenv: launch/find_python.sh's rule picks the
    Python (--python, else a 3.12+ on the worker, else uv's managed one, as TPU images ship 3.10),
    then the runtime lock and the pinned libtpu, no test packages."""
    uv = "~/.local/bin/uv"
    venv_pip = f"{uv} pip install --python .venv/bin/python --quiet"
    return " && ".join([
        f"rm -rf maxlm && mkdir maxlm && tar -xzf {TARBALL} -C maxlm",
        "cd maxlm",
        # pip of the image's Python, else uv's standalone installer; both put uv in ~/.local/bin
        f"({uv} --version 2>/dev/null | grep -q ' {UV_VERSION}' || python3 -m pip install --user "
        f"--quiet uv=={UV_VERSION} || curl -LsSf https://astral.sh/uv/{UV_VERSION}/install.sh | sh)",
        f"python=$(PYTHON={shlex.quote(args.python)} UV={uv} launch/find_python.sh)",
        f'{uv} venv --python "$python" .venv',
        f"{venv_pip} -r requirements.lock -r locks/tpu.lock",
        f"{venv_pip} --no-deps -e .",
    ])


def start_command(train_args: list[str], env: list[str]) -> str:
    """Start the training on a worker through launch/tpu_worker.sh (detached; sources
    launch/tpu_env.sh, libtpu's settings). `env` is exported first: the user's --env values win
    over the preset, whose `:-` keeps a value already set."""
    exports = "".join(f"export {shlex.quote(item)} && " for item in env)
    return f"cd maxlm && {exports}launch/tpu_worker.sh start {shlex.join(train_args)}"


WAIT = "cd maxlm && launch/tpu_worker.sh wait"


def megascale_env(args, slice_id: int, coordinator: str) -> list[str]:
    """The variables libtpu's multislice runtime reads on each worker of slice `slice_id`."""
    return [f"MEGASCALE_COORDINATOR_ADDRESS={coordinator}:{MEGASCALE_PORT}",
            f"MEGASCALE_NUM_SLICES={args.num_slices}", f"MEGASCALE_SLICE_ID={slice_id}",
            f"MEGASCALE_PORT={MEGASCALE_PORT}"]


class Launcher:
    def __init__(self, args, train_args: list[str]):
        self.args, self.train_args, self.pod = args, train_args, Pod(args)

    def run(self, command: list[str], capture: bool = False) -> subprocess.CompletedProcess:
        print("[tpu] " + shlex.join(command), flush=True)
        if self.args.dry_run:
            return subprocess.CompletedProcess(command, 0, stdout="")
        return subprocess.run(command, capture_output=capture, text=True)

    def check(self, command: list[str]) -> None:
        status = self.run(command).returncode
        if status:
            raise Failed(status, shlex.join(command[:6]))

    def state(self) -> str:
        result = self.run(self.pod.describe_state(), capture=True)
        return result.stdout.strip() if result.returncode == 0 else "GONE"

    def create(self) -> None:
        self.check(self.pod.create())
        if self.pod.queued and not self.args.dry_run:
            self.wait_until_active()

    def wait_until_active(self) -> None:
        """Queued resources are granted asynchronously: poll until the slices exist."""
        while (state := self.state()) != "ACTIVE":
            print(f"[tpu] queued resource {self.args.name}: {state or 'unknown'}", flush=True)
            if state in ("FAILED", "SUSPENDED", "GONE"):
                raise Failed(1, f"queued resource {self.args.name} is {state}")
            time.sleep(30)

    def install(self) -> None:
        with tempfile.TemporaryDirectory() as scratch:
            tarball = os.path.join(scratch, TARBALL)
            self.check(["git", "-C", ROOT, "archive", "--format=tar.gz", f"--output={tarball}", "HEAD"])
            self.check(self.pod.scp_to_all(tarball))
        self.check(self.pod.ssh(install_command(self.args)))

    def start(self) -> None:
        a = self.args
        if a.num_slices == 1:
            self.check(self.pod.ssh(start_command(self.train_args, a.env)))
            return
        # Slice 0's first worker coordinates the slices: its address, asked of the worker itself.
        result = self.run(self.pod.ssh("hostname -I | cut -d' ' -f1", node="0", worker="0"), capture=True)
        coordinator = result.stdout.strip() or "SLICE0_WORKER0_ADDRESS"
        if result.returncode:
            raise Failed(result.returncode, "reading slice 0's address")
        for slice_id in range(a.num_slices):
            env = megascale_env(a, slice_id, coordinator) + a.env
            self.check(self.pod.ssh(start_command(self.train_args, env), node=str(slice_id)))

    def follow(self) -> int:
        """Worker 0's log until its training ends; its status. A dropped connection to a slice
        that is still there follows again (the training runs on, detached)."""
        dropped = 0
        while True:
            status = self.run(self.pod.ssh(WAIT, node="0", worker="0")).returncode
            if status != SSH_FAILED or self.args.dry_run:
                return status
            dropped += 1
            if self.state() not in READY_STATES or dropped > 5:
                return status
            print(f"[tpu] connection to worker 0 lost ({dropped}); following again", flush=True)
            time.sleep(30)

    def supervise(self) -> int:
        """Start (unless attaching), follow, and start again after each preemption: on the same
        slices while they are up, else on new ones (a spot slice preempted is gone)."""
        a = self.args
        if not a.attach:
            if not a.reuse:
                self.create()
            if not a.no_install:
                self.install()
            self.start()
        if a.detach:
            print("[tpu] started; follow it with the same command and --attach", flush=True)
            return 0
        restarts = 0
        while True:
            status = self.follow()
            if status not in (PREEMPTED, NO_RUN, SSH_FAILED) or a.dry_run:
                return status
            state = self.state()
            if status == SSH_FAILED and state in READY_STATES:  # no preemption: ssh itself fails
                return status
            if restarts == a.max_restarts:
                print(f"[tpu] stopped with status {status}; not restarted: {restarts} restarts done",
                      flush=True)
                return status
            restarts += 1
            print(f"[tpu] stopped with status {status}, slice state {state or 'unknown'}: restart "
                  f"{restarts} of {a.max_restarts}; the run resumes from its newest checkpoint", flush=True)
            if state not in READY_STATES:
                if state != "GONE":
                    self.check(self.pod.delete())
                self.create()
                self.install()
            self.start()

    def collect(self) -> None:
        """Worker 0's log back here, and the slices deleted (unless --keep)."""
        self.run(self.pod.scp_from_first(LOG, f"{self.args.name}-train.log"))
        if not self.args.keep:
            self.run(self.pod.delete())


class Failed(Exception):
    def __init__(self, status: int, what: str):
        super().__init__(f"{what} failed with status {status}")
        self.status = status


def main(argv: list[str]) -> int:
    split = argv.index("--") if "--" in argv else len(argv)
    argv, train_args = argv[:split], argv[split + 1 :]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--name", required=True, help="TPU VM / queued resource name")
    parser.add_argument("--zone", required=True)
    parser.add_argument("--accelerator", required=True, help="one slice's type, e.g. v5p-64, v5litepod-16, v4-8")
    parser.add_argument("--num_slices", type=int, default=1,
                        help="slices of --accelerator in one queued resource (multislice)")
    parser.add_argument("--project", default="")
    parser.add_argument("--runtime", default="", help="TPU software version (default by family)")
    parser.add_argument("--python", default="",
                        help="the workers' Python 3.12+ for the virtualenv (a path or name on the workers; "
                             "default: launch/find_python.sh's rule there, which ends with uv's own 3.12)")
    parser.add_argument("--spot", action="store_true", help="spot capacity (preemptible)")
    parser.add_argument("--queued", action="store_true", help="use queued resources")
    parser.add_argument("--reuse", action="store_true", help="the TPU exists already: skip create")
    parser.add_argument("--keep", action="store_true", help="do not delete the TPU afterwards")
    parser.add_argument("--no_install", action="store_true",
                        help="with --reuse: maxlm is installed there already (an earlier run with "
                             "--keep, e.g. launch/sweep.py's previous point); ship nothing")
    parser.add_argument("--detach", action="store_true",
                        help="return once the training has started (the TPU is kept)")
    parser.add_argument("--attach", action="store_true",
                        help="follow a training started earlier (same command line), with restarts")
    parser.add_argument("--max_restarts", type=int, default=20,
                        help="restarts after preemptions before giving up")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="set on every worker before training (repeatable), e.g. "
                             "LIBTPU_INIT_ARGS=... (replaces launch/tpu_env.sh's) or JAX_COMPILATION_CACHE_DIR=gs://...")
    parser.add_argument("--dry_run", action="store_true", help="print the commands, run nothing")
    args = parser.parse_args(argv)
    bad_env = [item for item in args.env if "=" not in item or not item.split("=", 1)[0].isidentifier()]
    if bad_env:
        parser.error(f"--env takes KEY=VALUE, got {bad_env[0]!r}")
    if args.no_install and not args.reuse:
        parser.error("--no_install needs --reuse (a new TPU has nothing installed)")
    if args.num_slices < 1:
        parser.error(f"--num_slices must be >= 1, got {args.num_slices}")
    if args.attach and args.detach:
        parser.error("--attach follows a training, --detach does not: give one")
    if not any(a.startswith("--config=") for a in train_args):
        parser.error("give the training arguments after --, e.g. -- --config=configs/llama_1b.py --workdir=gs://...")

    launcher = Launcher(args, train_args)
    try:
        status = launcher.supervise()
    except Failed as e:
        print(f"[tpu] {e}", file=sys.stderr, flush=True)
        status = e.status
    if not args.detach:
        launcher.collect()
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
