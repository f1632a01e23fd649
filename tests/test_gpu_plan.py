"""NVIDIA GPUs without a GPU: the launchers' XLA flags are accepted, and the GPU presets compiled
for 8×H100 (maxlm/bench/targets) fit, with cuDNN attention and, with model.fp8, cuBLASLt float8 GEMMs.

Each plan runs as a user types it, with the flags of launch/gpu_env.sh, JAX's CUDA plugin on
PYTHONPATH (`make test` installs it in .venv/target-compilers and names it in MAXLM_TARGET_COMPILERS)."""

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT, command_env

pytestmark = pytest.mark.slow

TARGET_COMPILERS = os.environ.get("MAXLM_TARGET_COMPILERS", "")
needs_compiler = pytest.mark.skipif(
    not os.path.isdir(TARGET_COMPILERS),
    reason="JAX's CUDA plugin is not installed here (`make test` installs it in .venv/target-compilers)")
H100_USABLE = 80e9  # the bound: the planned peak stays under 80 GB


def in_gpu_env(command: str, tmp_path, **extra) -> subprocess.CompletedProcess:
    """`command` in bash after `source launch/gpu_env.sh`, as the GPU launchers run maxlm."""
    env = command_env(tmp_path, devices=None, target_compile=True, **extra)
    return subprocess.run(["bash", "-c", f"source launch/gpu_env.sh && {command}"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)


def test_xla_aborts_on_a_flag_it_does_not_know(tmp_path):
    """The control for the plans below, which compile with every flag of launch/gpu_env.sh: the
    pinned jaxlib accepts them all, or those plans would abort the same way."""
    result = in_gpu_env(f'{sys.executable} -c "import jax; print(jax.devices())"', tmp_path,
                        XLA_FLAGS="--xla_gpu_no_such_flag=true")
    assert result.returncode != 0 and "Unknown flag" in result.stderr


def plan(tmp_path, config: str, target: str, *overrides: str, xla_flags: str = "") -> dict:
    result = in_gpu_env(
        f"{sys.executable} -m maxlm.bench plan --config={config} --target={target} {' '.join(overrides)}",
        tmp_path, PYTHONPATH=TARGET_COMPILERS, XLA_FLAGS=xla_flags)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


@needs_compiler
@pytest.mark.parametrize("config, target, overrides, hosts, attention", [
    ("configs/llama_1b_h100x8.py", "h100x8", (), 1, "cudnn"),
    ("configs/llama_8b_h100x8.py", "h100x8", (), 1, "cudnn"),
    ("configs/qwen3_8b_h100x8.py", "h100x8", (), 1, "cudnn"),  # the model families' larger presets (docs/models.md)
    ("configs/mistral_7b_h100x8.py", "h100x8", (), 1, "cudnn"),  # its sliding window in cuDNN's kernel
    # heads of 256, wider than JAX's cuDNN binding takes off a Hopper GPU: XLA attention (`auto`)
    ("configs/gemma3_12b_h100x8.py", "h100x8", (), 1, "xla"),
    # docs/gpus.md's 2-node job: two processes of 8 GPUs, one FSDP mesh
    ("configs/llama_1b_h100x8.py", "h100x16", ("--config.mesh.fsdp=16", "--config.num_devices=16"), 2, "cudnn"),
])
@pytest.mark.ci
def test_gpu_presets_fit_an_h100(tmp_path, config, target, overrides, hosts, attention):
    result = plan(tmp_path, config, target, *overrides)
    assert result["device_kind"] == "NVIDIA H100 80GB HBM3"
    assert result["device_count"] == 8 * hosts and result["process_count"] == hosts
    peak = result["bytes_per_device"]["peak"]
    assert result["fits"] and peak < H100_USABLE, result["bytes_per_device"]
    assert result["device_memory_bytes"] == int(84942979072 * 0.90)  # gpu_env.sh's share of HBM
    cudnn = {"__cudnn$fmhaScaleBiasSoftmax", "__cudnn$fmhaScaleBiasSoftmaxBackward"}
    assert result["attention"] == attention and (cudnn <= set(result["kernels"])) == (attention == "cudnn")
    assert "__cublas$lt$matmul" in result["kernels"]


@needs_compiler
@pytest.mark.ci  # a 1B compile at 64k tokens for 8 H100s, about a minute of CPU
def test_the_64k_preset_fits_an_h100_host_with_the_ring_and_cudnn_per_block(tmp_path):
    """Each ring block through cuDNN's fused kernels, forward and backward (maxlm/model/parallel/ring_blocks.py),
    compiled for the real GPUs: the only check of cuDNN's private backward binding off a GPU."""
    result = plan(tmp_path, "configs/llama_1b_64k_h100x8.py", "h100x8", "--noestimate")
    assert result["context_parallel"] == "ring over 8 devices, zig-zag, cudnn per block"
    assert result["fits"] and result["bytes_per_device"]["peak"] < H100_USABLE, result["bytes_per_device"]
    assert {"__cudnn$fmhaScaleBiasSoftmax", "__cudnn$fmhaScaleBiasSoftmaxBackward"} <= set(result["kernels"])


@needs_compiler
@pytest.mark.parametrize("mesh, strategy", [
    pytest.param(("--config.mesh.fsdp=4",), "none", marks=pytest.mark.ci),  # 14 s
    pytest.param(("--config.mesh.fsdp=1", "--config.mesh.sequence=4", "--config.model.context_parallel=ring",
                  "--config.model.context_load_balance=True"), "ring over 4 devices, zig-zag, cudnn per block",
                 marks=pytest.mark.ci),
], ids=["whole_rows", "ring"])
def test_a_pipeline_compiles_cudnn_under_its_vmap(tmp_path, mesh, strategy):
    """mesh.stage=2 runs the stages under vmap, where JAX's own batching rule for cuDNN fails on a
    bias shared by the heads: maxlm/model/kernels/cudnn.py's folded calls compile to cuDNN's kernels, for
    whole rows and per ring block."""
    result = plan(tmp_path, "configs/tiny.py", "h100x8", "--noestimate", "--config.seq_len=1024", "--config.batch_size=8",
                  "--config.model.dtype=bfloat16", "--config.mesh.stage=2", "--config.model.pipeline_microbatches=2", *mesh)
    assert result["attention"] == "cudnn" and result["context_parallel"] == strategy and result["fits"]
    assert {"__cudnn$fmhaScaleBiasSoftmax", "__cudnn$fmhaScaleBiasSoftmaxBackward"} <= set(result["kernels"])


@needs_compiler
@pytest.mark.ci  # 2 to 3 minutes on the 2-core machine
def test_the_qwen3_moe_preset_fits_two_h100_hosts(tmp_path):
    """The whole preset (48 layers, 64 x 4096), deviceless with the dropless sort kept off CUB
    (whose scratch size XLA asks a GPU for): with the tiled grouped matmul it fits, where
    ragged_dot's GPU buffers grow with all 128 experts (docs/moe.md#presets)."""
    result = plan(tmp_path, "configs/qwen3_30b_a3b_h100x16.py", "h100x16",
                  xla_flags="--xla_gpu_enable_cub_radix_sort=false")
    assert result["device_count"] == 16 and result["process_count"] == 2 and result["mesh"]["fsdp"] == 16
    assert result["grouped_matmul"] == "tiled" and result["params"] == 30_532_122_624
    assert result["fits"] and result["bytes_per_device"]["peak"] < H100_USABLE, result["bytes_per_device"]
    assert {"__cudnn$fmhaScaleBiasSoftmax", "__cudnn$fmhaScaleBiasSoftmaxBackward"} <= set(result["kernels"])


@needs_compiler
@pytest.mark.ci  # about 40 s on the 2-core machine
def test_expert_parallelism_compiles_the_ragged_all_to_all_for_h100s_in_a_pipeline(tmp_path):
    """model.expert_dispatch=auto on GPUs: the dropless tokens go to their experts' GPUs and back
    through XLA's ragged-all-to-all (NCCL), 2 a layer forward and 2 backward, here under the
    pipeline's vmap (JAX's batching rule for the collective; the TPU test compiles it without a
    pipeline). XLA:CPU cannot run it."""
    result = plan(tmp_path, "configs/moe_tiny.py", "h100x8", "--noestimate", "--config.model.dtype=bfloat16",
                  "--config.mesh.fsdp=1", "--config.mesh.stage=2", "--config.mesh.expert=4",
                  "--config.model.first_dense_layers=2")
    assert result["expert_dispatch"] == "ragged_all_to_all" and result["fits"]
    moe_layers = 2  # moe_tiny's 4 layers, the first 2 dense here
    assert result["collectives"].get("ragged-all-to-all") == 4 * moe_layers, result["collectives"]


@needs_compiler
@pytest.mark.ci
def test_fp8_compiles_to_cublaslt_float8_gemms_on_an_h200(tmp_path):
    overrides = ("--config.model.fp8=true", "--config.model.dtype=bfloat16", "--config.batch_size=8")
    result = plan(tmp_path, "configs/tiny.py", "h200x8", *overrides)
    assert result["device_kind"] == "NVIDIA H200 141GB HBM3e"
    assert "__cublas$lt$matmul$f8" in result["kernels"]
    # The control: with Triton GEMMs allowed again (a later flag wins), no float8 GEMM is left.
    # Deterministic ops off too: with them XLA wants a default Triton config, which a deviceless
    # compile cannot give ("CublasLtBackend cannot enumerate configs in deviceless mode").
    triton = plan(tmp_path, "configs/tiny.py", "h200x8", *overrides,
                  xla_flags="--xla_gpu_enable_triton_gemm=true --xla_gpu_deterministic_ops=false")
    assert not any("f8" in kernel for kernel in triton["kernels"]), triton["kernels"]


@pytest.mark.parametrize("target, pythonpath, message", [
    ("a100x8", TARGET_COMPILERS, "--target='a100x8' is not a known target: GPUxN with GPU one of h100, "
                             "h200 and N a multiple of 8 (e.g. h100x8, h200x8)"),
    ("h100x12", TARGET_COMPILERS, "N a multiple of 8"),
    # The venv itself never has the plugin (Makefile: CPU runs must not try to load CUDA).
    ("h100x8", "", "compiles with JAX's CUDA plugin, which this environment lacks (make install ACCEL=cuda12)"),
])
def test_a_target_that_cannot_be_compiled_for_is_one_line_exit_2(tmp_path, target, pythonpath, message):
    result = subprocess.run(
        [sys.executable, "-m", "maxlm.bench", "plan", "--config=configs/tiny.py", f"--target={target}"],
        cwd=ROOT, env=command_env(tmp_path, devices=None, target_compile=True, PYTHONPATH=pythonpath),
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and message in result.stderr, result.stderr[-2000:]
