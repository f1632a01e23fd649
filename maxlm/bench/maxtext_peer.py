"""MaxText as the peer of `python -m maxlm.bench compare` (maxlm/bench/compare.py): a maxlm config in
MaxText's terms, what MaxText's log says, and the venv MaxText runs in.

The mapping is to MaxText 0.2.5's keys (its MaxText/configs/base.yml; `check_keys` verifies them against
the installed copy). The venv is made from launch/peers/maxtext.lock, a full freeze of
`maxtext[tpu]==0.2.5`'s environment, which needs Python 3.12 or newer.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys

from maxlm import config as config_lib, model
from maxlm.model import attention_plan
from maxlm.model.moe import grouped_matmul
from maxlm.runtime.errors import ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # maxlm/bench/ is two below
LOCK = os.path.join(REPO, "launch", "peers", "maxtext.lock")
STAMP = ".maxlm-lock-sha256"  # in the venv: the sha256 of the lock it was installed from
TRAIN_MODULE = "maxtext.trainers.pre_train.train"
FIRST_STEP_LINE = re.compile(r"completed step: 0,")
STEP_LINE = re.compile(r"completed step: (\d+), seconds: ([0-9.]+)")
PARAMS_LINE = re.compile(r"number parameters: ([0-9.]+) billion")
# model.remat -> MaxText's overrides (policies of MaxText's layers/nnx_decoders.py)
REMAT = {
    "full": {"remat_policy": "full"},
    "save_dots": {"remat_policy": "minimal"},  # every weight matmul's output
    "save_qkv_proj": {"remat_policy": "save_qkv_proj"},
    # maxlm's keeps both output projections; MaxText's save_out_proj only the attention's
    "save_out_proj": {"remat_policy": "custom", "out_proj": "device", "mlpwo": "device"},
    # unscanned layers only: MaxText 0.2.5 wraps its scanned layer body in jax.checkpoint under
    # every policy, and 'none' then saves nothing, as 'full'
    "none": {"remat_policy": "none"},
}


class PeerError(RuntimeError):
    """The peer's environment could not be made or does not match the mapping (exit 1)."""


def check_expressible(cfg, target: str = "") -> None:
    """Raises ConfigError naming everything in `cfg` that MaxText cannot run the same way, on this
    CPU or compiled for the TPU slice `target`."""
    m, o = cfg.model, cfg.optim
    on_cpu = not target
    problems = {
        "more than one device (the comparison runs on one)":
            on_cpu and math.prod(cfg.mesh[a] for a in config_lib.MESH_AXES) != 1,
        "mesh.stage > 1 (MaxText's pipeline is another scheme)": cfg.mesh.stage != 1,
        **({} if on_cpu else context_parallel_problems(cfg)),  # on CPU: one device
        f"model.positions={m.positions!r} (MaxText's llama2 block has RoPE only)": m.positions != "rope",
        f"model.rope_scaling={m.rope_scaling!r} (not mapped to MaxText's rope settings)": m.rope_scaling != "none",
        "model.label_smoothing (MaxText's pre-training loss has none)": m.label_smoothing,
        "model.fp8": m.fp8,
        **block_problems(m),
        **moe_problems(m),
        "model.logits_chunk_size on CPU (a TPU plan maps it to MaxText's vocabulary tiling)":
            on_cpu and m.logits_chunk_size,
        "model.dtype='float16' (maxlm's loss scaling has no MaxText counterpart)": m.dtype == "float16",
        "model.mtp_depth > 0 (MaxText's mtp_num_layers is not mapped: its MTP layers are the decoder's own type)":
            m.mtp_depth,
        f"model.attention={m.attention!r} (on CPU: xla)": on_cpu and m.attention not in ("auto", "xla"),
        f"optim.name={o.name!r} (adamw only)": o.name != "adamw",
        "optim.grad_accum_steps > 1": o.grad_accum_steps != 1,
        "model.remat='none' with model.scan_layers (MaxText 0.2.5 rematerialises scanned layers under "
        "every remat_policy; use model.remat=full, or model.scan_layers=False)": m.remat == "none" and m.scan_layers,
    }
    found = [what for what, bad in problems.items() if bad]
    if found:
        raise ConfigError("MaxText cannot run this config the same way: " + "; ".join(found))


# Gemma 3's block as maxlm's keys say it (MaxText's gemma3 decoder block has them all built in,
# its local:global pattern fixed at 5:1)
GEMMA3_BLOCK = {"norm_placement": "sandwich", "qk_norm": "per_head", "mlp_activation": "geglu", "norm_plus_one": True,
                "scale_embeddings": True, "layer_pattern": "LLLLLG"}


def decoder_block(m) -> str:
    """MaxText's decoder block for the model `m`: gemma3 for Gemma 3's block, qwen3 for Llama's with
    per-head qk-norm, mixtral for an MoE model, else llama2 (`block_problems` says what none runs)."""
    if all(m[key] == value for key, value in GEMMA3_BLOCK.items()):
        return "gemma3"
    if m.num_experts:
        return "mixtral"
    return "qwen3" if m.qk_norm == "per_head" else "llama2"


def block_problems(m) -> dict[str, bool]:
    """What of the model's block MaxText's `decoder_block` for it cannot run the same way."""
    block = decoder_block(m)
    if block == "gemma3":
        return {f"model.sliding_window={m.sliding_window} (MaxText's gemma3 block has local layers)": not m.sliding_window,
                "model.attn_logit_softcap (Gemma 3 has none)": m.attn_logit_softcap}
    name = f"MaxText's {block} block"
    return {
        f"model.qk_norm={m.qk_norm!r} ({name} has {'per-head' if block == 'qwen3' else 'no'} qk-norm)":
            m.qk_norm != ("per_head" if block == "qwen3" else "none"),
        f"model.norm_placement={m.norm_placement!r} ({name} is pre-norm)": m.norm_placement != "pre",
        f"model.norm={m.norm!r}, mlp_activation={m.mlp_activation!r}, use_bias={m.use_bias}, qkv_bias={m.qkv_bias}, "
        f"norm_plus_one={m.norm_plus_one}, scale_embeddings={m.scale_embeddings} ({name}: RMSNorm, SwiGLU, no biases)":
            (m.norm, m.mlp_activation, m.use_bias, m.qkv_bias, m.norm_plus_one, m.scale_embeddings)
            != ("rmsnorm", "swiglu", False, False, False, False),
        f"model.sliding_window={m.sliding_window} (mapped for MaxText's gemma3 block only)": m.sliding_window,
        f"model.final_logit_softcap={m.final_logit_softcap:g} (mapped for MaxText's gemma3 block only)":
            m.final_logit_softcap,
        "model.attn_logit_softcap": m.attn_logit_softcap,
        f"model.attention_kind={m.attention_kind!r} (not mapped to MaxText's MLA)": m.attention_kind != "gqa",
    }


def block_args(m) -> dict:
    """MaxText's overrides of the decoder block: qwen3's qk-norm; gemma3's window, local RoPE base
    and soft cap (its model_name picks the query scaling: gemma3-4b's is 1/sqrt(head_dim), as
    maxlm's; override_model_config lets the shape here replace that model's)."""
    block = decoder_block(m)
    if block == "qwen3":
        return {"decoder_block": "qwen3", "use_qk_norm": True}
    if block != "gemma3":
        return {}
    return {"model_name": "gemma3-4b", "override_model_config": True, "decoder_block": "gemma3",
            "mlp_activations": '["gelu","linear"]', "sliding_window_size": m.sliding_window,
            "use_post_attn_norm": True, "use_post_ffw_norm": True, "rope_linear_scaling_factor": 1.0,
            "local_rope_max_timescale": m.rope_theta_local or m.rope_theta,
            "final_logits_soft_cap": m.final_logit_softcap}


def context_parallel_problems(cfg) -> dict[str, bool]:
    """What of `mesh.sequence` > 1 MaxText's TPU context parallelism cannot run the same way. Its ring
    and Ulysses run only in Tokamax's splash kernel. (Load balancing, maxlm's for the ring only,
    is MaxText's `context_parallel_load_balance`.)"""
    m = cfg.model
    if cfg.mesh.sequence == 1:
        return {}
    splash = attention_plan.kernels(cfg, "tpu")["attention"] == "splash"
    return {
        f"model.context_parallel={m.context_parallel!r} without splash attention (MaxText's TPU ring and "
        "Ulysses run in Tokamax's splash kernel only)": m.context_parallel != "all_gather" and not splash,
    }


def context_parallel_args(cfg) -> dict:
    """MaxText's context-parallel overrides for `mesh.sequence`: the same strategy over an
    `ici_context_parallelism` axis of the same size, with load balancing (zig-zag: MaxText's
    dual-chunk order) as maxlm's. MaxText's ring and Ulysses require its Tokamax splash kernel."""
    m = cfg.model
    if cfg.mesh.sequence == 1:
        return {"ici_context_parallelism": 1}
    return {"ici_context_parallelism": cfg.mesh.sequence, "context_parallel_strategy": m.context_parallel,
            "context_parallel_load_balance": m.context_load_balance,
            **({"use_tokamax_splash": True} if m.context_parallel != "all_gather" else {})}


def moe_problems(m) -> dict[str, bool]:
    """What of an MoE model MaxText's `mixtral` block cannot run the same way (problem: found?)."""
    if not m.num_experts:
        return {}
    return {
        "model.shared_experts > 0 (MaxText's mixtral block has none)": m.shared_experts,
        "model.first_dense_layers > 0 (MaxText's mixtral block has every layer MoE)": m.first_dense_layers,
        f"model.router={m.router!r} (the mixtral block: softmax)": m.router != "softmax",
        "model.router_renormalize=False (the mixtral block's softmax over the top-k logits renormalises)":
            not m.router_renormalize,
        "model.router_groups > 0 or model.router_scale != 1": m.router_groups or m.router_scale != 1,
        f"model.load_balance={m.load_balance!r} (aux_loss or none)": m.load_balance not in ("aux_loss", "none"),
        "model.router_z_loss (MaxText's MoE has no router z-loss)": m.router_z_loss,
    }


def moe_args(cfg, target: str) -> dict:
    """MaxText's MoE overrides: its `mixtral` block, a llama block whose MLP is the routed MoE with
    gates softmax(top-k logits), which is maxlm's softmax router with renormalised gates. Dropless is
    its `sparse_matmul` (grouped matmuls: jax.lax.ragged_dot, or megablox where maxlm runs megablox);
    capacity its dense dispatch (both queue per sequence; the order slots drop in differs)."""
    m = cfg.model
    if not m.num_experts:
        return {}
    megablox = bool(target) and grouped_matmul.grouped_matmul_backend(
        m.grouped_matmul, model.compute_dtype(m), platform="tpu") == "megablox"
    return {"decoder_block": "mixtral", "num_experts": m.num_experts, "num_experts_per_tok": m.experts_per_token,
            "base_moe_mlp_dim": m.expert_mlp_dim, "base_mlp_dim": m.expert_mlp_dim,  # every layer MoE: equal
            "sparse_matmul": not m.capacity_factor, "megablox": megablox,
            "capacity_factor": m.capacity_factor or -1.0,  # -1: no dropping
            "load_balance_loss_weight": m.load_balance_weight if m.load_balance == "aux_loss" else 0.0,
            **({"ici_expert_parallelism": cfg.mesh.expert} if target else {})}


def attention_of(cfg, platform: str) -> str:
    """MaxText's `attention` for the backend maxlm's step runs on `platform`."""
    return {"splash": "flash", "xla": "dot_product"}[attention_plan.kernels(cfg, platform)["attention"]]


def maxtext_args(cfg, steps: int, workdir: str, target: str = "") -> list[str]:
    """MaxText's `key=value` overrides of its base.yml for the resolved maxlm config `cfg`, running
    `steps` steps with outputs under `workdir` on this CPU, or compiled for the TPU slice `target`
    (the mesh's axes as MaxText's, the logits chunks as its vocabulary tiling). Raises
    ConfigError (`check_expressible`)."""
    check_expressible(cfg, target)
    m, o = cfg.model, cfg.optim
    devices = math.prod(cfg.mesh[a] for a in config_lib.MESH_AXES)
    placement = {"hardware": "cpu", "attention": "dot_product"}
    if target:
        placement = {"hardware": "tpu", "attention": attention_of(cfg, "tpu"),
                     "ici_data_parallelism": cfg.mesh.data, "ici_fsdp_parallelism": cfg.mesh.fsdp,
                     "ici_tensor_parallelism": cfg.mesh.tensor, **context_parallel_args(cfg),
                     "num_vocab_tiling": cfg.seq_len // m.logits_chunk_size if m.logits_chunk_size else 1}
    args = {
        "run_name": "compare", "base_output_directory": workdir, **placement,
        "skip_jax_distributed_system": True, "dataset_type": "synthetic", "enable_checkpointing": False,
        "enable_tensorboard": False, "jax_cache_dir": None, "steps": steps,  # None: no compilation cache
        "decoder_block": "llama2", "base_emb_dim": m.d_model, "base_num_decoder_layers": m.num_layers,
        "base_num_query_heads": m.num_heads, "base_num_kv_heads": m.num_kv_heads,
        "head_dim": m.head_dim or m.d_model // m.num_heads, "base_mlp_dim": m.mlp_dim,
        "vocab_size": m.vocab_size, "max_target_length": cfg.seq_len,
        "per_device_batch_size": cfg.batch_size / devices,
        "scan_layers": m.scan_layers, "dtype": m.dtype,
        "weight_dtype": "float32",  # maxlm's parameters are always float32
        "logits_via_embedding": m.tie_embeddings, "normalization_layer_epsilon": m.norm_eps,
        "rope_max_timescale": m.rope_theta, "z_loss_multiplier": m.z_loss,
        # the schedule's shape is left out: it costs nothing per step
        "opt_type": "adamw", "learning_rate": o.lr, "adam_b1": o.b1, "adam_b2": o.b2, "adam_eps": o.eps,
        "adam_weight_decay": o.weight_decay, "gradient_clipping_threshold": o.clip_norm, "mu_dtype": o.mu_dtype,
        **REMAT[m.remat],
        **moe_args(cfg, target),
        **block_args(m),
    }
    return [f"{key}={override_value(value)}" for key, value in args.items()]


def override_value(value) -> str:
    """`value` as MaxText's command line (OmegaConf) reads it back: `key=` is None, 10000 an int."""
    if value is None:
        return ""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def parse_maxtext_log(text: str) -> list[tuple[int, float]]:
    """(step, seconds) of every `completed step: N, seconds: S` line MaxText logged."""
    return [(int(step), float(sec)) for step, sec in STEP_LINE.findall(text)]


def measure(text: str, warmup: int, timed: int, tokens_per_step: int) -> dict:
    """tokens/s of a MaxText run's log: steps `warmup` to `warmup + timed - 1`, median time. Its
    first two logged times are only the dispatch's (asynchronous), so `warmup` must be 2 or more."""
    seconds = dict(parse_maxtext_log(text))
    wanted = range(warmup, warmup + timed)
    if any(step not in seconds for step in wanted):
        raise ValueError(f"MaxText logged no time for some of steps {wanted.start}-{wanted.stop - 1}")
    step_sec = statistics.median(seconds[step] for step in wanted)
    params = PARAMS_LINE.search(text)
    return {"tokens_per_sec": tokens_per_step / step_sec, "step_sec_median": step_sec,
            "params_billion": float(params.group(1)) if params else None}


def check_keys(overrides: list[str], base_yml: str) -> None:
    """Every override names a key of MaxText's base.yml (another MaxText version may rename some)."""
    with open(base_yml) as f:
        text = f.read()
    keys = [override.split("=")[0] for override in overrides]
    missing = [key for key in keys if not re.search(rf"^{re.escape(key)}:", text, re.M)]
    if missing:
        raise PeerError(f"{base_yml} has no {', '.join(missing)}: maxlm/bench/maxtext_peer.py maps to MaxText 0.2.5")


def peer_base_python(named: str) -> str:
    """The Python the peer venv is made from: `named` (--peer_python), else the one maxlm runs on."""
    if not named:
        return sys._base_executable  # the interpreter behind maxlm's own venv
    try:
        check = subprocess.run([named, "-c", "import sys; sys.exit(sys.version_info < (3, 12))"], capture_output=True)
    except OSError:
        check = None
    if check is None or check.returncode:
        raise ConfigError(f"--peer_python={named} does not run as Python 3.12 or newer")
    return named


def ensure_peer_venv(path: str, python: str = "") -> None:
    """Makes `path` a venv with launch/peers/maxtext.lock installed (with uv when on PATH, else pip),
    unless its stamp records this lock already. A venv made otherwise (no stamp) that has maxtext
    is used as it is."""
    with open(LOCK, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    venv_python, stamp = os.path.join(path, "bin", "python"), os.path.join(path, STAMP)
    if os.path.exists(venv_python):
        if os.path.exists(stamp):
            with open(stamp) as f:
                if f.read().strip() == digest:
                    return
        elif subprocess.run([venv_python, "-c", "import maxtext"], capture_output=True).returncode == 0:
            return progress(f"{path} has no {STAMP}: using its maxtext as it is")
    uv = shutil.which("uv")
    if not os.path.exists(venv_python):
        base = peer_base_python(python)
        progress(f"creating {path} with {base}")
        checked([uv, "venv", "--python", base, path] if uv else [base, "-m", "venv", path])
    progress(f"installing {os.path.relpath(LOCK, REPO)} into {path} with {'uv' if uv else 'pip'} (about 2.3 GB)")
    install = [uv, "pip", "install", "--python", venv_python] if uv else [venv_python, "-m", "pip", "install"]
    checked(install + ["--no-deps", "-r", LOCK])  # the lock is a full freeze
    with open(stamp, "w") as f:
        f.write(digest + "\n")


def checked(command: list[str]) -> None:
    if subprocess.run(command, stdout=sys.stderr).returncode:  # stdout is for the JSON result
        raise PeerError(f"failed: {shlex.join(command)}")


def progress(message: str) -> None:
    print(f"compare: {message}", file=sys.stderr, flush=True)
