"""Cloud TPU slices without a TPU (maxlm/targets/tpu.py): libtpu's own compiler plans the train
step with the workers' LIBTPU_INIT_ARGS (launch/tpu_env.sh), splash attention compiles natively
inside it, an over-size step is `fits: false` with XLA's message, and the plan estimates the step
time from XLA's counts.

Plans run as a user types them, libtpu on PYTHONPATH (`make test` installs it in
.venv/target-compilers and names it in MAXLM_TARGET_COMPILERS)."""

import json
import os
import subprocess
import sys

import pytest

from maxlm import config as config_lib, model
from maxlm.bench import plan as plan_lib
from maxlm.bench.targets import tpu
from maxlm.observe import flops
from tests.helpers import ROOT, command_env, load_config

TARGET_COMPILERS = os.environ.get("MAXLM_TARGET_COMPILERS", "")
needs_libtpu = pytest.mark.skipif(
    not os.path.isdir(os.path.join(TARGET_COMPILERS, "libtpu")),
    reason="libtpu is not installed here (`make test` installs it in .venv/target-compilers)")


def run_plan(tmp_path, config: str, target: str, *flags: str, libtpu_args: str = "", worker_flags: bool = True):
    """The plan as a user on a CPU machine types it, after `source launch/tpu_env.sh` (the
    workers' LIBTPU_INIT_ARGS, plus `libtpu_args`); with `worker_flags=False`, libtpu's defaults
    (as `bench compare` compiles)."""
    setup = (f'source launch/tpu_env.sh && export LIBTPU_INIT_ARGS="$LIBTPU_INIT_ARGS{libtpu_args}" && '
             if worker_flags else "")
    command = f"{setup}{sys.executable} -m maxlm.bench plan --config={config} --target={target} {' '.join(flags)}"
    return subprocess.run(["bash", "-c", command], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=command_env(tmp_path, devices=None, target_compile=True,
                                                         PYTHONPATH=TARGET_COMPILERS))


def plan(tmp_path, config: str, target: str, *flags: str, worker_flags: bool = True) -> dict:
    result = run_plan(tmp_path, config, target, *flags, worker_flags=worker_flags)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    return json.loads(result.stdout)


def test_hardware_flops_add_the_forward_work_remat_recomputes():
    cfg = load_config("llama_1b").model
    parts = flops.forward_flops_breakdown(cfg, 4096)
    layers = parts["total"] - parts["lm_head"]
    for remat, recomputed in [("none", 0), ("save_dots", parts["attention"]), ("full", layers),
                              ("save_out_proj", layers - parts["out_proj"] - parts["mlp"] / 3)]:
        cfg.remat = remat
        assert flops.hardware_flops_per_token(cfg, 4096) == pytest.approx(flops.flops_per_token(cfg, 4096) + recomputed)


@pytest.mark.parametrize("generation, chips, grid", [
    ("v5p", 4, (2, 2, 1)), ("v5p", 8, (2, 2, 2)), ("v5p", 16, (2, 2, 4)), ("v5p", 32, (2, 4, 4)),
    ("v5p", 64, (4, 4, 4)), ("v4", 128, (4, 4, 8)), ("v5e", 1, (1, 1)), ("v5e", 8, (2, 4)),
    ("v5e", 16, (4, 4)), ("v6e", 32, (4, 8)), ("v6e", 256, (16, 16)),
])
def test_slices_have_cloud_tpus_chip_layouts(generation, chips, grid):
    assert tpu.chip_grid(generation, chips) == grid


@pytest.mark.ci
@pytest.mark.slow
@needs_libtpu
def test_a_v5p_plan_compiles_splash_natively_and_estimates_the_step(tmp_path):
    result = plan(tmp_path, "configs/tiny.py", "v5p-8", "--config.seq_len=256", "--config.model.dtype=bfloat16",
                  "--config.model.splash_block_q=128")
    assert result["device_kind"] == "TPU v5" and result["device_count"] == 4  # 4 chips, 8 TensorCores
    assert result["fits"] and result["device_memory_bytes"] == 95 * 2**30
    # auto = splash with the configured query tile, compiled by Mosaic, not interpreted
    assert result["attention"] == "splash" and result["splash_blocks"] == [128, 256]
    assert "tpu_custom_call" in result["kernels"]
    estimate = result["estimate"]
    assert estimate["step_sec"] == max(estimate["compute_sec"], estimate["memory_sec"]) > 0
    assert estimate["hardware_flops_per_device"] == estimate["model_flops_per_device"] > 0  # remat none
    assert 0 < estimate["mfu"] <= 1 and estimate["bytes_accessed_per_device"] > 0


@pytest.mark.slow
@needs_libtpu
def test_a_step_too_big_for_the_slice_is_fits_false_with_xlas_message(tmp_path):
    result = plan(tmp_path, "configs/llama_8b.py", "v5e-16", "--noestimate")
    assert result["fits"] is False and result["device_kind"].startswith("TPU v5")
    assert result["xla_message"].startswith("RESOURCE_EXHAUSTED") and "exceeds available HBM" in result["xla_message"]


@pytest.mark.ci  # a 4-layer 8B compile for v5p-64, about 60 s of CPU
@needs_libtpu
def test_unrolled_layers_finish_their_weight_gradients_before_the_layer_below(tmp_path):
    """Left free, libtpu's scheduler put each unrolled layer's weight gradients at the end of the
    backward pass, keeping the layer's [B, L, F] MLP gradients live across the layers below
    (backward_order.call_in_order). Four Llama 3 8B layers on a v5p-64, remat full,
    compiled as `bench compare` does (libtpu's default flags): 17.2 GB of temp free, 7.7 GB
    ordered (libtpu 0.0.50.1, 2026-12-07; eight layers on libtpu 0.0.42.1: 35.6 and 8.8 GB;
    docs/performance.md#compiled-for-v5p-no-tpu)."""
    result = plan(tmp_path, "configs/llama_8b_v5p64.py", "v5p-64", "--noestimate", "--config.model.remat=full",
                  "--config.model.num_layers=4", "--config.model.scan_layers=False", worker_flags=False)
    assert result["bytes_per_device"]["temp"] < 12e9


@pytest.mark.parametrize("target, message", [
    ("v5p-12", "is not a known TPU slice"),  # not a power of two
    ("v5e-2", "is not a known TPU slice"),  # no such layout
    ("v7-8", "is not a known TPU slice"),
])
def test_an_unknown_slice_is_one_line_exit_2(tmp_path, target, message):
    result = run_plan(tmp_path, "configs/tiny.py", target)
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
@needs_libtpu
def test_libtpu_refuses_a_flag_it_does_not_know(tmp_path):
    """The control for the plans above, which compile with launch/tpu_env.sh's LIBTPU_INIT_ARGS:
    an unknown flag would fail them."""
    result = run_plan(tmp_path, "configs/tiny.py", "v5p-8", "--config.seq_len=256", "--noestimate",
                      libtpu_args=" --xla_tpu_no_such_flag=true")
    assert result.returncode != 0 and "Unknown command line flag 'xla_tpu_no_such_flag'" in result.stderr


@pytest.mark.ci  # five full 1B-8B compiles for v5p, about 7 minutes of CPU: in CI (make test-ci)
@needs_libtpu
@pytest.mark.parametrize("config, target", [
    ("configs/llama_1b.py", "v5p-8"),  # the base config as shipped, 1M tokens a step
    ("configs/llama_1b_v5p8.py", "v5p-8"),
    ("configs/llama_1b_v5p64.py", "v5p-64"),
    ("configs/llama_8b_v5p64.py", "v5p-64"),
    ("configs/olmo3_7b_v5p64.py", "v5p-64"),  # the model families' larger presets (docs/models.md)
])
def test_the_tpu_presets_fit_their_slices_with_splash_compiled(tmp_path, config, target):
    result = plan(tmp_path, config, target, "--noestimate")
    assert result["fits"] and result["bytes_per_device"]["peak"] < 95 * 2**30, result["bytes_per_device"]
    assert result["attention"] == "splash" and "tpu_custom_call" in result["kernels"]


@pytest.mark.ci  # an 8B compile at 128k tokens for v5p-64, about 2 minutes of CPU
@needs_libtpu
def test_the_128k_preset_fits_v5p64_with_the_ring_and_splash_per_block(tmp_path):
    """Llama 3 8B at 131,072 tokens: each sequence over one host's 4 chips (the mesh keeps the
    sequence axis within a host, though the topology's own layout would lay it across two)."""
    result = plan(tmp_path, "configs/llama_8b_128k_v5p64.py", "v5p-64", "--noestimate")
    assert result["fits"] and result["bytes_per_device"]["peak"] < 95 * 2**30, result["bytes_per_device"]
    assert result["context_parallel"] == "ring over 4 devices, zig-zag, splash per block"
    assert result["attention"] == "splash" and result["splash_blocks"] == [512, 512]
    assert "tpu_custom_call" in result["kernels"] and result["seq_len"] == 131072


@pytest.mark.ci  # make test keeps within its 12 minutes (CI runs it: make test-ci)
@pytest.mark.slow
@needs_libtpu
def test_the_ring_compiles_splash_per_block_natively_for_a_v5p(tmp_path):
    """Ring attention over 4 chips in zig-zag order, each block through splash compiled by Mosaic,
    its backward kernels fed the whole rows' residuals (maxlm/model/parallel/ring_blocks.py)."""
    result = plan(tmp_path, "configs/tiny.py", "v5p-8", "--noestimate", "--config.seq_len=1024", "--config.batch_size=2",
                  "--config.mesh.sequence=4", "--config.mesh.fsdp=1", "--config.model.context_parallel=ring",
                  "--config.model.context_load_balance=True", "--config.model.dtype=bfloat16")
    assert result["attention"] == "splash" and result["splash_blocks"] == [128, 128] and result["fits"]
    assert result["context_parallel"] == "ring over 4 devices, zig-zag, splash per block"
    assert "tpu_custom_call" in result["kernels"]


@pytest.mark.slow
@needs_libtpu
@pytest.mark.parametrize("mesh, strategy", [
    pytest.param(("--config.mesh.fsdp=2",), "none", marks=pytest.mark.ci),  # 14 s: ci, as the ring
    pytest.param(("--config.mesh.fsdp=1", "--config.mesh.sequence=2", "--config.model.context_parallel=ring"),
                 "ring over 2 devices, splash per block", marks=pytest.mark.ci),
], ids=["whole_rows", "ring"])
def test_a_pipeline_compiles_splash_under_its_vmap_for_a_v5p(tmp_path, mesh, strategy):
    """mesh.stage=2 runs the stages under vmap: splash, whole rows or per ring block, compiled by
    Mosaic inside it."""
    result = plan(tmp_path, "configs/tiny.py", "v5p-8", "--noestimate", "--config.seq_len=1024", "--config.batch_size=8",
                  "--config.model.dtype=bfloat16", "--config.mesh.stage=2", "--config.model.pipeline_microbatches=2", *mesh)
    assert result["attention"] == "splash" and result["context_parallel"] == strategy and result["fits"]
    assert "tpu_custom_call" in result["kernels"]


@pytest.mark.ci  # about 95 s on a loaded 2-core machine
@pytest.mark.slow
@needs_libtpu
def test_an_moe_plan_compiles_megablox_natively(tmp_path):
    """model.grouped_matmul=auto is the Pallas megablox kernel on a TPU, compiled by Mosaic: its
    forward and backward kernels (gmm, tgmm) in the step, libtpu's own ragged_dot kernel not."""
    result = plan(tmp_path, "configs/moe_tiny.py", "v5p-8", "--noestimate", "--config.model.dtype=bfloat16",
                  "--config.model.attention=xla")
    assert result["grouped_matmul"] == "megablox" and result["fits"]
    assert {"gmm", "tgmm"} <= set(result["tpu_kernels"]) and "ragged-dot-none" not in result["tpu_kernels"]
    assert result["params"] > result["active_params"] > 0


@pytest.mark.ci  # about 30 s on a loaded 2-core machine
@pytest.mark.slow
@needs_libtpu
def test_expert_parallelism_compiles_the_ragged_all_to_all_natively(tmp_path):
    """model.expert_dispatch=auto on a TPU: the dropless tokens go to their experts' chips and back
    through XLA's ragged-all-to-all (2 a layer forward, 2 backward; XLA:CPU cannot run it)."""
    result = plan(tmp_path, "configs/moe_tiny.py", "v5p-8", "--noestimate", "--config.model.dtype=bfloat16",
                  "--config.model.attention=xla", "--config.mesh.fsdp=1", "--config.mesh.expert=4")
    assert result["expert_dispatch"] == "ragged_all_to_all" and result["fits"]
    assert result["collectives"].get("ragged-all-to-all", 0) >= 4, result["collectives"]


def test_collectives_are_counted_by_op_not_by_name():
    hlo = """
  %ragged-all-to-all-start = ((bf16[512,128]{1,0}, /*index=5*/s64[8]{0}), bf16[2048,128]{1,0}) ragged-all-to-all-start(%a, %b)
  %ragged-all-to-all-done = bf16[2048,128]{1,0} ragged-all-to-all-done(%ragged-all-to-all-start)
  %all-gather.3 = f32[64,8]{1,0} all-gather(%all-to-all.2), dimensions={0}
  %all-to-all.2 = f32[16,8]{1,0} all-to-all(%x), dimensions={0}
  ROOT %all-reduce-start = f32[] all-reduce-start(%y), to_apply=%add"""
    assert plan_lib.collectives(hlo) == {"all-gather": 1, "all-reduce": 1, "all-to-all": 1, "ragged-all-to-all": 1}


@pytest.mark.ci  # a tiny model: about a minute on a loaded 2-core machine
@pytest.mark.slow
@needs_libtpu
def test_deepseek_v3s_block_compiles_splash_with_narrower_values_and_megablox_natively(tmp_path):
    """configs/deepseek_v3_tiny.py for a v5p-8: multi-head latent attention's values (32 dims)
    narrower than its queries and keys (48) through splash, compiled by Mosaic, and its MoE layers
    through megablox."""
    result = plan(tmp_path, "configs/deepseek_v3_tiny.py", "v5p-8", "--noestimate", "--config.model.dtype=bfloat16",
                  "--config.mesh.fsdp=4")
    assert result["fits"] and result["attention"] == "splash" and "tpu_custom_call" in result["kernels"]
    assert result["grouped_matmul"] == "megablox" and {"gmm", "tgmm"} <= set(result["tpu_kernels"])


@pytest.mark.parametrize("config, devices, total, active", [
    ("mixtral_8x7b_v5p64", 32, 46_702_792_704, 12_879_925_248),  # Mixtral 8x7B: 46.7B, 12.9B active
    ("qwen3_30b_a3b_h100x16", 16, 30_532_122_624, 3_353_032_704),  # Qwen3-30B-A3B: 30.5B, 3.3B, as published
])
def test_the_moe_presets_have_their_models_sizes(config, devices, total, active):
    cfg = config_lib.resolve(load_config(config), devices)
    assert (model.count_params(cfg.model), model.active_params(cfg.model)) == (total, active)


def test_tpu_kernels_are_named_by_their_pallas_function_or_op():
    hlo = "\n".join(f'%x{i} = custom-call(), custom_call_target="{target}", metadata={{op_name="{op}"}}'
                    for i, (target, op) in enumerate([
                        ("tpu_custom_call", "jit(train_step)/layers/mlp/shard_map/jit(gmm)/pallas_call"),
                        ("tpu_custom_call", "jit(train_step)/transpose(jvp(Transformer))/jit(tgmm)/pallas_call"),
                        ("tpu_custom_call", "jit(train_step)/layers/mlp/ragged_dot_general/ragged-dot-none"),
                        ("__cublas$lt$matmul", "jit(train_step)/dot_general")]))
    assert plan_lib.tpu_kernels(hlo) == ["gmm", "ragged-dot-none", "tgmm"]


@pytest.mark.ci  # a 46.7B-parameter MoE compiled for v5p-64: 5 to 8 minutes on a loaded 2-core machine
@needs_libtpu
def test_the_mixtral_preset_fits_v5p64_with_megablox_and_splash_compiled(tmp_path):
    result = plan(tmp_path, "configs/mixtral_8x7b_v5p64.py", "v5p-64", "--noestimate")
    assert result["fits"] and result["bytes_per_device"]["peak"] < 95 * 2**30, result["bytes_per_device"]
    assert result["grouped_matmul"] == "megablox" and {"gmm", "tgmm"} <= set(result["tpu_kernels"])
    assert result["attention"] == "splash"


@pytest.mark.ci
@pytest.mark.slow
@needs_libtpu
def test_two_slices_over_the_data_center_network(tmp_path):
    """--num_slices=2: two v5p-8 slices, one process each, joined by mesh.dcn_data."""
    result = plan(tmp_path, "configs/tiny.py", "v5p-8", "--num_slices=2", "--config.seq_len=256",
                  "--config.model.dtype=bfloat16", "--config.mesh.data=2", "--config.mesh.dcn_data=2",
                  "--noestimate")
    assert result["device_count"] == 8 and result["process_count"] == 2 and result["fits"]


@needs_libtpu
def test_a_target_plan_prints_its_phases_compile_then_estimate(tmp_path):
    """On stderr, a line per phase: the step's compile, then the estimate's 2 compiles counted;
    stdout is the plan's JSON alone."""
    command = (f"source launch/tpu_env.sh && {sys.executable} -m maxlm.bench plan --config=configs/tiny.py "
               "--target=v5p-8")
    done = subprocess.run(["bash", "-c", command], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=command_env(tmp_path, devices=None, target_compile=True, PYTHONPATH=TARGET_COMPILERS,
                                          MAXLM_PROGRESS_SECONDS="0.1"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout)["estimate"]["step_sec"] > 0
    lines = [line for line in done.stderr.splitlines() if line.startswith("maxlm: plan ")]
    compile_lines = [line for line in lines if line.startswith("maxlm: plan v5p-8 compile (phase 1/2): ")]
    estimate_lines = [line for line in lines if line.startswith("maxlm: plan v5p-8 estimate (phase 2/2): ")]
    assert lines == compile_lines + estimate_lines and compile_lines and estimate_lines, done.stderr[-3000:]
    assert compile_lines[-1].endswith(", done")
    assert estimate_lines[-1].startswith("maxlm: plan v5p-8 estimate (phase 2/2): 2/2 compiles (100%)")
    assert estimate_lines[-1].endswith(", done")
