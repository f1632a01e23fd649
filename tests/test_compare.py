"""`maxlm.bench compare --peer=maxtext` without MaxText: the config mapping and its refusals, MaxText's
log and maxlm's JSON read back, the pairs and medians with fake runs, the commands of both runtimes."""

import hashlib
import pathlib
import re
import sys

import pytest

from maxlm import cli, config as config_lib
from maxlm.bench import compare, maxtext_peer
from maxlm.runtime.errors import ConfigError
from tests.helpers import load_config

# The model of the comparison in docs/performance.md: 20.6M parameters, batch 4 x 256, bfloat16.
ISSUE_MODEL = {"model.d_model": 256, "model.num_layers": 4, "model.num_heads": 4, "model.num_kv_heads": 4,
               "model.head_dim": 64, "model.mlp_dim": 1024, "model.vocab_size": 32000, "seq_len": 256,
               "batch_size": 4, "model.remat": "full", "model.attention": "xla", "model.dtype": "bfloat16"}

# From a real MaxText 0.2.5 run of that model on this CPU (stderr, 2026-12-01; one config line kept)
MAXTEXT_LOG = """\
I1201 06:19:55.857740 140602799827840 pyconfig.py:591] Config param adam_b1: 0.9
I1201 06:20:01.048598 140602799827840 metric_logger.py:425] number parameters: 0.021 billion
I1201 06:20:02.541905 140602799827840 metric_logger.py:265] completed step: 0, seconds: 0.057, TFLOP/s/device: 1.355, Tokens/s/device: 17854.341, total_weights: 1024, loss: 10.880, lm_loss: 10.880, perplexity: 53108.922
I1201 06:20:03.902605 140602799827840 metric_logger.py:265] completed step: 1, seconds: 0.112, TFLOP/s/device: 0.693, Tokens/s/device: 9135.353, total_weights: 1024, loss: 10.798, lm_loss: 10.798, perplexity: 48915.969
I1201 06:20:05.238287 140602799827840 metric_logger.py:265] completed step: 2, seconds: 1.332, TFLOP/s/device: 0.058, Tokens/s/device: 768.954, total_weights: 1024, loss: 10.720, lm_loss: 10.720, perplexity: 45240.695
I1201 06:20:06.543772 140602799827840 metric_logger.py:265] completed step: 3, seconds: 1.356, TFLOP/s/device: 0.057, Tokens/s/device: 755.213, total_weights: 1024, loss: 10.652, lm_loss: 10.652, perplexity: 42286.277
I1201 06:20:07.868460 140602799827840 metric_logger.py:265] completed step: 4, seconds: 1.340, TFLOP/s/device: 0.058, Tokens/s/device: 764.297, total_weights: 1024, loss: 10.599, lm_loss: 10.599, perplexity: 40100.191
"""  # noqa: E501


def issue_config(**overrides):
    cfg = config_lib.apply_overrides(load_config("tiny"), {**ISSUE_MODEL, **overrides})
    return config_lib.resolve(cfg, 1, 1, "cpu")


def as_dict(args: list[str]) -> dict:
    return dict(arg.split("=", 1) for arg in args)


def test_maxtext_args_for_the_issue_model():
    assert as_dict(maxtext_peer.maxtext_args(issue_config(), 12, "/tmp/out")) == {
        "run_name": "compare", "base_output_directory": "/tmp/out", "hardware": "cpu",
        "skip_jax_distributed_system": "True", "dataset_type": "synthetic", "enable_checkpointing": "False",
        "enable_tensorboard": "False", "jax_cache_dir": "", "steps": "12", "decoder_block": "llama2",
        "base_emb_dim": "256", "base_num_decoder_layers": "4", "base_num_query_heads": "4",
        "base_num_kv_heads": "4", "head_dim": "64", "base_mlp_dim": "1024", "vocab_size": "32000",
        "max_target_length": "256", "per_device_batch_size": "4", "scan_layers": "True",
        "attention": "dot_product", "dtype": "bfloat16", "weight_dtype": "float32",
        "logits_via_embedding": "False", "normalization_layer_epsilon": "1e-05", "rope_max_timescale": "10000",
        "z_loss_multiplier": "0", "opt_type": "adamw", "learning_rate": "0.003", "adam_b1": "0.9",
        "adam_b2": "0.95", "adam_eps": "1e-08", "adam_weight_decay": "0.1", "gradient_clipping_threshold": "1",
        "mu_dtype": "float32", "remat_policy": "full",
    }


MOE = {"model.num_experts": 8, "model.experts_per_token": 2}


@pytest.mark.parametrize("capacity_factor, dropless", [(0.0, True), (1.25, False)])
def test_an_moe_model_maps_to_maxtexts_mixtral_block(capacity_factor, dropless):
    """maxlm's softmax router with renormalised gates is the mixtral block's softmax over the top-k
    logits; dropless is its sparse_matmul (ragged_dot on the CPU), capacity its dense dispatch."""
    cfg = issue_config(**MOE, **{"model.expert_mlp_dim": 512, "model.capacity_factor": capacity_factor})
    args = as_dict(maxtext_peer.maxtext_args(cfg, 12, "/tmp/out"))
    assert {k: args[k] for k in ("decoder_block", "num_experts", "num_experts_per_tok", "base_moe_mlp_dim",
                                 "base_mlp_dim", "sparse_matmul", "megablox", "capacity_factor",
                                 "load_balance_loss_weight")} == {
        "decoder_block": "mixtral", "num_experts": "8", "num_experts_per_tok": "2", "base_moe_mlp_dim": "512",
        "base_mlp_dim": "512", "sparse_matmul": str(dropless), "megablox": "False",
        "capacity_factor": "-1" if dropless else "1.25", "load_balance_loss_weight": "0.01"}
    none = as_dict(maxtext_peer.maxtext_args(issue_config(**MOE, **{"model.load_balance": "none"}), 12, "/tmp/out"))
    assert none["load_balance_loss_weight"] == "0"


def test_head_dim_zero_is_d_model_over_heads_and_tied_embeddings_map():
    args = as_dict(maxtext_peer.maxtext_args(issue_config(**{"model.head_dim": 0, "model.tie_embeddings": True}),
                                             12, "/tmp/out"))
    assert (args["head_dim"], args["logits_via_embedding"]) == ("64", "True")


GEMMA3 = {"model.norm_placement": "sandwich", "model.qk_norm": "per_head", "model.mlp_activation": "geglu",
          "model.norm_plus_one": True, "model.scale_embeddings": True, "model.layer_pattern": "LLLLLG",
          "model.sliding_window": 64, "model.rope_theta_local": 1e4, "model.num_layers": 6}


def test_qwen3_and_gemma3_blocks_map_to_maxtexts():
    """Per-head qk-norm on Llama's block is MaxText's qwen3 block; Gemma 3's block is its gemma3
    block (its 5:1 pattern built in) with the window, the local RoPE base and no linear scaling."""
    qwen3 = as_dict(maxtext_peer.maxtext_args(issue_config(**{"model.qk_norm": "per_head"}), 12, "/tmp/out"))
    assert (qwen3["decoder_block"], qwen3["use_qk_norm"]) == ("qwen3", "True")
    gemma3 = as_dict(maxtext_peer.maxtext_args(issue_config(**GEMMA3), 12, "/tmp/out"))
    assert {k: gemma3[k] for k in ("decoder_block", "model_name", "override_model_config", "mlp_activations",
                                   "sliding_window_size", "use_post_attn_norm", "use_post_ffw_norm",
                                   "local_rope_max_timescale", "rope_linear_scaling_factor",
                                   "base_num_decoder_layers")} == {
        "decoder_block": "gemma3", "model_name": "gemma3-4b", "override_model_config": "True",
        "mlp_activations": '["gelu","linear"]', "sliding_window_size": "64", "use_post_attn_norm": "True",
        "use_post_ffw_norm": "True", "local_rope_max_timescale": "10000", "rope_linear_scaling_factor": "1",
        "base_num_decoder_layers": "6"}
    for odd, named in (({"model.layer_pattern": "LLG"}, "model.norm_placement='sandwich'"),
                       ({"model.qk_norm": "full"}, "model.qk_norm='full'")):
        with pytest.raises(ConfigError, match=re.escape(named)):
            maxtext_peer.maxtext_args(issue_config(**{**GEMMA3, **odd}), 12, "/tmp/out")


@pytest.mark.parametrize("remat, scan, expected", [
    ("save_dots", True, {"remat_policy": "minimal"}),
    ("save_qkv_proj", True, {"remat_policy": "save_qkv_proj"}),
    ("save_out_proj", True, {"remat_policy": "custom", "out_proj": "device", "mlpwo": "device"}),
    ("none", False, {"remat_policy": "none"}),
])
def test_remat_policies_map_to_the_same_saved_tensors(remat, scan, expected):
    args = as_dict(maxtext_peer.maxtext_args(issue_config(**{"model.remat": remat, "model.scan_layers": scan}),
                                             12, "/tmp/out"))
    assert {k: args.get(k) for k in expected} == expected


@pytest.mark.parametrize("overrides, named", [
    ({"model.positions": "learned"}, "model.positions='learned'"),
    ({"model.norm_placement": "post"}, "model.norm_placement='post'"),
    ({"model.mlp_activation": "gelu"}, "mlp_activation='gelu'"),
    ({"model.sliding_window": 16}, "model.sliding_window=16"),
    ({"model.final_logit_softcap": 30.0}, "model.final_logit_softcap=30"),
    ({"model.label_smoothing": 0.1}, "model.label_smoothing"),
    ({"optim.name": "lion"}, "optim.name='lion'"),
    ({"model.remat": "none"}, "model.remat='none' with model.scan_layers"),
    ({**MOE, "model.shared_experts": 1}, "model.shared_experts > 0"),
    ({**MOE, "model.router": "sigmoid"}, "model.router='sigmoid'"),
    ({**MOE, "model.router_renormalize": False}, "model.router_renormalize=False"),
    ({**MOE, "model.load_balance": "bias"}, "model.load_balance='bias'"),
    ({**MOE, "model.router_z_loss": 1e-3}, "model.router_z_loss"),
])
def test_what_maxtext_cannot_run_the_same_way_is_refused(overrides, named):
    with pytest.raises(ConfigError, match=re.escape(named)):
        maxtext_peer.maxtext_args(issue_config(**overrides), 12, "/tmp/out")


def test_more_than_one_device_is_refused():
    cfg = config_lib.apply_overrides(load_config("tiny"), {**ISSUE_MODEL, "mesh.data": 2, "mesh.fsdp": 1})
    with pytest.raises(ConfigError, match="more than one device"):
        maxtext_peer.maxtext_args(config_lib.resolve(cfg, 2, 1, "cpu"), 12, "/tmp/out")


def test_maxtext_log_is_read_back():
    assert maxtext_peer.parse_maxtext_log(MAXTEXT_LOG) == [(0, 0.057), (1, 0.112), (2, 1.332), (3, 1.356),
                                                           (4, 1.340)]
    # steps 2-4 timed: median 1.340 s for 4 x 256 tokens
    assert maxtext_peer.measure(MAXTEXT_LOG, 2, 3, 1024) == {
        "tokens_per_sec": 1024 / 1.340, "step_sec_median": 1.340, "params_billion": 0.021}
    with pytest.raises(ValueError, match="steps 2-5"):
        maxtext_peer.measure(MAXTEXT_LOG, 2, 4, 1024)


def test_maxlm_json_is_read_after_other_output():
    text = 'maxlm: warning: something\nbench: step 0 done\n{\n  "tokens_per_sec": 5000.0,\n' \
           '  "step_sec_median": 0.2,\n  "xla_flags": "--a"\n}\n'
    assert compare.maxlm_measure(text) == {"tokens_per_sec": 5000.0, "step_sec_median": 0.2, "xla_flags": "--a"}


def fake_side(name):
    """A side whose run's whole output is its tokens/s (the fake launcher prints it)."""
    return compare.Side(name, [name], {}, re.compile("x"), lambda text: {"tokens_per_sec": float(text),
                                                                         "step_sec_median": 1024 / float(text)})


def test_pairs_alternate_and_medians_and_ratios_are_per_pair():
    outputs = {"maxlm": iter([("1000", 20.0), ("1200", 21.0), ("900", None)]),
               "maxtext": iter([("500", 40.0), ("800", 42.0), ("450", 41.0)])}
    order = []

    def launch(command, env, first_step_line):
        order.append(command[0])
        text, first = next(outputs[command[0]])
        return compare.Output(text, first, 0)

    results = compare.run_pairs([fake_side("maxlm"), fake_side("maxtext")], 3, launch)
    assert order == ["maxlm", "maxtext", "maxtext", "maxlm", "maxlm", "maxtext"]
    summary = compare.summarize(results)
    assert [p["first"] for p in summary["pairs"]] == ["maxlm", "maxtext", "maxlm"]
    assert [p["ratio"] for p in summary["pairs"]] == [2.0, 1.5, 2.0]
    assert summary["pairs"][1]["maxtext"] == {"tokens_per_sec": 800.0, "step_sec_median": 1.28, "first_step_sec": 42.0}
    assert summary["maxlm_tokens_per_sec_median"] == 1000.0
    assert summary["maxtext_tokens_per_sec_median"] == 500.0
    assert summary["median_ratio"] == 2.0
    # the third pair has no maxlm first-step time: its ratio is left out, not counted as 0
    assert summary["maxlm_first_step_sec_median"] == 20.5
    assert summary["first_step_ratio"] == pytest.approx((20 / 40 + 21 / 42) / 2)


def test_a_failed_run_stops_the_comparison_with_its_output():
    def launch(command, env, first_step_line):
        return compare.Output("Traceback ...\nImportError: x\n", None, 1)

    with pytest.raises(compare.RunFailed, match="maxlm exited with status 1") as failed:
        compare.run_pairs([fake_side("maxlm"), fake_side("maxtext")], 1, launch)
    assert "ImportError" in failed.value.output


def test_maxlm_command_keeps_the_users_flags_but_compares():
    argv = ["compare", "--peer=maxtext", "--pairs", "2", "--config=configs/tiny.py", "--config.seq_len=256",
            "--runtime=same", "--peer_venv=/v", "--steps=5", "--warmup_steps", "3"]
    assert compare.maxlm_bench_flags(argv, 3, 5) == ["--config=configs/tiny.py", "--config.seq_len=256",
                                                     "--warmup_steps=3", "--steps=5"]


@pytest.mark.parametrize("runtime", ["own", "same"])
def test_runtimes_choose_the_interpreter_and_xla_flags(runtime, monkeypatch):
    monkeypatch.setattr(cli, "USER_XLA_FLAGS", "--xla_dump_to=/tmp/d")
    maxlm_side, maxtext_side = compare.make_sides(issue_config(), runtime, "/v/bin/python", "/v/maxtext",
                                                  ["steps=5"], ["--config=configs/tiny.py"], 2, 3)
    assert maxtext_side.command == ["/v/bin/python", "-m", "maxtext.trainers.pre_train.train",
                                    "/v/maxtext/configs/base.yml", "steps=5"]
    assert maxtext_side.env["DECOUPLE_GCLOUD"] == "TRUE"
    same = runtime == "same"
    assert maxlm_side.command[0] == ("/v/bin/python" if same else sys.executable)
    # own: the user's flags (maxlm's process adds its default itself); same: maxlm's default for both
    expected = "--xla_dump_to=/tmp/d" + (f" {cli.CPU_DEFAULT}" if same else "")
    assert maxlm_side.env["XLA_FLAGS"] == maxtext_side.env["XLA_FLAGS"] == expected
    assert ("PYTHONPATH" in maxlm_side.env) == same
    assert maxlm_side.shell().startswith("PYTHONPATH=" if same else "JAX_PLATFORMS=cpu XLA_FLAGS=")


def test_a_venv_stamped_with_this_lock_is_not_installed_again(tmp_path, monkeypatch):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").touch()
    with open(maxtext_peer.LOCK, "rb") as f:
        (tmp_path / maxtext_peer.STAMP).write_text(hashlib.sha256(f.read()).hexdigest() + "\n")
    monkeypatch.setattr(maxtext_peer, "checked", lambda command: pytest.fail(f"ran {command}"))
    maxtext_peer.ensure_peer_venv(str(tmp_path))


def test_a_peer_python_that_is_not_3_12_is_refused():
    with pytest.raises(ConfigError, match="--peer_python=/nonexistent/python"):
        maxtext_peer.peer_base_python("/nonexistent/python")


# --- compiled TPU plans (compare --target) ---------------------------------------------------------

# The two lines MaxText 0.2.5's train_compile printed for Llama 3.2 1B on v5p-8 (2026-12-01), cut
# down to the keys read (the real cost analysis has hundreds of per-operand entries)
TRAIN_COMPILE_OUTPUT = """\
Jitting and compilation complete!
Finished train_compile.py successfully!
Cost analysis: {'utilization0{}': 6484.9, 'flops': 493210589724672.0, 'bytes accessed0{}': 330484973568.0, \
'bytes accessed': 996501422080.0, 'transcendentals': 46488264704.0, 'optimal_seconds': 1.4317399263381958}
Memory analysis: CompiledMemoryStats(generated_code_size_in_bytes=399155200, argument_size_in_bytes=3709366784, \
output_size_in_bytes=3708063552, alias_size_in_bytes=3708056064, temp_size_in_bytes=11749490688, \
host_generated_code_size_in_bytes=0, host_argument_size_in_bytes=0, host_output_size_in_bytes=0, \
host_alias_size_in_bytes=0, host_temp_size_in_bytes=0)
"""


def test_train_compile_output_is_read_back_with_the_same_peak_formula_as_ours():
    from maxlm.bench import compare_plan

    figures = compare_plan.maxtext_plan(TRAIN_COMPILE_OUTPUT)
    assert figures["flops"] == 493210589724672.0 and figures["bytes_accessed"] == 996501422080.0
    assert figures["optimal_seconds"] == pytest.approx(1.43174)
    assert figures["peak"] == 3709366784 + 3708063552 - 3708056064 + 11749490688
    with pytest.raises(ValueError, match="no cost or memory analysis"):
        compare_plan.maxtext_plan("Jitting and compiling train step...\n")


def test_the_estimate_is_the_slower_of_compute_and_memory_at_the_chips_datasheet():
    from maxlm.bench import compare_plan
    from maxlm.bench.targets import tpu
    from maxlm.observe import flops

    peak, bandwidth = flops.table_peak("TPU v5", "bfloat16"), tpu.TPUS["v5p"][4]
    compute_bound = compare_plan.estimate({"flops": 100 * peak, "bytes_accessed": bandwidth}, "v5p-8", "bfloat16")
    assert compute_bound == {"compute_sec": 100.0, "memory_sec": 1.0, "step_sec": 100.0}
    memory_bound = compare_plan.estimate({"flops": peak, "bytes_accessed": 3 * bandwidth}, "v5p-64", "bfloat16")
    assert memory_bound["step_sec"] == pytest.approx(3.0)


def test_a_tpu_plan_maps_the_mesh_chunks_and_splash_attention():
    cfg = config_lib.resolve(load_config("llama_1b_v5p8"), 4, 1, "tpu")
    args = as_dict(maxtext_peer.maxtext_args(cfg, 1, "/tmp/out", target="v5p-8"))
    assert {k: args[k] for k in ("hardware", "attention", "ici_data_parallelism", "ici_fsdp_parallelism",
                                 "ici_tensor_parallelism", "num_vocab_tiling", "per_device_batch_size",
                                 "max_target_length", "logits_via_embedding", "rope_max_timescale")} == {
        "hardware": "tpu", "attention": "flash", "ici_data_parallelism": "1", "ici_fsdp_parallelism": "4",
        "ici_tensor_parallelism": "1", "num_vocab_tiling": "8",  # 4096 / 512: 16 x 512 positions a tile
        "per_device_batch_size": "16", "max_target_length": "4096", "logits_via_embedding": "True",
        "rope_max_timescale": "500000"}
    # on the CPU the same chunks are refused: MaxText's CPU run is compared without them
    with pytest.raises(ConfigError, match="logits_chunk_size on CPU"):
        maxtext_peer.check_expressible(issue_config(**{"model.logits_chunk_size": 64}))


def long_context_v5p8(**overrides):
    """Llama 3.2 1B on a v5p-8 at 32k tokens, the sequence split over its 4 chips."""
    cfg = config_lib.apply_overrides(load_config("llama_1b_v5p8"), {
        "seq_len": 32768, "batch_size": 4, "mesh.fsdp": 1, "mesh.sequence": 4, **overrides})
    return config_lib.resolve(cfg, 4, 1, "tpu")


@pytest.mark.parametrize("strategy, balanced, tokamax", [
    ("ring", True, True), ("ring", False, True), ("ulysses", False, True), ("all_gather", False, None)])
def test_a_tpu_plan_maps_context_parallelism_to_maxtexts(strategy, balanced, tokamax):
    """Each strategy to MaxText's of the same name; its kernel as maxlm's (the all-gather's 'auto'
    is XLA's attention: splash needs whole rows)."""
    cfg = long_context_v5p8(**{"model.context_parallel": strategy, "model.context_load_balance": balanced,
                               "model.attention": "auto"})
    args = as_dict(maxtext_peer.maxtext_args(cfg, 1, "/tmp/out", target="v5p-8"))
    assert (args["ici_context_parallelism"], args["context_parallel_strategy"],
            args["context_parallel_load_balance"]) == ("4", strategy, str(balanced))
    assert args.get("use_tokamax_splash") == (tokamax and "True")  # MaxText's ring and Ulysses need it
    assert args["attention"] == ("dot_product" if strategy == "all_gather" else "flash")
    assert args["max_target_length"] == "32768" and args["per_device_batch_size"] == "1"
    # without a sequence axis MaxText's own default (all_gather, balanced) never matters
    plain = as_dict(maxtext_peer.maxtext_args(config_lib.resolve(load_config("llama_1b_v5p8"), 4, 1, "tpu"),
                                              1, "/tmp/out", target="v5p-8"))
    assert plain["ici_context_parallelism"] == "1" and "context_parallel_strategy" not in plain


@pytest.mark.parametrize("strategy", ["ring", "ulysses"])
def test_a_ring_or_ulysses_without_splash_is_refused(strategy):
    """MaxText's TPU ring and Ulysses run only in its splash kernel: XLA's attention is not comparable."""
    cfg = long_context_v5p8(**{"model.context_parallel": strategy, "model.attention": "xla"})
    with pytest.raises(ConfigError, match="without splash attention"):
        maxtext_peer.maxtext_args(cfg, 1, "/tmp/out", target="v5p-8")


@pytest.mark.parametrize("scanned", [False, True])
def test_a_tpu_plan_compiles_both_sides_with_the_same_layer_layout(scanned):
    """`compare --target --layers=scanned` compiles both steps scanned (the presets' layout), the
    default both unrolled: the two sides never differ in it."""
    from maxlm.bench import compare_plan

    cfg = config_lib.resolve(load_config("llama_8b_v5p64"), 32, 1, "tpu")
    cfg.model.scan_layers = scanned
    maxlm_side, maxtext_side = compare_plan.sides(cfg, "v5p-64", "/v/bin/python", "/v/maxtext", [])
    assert maxlm_side.command[-1] == f"--config.model.scan_layers={scanned}"
    assert as_dict(maxtext_side.command[5:])["scan_layers"] == str(scanned)


def test_the_peer_lock_and_venv_are_found_at_the_repository_root():
    """The peer's lock is `launch/peers/maxtext.lock` and its default venv `.venv-maxtext`, both at
    the repository root, wherever maxtext_peer.py sits in the package."""
    root = pathlib.Path(__file__).resolve().parents[1]
    assert pathlib.Path(maxtext_peer.REPO) == root
    assert pathlib.Path(maxtext_peer.LOCK).is_file()
