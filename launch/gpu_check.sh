#!/bin/bash
# Everything maxlm checks and measures on an NVIDIA GPU, in one command (about 9 minutes or less
# on one H200), with whatever jax the machine has:
#
#   launch/gpu_check.sh OUT_DIR [CHECK...]
#
# CHECK names some of the checks below to run only those (default: all).
# OUT_DIR gets one JSON file per check, its log, and summary.jsonl (one line per check: name, exit
# status, seconds). docs/gpus.md records the figures, with the date and the machine.
#   devices     jax and the GPUs it sees, and the peak FLOP/s maxlm divides by
#   gpu_tests   the suite's GPU-only tests (pytest -m gpu): cuDNN attention against XLA (values and
#               gradients, seq 256 and 4096), cuBLASLt float8 GEMMs in the compiled HLO
#   attention   cuDNN against XLA attention at Llama 3.2 1B's shapes, seq 4096: differences, times
#   fp8_hlo     how many float8 GEMMs the fp8 train step compiles to, with and without Triton GEMMs
#   bench_bf16, bench_fp8   maxlm.bench of the 1B model at seq 4096 (tokens/s, MFU, peak memory)
#   resume      a short maxlm.train stopped by SIGTERM and resumed equals one run straight through
#               (the runs, logs included, in OUT_DIR/resume_runs)
# maxlm comes from this checkout (PYTHONPATH); its Python dependencies must be importable
# (`make install ACCEL=cuda12|cuda13`, or the GPU image's own packages plus what is missing).
set -uo pipefail
OUT=$(mkdir -p "${1:?usage: launch/gpu_check.sh OUT_DIR [CHECK...]}" && cd "$1" && pwd)
shift
ONLY=" $* "
cd "$(dirname "$0")/.."
# $PYTHON, else launch/find_python.sh's rule (a GPU image's python3.12 or python3 with its own jax)
PY=$(launch/find_python.sh) || exit 2
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
source launch/gpu_env.sh
export JAX_PLATFORMS=${JAX_PLATFORMS:-cuda}  # a GPU or a failure, never a silent CPU run
: > "$OUT/summary.jsonl"

check() {  # check NAME LIMIT_SECONDS COMMAND...: stdout to NAME.json, stderr to NAME.log
  local name=$1 limit=$2 start=$SECONDS
  shift 2
  [ "$ONLY" = "  " ] || [[ "$ONLY" == *" $name "* ]] || return 0
  echo "== $name"
  timeout "$limit" "$@" > "$OUT/$name.json" 2> "$OUT/$name.log"
  local rc=$?
  echo "{\"check\": \"$name\", \"rc\": $rc, \"sec\": $((SECONDS - start))}" | tee -a "$OUT/summary.jsonl"
}

check devices 60 "$PY" -c '
import json, jax
from maxlm.observe import flops
print(json.dumps({"jax": jax.__version__, "platform_version": jax.devices()[0].client.platform_version,
                  "backend": jax.default_backend(), "devices": [d.device_kind for d in jax.devices()],
                  "compute_capability": getattr(jax.devices()[0], "compute_capability", None),
                  "peak": flops.peak_flops(jax.devices(), "bfloat16")}, indent=2))'

check gpu_tests 120 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/test_cudnn.py tests/test_kernels.py \
  --junitxml="$OUT/gpu_tests.xml"

PLATFORM=(--config.platform="${MAXLM_PLATFORM:-gpu}")  # the platform every check must run on
ONE_B=(--config=configs/llama_1b.py --config.seq_len=4096 "${PLATFORM[@]}")
check attention 90 "$PY" -m maxlm.bench attention "${ONE_B[@]}" --config.batch_size=2 --steps=10

check fp8_hlo 120 "$PY" -c '
import json, os, subprocess, sys
counts = {}
for name, extra in (("triton_gemm_off", ""), ("triton_gemm_on", " --xla_gpu_enable_triton_gemm=true --xla_gpu_deterministic_ops=false")):
    env = dict(os.environ, XLA_FLAGS=os.environ["XLA_FLAGS"] + extra)
    out = subprocess.run([sys.executable, "-m", "maxlm.bench", "plan", "--config=configs/llama_125m.py",
                          "--config.model.fp8=true", "--config.batch_size=8"],
                         env=env, capture_output=True, text=True, check=True).stdout
    counts[name] = json.loads(out)["kernels"]
print(json.dumps(counts, indent=2))'

BENCH=("${ONE_B[@]}" --config.batch_size=8 --config.model.remat=save_out_proj
       --config.model.logits_chunk_size=512 --warmup_steps=2 --steps=5)
check bench_bf16 150 "$PY" -m maxlm.bench "${BENCH[@]}"
check bench_fp8 150 "$PY" -m maxlm.bench "${BENCH[@]}" --config.model.fp8=true

check resume 120 bash -c '
set -euo pipefail
runs="'"$OUT"'/resume_runs"  # both runs and their logs stay with the results
rm -rf "$runs"; mkdir -p "$runs"
train=("'"$PY"'" -m maxlm.train --config=configs/tiny.py '"${PLATFORM[*]}"'
       --config.steps=400 --config.log_every_steps=10 --config.checkpoint.every_steps=50)
"${train[@]}" --workdir="$runs/straight" > "$runs/straight.log" 2>&1
"${train[@]}" --workdir="$runs/stopped" > "$runs/stopped.log" 2>&1 &
pid=$!  # the trainer itself: a SIGTERM to a shell around it would leave it running
until grep -q "\"step\": 20" "$runs/stopped/metrics.jsonl" 2>/dev/null; do sleep 0.2; done
kill -TERM $pid; set +e; wait $pid; stopped_rc=$?; set -e
"${train[@]}" --workdir="$runs/stopped" > "$runs/resumed.log" 2>&1
"'"$PY"'" - "$runs" "$stopped_rc" <<EOF
import json, sys
runs, rc = sys.argv[1], int(sys.argv[2])
def losses(run):
    rows = [json.loads(line) for line in open(f"{runs}/{run}/metrics.jsonl")]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}
straight, stopped = losses("straight"), losses("stopped")
same = all(stopped[s] == straight[s] for s in stopped if s in straight)
print(json.dumps({"sigterm_exit": rc, "steps_compared": len(set(straight) & set(stopped)),
                  "bitwise_equal": same, "last_step": max(stopped)}, indent=2))
sys.exit(0 if rc == 143 and same and max(stopped) == 400 else 1)
EOF'

echo "results in $OUT (summary.jsonl)"
