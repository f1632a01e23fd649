"""Hugging Face files: export a run's parameters, import a checkpoint's (the classes:
`maxlm/hf/architectures.py`).

Export (`export`, `python -m maxlm.export`) writes what transformers' causal-LM class of the run
(`maxlm/hf/architectures.py` picks it from the model config) and `AutoTokenizer` load with no
custom code: config.json, generation_config.json, the safetensors weights (sharded past a size,
with an index) and the tokenizer files (`maxlm/hf/tokenizer_files.py`). Each tensor is gathered
to the host one at a time (a layer's, an expert's), converted (`hf_mapping.to_hf`) and written,
so the host holds at most one file's worth.

Import (`load_params`, the config key `checkpoint.init_from_hf`) checks the folder's config and
tensors against the run (one exit-2 line listing every mismatch; process 0 checks, and every
process raises or goes on with it), then builds each parameter with
`jax.make_array_from_callback`, every device reading only its own block (`hf_mapping.read_block`)
from the memory-mapped safetensors files: no device and no host ever holds more than a shard of a
parameter (times the layers of a scanned one). A folder at a URL (`gs://bucket/llama`) is read
through etils.epath instead of memory-mapped: a block's rows are read whole, 64 MiB at a time, and
only its columns kept. The mapping itself is in `maxlm/hf/mapping.py`.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from etils import epath

from maxlm import config as config_lib
from maxlm.hf.architectures import architecture
from maxlm.hf.config_json import check_config, hf_config, model_config_from_hf
from maxlm.hf.mapping import hf_index, hf_tensors, read_block, sources, to_hf
from maxlm.hf.tokenizer_files import write_json, write_tokenizer
from maxlm.runtime import console, paths, processes

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
DTYPES = ("float32", "bfloat16")  # export dtypes (`--dtype`)
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30  # transformers' own default for save_pretrained shards
_FLOAT_DTYPES = ("F32", "BF16", "F16")
_NUMPY_DTYPES = {"F32": np.float32, "BF16": ml_dtypes.bfloat16, "F16": np.float16}
_CHUNK_BYTES = 64 << 20  # read at a time from a folder at a URL


def read_dir(path: str) -> tuple[dict, dict[str, str]]:
    """(config.json, {tensor name: safetensors file}) of a HF checkpoint folder (local, `~`
    expanded, or a URL such as `gs://bucket/llama`, read through epath): one `model.safetensors`
    or shards listed in `model.safetensors.index.json`. This process reads it (see `checked_dir`)."""
    path = os.path.expanduser(path)
    folder = epath.Path(path)
    if not (folder / "config.json").is_file():
        raise config_lib.ConfigError(
            f"checkpoint.init_from_hf={path}: no config.json there (a Hugging Face Llama, Qwen3, Mixtral or "
            "Qwen3-MoE folder, local or gs://, with config.json and model.safetensors or a safetensors index "
            "is needed)")
    try:
        hf = json.loads((folder / "config.json").read_text())
    except ValueError as e:
        raise config_lib.ConfigError(f"{folder / 'config.json'} is not valid JSON ({e})") from None
    if (folder / INDEX).is_file():
        weight_map = json.loads((folder / INDEX).read_text())["weight_map"]
    elif (folder / WEIGHTS).is_file():
        weight_map = {name: WEIGHTS for name in _header(folder / WEIGHTS)[0]}
    else:
        raise config_lib.ConfigError(
            f"checkpoint.init_from_hf={path}: neither {WEIGHTS} nor {INDEX} there "
            "(only safetensors checkpoints are read, not pytorch_model.bin)")
    missing = sorted(f for f in set(weight_map.values()) if not (folder / f).is_file())
    if missing:
        raise config_lib.ConfigError(f"checkpoint.init_from_hf={path}: {INDEX} lists missing "
                                     f"files {', '.join(missing)}")
    return hf, weight_map


def _header(file: epath.Path) -> tuple[dict, int]:
    """({tensor name: {dtype, shape, data_offsets}}, where the data starts) of a safetensors file:
    its JSON header, the only part read."""
    with file.open("rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header, 8 + size


def check_weights(path: str, weight_map: dict[str, str], model_cfg) -> None:
    """Raises ConfigError naming the tensors the model needs that are missing, have another
    shape or are not floating point (reads only the files' headers)."""
    folder = epath.Path(os.path.expanduser(path))
    headers = {f: _header(folder / f)[0] for f in sorted(set(weight_map.values()))}
    problems = []
    for name, tensor in hf_tensors(model_cfg).items():
        info = headers[weight_map[name]].get(name) if name in weight_map else None
        if info is None:
            problems.append(f"{name} missing")
            continue
        shape, dtype = tuple(info["shape"]), info["dtype"]
        if shape != tensor.hf_shape:
            problems.append(f"{name} has shape {list(shape)}, expected {list(tensor.hf_shape)}")
        elif dtype not in _FLOAT_DTYPES:
            problems.append(f"{name} has dtype {dtype}, expected one of {_FLOAT_DTYPES}")
    if problems:
        more = f" (and {len(problems) - 8} more)" if len(problems) > 8 else ""
        raise config_lib.ConfigError(
            f"checkpoint.init_from_hf={path}: the weights do not fit the model: "
            + "; ".join(problems[:8]) + more)


def checked_dir(path: str, model_cfg, seq_len: int = 0) -> dict[str, str]:
    """{tensor name: safetensors file} of the HF folder at `path`, checked against `model_cfg` at
    the run's `seq_len` (`config_json.check_config`; ConfigError) by process 0 alone: every process of the job calls this together, and all go on
    or raise together (a folder one host cannot see does not stop that one alone)."""

    def check() -> bytes:
        hf, weight_map = read_dir(path)
        check_config(hf, model_cfg, path, seq_len)
        check_weights(path, weight_map, model_cfg)
        return json.dumps(weight_map).encode()

    return json.loads(processes.from_process_0(check))


class _EpathFile:
    """A safetensors file read through epath (at a URL: nothing to memory-map), with safe_open's
    `get_slice`."""

    def __init__(self, file: epath.Path):
        self.file = file
        self.header, self.start = _header(file)

    def get_slice(self, name: str) -> _EpathSlice:
        return _EpathSlice(self, self.header[name])


class _EpathSlice:
    """One tensor of an `_EpathFile`: `[rows, columns]` reads only those rows, `_CHUNK_BYTES` at
    a time, and keeps only those columns."""

    def __init__(self, file: _EpathFile, info: dict):
        self.file, self.info = file, info

    def __getitem__(self, index: tuple[slice, ...]) -> np.ndarray:
        shape, dtype = self.info["shape"], np.dtype(_NUMPY_DTYPES[self.info["dtype"]])
        rows = range(*index[0].indices(shape[0]))
        row_bytes = math.prod(shape[1:]) * dtype.itemsize
        step = max(1, _CHUNK_BYTES // row_bytes)
        blocks = [np.empty((0, *shape[1:]), dtype)[(slice(None), *index[1:])]]
        with self.file.file.open("rb") as f:
            for first in range(rows.start, rows.stop, step):
                n = min(step, rows.stop - first)
                f.seek(self.file.start + self.info["data_offsets"][0] + first * row_bytes)
                block = np.frombuffer(f.read(n * row_bytes), dtype).reshape(n, *shape[1:])
                blocks.append(block[(slice(None), *index[1:])])
        return np.concatenate(blocks)


@contextlib.contextmanager
def _open(path: str, weight_map: dict[str, str]):
    """{tensor name: safetensors slice}: memory-mapped for a local folder, read through epath for a
    URL (nothing is read until sliced). Every process opens the files itself; one that cannot (a
    folder on process 0's host only) stops every process with a ConfigError."""
    from safetensors import safe_open

    with contextlib.ExitStack() as stack:
        files, problem = {}, None
        try:
            for f in sorted(set(weight_map.values())):
                if paths.is_remote(path):
                    files[f] = _EpathFile(epath.Path(path) / f)
                else:
                    files[f] = stack.enter_context(safe_open(os.path.join(path, f), framework="numpy"))
        except Exception as e:  # whatever stops this process must stop every process
            problem = f"{type(e).__name__}: {e}"
        if blind := processes.blind(problem is None):
            raise config_lib.ConfigError(
                f"checkpoint.init_from_hf={path} cannot be read by process(es) {', '.join(map(str, blind))} "
                f"of the job{f' ({problem})' if problem else ''}: put it on storage every host shares")
        yield {name: files[f].get_slice(name) for name, f in weight_map.items()}


def take_model_keys(cfg) -> dict:
    """`model.from_hf`: the model keys of `checkpoint.init_from_hf`'s config.json, set on
    `cfg.model` and returned, before the config is resolved. ConfigError (exit 2) without a folder,
    or where the folder's model holds what maxlm's cannot represent."""
    path = cfg.checkpoint.init_from_hf
    if not path:
        raise config_lib.ConfigError("model.from_hf=True takes the model keys from checkpoint.init_from_hf's "
                                     "config.json: set checkpoint.init_from_hf=PATH as well")
    hf, _ = read_dir(path)
    mapped, unsupported = model_config_from_hf(hf)
    if unsupported:
        raise config_lib.ConfigError(f"model.from_hf: {path}/config.json holds what maxlm's model cannot "
                                     f"represent: {'; '.join(unsupported)}")
    for name, value in mapped.items():
        cfg.model[name] = value
    return mapped


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
    architecture(cfg.model, f"checkpoint.init_from_hf={ckpt.init_from_hf}")
    if cfg.model.mtp_depth:
        raise config_lib.ConfigError(
            f"checkpoint.init_from_hf={ckpt.init_from_hf} with model.mtp_depth={cfg.model.mtp_depth}: a Llama "
            "checkpoint holds no multi-token prediction modules to start them from; set model.mtp_depth=0")
    path = os.path.expanduser(ckpt.init_from_hf)
    with _open(path, checked_dir(path, cfg.model, cfg.seq_len)):
        pass  # every process opens the weights now: one that cannot stops the job before it writes


# ----------------------------------------------------------------------------- import


def load_params(path: str, model_cfg, abstract_params, seq_len: int = 0):
    """The parameters of the HF checkpoint at `path` (checked against the run at `seq_len`: 0, the
    model config alone) as maxlm's pytree of float32 jax.Arrays, with
    the shapes and shardings of `abstract_params` (`state.abstract_params(model_cfg, shardings)`),
    built shard by shard: each device receives only its own block, read from the memory-mapped
    files.

    Raises ConfigError when the checkpoint does not match `model_cfg`.
    """
    architecture(model_cfg, f"checkpoint.init_from_hf={path}")
    path = os.path.expanduser(path)
    weight_map = checked_dir(path, model_cfg, seq_len)
    out: dict[str, Any] = {}
    with _open(path, weight_map) as slices:
        for source in sources(model_cfg, abstract_params):
            target = functools.reduce(lambda t, k: t[k], source.keys, abstract_params)

            def read(index, source=source):  # one HF tensor's block per layer and expert in `index`
                n = len(source.leading)
                ranges = [range(*s.indices(size)) for s, size in zip(index, source.leading)]
                blocks = [read_block(slices[source.hf_name(at)], source.tensor, index[n:])
                          for at in itertools.product(*ranges)]
                return np.stack(blocks).reshape(*map(len, ranges), *blocks[0].shape).astype(np.float32)

            array = jax.make_array_from_callback(target.shape, target.sharding, read)
            node = out
            for k in source.keys[:-1]:
                node = node.setdefault(k, {})
            node[source.keys[-1]] = array
    return out


# ----------------------------------------------------------------------------- export


def _to_host(x) -> np.ndarray:
    """A (sharded) jax.Array on this host, gathered from every process's devices if need be."""
    if x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


@functools.partial(jax.jit, static_argnums=2)
def _slice_as(array, index: tuple, dtype):
    """`array[index]` (a scanned parameter's layer, an MoE layer's expert) in `dtype`, on the
    devices (nothing else is gathered)."""
    return array[index].astype(dtype)


def _arrays(model_cfg, params, dtype):
    """{HF name: (a thunk giving the HF numpy tensor, nbytes)}, in file order. A tensor fused
    from several arrays (GPT-2's c_attn) is their parts joined along its last axis."""
    itemsize = jnp.dtype(dtype).itemsize
    parts = {}
    for source in sources(model_cfg, params):
        leaf = functools.reduce(lambda t, k: t[k], source.keys, params)
        for index, name in hf_index(source):
            part = functools.partial(lambda a, at, t: to_hf(_to_host(_slice_as(a, at, dtype)), t), leaf, index,
                                     source.tensor)
            parts.setdefault(name, {})[source.tensor.part[0]] = part

    def joined(name):
        pieces = [parts[name][k]() for k in sorted(parts[name])]
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces, axis=-1)

    return {n: (functools.partial(joined, n), math.prod(t.hf_shape) * itemsize)
            for n, t in hf_tensors(model_cfg).items()}


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
    plan = _shard_plan({n: a[1] for n, a in arrays.items()}, max_shard_bytes)
    names = [WEIGHTS] if len(plan) == 1 else [
        f"model-{k + 1:05d}-of-{len(plan):05d}.safetensors" for k in range(len(plan))]
    writer = jax.process_index() == 0
    for file, tensor_names in zip(names, plan):
        tensors = {}
        for name in tensor_names:
            host = arrays[name][0]()
            if writer:
                tensors[name] = host
            del host
        if writer:
            save_file(tensors, os.path.join(out, file), metadata={"format": "pt"})
        del tensors
    if len(plan) > 1 and writer:
        index = {"metadata": {"total_size": sum(a[1] for a in arrays.values())},
                 "weight_map": {n: f for f, ns in zip(names, plan) for n in ns}}
        write_json(os.path.join(out, INDEX), index)
    return names + ([INDEX] if len(plan) > 1 else [])


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
    """Writes a transformers-loadable folder (of the class `architecture` picks) of the run `cfg`'s
    `params` into `out` (a local directory, created; it must not already hold an export): config.json,
    generation_config.json, the safetensors weights in `dtype` and the tokenizer files. Every
    process calls it; process 0 checks `out` and writes. Returns the files' names."""
    from maxlm.data.tokenizers import config_tokenizer

    if dtype not in DTYPES:
        raise config_lib.ConfigError(f"--dtype={dtype!r}: expected one of {', '.join(DTYPES)}")
    arch = architecture(cfg.model, "the Hugging Face export")
    if cfg.model.num_experts and cfg.model.capacity_factor:
        console.warn(f"model.capacity_factor={cfg.model.capacity_factor}: transformers' MoE classes run every "
                     "token's experts (dropless); their logits are maxlm's with capacity_factor=0, which differ "
                     "where maxlm's capacity drops token-slots")
    out = os.path.expanduser(out)

    def check_out() -> bytes:  # process 0's, which writes there
        taken = [f for f in (WEIGHTS, INDEX, "config.json") if os.path.exists(os.path.join(out, f))]
        if taken:
            raise config_lib.ConfigError(f"--out={out} already holds an export ({', '.join(taken)}); "
                                         "choose another directory or remove it")
        return b""

    processes.from_process_0(check_out)
    tokenizer = tokenizer or config_tokenizer(cfg.data, job=True)
    m = cfg.model
    if m.d_model % m.num_heads:
        console.warn(f"model.d_model={m.d_model} is not divisible by model.num_heads={m.num_heads}: "
                 "the weights are right, but transformers' LlamaConfig rejects such a config")
    if m.mtp_depth:  # as DeepSeek-V3's own HF model does, which runs without its MTP module
        console.warn(f"the export leaves out the {m.mtp_depth} multi-token prediction module(s) (mtp_*): "
                     f"transformers' {arch.name} has none; the main model is exported whole")
    if jax.process_index() == 0:
        os.makedirs(out, exist_ok=True)
    files = write_weights(params, m, out, dtype, max_shard_bytes)
    if jax.process_index() == 0:
        write_json(os.path.join(out, "config.json"), hf_config(cfg, tokenizer, dtype))
        write_json(os.path.join(out, "generation_config.json"), generation_config(cfg, tokenizer))
        files += ["config.json", "generation_config.json"] + write_tokenizer(tokenizer, out, cfg.seq_len)
    return files
