#!/bin/bash
# What launch/tpu.py runs on every TPU worker, from the unpacked code (~/maxlm):
#
#   launch/tpu_worker.sh start TRAIN_ARGS...   start `python -m maxlm.train TRAIN_ARGS` in its own
#                                              session, detached from the ssh session that started
#                                              it (a dropped connection does not stop it); returns
#                                              at once
#   launch/tpu_worker.sh wait                  follow this worker's log until the training ends;
#                                              exit with the training's status
#
# The state of the run on this worker is in $MAXLM_RUN_DIR (default ~/maxlm-run): train.pid,
# train.log (appended across starts) and train.status (written when the training ends). When it
# ends, the log is also copied to WORKDIR/logs/HOSTNAME.log (gs:// too), so it outlives the VM.
#
# `wait` exits with the training's status (0 done, 143 stopped by SIGTERM after committing a
# checkpoint, 2 bad config, ...), or 75 when no training started here has a status: the VM was
# restarted under it, or nothing was started.
set -uo pipefail
RUN_DIR=${MAXLM_RUN_DIR:-$HOME/maxlm-run}
PYTHON=${PYTHON:-.venv/bin/python}
NO_RUN=75

running() {  # the training started here is alive (and the pid is still ours, not a reused one)
  [ -f "$RUN_DIR/train.pid" ] || return 1
  local pid
  pid=$(cat "$RUN_DIR/train.pid")
  kill -0 "$pid" 2>/dev/null && grep -q tpu_worker "/proc/$pid/cmdline" 2>/dev/null
}

start() {
  mkdir -p "$RUN_DIR"
  if running; then
    echo "tpu_worker: a training started here is still running (pid $(cat "$RUN_DIR/train.pid")):" \
         "follow it with launch/tpu.py --attach" >&2
    exit 3
  fi
  rm -f "$RUN_DIR/train.status"
  echo "tpu_worker: $(date -u +%FT%TZ) starting on $(hostname)" >> "$RUN_DIR/train.log"
  # setsid: a session of its own, so the end of this ssh session (SIGHUP to its process group)
  # does not reach the training; every stream is redirected so that ssh does not wait for it.
  setsid "$0" run "$@" >> "$RUN_DIR/train.log" 2>&1 < /dev/null &
  echo $! > "$RUN_DIR/train.pid"
}

copy_log_to_workdir() {  # epath: a gs:// workdir as well as a shared filesystem
  local workdir="" arg
  for arg in "$@"; do
    case "$arg" in --workdir=*) workdir=${arg#--workdir=} ;; esac
  done
  [ -n "$workdir" ] || return 0
  "$PYTHON" - "$workdir" "$RUN_DIR/train.log" <<'EOF' || echo "tpu_worker: log not copied to the workdir" >&2
import socket, sys
from etils import epath
logs = epath.Path(sys.argv[1]) / "logs"
logs.mkdir(parents=True, exist_ok=True)
(logs / f"{socket.gethostname()}.log").write_text(open(sys.argv[2], errors="replace").read())
EOF
}

run() {  # the detached part: train, then record the status
  source launch/tpu_env.sh
  child=""
  stopping=0
  # A preemption notice (SIGTERM) to this shell goes on to the training, which saves and exits 143.
  trap 'stopping=1; [ -z "$child" ] || kill -TERM "$child" 2>/dev/null' TERM
  # --config.platform (after --config, as config flags must be): a worker whose jax cannot see
  # the TPU exits 2 instead of training on its CPU. MAXLM_PLATFORM overrides it (the tests: cpu).
  MAXLM_DISTRIBUTED=${MAXLM_DISTRIBUTED:-auto} "$PYTHON" -m maxlm.train "$@" \
    --config.platform="${MAXLM_PLATFORM:-tpu}" &
  child=$!
  [ "$stopping" -eq 0 ] || kill -TERM "$child" 2>/dev/null
  while true; do  # `wait` returns early (> 128) when the trap runs: wait until it has exited
    wait "$child"
    status=$?
    kill -0 "$child" 2>/dev/null || break
  done
  echo "tpu_worker: $(date -u +%FT%TZ) the training ended with status $status"
  copy_log_to_workdir "$@" >> "$RUN_DIR/train.log" 2>&1
  echo "$status" > "$RUN_DIR/train.status"
}

wait_for_end() {
  if [ -f "$RUN_DIR/train.pid" ]; then
    # the last lines, then everything new until the training's process has exited
    tail -n 20 -F --pid="$(cat "$RUN_DIR/train.pid")" "$RUN_DIR/train.log" 2>/dev/null
  fi
  if running; then  # tail stopped but the training runs on (tail was killed): not an end
    exit 255
  fi
  if [ -f "$RUN_DIR/train.status" ]; then
    exit "$(cat "$RUN_DIR/train.status")"
  fi
  echo "tpu_worker: no training with a status on $(hostname): it never started, or the VM" \
       "restarted under it" >&2
  exit $NO_RUN
}

command=${1:-}
shift || true
case "$command" in
  start) start "$@" ;;
  run) run "$@" ;;
  wait) wait_for_end ;;
  *) echo "usage: launch/tpu_worker.sh start TRAIN_ARGS... | wait" >&2; exit 2 ;;
esac
