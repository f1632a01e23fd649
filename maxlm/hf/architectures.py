"""Which transformers class holds a maxlm model, and its `config.json` both ways.

    arch = architecture(model_cfg, "the Hugging Face export")   # or one ConfigError line
    hf_config(cfg, tokenizer, dtype)      # the export's config.json
    check_config(hf, model_cfg, source)   # an import's config.json against the run

The class follows from the model config:

    model.num_experts = 0     LlamaForCausalLM
    model.num_experts > 0     MixtralForCausalLM

A key the class cannot hold is refused with one line naming it (`architecture`). The weights'
names are in `maxlm/hf/mapping.py`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from maxlm import config as config_lib


class Arch(NamedTuple):
    """A transformers causal-LM class that holds maxlm models, as the mapping needs it."""

    hf_class: str  # config.json's `architectures`
    model_type: str
    moe_block: str = ""  # an MoE layer's module name (its router is `{moe_block}.gate`); "" for a dense class
    expert_weights: tuple[str, str, str] = ()  # an expert's gate, up and down projections


LLAMA = Arch("LlamaForCausalLM", "llama")
MIXTRAL = Arch("MixtralForCausalLM", "mixtral", "block_sparse_moe", ("w1", "w3", "w2"))
ARCHITECTURES = {a.model_type: a for a in (LLAMA, MIXTRAL)}


def _mixtral_refusals(m) -> list[str]:
    """The model keys transformers' Mixtral has no place for, each with why."""
    checks = [
        (m.shared_experts, f"model.shared_experts={m.shared_experts} (Mixtral has no shared experts)"),
        (m.router != "softmax", f"model.router={m.router!r} (Mixtral's router is a softmax over all experts)"),
        (m.router_groups, f"model.router_groups={m.router_groups} (Mixtral has no group-limited routing)"),
        (m.first_dense_layers, f"model.first_dense_layers={m.first_dense_layers} (every Mixtral layer is an "
                               "MoE layer)"),
        (not m.router_renormalize, "model.router_renormalize=False (Mixtral renormalises the top-k gates "
                                   "to sum 1)"),
        (m.router_scale != 1, f"model.router_scale={m.router_scale} (Mixtral does not scale the gates)"),
        (m.load_balance == "bias", "model.load_balance='bias' (the selection bias has no place in "
                                   "Mixtral's router)"),
    ]
    return [why for refused, why in checks if refused]


def architecture(m, what: str) -> Arch:
    """The class that holds the model `m`, or ConfigError naming every key it cannot hold (`what`
    is the export or the import, for the message)."""
    if m.positions != "rope":
        raise config_lib.ConfigError(
            f"{what} needs model.positions='rope', got {m.positions!r}: transformers' Llama and "
            "Mixtral have only RoPE, no sinusoidal or learned position embeddings")
    if not m.num_experts:
        return LLAMA
    if refused := _mixtral_refusals(m):
        raise config_lib.ConfigError(
            f"{what} maps a mixture-of-experts model to transformers' MixtralForCausalLM, which cannot "
            f"hold " + "; ".join(refused))
    return MIXTRAL


# ----------------------------------------------------------------------------- export


def hf_config(cfg, tokenizer, dtype: str = "float32") -> dict:
    """The `config.json` of the class `architecture` picks, equal to the run's model.

    RoPE's base is written both as `rope_theta` (transformers 4.x) and in `rope_parameters`
    (5.x); the dtype as `torch_dtype` (4.x) and `dtype` (5.x).
    """
    m = cfg.model
    arch = architecture(m, "the Hugging Face export")
    config = {
        "architectures": [arch.hf_class],
        "model_type": arch.model_type,
        "hidden_size": m.d_model,
        "intermediate_size": m.mlp_dim,
        "num_attention_heads": m.num_heads,
        "num_key_value_heads": m.num_kv_heads,
        "head_dim": m.head_dim,
        "num_hidden_layers": m.num_layers,
        "vocab_size": m.vocab_size,
        "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta},
        "tie_word_embeddings": bool(m.tie_embeddings),
        "max_position_embeddings": cfg.seq_len,
        "torch_dtype": dtype,
        "dtype": dtype,
        "bos_token_id": tokenizer.bos_id,
        "eos_token_id": tokenizer.eos_id,
        "pad_token_id": tokenizer.pad_id,
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "initializer_range": m.init_std,
        "use_cache": True,
    }
    if arch is LLAMA:
        config.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    if arch is MIXTRAL:
        config.update(
            intermediate_size=m.expert_mlp_dim,  # Mixtral's only MLPs are its experts
            num_local_experts=m.num_experts,
            num_experts_per_tok=m.experts_per_token,
            sliding_window=None,
            router_jitter_noise=0.0,
            # read by transformers' training only, with output_router_logits=True
            router_aux_loss_coef=m.load_balance_weight if m.load_balance == "aux_loss" else 0.0,
            output_router_logits=False,
        )
    return config


# ----------------------------------------------------------------------------- import


def _rope(hf: dict) -> tuple[float, str]:
    """(theta, rope type) of an HF config, either layout (`rope_parameters` or `rope_theta` +
    `rope_scaling`)."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    kinds = [params.get("rope_type"), scaling.get("rope_type"), scaling.get("type")]
    return float(theta), next((k for k in kinds if k and k != "default"), "default")


def _mixtral_keys(hf: dict) -> tuple[dict, list[str]]:
    """Mixtral's MoE keys as maxlm's, and what maxlm cannot represent."""
    mapped = {"num_experts": hf.get("num_local_experts", 8), "experts_per_token": hf.get("num_experts_per_tok", 2),
              "expert_mlp_dim": hf["intermediate_size"], "shared_experts": 0, "first_dense_layers": 0,
              "router": "softmax", "router_renormalize": True, "router_scale": 1.0, "router_groups": 0}
    unsupported = []
    if hf.get("sliding_window") is not None:
        unsupported.append(f"sliding_window={hf['sliding_window']} (maxlm's attention is full causal)")
    return mapped, unsupported


def model_config_from_hf(hf: dict) -> tuple[dict, list[str]]:
    """({maxlm model key: value}, [features maxlm's model cannot represent]) of an HF config."""
    required = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size",
                "vocab_size")
    if missing := [key for key in required if not isinstance(hf.get(key), int)]:
        raise config_lib.ConfigError(f"config.json lacks {', '.join(missing)} "
                                     f"(is it a {' or '.join(a.hf_class for a in ARCHITECTURES.values())} config?)")
    heads = hf["num_attention_heads"]
    theta, rope_type = _rope(hf)
    mapped = {
        "num_layers": hf["num_hidden_layers"],
        "d_model": hf["hidden_size"],
        "num_heads": heads,
        "num_kv_heads": hf.get("num_key_value_heads") or heads,
        "head_dim": hf.get("head_dim") or hf["hidden_size"] // heads,
        "mlp_dim": hf["intermediate_size"],
        "vocab_size": hf["vocab_size"],
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "rope_theta": theta,
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
    }
    unsupported = []
    model_type = hf.get("model_type", "llama")
    arch = ARCHITECTURES.get(model_type)
    archs = hf.get("architectures") or [arch.hf_class if arch else "?"]
    if arch is None or arch.hf_class not in archs:
        known = ", ".join(f"{a.model_type!r} ({a.hf_class})" for a in ARCHITECTURES.values())
        unsupported.append(f"model_type={model_type!r} architectures={archs} (maxlm reads {known})")
    elif arch is MIXTRAL:
        moe_keys, moe_unsupported = _mixtral_keys(hf)
        del mapped["mlp_dim"]  # Mixtral's intermediate_size is its experts'; it has no dense MLP
        mapped.update(moe_keys)
        unsupported += moe_unsupported
    else:
        mapped["num_experts"] = 0
    if rope_type != "default":
        unsupported.append(f"rope type {rope_type!r} (maxlm has plain RoPE only, no rope scaling)")
    if hf.get("hidden_act", "silu") != "silu":
        unsupported.append(f"hidden_act={hf['hidden_act']!r} (maxlm's MLP is SwiGLU: silu)")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key, False):
            unsupported.append(f"{key}=true (maxlm's layers have no biases)")
    return mapped, unsupported


def _same(a, b) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return bool(a) == bool(b)
    if isinstance(a, float) or isinstance(b, float):
        return math.isclose(float(a), float(b), rel_tol=1e-9)
    return a == b


def check_config(hf: dict, model_cfg, source: str) -> None:
    """Raises ConfigError listing every model key where the run differs from the HF config (with
    the value to set) and every HF feature maxlm cannot represent."""
    try:
        mapped, unsupported = model_config_from_hf(hf)
    except config_lib.ConfigError as e:
        raise config_lib.ConfigError(f"checkpoint.init_from_hf={source}: {e}") from None
    diffs = [f"model.{key}={model_cfg[key]!r} but the checkpoint has {value!r}"
             for key, value in mapped.items() if not _same(model_cfg[key], value)]
    if diffs or unsupported:
        fix = " ".join(f"--config.model.{k}={v}" for k, v in mapped.items()
                       if not _same(model_cfg[k], v))
        parts = diffs + [f"unsupported: {u}" for u in unsupported]
        raise config_lib.ConfigError(
            f"checkpoint.init_from_hf={source} does not match the run: " + "; ".join(parts)
            + (f" (set {fix})" if fix and not unsupported else ""))
