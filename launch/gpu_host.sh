#!/bin/bash
# Train on one multi-GPU host: a single process drives every visible GPU (JAX's usual model on one
# host), so no coordinator is needed. Set the mesh to the GPU count, e.g. 8 GPUs as fsdp × tensor:
#
#   launch/gpu_host.sh --config=configs/llama_1b.py --workdir=runs/llama_1b \
#       --config.mesh.fsdp=-1 --config.model.dtype=bfloat16
#
# The XLA settings are launch/gpu_env.sh's (see there for why), as for SLURM.
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/gpu_env.sh
# $PYTHON, else .venv (`make install ACCEL=cuda12|cuda13`), held to launch/find_python.sh's rule
PYTHON=$(PYTHON=${PYTHON:-.venv/bin/python} launch/find_python.sh) || exit 2
# --config.platform=gpu (after --config, as config flags must be; MAXLM_PLATFORM overrides it):
# without a CUDA-enabled jax this is exit 2, not a run on the CPU
exec "$PYTHON" -m maxlm.train "$@" --config.platform="${MAXLM_PLATFORM:-gpu}"
