#!/bin/sh
# Print the path of a Python maxlm can run on (3.12 or newer); else say in one line what to install
# and exit 2. The Makefile makes .venv with it, and the launchers make or check theirs with it.
#
# The rule, first match wins:
#   1. $PYTHON, when given (a name on PATH or a path); one older than 3.12 is an error, not skipped;
#   2. python3.13, python3.12, python3 on PATH (each one run: a pyenv shim of a version that is not
#      selected is on PATH but fails);
#   3. pyenv's installed versions, newest first ($PYENV_ROOT, default ~/.pyenv);
#   4. uv's: `uv python find '>=3.12'`, else `uv python install 3.12` (uv from PATH or $UV).
set -u

# the interpreter's own path when `$1` runs and is 3.12 or newer; nothing otherwise
usable() {
  "$1" -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1 &&
    "$1" -c 'import sys; print(sys.executable)' 2>/dev/null
}

if [ -n "${PYTHON:-}" ]; then
  usable "$PYTHON" && exit 0
  echo "PYTHON=$PYTHON is not a Python 3.12 or newer that runs; name another, or leave PYTHON unset" >&2
  exit 2
fi

for name in python3.13 python3.12 python3; do
  command -v "$name" >/dev/null 2>&1 && usable "$name" && exit 0
done

for dir in $(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.* 2>/dev/null | sort -V -r); do
  [ -x "$dir/bin/python3" ] && usable "$dir/bin/python3" && exit 0
done

uv=${UV:-$(command -v uv || echo "$HOME/.local/bin/uv")}
if [ -x "$uv" ]; then
  found=$("$uv" python find '>=3.12' 2>/dev/null) ||
    found=$("$uv" python install 3.12 >&2 && "$uv" python find '>=3.12' 2>/dev/null)
  [ -n "$found" ] && usable "$found" && exit 0
fi

echo "maxlm needs Python 3.12 or newer and found none (python3.13/python3.12/python3 on PATH, pyenv, uv):" \
     "install one (e.g. 'uv python install 3.12' or 'pyenv install 3.12'), or name it with PYTHON=/path/to/python3.12" >&2
exit 2
