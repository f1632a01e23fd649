"""Run one training job as N processes on this machine, the way a cluster would.

    python launch/local.py --processes=2 --devices_per_process=4 -- \
        --config=configs/tiny.py --workdir=runs/tiny2x4

Each process is `python -m maxlm.train <train args>` with JAX's multi-controller runtime set up
through `JAX_COORDINATOR_ADDRESS=127.0.0.1:PORT`, `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID` (read by
maxlm/runtime/distributed.py) and `M` fake CPU devices, gloo collectives between them. Output lines are
prefixed with the process index. If a process dies, the others are killed at once and the whole job is
started again (up to --max_restarts): it resumes from the newest checkpoint, as a cluster's
babysitter would do. Exit status: the job's (0 done; the failing process's status otherwise).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time

NO_RETRY = {2}  # a config or data error fails the same way every time
PREEMPTED = 143  # maxlm.train's "checkpoint committed after SIGTERM"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pump(prefix: str, stream, out) -> None:
    for line in iter(stream.readline, ""):
        out.write(f"{prefix}{line}")
        out.flush()


def start(index: int, args, train_args: list[str], port: int) -> subprocess.Popen:
    env = dict(os.environ)
    env.update(
        JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
        JAX_NUM_PROCESSES=str(args.processes),
        JAX_PROCESS_ID=str(index),
        JAX_PLATFORMS="cpu",
        PYTHONUNBUFFERED="1",
        XLA_FLAGS=(env.get("XLA_FLAGS", "")
                   + f" --xla_force_host_platform_device_count={args.devices_per_process}").strip(),
    )
    process = subprocess.Popen(
        [sys.executable, "-m", "maxlm.train", *train_args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,  # our signals reach it only when we forward them
    )
    threading.Thread(target=_pump, args=(f"[{index}] ", process.stdout, sys.stdout), daemon=True).start()
    return process


def stop_all(processes: list[subprocess.Popen], grace: float) -> None:
    """SIGTERM (so each can save at a step they agree on), then SIGKILL after `grace` seconds."""
    for p in processes:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in processes:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def run_once(args, train_args: list[str], terminating: threading.Event) -> int:
    """One attempt of the whole job; returns its exit status."""
    port = args.port or free_port()
    processes = [start(i, args, train_args, port) for i in range(args.processes)]
    try:
        while True:
            if terminating.is_set():  # preempted: let every process save and exit
                stop_all(processes, args.grace_seconds)
                return PREEMPTED
            codes = [p.poll() for p in processes]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                # One process died: the others hang in their next collective, where a SIGTERM
                # cannot reach a step they agree on (a save needs every process), so waiting out
                # a grace period saves nothing. Kill them now; a save they had under way is never
                # mistaken for a checkpoint, and the restart resumes from the last committed one.
                stop_all(processes, grace=0)
                return failed[0]
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.2)
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()


def main(argv: list[str]) -> int:
    if "--" in argv:
        split = argv.index("--")
        argv, train_args = argv[:split], argv[split + 1 :]
    else:
        train_args = []
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, required=True)
    parser.add_argument("--devices_per_process", type=int, default=1)
    parser.add_argument("--max_restarts", type=int, default=3)
    parser.add_argument("--port", type=int, default=0, help="coordinator port (0: a free one)")
    parser.add_argument("--grace_seconds", type=float, default=60.0)
    args = parser.parse_args(argv)
    if args.processes < 1 or args.devices_per_process < 1:
        parser.error("--processes and --devices_per_process must be >= 1")
    if not train_args:
        parser.error("give the training arguments after --, e.g. -- --config=configs/tiny.py --workdir=DIR")

    terminating = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: terminating.set())

    for attempt in range(args.max_restarts + 1):
        code = run_once(args, train_args, terminating)
        if code == 0 or code in NO_RETRY or terminating.is_set():
            return code
        if attempt < args.max_restarts:
            print(f"[launch] a process exited with status {code}; restarting the job "
                  f"({attempt + 1} of {args.max_restarts})", flush=True)
    print(f"[launch] giving up after {args.max_restarts} restarts (last status {code})", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
