"""Hugging Face Llama ↔ maxlm: the weight and config mapping, the exporter and the importer.

maxlm's model is the Llama architecture (pre-norm RMSNorm, RoPE, SwiGLU, grouped-query attention,
no biases), so a run converts to `transformers.LlamaForCausalLM` without custom code:

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
them. Export reshapes one layer's array at a time on the host; import reads only the rows and
columns of a tensor that one device's shard needs (`_read_block`) from the lazily opened
(memory-mapped) safetensors files, through `jax.make_array_from_callback`, so no device and no
host ever holds more than a shard of a parameter (times the layers of a scanned one).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import shutil
import sys
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from maxlm import config as config_lib, model

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
DTYPES = ("float32", "bfloat16")  # export dtypes (`--dtype`)
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30  # transformers' own default for save_pretrained shards
_FLOAT_DTYPES = ("F32", "BF16", "F16")


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


def _sources(m, params) -> list[tuple[tuple[str, ...], str, Tensor]]:
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


def _read_block(hf_slice, tensor: Tensor, index: tuple[slice, ...]) -> np.ndarray:
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


def read_dir(path: str) -> tuple[dict, dict[str, str]]:
    """(config.json, {tensor name: safetensors file}) of a local HF checkpoint folder: one
    `model.safetensors` or shards listed in `model.safetensors.index.json`."""
    path = os.path.expanduser(path)
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise config_lib.ConfigError(
            f"checkpoint.init_from_hf={path}: no config.json there (a local Hugging Face Llama "
            "folder with config.json and model.safetensors or a safetensors index is needed)")
    try:
        hf = json.loads(open(config_path).read())
    except ValueError as e:
        raise config_lib.ConfigError(f"{config_path} is not valid JSON ({e})") from None
    index_path = os.path.join(path, INDEX)
    if os.path.isfile(index_path):
        weight_map = json.loads(open(index_path).read())["weight_map"]
    elif os.path.isfile(os.path.join(path, WEIGHTS)):
        from safetensors import safe_open

        with safe_open(os.path.join(path, WEIGHTS), framework="numpy") as f:
            weight_map = {name: WEIGHTS for name in f.keys()}
    else:
        raise config_lib.ConfigError(
            f"checkpoint.init_from_hf={path}: neither {WEIGHTS} nor {INDEX} there "
            "(only safetensors checkpoints are read, not pytorch_model.bin)")
    missing = sorted({f for f in weight_map.values() if not os.path.isfile(os.path.join(path, f))})
    if missing:
        raise config_lib.ConfigError(f"checkpoint.init_from_hf={path}: {INDEX} lists missing "
                                     f"files {', '.join(missing)}")
    return hf, weight_map


@contextlib.contextmanager
def _open(path: str, weight_map: dict[str, str]):
    """{tensor name: safetensors slice}, memory-mapped (nothing is read until sliced)."""
    from safetensors import safe_open

    with contextlib.ExitStack() as stack:
        files = {f: stack.enter_context(safe_open(os.path.join(path, f), framework="numpy"))
                 for f in sorted(set(weight_map.values()))}
        yield {name: files[f].get_slice(name) for name, f in weight_map.items()}


def check_weights(path: str, weight_map: dict[str, str], model_cfg) -> None:
    """Raises ConfigError naming the tensors the model needs that are missing, have another
    shape or are not floating point (reads only the files' headers)."""
    problems = []
    with _open(os.path.expanduser(path), weight_map) as slices:
        for name, tensor in hf_tensors(model_cfg).items():
            if name not in slices:
                problems.append(f"{name} missing")
                continue
            shape, dtype = tuple(slices[name].get_shape()), slices[name].get_dtype()
            if shape != tensor.hf_shape:
                problems.append(f"{name} has shape {list(shape)}, expected {list(tensor.hf_shape)}")
            elif dtype not in _FLOAT_DTYPES:
                problems.append(f"{name} has dtype {dtype}, expected one of {_FLOAT_DTYPES}")
    if problems:
        more = f" (and {len(problems) - 8} more)" if len(problems) > 8 else ""
        raise config_lib.ConfigError(
            f"checkpoint.init_from_hf={path}: the weights do not fit the model: "
            + "; ".join(problems[:8]) + more)


def check_init_from_hf(cfg, workdir: str | None = None) -> None:
    """Before training: `checkpoint.init_from_hf`'s folder against the run's config (ConfigError,
    exit 2). Skipped when `workdir` already has a checkpoint: resuming wins, as with restore_from."""
    from maxlm import checkpoint

    ckpt = cfg.checkpoint
    if not ckpt.get("init_from_hf"):
        return
    if ckpt.restore_from:
        raise config_lib.ConfigError(
            f"checkpoint.init_from_hf={ckpt.init_from_hf} and checkpoint.restore_from="
            f"{ckpt.restore_from} are both set; a run starts from one of them")
    if workdir is not None and checkpoint.step_dirs(checkpoint.checkpoint_dir(workdir))["complete"]:
        return
    hf, weight_map = read_dir(ckpt.init_from_hf)
    check_config(hf, cfg.model, ckpt.init_from_hf)
    check_weights(ckpt.init_from_hf, weight_map, cfg.model)


# ----------------------------------------------------------------------------- import


def load_params(path: str, model_cfg, shardings):
    """The parameters of the HF checkpoint at `path` as maxlm's pytree of float32 jax.Arrays with
    `shardings` (a pytree of NamedShardings like `init_params`'s output), built shard by shard:
    each device receives only its own block, read from the memory-mapped files.

    Raises ConfigError when the checkpoint does not match `model_cfg`.
    """
    path = os.path.expanduser(path)
    hf, weight_map = read_dir(path)
    check_config(hf, model_cfg, path)
    check_weights(path, weight_map, model_cfg)
    shapes = jax.eval_shape(functools.partial(model.init_params, model_cfg), jax.random.key(0))
    flat_shardings = {tuple(k.key for k in p): s for p, s in
                      jax.tree_util.tree_flatten_with_path(shardings)[0]}
    out: dict[str, Any] = {}
    with _open(path, weight_map) as slices:
        for keys, name, tensor in _sources(model_cfg, shapes):
            shape = functools.reduce(lambda t, k: t[k], keys, shapes).shape
            if "{i}" in name:  # scanned: [layers, ...], each block one slice per layer

                def read(index, name=name, tensor=tensor):
                    layers = range(*index[0].indices(model_cfg.num_layers))
                    blocks = [_read_block(slices[name.format(i=i)], tensor, index[1:]) for i in layers]
                    return np.stack(blocks).astype(np.float32)
            else:

                def read(index, name=name, tensor=tensor):
                    return _read_block(slices[name], tensor, index).astype(np.float32)

            array = jax.make_array_from_callback(shape, flat_shardings[keys], read)
            node = out
            for k in keys[:-1]:
                node = node.setdefault(k, {})
            node[keys[-1]] = array
    return out


# ----------------------------------------------------------------------------- export


def _to_host(x) -> np.ndarray:
    """A (sharded) jax.Array on this host, gathered from every process's devices if need be."""
    if x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


@functools.partial(jax.jit, static_argnums=2)
def _layer_as(stacked, i, dtype):
    """Layer `i` of a scanned parameter in `dtype`, on the devices (nothing else is gathered)."""
    return stacked[i].astype(dtype)


def _arrays(model_cfg, params, dtype):
    """{HF name: (a thunk giving the host numpy tensor, Tensor, nbytes)}, in file order."""
    itemsize = jnp.dtype(dtype).itemsize
    found = {}
    for keys, name, tensor in _sources(model_cfg, params):
        leaf = functools.reduce(lambda t, k: t[k], keys, params)
        if "{i}" in name:
            for i in range(model_cfg.num_layers):
                found[name.format(i=i)] = (
                    functools.partial(lambda a, i: _to_host(_layer_as(a, i, dtype)), leaf, i), tensor)
        else:
            found[name] = (functools.partial(lambda a: _to_host(a.astype(dtype)), leaf), tensor)
    order = hf_tensors(model_cfg)
    return {n: (*found[n], math.prod(t.hf_shape) * itemsize) for n, t in order.items()}


def _shard_plan(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Tensor names split, in order, into files of at most `max_shard_bytes` (a larger tensor
    gets a file of its own)."""
    shards, current, total = [], [], 0
    for name, nbytes in sizes.items():
        if current and total + nbytes > max_shard_bytes:
            shards.append(current)
            current, total = [], 0
        current.append(name)
        total += nbytes
    return shards + [current] if current else shards


def write_weights(params, model_cfg, out: str, dtype: str = "float32",
                  max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list[str]:
    """Writes the parameters as HF tensors into `out` (process 0; every process must call it, as
    gathering a tensor sharded across processes is collective): `model.safetensors`, or
    `model-0000k-of-0000n.safetensors` shards plus `model.safetensors.index.json` when they exceed
    `max_shard_bytes`. A tensor is gathered to the host, converted and dropped one at a time, so
    the host holds at most one file's worth. Returns the files written."""
    from safetensors.numpy import save_file

    arrays = _arrays(model_cfg, params, jnp.dtype(dtype))
    plan = _shard_plan({n: a[2] for n, a in arrays.items()}, max_shard_bytes)
    names = [WEIGHTS] if len(plan) == 1 else [
        f"model-{k + 1:05d}-of-{len(plan):05d}.safetensors" for k in range(len(plan))]
    writer = jax.process_index() == 0
    for file, tensor_names in zip(names, plan):
        tensors = {}
        for name in tensor_names:
            thunk, tensor, _ = arrays[name]
            host = thunk()
            if writer:
                tensors[name] = to_hf(host, tensor)
            del host
        if writer:
            save_file(tensors, os.path.join(out, file), metadata={"format": "pt"})
        del tensors
    if len(plan) > 1 and writer:
        index = {"metadata": {"total_size": sum(a[2] for a in arrays.values())},
                 "weight_map": {n: f for f, ns in zip(names, plan) for n in ns}}
        _write_json(os.path.join(out, INDEX), index)
    return names + ([INDEX] if len(plan) > 1 else [])


def _write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=False)
        f.write("\n")


def _special(content: str) -> dict:
    return {"content": content, "special": True, "lstrip": False, "rstrip": False,
            "normalized": False, "single_word": False}


def write_tokenizer(tokenizer, out: str, seq_len: int) -> list[str]:
    """The tokenizer files transformers' `AutoTokenizer` loads.

    SentencePiece: the `.model` as `tokenizer.model` with a `LlamaTokenizer` config (bos added,
    eos not, as maxlm frames documents). Byte tokens: a `ByT5Tokenizer` config, whose byte ids are
    maxlm's (byte b = id b + 3) and whose special tokens are renamed to maxlm's pad 0, bos 1, eos 2
    (see the README for what it does differently: it appends eos instead of prepending bos).
    """
    from maxlm.data.tokenizer import ByteTokenizer

    if isinstance(tokenizer, ByteTokenizer):
        pieces = {"pad": "<pad>", "bos": "<s>", "eos": "</s>", "unk": "<unk>"}
        config = {
            "tokenizer_class": "ByT5Tokenizer",
            "extra_ids": 0,
            "added_tokens_decoder": {str(tokenizer.pad_id): _special(pieces["pad"]),
                                     str(tokenizer.bos_id): _special(pieces["bos"]),
                                     str(tokenizer.eos_id): _special(pieces["eos"])},
        }
        files = []
    else:
        import sentencepiece as spm

        shutil.copyfile(tokenizer.spec, os.path.join(out, "tokenizer.model"))
        sp = spm.SentencePieceProcessor(model_file=tokenizer.spec)
        pieces = {"pad": sp.id_to_piece(tokenizer.pad_id), "bos": sp.id_to_piece(tokenizer.bos_id),
                  "eos": sp.id_to_piece(tokenizer.eos_id), "unk": sp.id_to_piece(sp.unk_id())}
        config = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": True,
                  "add_eos_token": False, "legacy": True}
        files = ["tokenizer.model"]
    tokens = {f"{kind}_token": piece for kind, piece in pieces.items()}
    config.update(tokens, model_max_length=seq_len, clean_up_tokenization_spaces=False)
    _write_json(os.path.join(out, "tokenizer_config.json"), config)
    _write_json(os.path.join(out, "special_tokens_map.json"), tokens)
    return files + ["tokenizer_config.json", "special_tokens_map.json"]


def generation_config(cfg, tokenizer) -> dict:
    """bos/eos/pad for `generate`, and the untrained ids past the tokenizer's vocabulary (a
    vocab_size rounded up) suppressed, as maxlm's own sampler does."""
    config = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id,
              "pad_token_id": tokenizer.pad_id}
    if cfg.model.vocab_size > tokenizer.vocab_size:
        config["suppress_tokens"] = list(range(tokenizer.vocab_size, cfg.model.vocab_size))
    return config


def export(params, cfg, out: str, dtype: str = "float32",
           max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, tokenizer=None) -> list[str]:
    """Writes a transformers-loadable Llama folder of the run `cfg`'s `params` into `out` (a
    local directory, created; it must not already hold an export): config.json,
    generation_config.json, the safetensors weights in `dtype` and the tokenizer files. Every
    process calls it; process 0 writes. Returns the files' names."""
    from maxlm.data.tokenizer import load_tokenizer

    if dtype not in DTYPES:
        raise config_lib.ConfigError(f"--dtype={dtype!r}: expected one of {', '.join(DTYPES)}")
    out = os.path.expanduser(out)
    taken = [f for f in (WEIGHTS, INDEX, "config.json") if os.path.exists(os.path.join(out, f))]
    if taken:
        raise config_lib.ConfigError(f"--out={out} already holds an export ({', '.join(taken)}); "
                                     "choose another directory or remove it")
    tokenizer = tokenizer or load_tokenizer(cfg.data.tokenizer)
    m = cfg.model
    if m.d_model % m.num_heads and jax.process_index() == 0:
        print(f"maxlm: warning: model.d_model={m.d_model} is not divisible by model.num_heads="
              f"{m.num_heads}: the weights are right, but transformers' LlamaConfig rejects such "
              "a config", file=sys.stderr)
    if jax.process_index() == 0:
        os.makedirs(out, exist_ok=True)
    files = write_weights(params, m, out, dtype, max_shard_bytes)
    if jax.process_index() == 0:
        _write_json(os.path.join(out, "config.json"), hf_config(cfg, tokenizer, dtype))
        _write_json(os.path.join(out, "generation_config.json"), generation_config(cfg, tokenizer))
        files += ["config.json", "generation_config.json"] + write_tokenizer(tokenizer, out, cfg.seq_len)
    return files
