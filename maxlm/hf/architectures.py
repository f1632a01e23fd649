"""Which transformers class holds a maxlm model.

    arch = architecture(model_cfg, "the Hugging Face export")   # or one ConfigError line

The class follows from the model config's block (the config.json of each, both ways:
`maxlm/hf/config_json.py`; the weights' names: `maxlm/hf/mapping.py`):

    model.norm_placement, model.qk_norm    dense class                 mixture of experts
    pre, none                              LlamaForCausalLM            MixtralForCausalLM
    pre, per_head                          Qwen3ForCausalLM            Qwen3MoeForCausalLM
    post, full                             Olmo2ForCausalLM
    sandwich, none                         Gemma2ForCausalLM
    sandwich, per_head                     Gemma3ForCausalLM
    pre, none, attention_kind=mla          DeepseekV3ForCausalLM (dense, or mixture of experts after
                                           its first dense layers)

and where the sliding window goes (`window_layout`): on every layer, a dense Llama-shaped model is
MistralForCausalLM (Mixtral holds one too); with a `model.layer_pattern` of local and global
layers (transformers' `layer_types`), an OLMo 2-shaped one is Olmo3ForCausalLM, and the Gemma
classes hold any layout. The Gemma classes have Gemma's pieces (GeGLU, norms scaling by 1 + w,
embeddings by √d_model) and no other class has them; only they cap logits (Gemma 2 the attention
scores too). GPT2LMHeadModel holds the GPT-style model: learned positions, LayerNorm, GeLU,
biases (`gpt2_refusals`); every other class has RoPE, RMSNorm and no biases.

A key the class cannot hold is refused with one line naming it (`architecture`).
"""

from __future__ import annotations

from typing import NamedTuple

from maxlm import config as config_lib

# where a model's sliding window goes (`window_layout`)
NO_WINDOW, EVERY_LAYER, PATTERN = "none", "every layer", "pattern"
ANY_WINDOW = (NO_WINDOW, EVERY_LAYER, PATTERN)
LAYOUT_WORDS = {NO_WINDOW: "no sliding window", EVERY_LAYER: "a window on every layer",
                PATTERN: "local and global layers"}


class Arch(NamedTuple):
    """A transformers causal-LM class that holds maxlm models, as the mapping needs it."""

    hf_class: str  # config.json's `architectures`
    model_type: str
    qk_norm: str = "none"  # model.qk_norm: RMSNorm of queries and keys, self_attn.{q,k}_norm
    norm_placement: str = "pre"  # model.norm_placement
    windows: tuple[str, ...] = (NO_WINDOW,)  # the `window_layout`s it holds
    gemma: bool = False  # Gemma's GeGLU, (1 + w) norms and √d_model embedding scale, all required
    softcaps: tuple[str, ...] = ()  # the soft caps it applies: "attn" (scores), "final" (logits)
    local_rope: bool = False  # its local layers have their own RoPE (`rope_parameters` per layer type)
    tied: bool = False  # tie_word_embeddings when config.json is silent (the class's default)
    moe_block: str = ""  # an MoE layer's module name (its router is `{moe_block}.gate`); "" for a dense class
    expert_weights: tuple[str, str, str] = ()  # an expert's gate, up and down projections

    @property
    def name(self) -> str:
        return self.hf_class.removesuffix("ForCausalLM").removesuffix("LMHeadModel")


LLAMA = Arch("LlamaForCausalLM", "llama")
MISTRAL = Arch("MistralForCausalLM", "mistral", windows=(EVERY_LAYER,))
GPT2 = Arch("GPT2LMHeadModel", "gpt2", tied=True)  # learned positions, LayerNorm, GeLU, biases: `gpt2_refusals`
QWEN3 = Arch("Qwen3ForCausalLM", "qwen3", qk_norm="per_head")
OLMO2 = Arch("Olmo2ForCausalLM", "olmo2", qk_norm="full", norm_placement="post")
OLMO3 = Arch("Olmo3ForCausalLM", "olmo3", qk_norm="full", norm_placement="post", windows=(EVERY_LAYER, PATTERN),
             local_rope=True)
GEMMA2 = Arch("Gemma2ForCausalLM", "gemma2", norm_placement="sandwich", windows=ANY_WINDOW, gemma=True,
              softcaps=("attn", "final"), tied=True)
# Gemma 3's config has attn_logit_softcapping, which its attention does not read (transformers 5)
GEMMA3 = Arch("Gemma3ForCausalLM", "gemma3_text", qk_norm="per_head", norm_placement="sandwich", windows=ANY_WINDOW,
              gemma=True, softcaps=("final",), local_rope=True, tied=True)
MIXTRAL = Arch("MixtralForCausalLM", "mixtral", moe_block="block_sparse_moe", expert_weights=("w1", "w3", "w2"),
               windows=(NO_WINDOW, EVERY_LAYER))
QWEN3_MOE = Arch("Qwen3MoeForCausalLM", "qwen3_moe", qk_norm="per_head", moe_block="mlp",
                 expert_weights=("gate_proj", "up_proj", "down_proj"))
# multi-head latent attention; its MoE layers (after first_k_dense_replace dense ones) route by
# sigmoid scores with a selection bias and shared experts
DEEPSEEK_V3 = Arch("DeepseekV3ForCausalLM", "deepseek_v3", moe_block="mlp",
                   expert_weights=("gate_proj", "up_proj", "down_proj"))
ARCHITECTURES = {a.model_type: a for a in (LLAMA, MISTRAL, QWEN3, OLMO2, OLMO3, GEMMA2, GEMMA3, GPT2, MIXTRAL,
                                           QWEN3_MOE, DEEPSEEK_V3)}
ROPE_CLASSES = [a for a in ARCHITECTURES.values() if a is not GPT2]
DENSE_CLASSES = [a for a in ROPE_CLASSES if not a.moe_block]


def window_layout(m) -> str:
    """Where the model `m`'s sliding window goes: nowhere, on every layer, or on the local layers
    of its `model.layer_pattern`."""
    return PATTERN if m.layer_pattern else EVERY_LAYER if m.sliding_window else NO_WINDOW


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
        (m.scale_embeddings, "model.scale_embeddings=False"),
        (m.attn_logit_softcap, f"model.attn_logit_softcap=0 (not {m.attn_logit_softcap:g})"),
        (m.final_logit_softcap, f"model.final_logit_softcap=0 (not {m.final_logit_softcap:g})"),
    ) if refused]


def block_refusals(arch: Arch, m) -> list[str]:
    """What of the model `m`'s block the class `arch` (a RoPE class) cannot hold, each with why."""
    name = arch.name
    gemma_pieces = [
        (m.mlp_activation == "geglu", f"model.mlp_activation={m.mlp_activation!r}", "GeGLU MLP"),
        (m.norm_plus_one, f"model.norm_plus_one={m.norm_plus_one}", "norms scaling by 1 + w"),
        (m.scale_embeddings, f"model.scale_embeddings={m.scale_embeddings}", "embeddings scaled by √d_model"),
    ]
    checks = [(has != arch.gemma, f"{key} ({name} {'has' if arch.gemma else 'has no'} {what})")
              for has, key, what in gemma_pieces]
    checks += [
        (m.attn_logit_softcap and "attn" not in arch.softcaps,
         f"model.attn_logit_softcap={m.attn_logit_softcap:g} ({name}'s attention does not cap its scores)"),
        (m.final_logit_softcap and "final" not in arch.softcaps,
         f"model.final_logit_softcap={m.final_logit_softcap:g} ({name} does not cap its logits)"),
        (window_layout(m) not in arch.windows,
         f"model.sliding_window={m.sliding_window} with model.layer_pattern={m.layer_pattern!r} ({name} holds "
         + " or ".join(LAYOUT_WORDS[layout] for layout in arch.windows) + ")"),
        (m.rope_theta_local and not arch.local_rope,
         f"model.rope_theta_local={m.rope_theta_local:g} ({name}'s layers share one RoPE)"),
        (m.attention_kind == "mla" and arch is not DEEPSEEK_V3,
         f"model.attention_kind='mla' ({name}'s attention is grouped-query)"),
        (arch in (OLMO2, OLMO3) and m.head_dim * m.num_heads != m.d_model,
         f"model.head_dim={m.head_dim} ({name}'s heads are d_model / num_heads = {m.d_model // m.num_heads} wide)"),
    ]
    return [why for refused, why in checks if refused]


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
    if m.positions == "sinusoidal":
        raise config_lib.ConfigError(
            f"{what} has no class for model.positions='sinusoidal': the transformers classes maxlm maps have RoPE "
            f"({', '.join(a.name for a in ROPE_CLASSES)}) or a learned table (GPT2)")
    if m.positions == "learned" or m.norm == "layernorm" or m.mlp_activation == "gelu" or m.use_bias:
        if refused := gpt2_refusals(m):  # a GPT-style model, or nothing
            raise config_lib.ConfigError(
                f"{what} maps model.positions={m.positions!r}, model.norm={m.norm!r}, model.mlp_activation="
                f"{m.mlp_activation!r} and model.use_bias={m.use_bias} to GPT2LMHeadModel alone (the other classes "
                f"have RoPE, RMSNorm, a gated MLP, no biases), which needs " + "; ".join(refused))
        return GPT2
    if m.qkv_bias:
        raise config_lib.ConfigError(f"{what} has no class for model.qkv_bias=True (Qwen2's biases; the classes "
                                     f"maxlm maps, {', '.join(a.name for a in ARCHITECTURES.values())}, have none)")
    if m.attention_kind == "mla":
        return _deepseek_architecture(m, what)
    if m.num_experts:
        return _moe_architecture(m, what)
    block = (m.qk_norm, m.norm_placement)
    candidates = [a for a in DENSE_CLASSES if (a.qk_norm, a.norm_placement) == block]
    if not candidates:
        pairs = [f"{a.norm_placement!r} with {a.qk_norm!r} ({a.name})" for a in DENSE_CLASSES if NO_WINDOW in a.windows]
        raise config_lib.ConfigError(
            f"{what} has no class for model.norm_placement={m.norm_placement!r} with model.qk_norm="
            f"{m.qk_norm!r}; it maps " + ", ".join(pairs))
    arch = next((a for a in candidates if window_layout(m) in a.windows), candidates[0])
    if refused := block_refusals(arch, m):
        raise config_lib.ConfigError(f"{what} maps model.norm_placement={m.norm_placement!r} with model.qk_norm="
                                     f"{m.qk_norm!r} to transformers' {arch.hf_class}, which cannot hold "
                                     + "; ".join(refused))
    return arch


def _deepseek_architecture(m, what: str) -> Arch:
    """DeepSeek-V3: Llama's pre-norm block with multi-head latent attention, its MoE layers routed
    as DeepSeek-V3 routes."""
    arch, name = DEEPSEEK_V3, DEEPSEEK_V3.name
    checks = [(m.norm_placement != "pre", f"model.norm_placement={m.norm_placement!r} ({name}'s norms are 'pre')")]
    if m.num_experts:
        checks += [
            (m.router != "sigmoid", f"model.router={m.router!r} ({name} scores experts by a sigmoid)"),
            (m.load_balance != "bias", f"model.load_balance={m.load_balance!r} ({name}'s router adds its "
                                       "e_score_correction_bias: 'bias')"),
            (not m.shared_experts, f"model.shared_experts=0 ({name}'s MoE layers have shared experts)"),
        ]
    refused = [why for bad, why in checks if bad] + block_refusals(arch, m)
    if refused:
        raise config_lib.ConfigError(f"{what} maps model.attention_kind='mla' to transformers' {arch.hf_class}, "
                                     "which cannot hold " + "; ".join(refused))
    return arch


def _moe_architecture(m, what: str) -> Arch:
    """Mixtral or Qwen3-MoE, by qk-norm; both pre-norm, Llama's block otherwise."""
    if m.norm_placement != "pre" or m.qk_norm == "full":
        raise config_lib.ConfigError(
            f"{what} maps a mixture-of-experts model with model.norm_placement='pre' and model.qk_norm "
            f"'none' (Mixtral) or 'per_head' (Qwen3-MoE), not norm_placement={m.norm_placement!r} with "
            f"qk_norm={m.qk_norm!r}")
    arch = QWEN3_MOE if m.qk_norm == "per_head" else MIXTRAL
    if refused := _moe_refusals(arch, m) + block_refusals(arch, m):
        raise config_lib.ConfigError(
            f"{what} maps a mixture-of-experts model to transformers' {arch.hf_class}, which cannot "
            f"hold " + "; ".join(refused))
    return arch
