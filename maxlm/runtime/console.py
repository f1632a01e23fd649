"""One-line warnings for the user, on stderr, from process 0 only (the library's only output
outside logging: a command's own output and exit codes are maxlm/cli.py's)."""

import sys


def warn(message: str) -> None:
    """`maxlm: warning: ...` on stderr (also when logging is not set up), from process 0 only."""
    import jax

    if jax.process_index() == 0:
        print(f"maxlm: warning: {message}", file=sys.stderr, flush=True)
