"""A stand-in for `gcloud compute tpus` (the subset launch/tpu.py uses), for the launcher's tests.

Each TPU is one worker: a home directory under $FAKE_GCLOUD_DIR where `ssh` runs the command with
bash (HOME set to it) and `scp` copies to and from. `create` makes a fresh home and sets the state
(READY, or ACTIVE for a queued resource), `describe` prints it (a test writes PREEMPTED there to
preempt), `delete` removes both. Installing is faked: of the install command only the unpacking
of the shipped code runs (uv and pip would need the network); the tests give the workers a Python
through $PYTHON. Every call is appended to $FAKE_GCLOUD_DIR/calls.jsonl.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

STATE = Path(os.environ["FAKE_GCLOUD_DIR"])


def home(name: str) -> Path:
    return STATE / f"{name}.home"


def main(argv: list[str]) -> int:
    with open(STATE / "calls.jsonl", "a") as f:
        f.write(json.dumps(argv) + "\n")
    assert argv[:2] == ["compute", "tpus"], argv
    kind, verb, *rest = argv[2:]
    flags = dict(a[2:].split("=", 1) for a in rest if a.startswith("--") and "=" in a)
    positional = [a for a in rest if not a.startswith("--")]
    if verb == "create":
        name = positional[0]
        shutil.rmtree(home(name), ignore_errors=True)
        home(name).mkdir()
        (STATE / f"{name}.state").write_text("ACTIVE" if kind == "queued-resources" else "READY")
    elif verb == "delete":
        name = positional[0]
        shutil.rmtree(home(name), ignore_errors=True)
        (STATE / f"{name}.state").unlink(missing_ok=True)
    elif verb == "describe":
        state = STATE / f"{positional[0]}.state"
        if not state.exists():
            print("ERROR: NOT_FOUND", file=sys.stderr)
            return 1
        print(state.read_text())
    elif verb == "scp":
        source, dest = positional
        if ":" in dest:  # local -> every worker's home
            name = dest.split(":")[0]
            shutil.copy(source, home(name))
        else:
            name, remote = source.split(":~/")
            if not (home(name) / remote).exists():
                return 1
            shutil.copy(home(name) / remote, dest)
    elif verb == "ssh":
        name, command = positional[0], flags["command"]
        if not home(name).exists():
            print(f"ERROR: {name} not found", file=sys.stderr)
            return 255
        if "uv venv" in command:  # the install: unpack only
            command = command.split(" && cd maxlm")[0]
        return subprocess.run(["bash", "-c", command], cwd=home(name),
                              env={**os.environ, "HOME": str(home(name))}).returncode
    else:
        raise SystemExit(f"fake gcloud: {verb} not faked")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
