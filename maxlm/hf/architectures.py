"""Which transformers class holds a maxlm model, and its `config.json` both ways.

    arch = architecture(model_cfg, "the Hugging Face export")   # or one ConfigError line
    hf_config(cfg, tokenizer, dtype)      # the export's config.json
    check_config(hf, model_cfg, source)   # an import's config.json against the run

The class follows from the model config:

                          model.qk_norm = none     model.qk_norm = per_head
    model.num_experts = 0   LlamaForCausalLM         Qwen3ForCausalLM
    model.num_experts > 0   MixtralForCausalLM       Qwen3MoeForCausalLM

and, with model.norm_placement = post and model.qk_norm = full (a dense model),
Olmo2ForCausalLM. Every other class has model.norm_placement = pre. A model.sliding_window
makes a dense Llama-shaped model MistralForCausalLM; Mixtral holds one too, the others none.
GPT2LMHeadModel holds the GPT-style model: learned positions, LayerNorm, GeLU, biases
(`gpt2_refusals`); every other class has RoPE, RMSNorm, SwiGLU and no biases.

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
    qk_norm: str = "none"  # model.qk_norm: RMSNorm of queries and keys, self_attn.{q,k}_norm
    norm_placement: str = "pre"  # model.norm_placement
    sliding_window: bool = False  # holds model.sliding_window (config.json's `sliding_window`)
    moe_block: str = ""  # an MoE layer's module name (its router is `{moe_block}.gate`); "" for a dense class
    expert_weights: tuple[str, str, str] = ()  # an expert's gate, up and down projections

    @property
    def name(self) -> str:
        return self.hf_class.removesuffix("ForCausalLM").removesuffix("LMHeadModel")


LLAMA = Arch("LlamaForCausalLM", "llama")
MISTRAL = Arch("MistralForCausalLM", "mistral", sliding_window=True)
GPT2 = Arch("GPT2LMHeadModel", "gpt2")  # learned positions, LayerNorm, GeLU, biases: `gpt2_refusals`
QWEN3 = Arch("Qwen3ForCausalLM", "qwen3", qk_norm="per_head")
OLMO2 = Arch("Olmo2ForCausalLM", "olmo2", qk_norm="full", norm_placement="post")
MIXTRAL = Arch("MixtralForCausalLM", "mixtral", moe_block="block_sparse_moe", expert_weights=("w1", "w3", "w2"),
               sliding_window=True)
QWEN3_MOE = Arch("Qwen3MoeForCausalLM", "qwen3_moe", qk_norm="per_head", moe_block="mlp",
                 expert_weights=("gate_proj", "up_proj", "down_proj"))
ARCHITECTURES = {a.model_type: a for a in (LLAMA, MISTRAL, QWEN3, OLMO2, GPT2, MIXTRAL, QWEN3_MOE)}
ROPE_CLASSES = [a for a in ARCHITECTURES.values() if a is not GPT2]


def gpt2_refusals(m) -> list[str]:
    """What keeps the model `m` from GPT-2's block, each with the value it needs."""
    return [why for refused, why in (
        (m.positions != "learned", f"model.positions='learned' (not {m.positions!r})"),
        (m.norm != "layernorm", f"model.norm='layernorm' (not {m.norm!r})"),
        (m.mlp_activation != "gelu", f"model.mlp_activation='gelu' (not {m.mlp_activation!r})"),
        (not m.use_bias, "model.use_bias=True"),
        (m.norm_placement != "pre", f"model.norm_placement='pre' (not {m.norm_placement!r})"),
        (m.qk_norm != "none", f"model.qk_norm='none' (not {m.qk_norm!r})"),
        (m.sliding_window, f"model.sliding_window=0 (not {m.sliding_window})"),
        (m.num_experts, f"model.num_experts=0 (not {m.num_experts})"),
        (m.num_kv_heads != m.num_heads, f"model.num_kv_heads=model.num_heads={m.num_heads} (not {m.num_kv_heads})"),
        (m.head_dim * m.num_heads != m.d_model, f"model.head_dim=d_model / num_heads={m.d_model // m.num_heads} "
                                               f"(not {m.head_dim})"),
    ) if refused]


def _moe_refusals(arch: Arch, m) -> list[str]:
    """The MoE keys the class has no place for, each with why."""
    name = arch.name
    checks = [
        (m.shared_experts, f"model.shared_experts={m.shared_experts} ({name} has no shared experts)"),
        (m.router != "softmax", f"model.router={m.router!r} ({name}'s router is a softmax over all experts)"),
        (m.router_groups, f"model.router_groups={m.router_groups} ({name} has no group-limited routing)"),
        (m.router_scale != 1, f"model.router_scale={m.router_scale} ({name} does not scale the gates)"),
        (m.load_balance == "bias", f"model.load_balance='bias' (the selection bias has no place in "
                                   f"{name}'s router)"),
        (m.sliding_window and not arch.sliding_window, f"model.sliding_window={m.sliding_window} ({name}'s "
                                                       "attention is full causal)"),
    ]
    if arch is MIXTRAL:  # Qwen3-MoE has both: mlp_only_layers, norm_topk_prob
        checks += [
            (m.first_dense_layers, f"model.first_dense_layers={m.first_dense_layers} (every Mixtral layer is "
                                   "an MoE layer)"),
            (not m.router_renormalize, "model.router_renormalize=False (Mixtral renormalises the top-k "
                                       "gates to sum 1)"),
        ]
    return [why for refused, why in checks if refused]


def architecture(m, what: str) -> Arch:
    """The class that holds the model `m`, or ConfigError naming every key it cannot hold (`what`
    is the export or the import, for the message)."""
    if m.final_logit_softcap:
        raise config_lib.ConfigError(
            f"{what} has no class for model.final_logit_softcap={m.final_logit_softcap:g} (Gemma 2's; the classes "
            f"maxlm maps, {', '.join(a.name for a in ARCHITECTURES.values())}, do not cap their logits)")
    if m.positions == "sinusoidal":
        raise config_lib.ConfigError(
            f"{what} has no class for model.positions='sinusoidal': the transformers classes maxlm maps have RoPE "
            f"({', '.join(a.name for a in ROPE_CLASSES)}) or a learned table (GPT2)")
    if (m.positions, m.norm, m.mlp_activation, m.use_bias) != ("rope", "rmsnorm", "swiglu", False):
        if refused := gpt2_refusals(m):  # a GPT-style model, or nothing
            raise config_lib.ConfigError(
                f"{what} maps model.positions={m.positions!r}, model.norm={m.norm!r}, model.mlp_activation="
                f"{m.mlp_activation!r} and model.use_bias={m.use_bias} to GPT2LMHeadModel alone (the other classes "
                f"have RoPE, RMSNorm, SwiGLU, no biases), which needs " + "; ".join(refused))
        return GPT2
    if m.qkv_bias:
        raise config_lib.ConfigError(f"{what} has no class for model.qkv_bias=True (Qwen2's biases; the classes "
                                     f"maxlm maps, {', '.join(a.name for a in ARCHITECTURES.values())}, have none)")
    dense = [a for a in ROPE_CLASSES if not a.moe_block]
    if not m.num_experts:
        for arch in dense:
            if (arch.qk_norm, arch.norm_placement, arch.sliding_window) == (m.qk_norm, m.norm_placement,
                                                                           bool(m.sliding_window)):
                return _checked_head_dim(arch, m, what)
        if m.sliding_window and (m.qk_norm, m.norm_placement) != ("none", "pre"):
            raise config_lib.ConfigError(
                f"{what} maps model.sliding_window={m.sliding_window} to Mistral (model.qk_norm='none', "
                f"model.norm_placement='pre') only, not with model.qk_norm={m.qk_norm!r}, "
                f"model.norm_placement={m.norm_placement!r}")
        raise config_lib.ConfigError(
            f"{what} has no class for model.norm_placement={m.norm_placement!r} with model.qk_norm="
            f"{m.qk_norm!r}; it maps " + ", ".join(
                f"{a.norm_placement!r} with {a.qk_norm!r} ({a.name})" for a in dense if not a.sliding_window))
    if m.norm_placement != "pre" or m.qk_norm == "full":
        raise config_lib.ConfigError(
            f"{what} maps a mixture-of-experts model with model.norm_placement='pre' and model.qk_norm "
            f"'none' (Mixtral) or 'per_head' (Qwen3-MoE), not norm_placement={m.norm_placement!r} with "
            f"qk_norm={m.qk_norm!r}")
    arch = QWEN3_MOE if m.qk_norm == "per_head" else MIXTRAL
    if refused := _moe_refusals(arch, m):
        raise config_lib.ConfigError(
            f"{what} maps a mixture-of-experts model to transformers' {arch.hf_class}, which cannot "
            f"hold " + "; ".join(refused))
    return arch


def _checked_head_dim(arch: Arch, m, what: str) -> Arch:
    """OLMo 2's config has no head_dim: its heads are d_model / num_heads wide."""
    if arch is OLMO2 and m.head_dim * m.num_heads != m.d_model:
        raise config_lib.ConfigError(
            f"{what} maps to {arch.hf_class}, whose heads are d_model / num_heads = "
            f"{m.d_model // m.num_heads} wide, not model.head_dim={m.head_dim}")
    return arch


# ----------------------------------------------------------------------------- export

# model.rope_scaling's parameters: {rope type: {transformers' rope_parameters name: maxlm model key}}
ROPE_PARAMETERS = {
    "llama3": {"factor": "rope_scaling_factor", "low_freq_factor": "rope_low_freq_factor",
               "high_freq_factor": "rope_high_freq_factor", "original_max_position_embeddings": "rope_original_max_len"},
    "yarn": {"factor": "rope_scaling_factor", "beta_fast": "rope_beta_fast", "beta_slow": "rope_beta_slow",
             "original_max_position_embeddings": "rope_original_max_len"},
}


def rope_scaling(m) -> dict:
    """transformers' `rope_type` and scaling parameters of `model.rope_scaling`."""
    if m.rope_scaling == "none":
        return {"rope_type": "default"}
    return {"rope_type": m.rope_scaling, **{name: m[key] for name, key in ROPE_PARAMETERS[m.rope_scaling].items()}}



def hf_config(cfg, tokenizer, dtype: str = "float32") -> dict:
    """The `config.json` of the class `architecture` picks, equal to the run's model.

    RoPE's base is written both as `rope_theta` (transformers 4.x) and in `rope_parameters`
    (5.x), its scaling both as `rope_scaling` (4.x) and in `rope_parameters`; the dtype as
    `torch_dtype` (4.x) and `dtype` (5.x).
    """
    m = cfg.model
    arch = architecture(m, "the Hugging Face export")
    if arch is GPT2:
        return _gpt2_config(m, tokenizer, dtype)
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
        "rope_parameters": {"rope_theta": m.rope_theta, **rope_scaling(m)},
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
    if m.rope_scaling != "none":  # transformers 4.x's place for it
        config["rope_scaling"] = rope_scaling(m)
    # read by transformers' training only, with output_router_logits=True
    aux_loss = m.load_balance_weight if m.load_balance == "aux_loss" else 0.0
    if arch is LLAMA:
        config.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    if arch is MISTRAL:
        config.update(sliding_window=m.sliding_window)
    if arch is OLMO2:
        config.update(attention_bias=False)
        del config["head_dim"]  # d_model / num_heads (`_checked_head_dim`)
    if arch in (QWEN3, QWEN3_MOE):
        config.update(attention_bias=False, use_sliding_window=False, sliding_window=None,
                      max_window_layers=m.num_layers)
    if arch is MIXTRAL:
        config.update(intermediate_size=m.expert_mlp_dim,  # Mixtral's only MLPs are its experts
                      num_local_experts=m.num_experts, num_experts_per_tok=m.experts_per_token,
                      sliding_window=m.sliding_window or None, router_jitter_noise=0.0, router_aux_loss_coef=aux_loss,
                      output_router_logits=False)
    if arch is QWEN3_MOE:  # intermediate_size: the dense layers' (mlp_only_layers)
        config.update(moe_intermediate_size=m.expert_mlp_dim, num_experts=m.num_experts,
                      num_experts_per_tok=m.experts_per_token, norm_topk_prob=bool(m.router_renormalize),
                      decoder_sparse_step=1, mlp_only_layers=list(range(m.first_dense_layers)),
                      router_aux_loss_coef=aux_loss, output_router_logits=False)
    return config


def _gpt2_config(m, tokenizer, dtype: str) -> dict:
    """GPT2Config's names; its attention scales by 1/sqrt(head_dim) and adds no per-layer factor."""
    return {
        "architectures": [GPT2.hf_class], "model_type": GPT2.model_type, "vocab_size": m.vocab_size,
        "n_positions": m.max_positions, "n_embd": m.d_model, "n_layer": m.num_layers, "n_head": m.num_heads,
        "n_inner": m.mlp_dim, "activation_function": "gelu_new", "layer_norm_epsilon": m.norm_eps,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "initializer_range": m.init_std,
        "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
        "tie_word_embeddings": bool(m.tie_embeddings), "use_cache": True, "torch_dtype": dtype, "dtype": dtype,
        "bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id,
    }


def _gpt2_keys(hf: dict) -> tuple[dict, list[str]]:
    """A GPT2Config as maxlm's keys (GPT2Config's defaults where it is silent), and what maxlm
    cannot represent."""
    d, heads = hf.get("n_embd", 768), hf.get("n_head", 12)
    mapped = {"num_layers": hf.get("n_layer", 12), "d_model": d, "num_heads": heads, "num_kv_heads": heads,
              "head_dim": d // heads, "mlp_dim": hf.get("n_inner") or 4 * d, "vocab_size": hf.get("vocab_size", 50257),
              "tie_embeddings": bool(hf.get("tie_word_embeddings", True)), "positions": "learned",
              "max_positions": hf.get("n_positions", 1024), "norm": "layernorm", "mlp_activation": "gelu",
              "use_bias": True, "qkv_bias": False, "norm_placement": "pre", "qk_norm": "none", "sliding_window": 0,
              "num_experts": 0, "norm_eps": float(hf.get("layer_norm_epsilon", 1e-5))}
    unsupported = [why for refused, why in (
        (hf.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"),
         f"activation_function={hf.get('activation_function')!r} (maxlm's GeLU is the tanh approximation)"),
        (hf.get("scale_attn_by_inverse_layer_idx"), "scale_attn_by_inverse_layer_idx=true"),
        (not hf.get("scale_attn_weights", True), "scale_attn_weights=false"),
    ) if refused]
    return mapped, unsupported


# ----------------------------------------------------------------------------- import


def _rope(hf: dict) -> tuple[dict, list[str]]:
    """({maxlm model key: value} of RoPE's base and scaling, [what maxlm cannot represent]) of an
    HF config, either layout (`rope_parameters`, or `rope_theta` + `rope_scaling`)."""
    params = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = params.get("rope_type") or params.get("type") or "default"
    mapped = {"rope_theta": float(theta), "rope_scaling": "none", "rope_scaling_factor": 0.0, "rope_original_max_len": 0}
    if kind == "default":
        return mapped, []
    if kind not in ROPE_PARAMETERS:
        return mapped, [f"rope type {kind!r} (maxlm scales RoPE by {' or '.join(ROPE_PARAMETERS)} only)"]
    defaults = {"beta_fast": 32.0, "beta_slow": 1.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": hf.get("max_position_embeddings")}
    mapped["rope_scaling"] = kind
    for name, key in ROPE_PARAMETERS[kind].items():
        value = params.get(name) or defaults.get(name)
        mapped[key] = int(value) if key == "rope_original_max_len" else float(value)
    # YaRN's variants that maxlm's (transformers' defaults) does not have
    unsupported = [f"{kind} {name}={params[name]!r} (maxlm's attention factor is 0.1·ln(factor) + 1, its "
                   "correction range truncated)" for name in ("attention_factor", "mscale", "mscale_all_dim", "truncate")
                   if params.get(name) is not None and not (name == "truncate" and params[name])]
    return mapped, unsupported


def _moe_keys(arch: Arch, hf: dict) -> tuple[dict, list[str]]:
    """An MoE class's keys as maxlm's (with the routing the class implies), and what maxlm cannot
    represent. Defaults: transformers' MixtralConfig's and Qwen3MoeConfig's."""
    implied = {"shared_experts": 0, "router": "softmax", "router_scale": 1.0, "router_groups": 0}
    if arch is MIXTRAL:  # its intermediate_size is its experts'; it has no dense MLP
        return {"num_experts": hf.get("num_local_experts", 8), "experts_per_token": hf.get("num_experts_per_tok", 2),
                "expert_mlp_dim": hf["intermediate_size"], "first_dense_layers": 0, "router_renormalize": True,
                **implied}, []
    # Qwen3-MoE: layer i is dense when in mlp_only_layers or off every decoder_sparse_step-th
    step, only = hf.get("decoder_sparse_step", 1), hf.get("mlp_only_layers") or []
    dense = [i for i in range(hf["num_hidden_layers"]) if i in only or (i + 1) % step]
    experts = hf.get("num_experts", hf.get("num_local_experts", 128))  # transformers 5 saves the latter
    mapped = {"num_experts": experts, "experts_per_token": hf.get("num_experts_per_tok", 8),
              "expert_mlp_dim": hf.get("moe_intermediate_size", 768), "first_dense_layers": len(dense),
              "router_renormalize": bool(hf.get("norm_topk_prob", False)), **implied}
    if dense:  # intermediate_size is the dense layers'
        mapped["mlp_dim"] = hf["intermediate_size"]
    if dense != list(range(len(dense))):
        return mapped, [f"dense layers {dense} (maxlm's dense layers are the first ones: mlp_only_layers="
                        "[0, ..., k-1], decoder_sparse_step=1)"]
    return mapped, []


def model_config_from_hf(hf: dict) -> tuple[dict, list[str]]:
    """({maxlm model key: value}, [features maxlm's model cannot represent]) of an HF config."""
    if hf.get("model_type") == GPT2.model_type:
        return _gpt2_keys(hf)
    required = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size",
                "vocab_size")
    if missing := [key for key in required if not isinstance(hf.get(key), int)]:
        raise config_lib.ConfigError(f"config.json lacks {', '.join(missing)} "
                                     f"(is it a {' or '.join(a.hf_class for a in ARCHITECTURES.values())} config?)")
    heads = hf["num_attention_heads"]
    rope, unsupported = _rope(hf)
    mapped = {
        "num_layers": hf["num_hidden_layers"],
        "d_model": hf["hidden_size"],
        "num_heads": heads,
        "num_kv_heads": hf.get("num_key_value_heads") or heads,
        "head_dim": hf.get("head_dim") or hf["hidden_size"] // heads,
        "mlp_dim": hf["intermediate_size"],
        "vocab_size": hf["vocab_size"],
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        **rope,
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "positions": "rope", "norm": "rmsnorm", "mlp_activation": "swiglu", "use_bias": False, "qkv_bias": False,
    }
    model_type = hf.get("model_type", "llama")
    arch = ARCHITECTURES.get(model_type)
    archs = hf.get("architectures") or [arch.hf_class if arch else "?"]
    if arch is None or arch.hf_class not in archs:
        known = ", ".join(f"{a.model_type!r} ({a.hf_class})" for a in ARCHITECTURES.values())
        unsupported.append(f"model_type={model_type!r} architectures={archs} (maxlm reads {known})")
    else:
        mapped["qk_norm"], mapped["norm_placement"] = arch.qk_norm, arch.norm_placement
        if arch.moe_block:
            moe_keys, moe_unsupported = _moe_keys(arch, hf)
            del mapped["mlp_dim"]  # back in moe_keys when the model has dense layers
            mapped.update(moe_keys)
            unsupported += moe_unsupported
        else:
            mapped["num_experts"] = 0
    window = hf.get("sliding_window") if hf.get("use_sliding_window", True) else None
    mapped["sliding_window"] = window or 0
    if window and not (arch and arch.sliding_window):
        unsupported.append(f"sliding_window={window} (maxlm maps a window only to and from Mistral and Mixtral)")
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
