"""Hugging Face Llama files: export a run's parameters, import a Llama checkpoint's.

Export (`export`, `python -m maxlm.export`) writes what `transformers.LlamaForCausalLM` and
`AutoTokenizer` load with no custom code: config.json, generation_config.json, the safetensors
weights (sharded past a size, with an index) and the tokenizer files. Each tensor is gathered to
the host one layer at a time, converted (`hf_mapping.to_hf`) and written, so the host holds at most
one file's worth.

Import (`load_params`, the config key `checkpoint.init_from_hf`) checks the folder's config and
tensors against the run (one exit-2 line listing every mismatch), then builds each parameter with
`jax.make_array_from_callback`, every device reading only its own block (`hf_mapping.read_block`)
from the memory-mapped safetensors files: no device and no host ever holds more than a shard of a
parameter (times the layers of a scanned one). The mapping itself is in `maxlm/hf/mapping.py`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import shutil
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from maxlm import config as config_lib, console
from maxlm.hf.mapping import check_config, hf_config, hf_tensors, read_block, require_rope, sources, to_hf

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
DTYPES = ("float32", "bfloat16")  # export dtypes (`--dtype`)
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30  # transformers' own default for save_pretrained shards
_FLOAT_DTYPES = ("F32", "BF16", "F16")


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


def check_init_from_hf(cfg) -> None:
    """Before training a fresh workdir: `checkpoint.init_from_hf`'s folder against the run's config
    (ConfigError, exit 2). (A workdir with a checkpoint of its own resumes it instead.)"""
    ckpt = cfg.checkpoint
    if not ckpt.init_from_hf:
        return
    if ckpt.restore_from:
        raise config_lib.ConfigError(
            f"checkpoint.init_from_hf={ckpt.init_from_hf} and checkpoint.restore_from="
            f"{ckpt.restore_from} are both set; a run starts from one of them")
    require_rope(cfg.model, f"checkpoint.init_from_hf={ckpt.init_from_hf}")
    hf, weight_map = read_dir(ckpt.init_from_hf)
    check_config(hf, cfg.model, ckpt.init_from_hf)
    check_weights(ckpt.init_from_hf, weight_map, cfg.model)


# ----------------------------------------------------------------------------- import


def load_params(path: str, model_cfg, abstract_params):
    """The parameters of the HF checkpoint at `path` as maxlm's pytree of float32 jax.Arrays, with
    the shapes and shardings of `abstract_params` (`state.abstract_params(model_cfg, shardings)`),
    built shard by shard: each device receives only its own block, read from the memory-mapped
    files.

    Raises ConfigError when the checkpoint does not match `model_cfg`.
    """
    require_rope(model_cfg, f"checkpoint.init_from_hf={path}")
    path = os.path.expanduser(path)
    hf, weight_map = read_dir(path)
    check_config(hf, model_cfg, path)
    check_weights(path, weight_map, model_cfg)
    out: dict[str, Any] = {}
    with _open(path, weight_map) as slices:
        for keys, name, tensor in sources(model_cfg, abstract_params):
            target = functools.reduce(lambda t, k: t[k], keys, abstract_params)
            if "{i}" in name:  # scanned: [layers, ...], each block one slice per layer

                def read(index, name=name, tensor=tensor):
                    layers = range(*index[0].indices(model_cfg.num_layers))
                    blocks = [read_block(slices[name.format(i=i)], tensor, index[1:]) for i in layers]
                    return np.stack(blocks).astype(np.float32)
            else:

                def read(index, name=name, tensor=tensor):
                    return read_block(slices[name], tensor, index).astype(np.float32)

            array = jax.make_array_from_callback(target.shape, target.sharding, read)
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
    for keys, name, tensor in sources(model_cfg, params):
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
    require_rope(cfg.model, "the Hugging Face export")
    out = os.path.expanduser(out)
    taken = [f for f in (WEIGHTS, INDEX, "config.json") if os.path.exists(os.path.join(out, f))]
    if taken:
        raise config_lib.ConfigError(f"--out={out} already holds an export ({', '.join(taken)}); "
                                     "choose another directory or remove it")
    tokenizer = tokenizer or load_tokenizer(cfg.data.tokenizer)
    m = cfg.model
    if m.d_model % m.num_heads:
        console.warn(f"model.d_model={m.d_model} is not divisible by model.num_heads={m.num_heads}: "
                 "the weights are right, but transformers' LlamaConfig rejects such a config")
    if jax.process_index() == 0:
        os.makedirs(out, exist_ok=True)
    files = write_weights(params, m, out, dtype, max_shard_bytes)
    if jax.process_index() == 0:
        _write_json(os.path.join(out, "config.json"), hf_config(cfg, tokenizer, dtype))
        _write_json(os.path.join(out, "generation_config.json"), generation_config(cfg, tokenizer))
        files += ["config.json", "generation_config.json"] + write_tokenizer(tokenizer, out, cfg.seq_len)
    return files
