"""Hugging Face Llama ↔ maxlm: the weight and config mapping (the files are read and written in
`maxlm/hf/files.py`).

maxlm's model is the Llama architecture (pre-norm RMSNorm, RoPE, SwiGLU, grouped-query attention,
no biases), so a run converts to `transformers.LlamaForCausalLM` without custom code; a run with
other position encodings (`model.positions` sinusoidal or learned) does not (`require_llama`):

    maxlm parameter                      HF tensor (`model.layers.{i}.` prefix for a layer's)
    embed            [V, D]              model.embed_tokens.weight        [V, D]
    head             [D, V]              lm_head.weight                   [V, D]  (absent when tied)
    final_norm.scale [D]                 model.norm.weight                [D]
    attn_norm.scale  [D]                 input_layernorm.weight           [D]
    attn.wq          [D, H, Dh]          self_attn.q_proj.weight          [H·Dh, D]
    attn.wk, wv      [D, K, Dh]          self_attn.{k,v}_proj.weight      [K·Dh, D]
    attn.wo          [H, Dh, D]          self_attn.o_proj.weight          [D, H·Dh]
    mlp_norm.scale   [D]                 post_attention_layernorm.weight  [D]
    mlp.w_gate, w_up [D, F]              mlp.{gate,up}_proj.weight        [F, D]
    mlp.w_down       [F, D]              mlp.down_proj.weight             [D, F]

A layer's parameters are `layers` (scanned: a leading layer axis) or `layer_{i}` (unrolled). RoPE
needs no permutation: maxlm rotates the pairs (i, i + Dh/2), which is what HF's `rotate_half` does
(HF Llama checkpoints are stored in that layout; the tests compare logits with transformers').

Each HF tensor is described as its maxlm array seen through a reshape: the HF tensor's axes are
groups of maxlm dims (`q_proj`: [(H, Dh), (D,)]) and `perm` orders those dims as maxlm stores
them. `to_hf` converts one layer's array for export; `read_block` reads only the rows and columns
of an HF tensor that one device's shard needs, for import.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from maxlm import config as config_lib


class Tensor(NamedTuple):
    """How one HF tensor relates to a maxlm array (of one layer, for a layer's parameter)."""

    groups: tuple[tuple[int, ...], ...]  # the HF tensor's axes, each a group of maxlm-sized dims
    perm: tuple[int, ...]  # maxlm's array = the grouped dims (flattened) transposed by `perm`

    @property
    def hf_shape(self) -> tuple[int, ...]:
        return tuple(math.prod(g) for g in self.groups)


def _layer_tensors(m) -> dict[tuple[str, str], tuple[str, Tensor]]:
    """(maxlm module, parameter) in a block → (HF name within the layer, Tensor)."""
    D, H, K, Dh, F = m.d_model, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim
    return {
        ("attn_norm", "scale"): ("input_layernorm.weight", Tensor(((D,),), (0,))),
        ("attn", "wq"): ("self_attn.q_proj.weight", Tensor(((H, Dh), (D,)), (2, 0, 1))),
        ("attn", "wk"): ("self_attn.k_proj.weight", Tensor(((K, Dh), (D,)), (2, 0, 1))),
        ("attn", "wv"): ("self_attn.v_proj.weight", Tensor(((K, Dh), (D,)), (2, 0, 1))),
        ("attn", "wo"): ("self_attn.o_proj.weight", Tensor(((D,), (H, Dh)), (1, 2, 0))),
        ("mlp_norm", "scale"): ("post_attention_layernorm.weight", Tensor(((D,),), (0,))),
        ("mlp", "w_gate"): ("mlp.gate_proj.weight", Tensor(((F,), (D,)), (1, 0))),
        ("mlp", "w_up"): ("mlp.up_proj.weight", Tensor(((F,), (D,)), (1, 0))),
        ("mlp", "w_down"): ("mlp.down_proj.weight", Tensor(((D,), (F,)), (1, 0))),
    }


def _top_tensors(m) -> dict[tuple[str, ...], tuple[str, Tensor]]:
    """maxlm's parameters outside the blocks → (HF name, Tensor)."""
    D, V = m.d_model, m.vocab_size
    out = {("embed",): ("model.embed_tokens.weight", Tensor(((V,), (D,)), (0, 1))),
           ("final_norm", "scale"): ("model.norm.weight", Tensor(((D,),), (0,)))}
    if not m.tie_embeddings:
        out[("head",)] = ("lm_head.weight", Tensor(((V,), (D,)), (1, 0)))
    return out


def hf_tensors(m) -> dict[str, Tensor]:
    """Every HF tensor name of a model config, in file order, with its Tensor."""
    top = _top_tensors(m)
    out = {top[("embed",)][0]: top[("embed",)][1]}
    for i in range(m.num_layers):
        for name, tensor in _layer_tensors(m).values():
            out[f"model.layers.{i}.{name}"] = tensor
    for key, (name, tensor) in top.items():
        if key != ("embed",):
            out[name] = tensor
    return out


def sources(m, params) -> list[tuple[tuple[str, ...], str, Tensor]]:
    """[(maxlm path, HF name, Tensor)] for the leaves of a params tree (scanned or unrolled).

    A scanned parameter (`layers/...`, a leading layer axis) has a name with `{i}` for its
    layers; an unrolled one (`layer_{i}/...`) is one leaf per layer.
    """
    out = [(path, name, tensor) for path, (name, tensor) in _top_tensors(m).items()]
    for (module, param), (name, tensor) in _layer_tensors(m).items():
        if "layers" in params:
            out.append((("layers", module, param), "model.layers.{i}." + name, tensor))
        else:
            out += [((f"layer_{i}", module, param), f"model.layers.{i}.{name}", tensor)
                    for i in range(m.num_layers)]
    return out


def to_hf(array, tensor: Tensor) -> np.ndarray:
    """One maxlm array (one layer's) → the HF tensor (numpy, C-contiguous)."""
    array = np.asarray(array)
    nd = array.transpose(np.argsort(tensor.perm))
    return np.ascontiguousarray(nd.reshape(tensor.hf_shape))


def read_block(hf_slice, tensor: Tensor, index: tuple[slice, ...]) -> np.ndarray:
    """The block `index` (slices of maxlm's array, as jax.make_array_from_callback asks for them)
    of the HF tensor `hf_slice` (a safetensors slice, or any array), read without reading more
    than the block's rows × columns: each HF axis is read over the range its group's leading dim
    needs (the trailing dims of a group are whole in maxlm's shardings, e.g. head_dim)."""
    nd_shape = [n for group in tensor.groups for n in group]
    nd_index = [slice(None)] * len(nd_shape)
    for maxlm_axis, nd_axis in enumerate(tensor.perm):
        nd_index[nd_axis] = index[maxlm_axis]
    ranges = []
    for s, n in zip(nd_index, nd_shape):
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError(f"strided shard index {s} is not supported")
        ranges.append((start, stop))
    hf_index, block_shape, within = [], [], []
    k = 0
    for group in tensor.groups:
        inner = math.prod(group[1:])
        (start, stop), rest = ranges[k], ranges[k + 1:k + len(group)]
        hf_index.append(slice(start * inner, stop * inner))
        block_shape += [stop - start, *group[1:]]
        within += [slice(None), *(slice(a, b) for a, b in rest)]
        k += len(group)
    block = np.asarray(hf_slice[tuple(hf_index)]).reshape(block_shape)[tuple(within)]
    return block.transpose(tensor.perm)


# ----------------------------------------------------------------------------- config mapping


def require_llama(model_cfg, what: str) -> None:
    """ConfigError unless the model is one transformers' Llama can hold, so that `what` (an
    export, an import) can map it: positions by RoPE (`model.positions`; Llama has no other), and
    a dense MLP (the MoE classes, Mixtral's and Qwen3-MoE's, are not mapped yet)."""
    if model_cfg.num_experts:
        raise config_lib.ConfigError(
            f"{what} maps dense Llama models; this one has model.num_experts={model_cfg.num_experts} "
            "(mixture-of-experts export and import are not built yet)")
    if model_cfg.positions != "rope":
        raise config_lib.ConfigError(
            f"{what} needs model.positions='rope', got {model_cfg.positions!r}: transformers' Llama "
            "has only RoPE, no sinusoidal or learned position embeddings")


def hf_config(cfg, tokenizer, dtype: str = "float32") -> dict:
    """The `config.json` of a `LlamaForCausalLM` equal to the run's model.

    RoPE's base is written both as `rope_theta` (transformers 4.x) and in `rope_parameters`
    (5.x); the dtype as `torch_dtype` (4.x) and `dtype` (5.x).
    """
    m = cfg.model
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
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
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": m.init_std,
        "pretraining_tp": 1,
        "use_cache": True,
    }


def _rope(hf: dict) -> tuple[float, str]:
    """(theta, rope type) of an HF config, either layout (`rope_parameters` or `rope_theta` +
    `rope_scaling`)."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    kinds = [params.get("rope_type"), scaling.get("rope_type"), scaling.get("type")]
    return float(theta), next((k for k in kinds if k and k != "default"), "default")


def model_config_from_hf(hf: dict) -> tuple[dict, list[str]]:
    """({maxlm model key: value}, [features maxlm's model cannot represent]) of an HF config."""
    required = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size",
                "vocab_size")
    if missing := [key for key in required if not isinstance(hf.get(key), int)]:
        raise config_lib.ConfigError(f"config.json lacks {', '.join(missing)} "
                                     "(is it a Llama model's config?)")
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
    archs = hf.get("architectures") or ["LlamaForCausalLM"]
    if hf.get("model_type", "llama") != "llama" or "LlamaForCausalLM" not in archs:
        unsupported.append(f"model_type={hf.get('model_type')!r} architectures={archs} "
                           "(only Llama checkpoints: model_type 'llama', LlamaForCausalLM)")
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
