"""Train on a Cloud TPU VM or pod slice with `gcloud`: create, install, run everywhere, collect, delete.

    python launch/tpu.py --name=maxlm-v5p --zone=us-east5-a --accelerator=v5p-64 --spot -- \
        --config=configs/llama_1b.py --workdir=/mnt/shared/runs/llama_1b

Every step is one `gcloud compute tpus ...` command, printed before it runs; `--dry_run` prints
them and runs nothing. The same training command runs on every worker (`--worker=all`) with
`MAXLM_DISTRIBUTED=auto`, so each host calls `jax.distributed.initialize()` and JAX reads the pod's
topology itself. The code shipped is `git archive HEAD` of this checkout (commit first), installed
into a virtualenv on each worker with the runtime lock and `locks/tpu.lock` (libtpu); with
`--reuse --no_install` it is there already.
The workdir must be one every worker shares: a `gs://bucket/run` URL (every workdir write goes
through etils.epath; `gcsfs` is then installed too), Filestore/NFS, or a bucket mounted with
gcsfuse. Checkpoints are written by all hosts, metrics by host 0.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import time

DEFAULT_RUNTIME = {"v4": "tpu-ubuntu2204-base", "v5litepod": "v2-alpha-tpuv5-lite",
                   "v5p": "v2-alpha-tpuv5", "v6e": "v2-alpha-tpuv6e"}
TARBALL = "maxlm.tar.gz"
LOG = "maxlm-train.log"


def runtime_for(accelerator: str) -> str:
    family = accelerator.rsplit("-", 1)[0]
    if family not in DEFAULT_RUNTIME:
        raise SystemExit(f"tpu.py: no default --runtime for {accelerator!r}; pass --runtime")
    return DEFAULT_RUNTIME[family]


def gcloud(args, *words: str) -> list[str]:
    command = ["gcloud", "compute", "tpus", *words, f"--zone={args.zone}"]
    return command + ([f"--project={args.project}"] if args.project else [])


def create_commands(args) -> list[list[str]]:
    runtime = args.runtime or runtime_for(args.accelerator)
    if args.queued:  # queued resources: wait in line for capacity instead of failing at once
        command = gcloud(args, "queued-resources", "create", args.name, f"--node-id={args.name}",
                         f"--accelerator-type={args.accelerator}", f"--runtime-version={runtime}")
        return [command + (["--spot"] if args.spot else [])]
    command = gcloud(args, "tpu-vm", "create", args.name,
                     f"--accelerator-type={args.accelerator}", f"--version={runtime}")
    return [command + (["--spot"] if args.spot else [])]


def ssh(args, remote: str) -> list[str]:
    return gcloud(args, "tpu-vm", "ssh", args.name, "--worker=all", f"--command={remote}")


def install_command(args, train_args: list[str] = ()) -> str:
    # A gs:// workdir is written through etils.epath, whose GCS backend is gcsfs.
    remote = any(a.startswith("--workdir=gs://") for a in train_args)
    return " && ".join([
        f"rm -rf maxlm && mkdir maxlm && tar -xzf {TARBALL} -C maxlm",
        "cd maxlm",
        "python3 -m venv .venv",
        ".venv/bin/pip install --quiet --upgrade pip",
        # The runtime set plus the libtpu its jaxlib pins (the tests' packages stay off the workers).
        ".venv/bin/pip install --quiet -r requirements.lock -r locks/tpu.lock",
        ".venv/bin/pip install --quiet --no-deps -e .",
        *([".venv/bin/pip install --quiet gcsfs"] if remote else []),
    ])


def train_command(train_args: list[str], env: list[str] = ()) -> str:
    # The log on each worker survives the ssh session; `nohup` is not used so that the ssh
    # command's exit status is the training's (143 = preempted, 0 = done).
    # --config.platform=tpu (after --config, as config flags must be): a worker whose jax cannot
    # see the TPU exits 2 instead of training on its CPU.
    # launch/tpu_env.sh: libtpu's settings; the user's --env values are exported after it and win.
    exports = "".join(f"export {shlex.quote(item)} && " for item in env)
    return (f"cd maxlm && {exports}source launch/tpu_env.sh && MAXLM_DISTRIBUTED=auto .venv/bin/python -m maxlm.train "
            f"{shlex.join(train_args)} --config.platform=tpu 2>&1 | tee -a ~/{LOG}; "
            f"exit ${{PIPESTATUS[0]}}")


def job_commands(args, train_args: list[str]) -> list[list[str]]:
    """Create (unless --reuse), ship the code and install (unless --no_install), train: stop at
    the first failure."""
    commands = [] if args.reuse else create_commands(args)
    if not args.no_install:
        commands += [
            ["git", "archive", "--format=tar.gz", f"--output={TARBALL}", "HEAD"],
            gcloud(args, "tpu-vm", "scp", TARBALL, f"{args.name}:~/", "--worker=all"),
            ssh(args, install_command(args, train_args)),
        ]
    return commands + [ssh(args, train_command(train_args, args.env))]


def final_commands(args) -> list[list[str]]:
    """Run whatever happened above: collect worker 0's log, then delete (unless --keep)."""
    commands = [gcloud(args, "tpu-vm", "scp", f"{args.name}:~/{LOG}", f"{args.name}-{LOG}",
                       "--worker=0")]
    if not args.keep:
        delete = ("queued-resources", "delete", args.name, "--force") if args.queued else (
            "tpu-vm", "delete", args.name)
        commands.append(gcloud(args, *delete, "--quiet"))
    return commands


def wait_until_active(args) -> None:
    """Queued resources are granted asynchronously: poll until the slice exists."""
    describe = gcloud(args, "queued-resources", "describe", args.name, "--format=value(state.state)")
    while True:
        state = subprocess.run(describe, capture_output=True, text=True).stdout.strip()
        print(f"[tpu] queued resource {args.name}: {state or 'unknown'}", flush=True)
        if state == "ACTIVE":
            return
        if state in ("FAILED", "SUSPENDED"):
            raise SystemExit(f"tpu.py: queued resource {args.name} is {state}")
        time.sleep(30)


def main(argv: list[str]) -> int:
    split = argv.index("--") if "--" in argv else len(argv)
    argv, train_args = argv[:split], argv[split + 1 :]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--name", required=True, help="TPU VM / queued resource name")
    parser.add_argument("--zone", required=True)
    parser.add_argument("--accelerator", required=True, help="e.g. v5p-64, v5litepod-16, v4-8")
    parser.add_argument("--project", default="")
    parser.add_argument("--runtime", default="", help="TPU software version (default by family)")
    parser.add_argument("--spot", action="store_true", help="spot capacity (preemptible)")
    parser.add_argument("--queued", action="store_true", help="use queued resources")
    parser.add_argument("--reuse", action="store_true", help="the TPU exists already: skip create")
    parser.add_argument("--keep", action="store_true", help="do not delete the TPU afterwards")
    parser.add_argument("--no_install", action="store_true",
                        help="with --reuse: maxlm is installed there already (an earlier run with "
                             "--keep, e.g. launch/sweep.py's previous point); ship nothing")
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
    if not any(a.startswith("--config=") for a in train_args):
        parser.error("give the training arguments after --, e.g. -- --config=configs/llama_1b.py --workdir=gs://...")

    status = 0
    for command in job_commands(args, train_args):
        print("[tpu] " + shlex.join(command), flush=True)
        if args.dry_run:
            continue
        status = subprocess.run(command).returncode
        if status:
            print(f"[tpu] failed with status {status}", file=sys.stderr, flush=True)
            break
        if command[3:5] == ["queued-resources", "create"]:
            wait_until_active(args)
    for command in final_commands(args):
        print("[tpu] " + shlex.join(command), flush=True)
        if not args.dry_run:
            subprocess.run(command)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
