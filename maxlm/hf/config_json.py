"""A transformers class's `config.json` both ways, for the class `architectures.architecture`
picks.

    hf_config(cfg, tokenizer, dtype)      # the export's config.json
    check_config(hf, model_cfg, source)   # an import's config.json against the run
    model_config_from_hf(hf)              # ({maxlm model key: value}, [what maxlm cannot represent])

Local and global layers are transformers' `layer_types` ("sliding_attention", "full_attention"),
the pattern being their shortest period; a class with RoPE per layer type (`Arch.local_rope`)
keeps the global layers' base and scaling under "full_attention" and the local layers' base
under "sliding_attention" (never scaled, as in maxlm). The Gemma classes scale the queries by
query_pre_attn_scalar^-1/2, which maxlm's 1/sqrt(head_dim) holds when the two are equal.
"""

from __future__ import annotations

import math

from maxlm import config as config_lib
from maxlm.hf.architectures import (
    ARCHITECTURES,
    DEEPSEEK_V3,
    EVERY_LAYER,
    GEMMA2,
    GEMMA3,
    GPT2,
    LLAMA,
    MISTRAL,
    MIXTRAL,
    OLMO2,
    OLMO3,
    QWEN3,
    QWEN3_MOE,
    Arch,
    architecture,
)
from maxlm.model import layer_stack

# ----------------------------------------------------------------------------- export

# model.rope_scaling's parameters: {rope type: {transformers' rope_parameters name: maxlm model key}}
ROPE_PARAMETERS = {
    "linear": {"factor": "rope_scaling_factor"},
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
    if arch.local_rope:  # the local layers' RoPE under their layer type; 4.x: rope_local_base_freq
        local_theta = m.rope_theta_local or m.rope_theta
        config["rope_parameters"] = {"full_attention": config["rope_parameters"],
                                     "sliding_attention": {"rope_type": "default", "rope_theta": local_theta}}
        config["rope_local_base_freq"] = local_theta
    if arch in (OLMO3, GEMMA2, GEMMA3):
        config.update(sliding_window=m.sliding_window or None, layer_types=layer_types(m))
    if arch.gemma:
        del config["hidden_act"]
        config.update(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=m.head_dim, attention_bias=False,
                      final_logit_softcapping=m.final_logit_softcap or None, use_bidirectional_attention=False)
        if "attn" in arch.softcaps:
            config["attn_logit_softcapping"] = m.attn_logit_softcap or None
    # read by transformers' training only, with output_router_logits=True
    aux_loss = m.load_balance_weight if m.load_balance == "aux_loss" else 0.0
    if arch is LLAMA:
        config.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    if arch is MISTRAL:
        config.update(sliding_window=m.sliding_window)
    if arch in (OLMO2, OLMO3):
        config.update(attention_bias=False)
        del config["head_dim"]  # d_model / num_heads (`architectures.block_refusals`)
    if arch in (QWEN3, QWEN3_MOE):
        config.update(attention_bias=False, use_sliding_window=False, sliding_window=None,
                      max_window_layers=m.num_layers)
    if arch is MIXTRAL:
        config.update(intermediate_size=m.expert_mlp_dim,  # Mixtral's only MLPs are its experts
                      num_local_experts=m.num_experts, num_experts_per_tok=m.experts_per_token,
                      sliding_window=m.sliding_window or None, router_jitter_noise=0.0, router_aux_loss_coef=aux_loss,
                      output_router_logits=False)
    if arch is DEEPSEEK_V3:
        config.update(_deepseek_config(m))
        del config["head_dim"]
    if arch is QWEN3_MOE:  # intermediate_size: the dense layers' (mlp_only_layers)
        config.update(moe_intermediate_size=m.expert_mlp_dim, num_experts=m.num_experts,
                      num_experts_per_tok=m.experts_per_token, norm_topk_prob=bool(m.router_renormalize),
                      decoder_sparse_step=1, mlp_only_layers=list(range(m.first_dense_layers)),
                      router_aux_loss_coef=aux_loss, output_router_logits=False)
    return config


def _deepseek_config(m) -> dict:
    """DeepseekV3Config's own keys: the latent attention's, and the MoE layers' after
    first_k_dense_replace dense ones (a dense model: every layer dense, the MoE keys placeholders
    no layer reads). Its heads' width is qk_nope_head_dim + qk_rope_head_dim (no head_dim key)."""
    moe = m.num_experts > 0
    return {
        "num_key_value_heads": m.num_heads, "q_lora_rank": m.q_lora_rank or None,
        "kv_lora_rank": m.kv_lora_rank, "qk_nope_head_dim": m.qk_nope_head_dim, "qk_rope_head_dim": m.qk_rope_head_dim,
        "v_head_dim": m.v_head_dim, "rope_interleave": True, "attention_bias": False,
        "first_k_dense_replace": m.first_dense_layers if moe else m.num_layers,
        "n_routed_experts": m.num_experts if moe else 1, "num_experts_per_tok": m.experts_per_token if moe else 1,
        "moe_intermediate_size": m.expert_mlp_dim if moe else m.mlp_dim, "n_shared_experts": m.shared_experts or 1,
        "routed_scaling_factor": m.router_scale, "norm_topk_prob": True,
        "n_group": m.router_groups or 1, "topk_group": m.router_topk_groups or 1,
    }


def layer_types(m) -> list[str]:
    """transformers' `layer_types` of the model `m`'s layers: local ones "sliding_attention"."""
    local = layer_stack.LOCAL if m.layer_pattern else (layer_stack.GLOBAL if m.sliding_window else "")
    return ["sliding_attention" if kind == local else "full_attention" for kind in layer_stack.kinds(m)]


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
    if arch is DEEPSEEK_V3:
        return _deepseek_moe_keys(hf)
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


def _deepseek_moe_keys(hf: dict) -> tuple[dict, list[str]]:
    """DeepSeek-V3's MoE layers (after first_k_dense_replace dense ones; none: a dense model) as
    maxlm's keys, with DeepseekV3Config's defaults."""
    layers, dense = hf["num_hidden_layers"], hf.get("first_k_dense_replace", 3)
    if dense >= layers:
        return {"num_experts": 0, "mlp_dim": hf["intermediate_size"]}, []
    groups = hf.get("n_group") or 1
    mapped = {"num_experts": hf.get("n_routed_experts", 256), "experts_per_token": hf.get("num_experts_per_tok", 8),
              "expert_mlp_dim": hf.get("moe_intermediate_size", 2048), "first_dense_layers": dense,
              "shared_experts": hf.get("n_shared_experts", 1), "router": "sigmoid", "load_balance": "bias",
              "router_scale": float(hf.get("routed_scaling_factor", 2.5)), "router_groups": groups if groups > 1 else 0,
              "router_topk_groups": hf.get("topk_group", 4) if groups > 1 else 0}
    if dense:  # intermediate_size is the dense layers'
        mapped["mlp_dim"] = hf["intermediate_size"]
    unsupported = [] if hf.get("norm_topk_prob", True) else [
        "norm_topk_prob=false (maxlm's sigmoid router normalises the chosen gates to sum 1)"]
    return mapped, unsupported


def _latent_keys(arch: Arch | None, hf: dict) -> tuple[dict, list[str]]:
    """model.attention_kind and, for DeepSeek-V3, its latent attention's keys (DeepseekV3Config's
    defaults), and what maxlm cannot represent."""
    if arch is not DEEPSEEK_V3:
        return {"attention_kind": "gqa"}, []
    heads = hf["num_attention_heads"]
    nope, rope = hf.get("qk_nope_head_dim", 128), hf.get("qk_rope_head_dim", 64)
    mapped = {"attention_kind": "mla", "q_lora_rank": hf.get("q_lora_rank", 1536) or 0,
              "kv_lora_rank": hf.get("kv_lora_rank", 512), "qk_nope_head_dim": nope, "qk_rope_head_dim": rope,
              "v_head_dim": hf.get("v_head_dim", 128), "head_dim": nope + rope, "num_kv_heads": heads}
    checks = [
        (not hf.get("rope_interleave", True), "rope_interleave=false (maxlm reads DeepSeek's interleaved RoPE dims)"),
        ((hf.get("num_key_value_heads") or heads) != heads,
         f"num_key_value_heads={hf.get('num_key_value_heads')} (maxlm's latent attention has a key and value per "
         f"head: {heads})"),
    ]
    return mapped, [why for bad, why in checks if bad]


def _layer_kinds(arch: Arch | None, hf: dict) -> str | None:
    """Each layer's kind (L: sliding, G: full) of a class with `layer_types`, from them or the
    class's default pattern; None for a class without them (one window on every layer, or none)."""
    if arch not in (OLMO3, GEMMA2, GEMMA3):
        return None
    n, types = hf["num_hidden_layers"], hf.get("layer_types")
    if not types:
        every = {GEMMA2: 2, GEMMA3: hf.get("sliding_window_pattern", 6), OLMO3: 4}[arch]
        types = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n)]
    return "".join(layer_stack.LOCAL if t == "sliding_attention" else layer_stack.GLOBAL for t in types)


def _window_keys(arch: Arch | None, hf: dict) -> tuple[dict, list[str]]:
    """model.sliding_window and model.layer_pattern (the shortest period of the layer kinds), and
    what maxlm cannot represent."""
    window = (hf.get("sliding_window") if hf.get("use_sliding_window", True) else None) or 0
    kinds = _layer_kinds(arch, hf)
    if kinds is None:
        unsupported = [f"sliding_window={window} (maxlm maps a window on every layer only to and from "
                       f"{', '.join(a.name for a in ARCHITECTURES.values() if EVERY_LAYER in a.windows)})"] \
            if window and not (arch and EVERY_LAYER in arch.windows) else []
        return {"sliding_window": window, "layer_pattern": ""}, unsupported
    if set(kinds) - {layer_stack.LOCAL, layer_stack.GLOBAL} or len(kinds) != hf["num_hidden_layers"]:
        return {}, [f"layer_types={hf.get('layer_types')} (maxlm's layers are sliding_attention or full_attention, "
                    "one per layer)"]
    if layer_stack.LOCAL not in kinds or not window:
        return {"sliding_window": 0, "layer_pattern": ""}, []
    if layer_stack.GLOBAL not in kinds:
        return {"sliding_window": window, "layer_pattern": ""}, []
    return {"sliding_window": window, "layer_pattern": kinds[:layer_stack.period(kinds)]}, []


# RoPE bases of a class's layer types when its config.json is silent: (full_attention's, sliding's)
DEFAULT_THETAS = {GEMMA3: (1e6, 1e4), OLMO3: (5e5, 5e5), GEMMA2: (1e4, 1e4)}


def _rope_keys(arch: Arch | None, hf: dict, windows: dict) -> tuple[dict, list[str]]:
    """RoPE's keys: `_rope`'s, and for a class with RoPE per layer type the global layers' from
    "full_attention" (4.x: the flat keys) and the local layers' base from "sliding_attention"
    (4.x: rope_local_base_freq) as model.rope_theta_local, or as model.rope_theta when every
    layer is local."""
    if not (arch and arch.local_rope):
        rope, unsupported = _rope({**hf, "rope_theta": hf.get("rope_theta", DEFAULT_THETAS.get(arch, (1e4,))[0])})
        return {**rope, "rope_theta_local": 0.0}, unsupported
    full_theta, local_theta = DEFAULT_THETAS[arch]
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full, sliding = dict(params.get("full_attention") or {}), dict(params.get("sliding_attention") or {})
    else:
        full = {**(hf.get("rope_scaling") or {}), **params}
        full.setdefault("rope_theta", hf.get("rope_theta", full_theta))
        sliding = {"rope_type": "default", "rope_theta": hf.get("rope_local_base_freq", local_theta)}
    full.setdefault("rope_theta", full_theta)
    sliding.setdefault("rope_theta", local_theta)
    rope, unsupported = _rope({"rope_parameters": full, "max_position_embeddings": hf.get("max_position_embeddings")})
    if (sliding.get("rope_type") or sliding.get("type") or "default") != "default":
        unsupported.append(f"sliding_attention rope type {sliding.get('rope_type')!r} (maxlm's local layers are "
                           "never scaled)")
    local = float(sliding["rope_theta"])
    rope["rope_theta_local"] = 0.0
    if windows.get("layer_pattern") and local != rope["rope_theta"]:
        rope["rope_theta_local"] = local
    elif windows.get("sliding_window") and not windows.get("layer_pattern"):  # every layer local: their RoPE
        rope.update(rope_theta=local, rope_scaling="none", rope_scaling_factor=0.0, rope_original_max_len=0)
    return rope, unsupported


def _gemma_keys(arch: Arch | None, hf: dict, head_dim: int) -> tuple[dict, list[str]]:
    """Gemma's pieces (all or none) and the soft caps the class applies, with transformers'
    defaults (Gemma 2 caps at 50 and 30 when silent), and what maxlm cannot represent."""
    if not (arch and arch.gemma):
        unsupported = [f"hidden_act={hf['hidden_act']!r} (maxlm's gated MLP is SwiGLU: silu, or Gemma's GeGLU)"] \
            if hf.get("hidden_act", "silu") != "silu" else []
        return {"mlp_activation": "swiglu", "norm_plus_one": False, "scale_embeddings": False,
                "attn_logit_softcap": 0.0, "final_logit_softcap": 0.0}, unsupported
    default_cap = 30.0 if arch is GEMMA2 else None
    mapped = {"mlp_activation": "geglu", "norm_plus_one": True, "scale_embeddings": True,
              "final_logit_softcap": float(hf.get("final_logit_softcapping", default_cap) or 0.0),
              "attn_logit_softcap": float(hf.get("attn_logit_softcapping", 50.0) or 0.0) if arch is GEMMA2 else 0.0}
    activation = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    checks = [
        (activation not in ("gelu_pytorch_tanh", "gelu_new"),
         f"hidden_activation={activation!r} (maxlm's GeGLU gates with the tanh GeLU)"),
        (hf.get("query_pre_attn_scalar", 256) != head_dim,
         f"query_pre_attn_scalar={hf.get('query_pre_attn_scalar', 256)} (maxlm scales the scores by "
         f"1/sqrt(head_dim={head_dim}))"),
        (hf.get("use_bidirectional_attention"), "use_bidirectional_attention=true (maxlm's attention is causal)"),
    ]
    return mapped, [why for refused, why in checks if refused]


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
    model_type = hf.get("model_type", "llama")
    arch = ARCHITECTURES.get(model_type)
    archs = hf.get("architectures") or [arch.hf_class if arch else "?"]
    unsupported = []
    if arch is None or arch.hf_class not in archs:
        known = ", ".join(f"{a.model_type!r} ({a.hf_class})" for a in ARCHITECTURES.values())
        unsupported.append(f"model_type={model_type!r} architectures={archs} (maxlm reads {known})")
        arch = None
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    windows, window_unsupported = _window_keys(arch, hf)
    rope, rope_unsupported = _rope_keys(arch, hf, windows)
    gemma, gemma_unsupported = _gemma_keys(arch, hf, head_dim)
    latent, latent_unsupported = _latent_keys(arch, hf)
    mapped = {
        "num_layers": hf["num_hidden_layers"],
        "d_model": hf["hidden_size"],
        "num_heads": heads,
        "num_kv_heads": hf.get("num_key_value_heads") or heads,
        "head_dim": head_dim,
        "mlp_dim": hf["intermediate_size"],
        "vocab_size": hf["vocab_size"],
        "tie_embeddings": bool(hf.get("tie_word_embeddings", arch.tied if arch else False)),
        **rope,
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "positions": "rope", "norm": "rmsnorm", "use_bias": False, "qkv_bias": False,
        **windows, **gemma, **latent,
    }
    unsupported += rope_unsupported + window_unsupported + gemma_unsupported + latent_unsupported
    if arch is not None:
        mapped["qk_norm"], mapped["norm_placement"] = arch.qk_norm, arch.norm_placement
        if arch.moe_block:
            moe_keys, moe_unsupported = _moe_keys(arch, hf)
            del mapped["mlp_dim"]  # back in moe_keys when the model has dense layers
            mapped.update(moe_keys)
            unsupported += moe_unsupported
        else:
            mapped["num_experts"] = 0
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


def check_config(hf: dict, model_cfg, source: str, seq_len: int = 0) -> None:
    """Raises ConfigError listing every model key where the run differs from the HF config (with
    the value to set) and every HF feature maxlm cannot represent. A window on every layer that is
    at least the run's `seq_len` (Mistral 7B v0.1's 4096 at seq_len 4096) hides no key there: the
    run has none (model.sliding_window=0, which the config asks for at that length)."""
    try:
        mapped, unsupported = model_config_from_hf(hf)
    except config_lib.ConfigError as e:
        raise config_lib.ConfigError(f"checkpoint.init_from_hf={source}: {e}") from None
    if seq_len and not mapped.get("layer_pattern") and mapped.get("sliding_window", 0) >= seq_len:
        mapped["sliding_window"] = 0
    diffs = [f"model.{key}={model_cfg[key]!r} but the checkpoint has {value!r}"
             for key, value in mapped.items() if not _same(model_cfg[key], value)]
    if diffs or unsupported:
        fix = " ".join(f"--config.model.{k}={v}" for k, v in mapped.items()
                       if not _same(model_cfg[k], v))
        parts = diffs + [f"unsupported: {u}" for u in unsupported]
        raise config_lib.ConfigError(
            f"checkpoint.init_from_hf={source} does not match the run: " + "; ".join(parts)
            + (f" (set {fix})" if fix and not unsupported else ""))
