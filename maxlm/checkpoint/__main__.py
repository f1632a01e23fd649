"""`python -m maxlm.checkpoint {list,verify} --workdir=DIR` (or DIR alone; DIR: a workdir or its
`checkpoints/`): what is saved (step, status, size, time, kind), and with `verify` whether each one
restores (exit 1 if not).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time

from etils import epath

from maxlm.checkpoint import compatibility, store as checkpoint
from maxlm.runtime import paths


def _entries(directory: str):
    found = checkpoint.step_dirs(directory)
    rows = [(s, p, "complete") for s, p in found["complete"]]
    rows += [(s, p, "incomplete") for s, p in found["incomplete"]]
    rows += [(s, p, "damaged") for s, p in found["damaged"]]
    return sorted(rows, key=lambda r: (r[0], r[2]))


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


USAGE = "usage: python -m maxlm.checkpoint {list,verify} --workdir=DIR (or DIR alone)"


def parse_args(argv: list[str]) -> tuple[str, str] | None:
    """(command, DIR) of `{list,verify} --workdir=DIR`, `--workdir DIR` or `DIR`, in any order
    after the command; None for anything else."""
    if not argv or argv[0] not in ("list", "verify"):
        return None
    rest, found = list(argv[1:]), []
    while rest:
        arg = rest.pop(0)
        if arg == "--workdir" and rest:
            found.append(rest.pop(0))
        elif arg.startswith("--workdir="):
            found.append(arg[len("--workdir="):])
        elif arg.startswith("-"):  # another flag: not a directory named after it
            return None
        else:
            found.append(arg)
    return (argv[0], found[0]) if len(found) == 1 and found[0] else None


def main(argv: list[str]) -> int:
    parsed = parse_args(argv)
    if parsed is None:
        print(f"maxlm: config error: {USAGE}; got {argv}", file=sys.stderr)
        return 2
    command, directory = parsed[0], os.fspath(paths.workdir_path(parsed[1]))  # orbax wants it absolute
    if epath.Path(directory, "checkpoints").is_dir():
        directory = os.path.join(directory, "checkpoints")
    if not epath.Path(directory).is_dir():
        print(f"maxlm: config error: no checkpoint directory at {directory}", file=sys.stderr)
        return 2
    entries = _entries(directory)
    header = ["step", "status", "size", "saved", "kind"] + (["check"] if command == "verify" else [])
    rows, bad = [header], 0
    for step, path, status in entries:
        meta = {}
        with contextlib.suppress(Exception):
            meta = checkpoint.read_json(path, "meta")
        saved = meta.get("saved_at") or time.strftime(
            "%Y-%m-%dT%H:%M:%S", time.localtime(epath.Path(path).stat().mtime))
        row = [str(step), status, paths.human_bytes(paths.tree_bytes(path)), saved, meta.get("kind", "?")]
        if command == "verify":
            problem = compatibility.verify_one(path) if status == "complete" else status
            bad += problem is not None
            row.append("ok" if problem is None else problem)
        rows.append(row)
    print(f"{directory}: {len(entries)} checkpoint(s)")
    if entries:
        print(_table(rows))
    if command == "verify":
        print("all ok" if not bad else f"{bad} problem(s)")
        return 1 if bad else 0
    return 0


if __name__ == "__main__":
    logging.getLogger("absl").setLevel(logging.ERROR)
    sys.exit(main(sys.argv[1:]))
