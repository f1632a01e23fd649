# Sourced on every TPU worker before training (launch/tpu.py): libtpu's compiler settings for
# v5p/v6e throughput. libtpu refuses a flag it does not know, so tests/test_tpu_plan.py compiles a
# step for a v5p slice with these and checks that an unknown one is refused. `tpu.py --env
# LIBTPU_INIT_ARGS=...` replaces the whole line; a value already in the environment is kept.
MAXLM_LIBTPU_INIT_ARGS=(
  # Continuation fusion: run collectives inside the compute that needs them, over several steps,
  # overlapping them with the TensorCore's work. Not the all-gathers: from libtpu 0.0.50 (jax 0.12)
  # their continuation fusion is refused outside TPU v5e ("not supported/recommended"); they stay
  # asynchronous (xla_enable_async_all_gather), overlapped by the scheduler.
  --xla_tpu_enable_async_collective_fusion=true
  --xla_tpu_enable_async_collective_fusion_fuse_all_gather=false
  --xla_tpu_enable_async_collective_fusion_multiple_steps=true
  --xla_tpu_overlap_compute_collective_tc=true
  --xla_enable_async_all_gather=true
  # Data-parallel gradient all-reduces: combined and overlapped, also across unequal sizes.
  --xla_tpu_enable_data_parallel_all_reduce_opt=true
  --xla_tpu_data_parallel_opt_different_sized_ops=true
  --xla_enable_async_collective_permute=true
)
export LIBTPU_INIT_ARGS="${LIBTPU_INIT_ARGS:-${MAXLM_LIBTPU_INIT_ARGS[*]}}"
