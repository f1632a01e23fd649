# Sourced by every GPU launcher (gpu_host.sh, slurm.sbatch, gpu_check.sh): the XLA settings for
# H100/H200 training. XLA aborts on a flag it does not know, so tests/test_gpu_plan.py checks that
# the pinned jaxlib accepts every one and compiles the GPU presets with them. A flag the user
# already put in XLA_FLAGS comes later on the line, and the later value wins.
MAXLM_GPU_XLA_FLAGS=(
  # Overlap collectives with compute; in a scanned layer stack, issue the next layer's FSDP
  # all-gather and this layer's gradient reduce-scatter one iteration ahead (pipelined).
  # (From jaxlib 0.11.1 the three pipelined flags are deprecated aliases of
  # --xla_gpu_pipeline_*=on: still accepted, with a warning; the new names abort older jaxlibs.)
  --xla_gpu_enable_latency_hiding_scheduler=true
  --xla_gpu_enable_pipelined_all_gather=true
  --xla_gpu_enable_pipelined_reduce_scatter=true
  --xla_gpu_enable_pipelined_all_reduce=true
  --xla_gpu_enable_while_loop_double_buffering=true
  # Combine small collectives into few large ones (NCCL's per-call latency), up to 128 MiB each.
  --xla_gpu_all_gather_combine_threshold_bytes=134217728
  --xla_gpu_reduce_scatter_combine_threshold_bytes=134217728
  --xla_gpu_all_reduce_combine_threshold_bytes=134217728
  # Every GEMM to cuBLAS/cuBLASLt: otherwise XLA may compile model.fp8's float8 dots as 16-bit
  # Triton GEMMs (maxlm/model/kernels/fp8.py).
  --xla_gpu_enable_triton_gemm=false
  # Bitwise run-to-run determinism (same config and seed, same losses; a resume equal to a run
  # straight through): deterministic GEMM algorithms and scatter-adds. Without it two runs of
  # configs/tiny.py on an H200 parted at the 10th step (docs/gpus.md). Its cost in speed is not
  # measured yet; --xla_gpu_deterministic_ops=false in XLA_FLAGS turns it off.
  --xla_gpu_deterministic_ops=true
)
export XLA_FLAGS="${MAXLM_GPU_XLA_FLAGS[*]} ${XLA_FLAGS:-}"
# Let XLA's allocator take 90% of each GPU up front (JAX's default 75% leaves memory idle on a
# dedicated GPU); maxlm.targets.LAUNCHER_MEMORY_FRACTION is this number, for plans.
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.90}
