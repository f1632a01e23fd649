"""Defaults, validation and derived values for a run, in one place.

A run's config is an `ml_collections.ConfigDict`. `configs/NAME.py` files start from `defaults()`
and override what they need; command-line `--config.KEY=VALUE` flags override those. `resolve()`
then checks every cross-field constraint *before* anything is compiled or written, fills the mesh's
`-1`, and returns the config that `DIR/config.json` records.
"""

from __future__ import annotations

import json
import math

import ml_collections

# Logical axis names → mesh axes. Parameters and activations are annotated with the logical names
# on the left; a mesh sweep edits this table (or the mesh sizes), never the model.
#   batch    : activations' batch dim      → data parallel and fully-sharded data parallel
#   embed    : the d_model dim of weights  → fsdp (ZeRO-3: weights, grads and Adam state sharded)
#   heads/kv_heads/mlp/vocab               → tensor (Megatron-style column/row splits)
#   layers   : the scanned layers' axis    → pipeline stages (each stage holds its layers)
#   length   : activations' sequence dim   → sequence parallelism (attention gathers keys/values)
#   act_embed: the d_model dim of activations stays replicated: sharding it would add collectives
DEFAULT_RULES = (
    ("batch", ("data", "fsdp")),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("head_dim", None),
    ("layers", "stage"),
    ("length", "sequence"),
    ("act_embed", None),
)

MESH_AXES = ("stage", "data", "fsdp", "sequence", "tensor")  # outermost (slowest links) first
DCN_AXES = ("data", "fsdp")  # axes that may span granules: mesh.dcn_data, mesh.dcn_fsdp
DTYPES = ("float32", "bfloat16", "float16")  # model.dtype: compute; float16 turns on loss scaling
MU_DTYPES = ("float32", "bfloat16")  # optim.mu_dtype
REMAT = ("none", "full", "save_dots", "save_qkv_proj", "save_out_proj")  # see model.REMAT_POLICIES
ATTENTION = ("auto", "xla", "cudnn", "splash")  # see model.attention_backend
SPLASH_BLOCK = 128  # splash attention's tiles are multiples of the TPU's 128 lanes (maxlm/attention.py)


class ConfigError(ValueError):
    """A user error in the config: the message names the key, the numbers and what to change."""


def defaults() -> ml_collections.ConfigDict:
    """Every key a run reads, with its default. Config files override a subset."""
    c = ml_collections.ConfigDict()
    c.name = "default"
    c.seed = 0
    c.steps = 1000
    c.batch_size = 8  # global, in sequences
    c.seq_len = 256
    c.log_every_steps = 10

    c.mesh = ml_collections.ConfigDict()
    c.mesh.stage = 1  # pipeline parallelism: layers split over this many stages (GPipe)
    c.mesh.data = 1
    c.mesh.fsdp = -1  # -1: all devices left after the other axes
    c.mesh.sequence = 1  # sequence parallelism: activations split along the length dimension
    c.mesh.tensor = 1
    # Multi-slice / multi-node: how many granules (TPU slices; GPU/CPU processes) the data and
    # fsdp axes are split across, over DCN/the network; the rest of each axis is within a granule.
    c.mesh.dcn_data = 1
    c.mesh.dcn_fsdp = 1
    c.mesh.rules = DEFAULT_RULES

    c.model = ml_collections.ConfigDict()
    c.model.num_layers = 4
    c.model.d_model = 256
    c.model.num_heads = 4
    c.model.num_kv_heads = 4
    c.model.head_dim = 0  # 0: d_model // num_heads
    c.model.mlp_dim = 768
    c.model.vocab_size = 384
    c.model.tie_embeddings = False
    c.model.rope_theta = 10000.0
    c.model.norm_eps = 1e-5
    c.model.dtype = "float32"  # compute dtype; parameters are always float32
    c.model.init_std = 0.02
    c.model.scan_layers = True  # one compiled layer body (compile time flat in depth)
    c.model.pipeline_microbatches = 1  # with mesh.stage > 1: microbatches per step in the pipeline
    c.model.remat = "none"  # activation rematerialisation policy, one of REMAT
    c.model.attention = "auto"  # one of ATTENTION; the log says which one ran
    c.model.fp8 = False  # layer weight matmuls with float8 operands (maxlm/fp8.py)
    c.model.logits_chunk_size = 0  # >0: the loss computes logits this many positions at a time
    c.model.z_loss = 0.0  # weight of log²Z in the objective (PaLM uses 1e-4)
    c.model.label_smoothing = 0.0

    c.optim = ml_collections.ConfigDict()
    c.optim.lr = 3e-4  # peak, reached after warmup
    c.optim.warmup_steps = 100
    c.optim.decay_steps = 0  # 0: decay over the whole run (`steps`)
    c.optim.min_lr_ratio = 0.1  # cosine floor as a fraction of lr
    c.optim.clip_norm = 1.0  # 0 disables clipping
    c.optim.weight_decay = 0.1
    c.optim.b1 = 0.9
    c.optim.b2 = 0.95
    c.optim.eps = 1e-8
    c.optim.grad_accum_steps = 1  # microbatches per step, accumulated inside the jitted step
    c.optim.shard_state_over_data = False  # ZeRO-1: Adam moments also sharded over mesh.data
    c.optim.mu_dtype = "float32"  # Adam first moment's dtype: "float32" or "bfloat16"
    # dynamic loss scaling, on with model.dtype="float16" only (maxlm/loss_scale.py)
    c.optim.loss_scale_init = 2.0**15
    c.optim.loss_scale_growth_interval = 2000  # consecutive applied steps before the scale doubles
    c.optim.loss_scale_min = 1.0  # halving stops here; a non-finite step at the min is a bad step

    c.data = ml_collections.ConfigDict()
    c.data.source = "tfds:python_stdlib"
    c.data.tfds_dir = "~/.cache/maxlm/tensorflow_datasets"
    c.data.cache_dir = "~/.cache/maxlm/packed"
    c.data.tokenizer = "byte"  # "byte" or a sentencepiece .model path
    c.data.text_key = "text"  # the text field of .jsonl/.parquet files and TFDS examples
    c.data.txt_documents = "file"  # .txt: "file" = one document per file, "paragraph" = per blank-line block
    c.data.validation_percent = 2.0  # local files: share of documents (by stable hash) in validation
    c.data.bad_records = "error"  # broken JSON line / missing text_key: "error" (exit 2) or "skip" (counted)
    c.data.tokenizer_vocab_size = 0  # `python -m maxlm.data tokenizer`: 0 = model.vocab_size
    c.data.tokenizer_sample_docs = 20000  # documents sampled to train the tokenizer
    c.data.filters = ml_collections.ConfigDict()
    c.data.filters.min_words = 0  # 0 = off
    c.data.filters.max_symbol_ratio = 0.0  # 0 = off; else drop docs with more non-alnum, non-space chars
    c.data.filters.max_repeated_word_share = 0.0  # 0 = off; else drop docs whose top word exceeds this share
    c.data.filters.dedup = False  # drop exact duplicates (content hash) within a split

    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.every_steps = 100
    c.checkpoint.max_to_keep = 3  # newest regular checkpoints kept
    c.checkpoint.keep_period = 0  # also keep every step that is a multiple of this forever (0 = off)
    c.checkpoint.every_minutes = 0.0  # time-based temporary saves, replaced by the next (0 = off)
    c.checkpoint.max_bad_steps = 3  # consecutive non-finite (skipped) steps before a restore
    c.checkpoint.max_restores = 2  # such restores without progress before stopping (exit 3)
    c.checkpoint.restore_lr_scale = 1.0  # lr multiplier applied at each such restore
    c.checkpoint.restore_from = ""  # start a fresh workdir from another run's checkpoint
    c.checkpoint.restore_params_only = False  # with restore_from: params only (step 0, new optimizer)
    c.checkpoint.init_from_hf = ""  # a fresh workdir starts from a local HF Llama folder (maxlm/hf.py)

    c.debug = ml_collections.ConfigDict()
    c.debug.nan_at_step = -1  # fault injection: step N's gradients are NaN (-1 = off)
    c.debug.nan_steps = 1  # ... and the next nan_steps - 1 steps' too
    c.debug.nan_transient = True  # only the first time those steps run in this process

    c.eval = ml_collections.ConfigDict()
    c.eval.every_steps = 100  # 0 disables periodic eval
    c.eval.steps = 4  # validation batches per eval

    c.metrics = ml_collections.ConfigDict()
    c.metrics.tensorboard = True

    c.profile = ml_collections.ConfigDict()  # a jax.profiler trace of a few steps (maxlm/profiler.py)
    c.profile.start_step = 5  # the first traced step (after the compile and warm-up)
    c.profile.num_steps = 0  # 0 = off
    return c


def _positive(c, *keys):
    for key in keys:
        value = _get(c, key)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"{key} must be a positive number, got {value!r}")


def _non_negative(c, *keys):
    for key in keys:
        value = _get(c, key)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"{key} must be >= 0, got {value!r}")


def _get(c, key):
    for part in key.split("."):
        c = c[part]
    return c


def resolve_mesh_shape(mesh_cfg, num_devices: int) -> dict[str, int]:
    """Fills the one optional -1 so that stage × data × fsdp × sequence × tensor == num_devices.
    (A config saved before `mesh.sequence` existed lacks it: 1.)"""
    sizes = {axis: mesh_cfg.get(axis, 1) for axis in MESH_AXES}
    for axis, size in sizes.items():
        if not isinstance(size, int) or isinstance(size, bool) or (size < 1 and size != -1):
            raise ConfigError(f"mesh.{axis} must be a positive int or -1, got {size!r}")
    fill = [axis for axis, size in sizes.items() if size == -1]
    if len(fill) > 1:
        raise ConfigError(
            f"only one mesh axis may be -1, got {', '.join('mesh.' + a for a in fill)} = -1"
        )
    known = math.prod(size for size in sizes.values() if size != -1)
    if fill:
        if num_devices % known:
            raise ConfigError(
                f"mesh.{fill[0]}=-1 cannot be filled: the other axes multiply to {known}, "
                f"which does not divide the {num_devices} devices"
            )
        sizes[fill[0]] = num_devices // known
    product = math.prod(sizes.values())
    if product != num_devices:
        shape = " x ".join(f"{a}={s}" for a, s in sizes.items())
        raise ConfigError(
            f"mesh {shape} has {product} devices but {num_devices} are available; "
            f"make the product {num_devices} or set one axis to -1"
        )
    return sizes


def check_dcn(mesh_cfg, num_granules: int | None = None) -> None:
    """`mesh.dcn_data` / `mesh.dcn_fsdp` against the resolved mesh and, when known, the number of
    granules (TPU slices; processes on GPU/CPU) the devices come in."""
    dcn = {axis: mesh_cfg.get(f"dcn_{axis}", 1) for axis in DCN_AXES}
    for axis, size in dcn.items():
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ConfigError(f"mesh.dcn_{axis} must be a positive int, got {size!r}")
        if mesh_cfg[axis] % size:
            raise ConfigError(
                f"mesh.dcn_{axis}={size} must divide mesh.{axis}={mesh_cfg[axis]} (mesh.{axis} = "
                f"dcn_{axis} granules x mesh.{axis}/dcn_{axis} devices within each)"
            )
    product = math.prod(dcn.values())
    if num_granules is not None and product > 1 and product != num_granules:
        raise ConfigError(
            f"mesh.dcn_data x mesh.dcn_fsdp = {dcn['data']} x {dcn['fsdp']} = {product} must equal "
            f"the number of granules, {num_granules} (TPU slices; processes on GPU/CPU)"
        )


def resolve(config: ml_collections.ConfigDict, num_devices: int,
            num_granules: int | None = None) -> ml_collections.ConfigDict:
    """Validates `config` for `num_devices` and returns a copy with derived values filled in.

    `num_granules`: how many TPU slices (processes on GPU/CPU) the devices come in, checked
    against `mesh.dcn_*` (None: not checked; `mesh.make_mesh` checks it again).
    Raises ConfigError with a one-line message on the first problem found.
    """
    c = ml_collections.ConfigDict(config.to_dict())
    m = c.model
    _positive(c, "steps", "batch_size", "seq_len", "log_every_steps", "optim.lr")
    _positive(c, "model.num_layers", "model.d_model", "model.num_heads", "model.num_kv_heads")
    _positive(c, "model.mlp_dim", "model.vocab_size", "model.rope_theta", "model.norm_eps")
    _positive(c, "checkpoint.every_steps", "checkpoint.max_to_keep", "eval.steps")
    _positive(c, "checkpoint.max_bad_steps", "debug.nan_steps")
    _non_negative(c, "checkpoint.keep_period", "checkpoint.every_minutes", "checkpoint.max_restores")
    if not 0 < c.checkpoint.restore_lr_scale <= 1:
        raise ConfigError(
            f"checkpoint.restore_lr_scale must be in (0, 1], got {c.checkpoint.restore_lr_scale}"
        )
    _non_negative(c, "optim.warmup_steps", "optim.decay_steps", "optim.clip_norm")
    _non_negative(c, "optim.weight_decay", "optim.min_lr_ratio", "eval.every_steps")
    _non_negative(c, "model.head_dim", "model.init_std", "seed")
    for key in ("start_step", "num_steps"):
        value = c.profile[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"profile.{key} must be an int >= 0, got {value!r}")
    for key in ("b1", "b2"):
        if not 0 <= c.optim[key] < 1:
            raise ConfigError(f"optim.{key} must be in [0, 1), got {c.optim[key]}")
    accum = c.optim.grad_accum_steps
    if not isinstance(accum, int) or isinstance(accum, bool) or accum < 1:
        raise ConfigError(f"optim.grad_accum_steps must be a positive int, got {accum!r}")
    if c.optim.mu_dtype not in MU_DTYPES:
        raise ConfigError(f"optim.mu_dtype must be one of {MU_DTYPES}, got {c.optim.mu_dtype!r}")
    if c.optim.min_lr_ratio > 1:
        raise ConfigError(f"optim.min_lr_ratio must be <= 1, got {c.optim.min_lr_ratio}")
    _check_loss_scale(c.optim)
    if m.dtype not in DTYPES:
        raise ConfigError(f"model.dtype must be one of {DTYPES}, got {m.dtype!r}")
    if m.remat not in REMAT:
        raise ConfigError(f"model.remat must be one of {REMAT}, got {m.remat!r}")
    if m.attention not in ATTENTION:
        raise ConfigError(f"model.attention must be one of {ATTENTION}, got {m.attention!r}")
    if m.attention == "splash" and c.seq_len % SPLASH_BLOCK:
        raise ConfigError(
            f"model.attention='splash' needs seq_len divisible by {SPLASH_BLOCK} (the kernel's tile), "
            f"got seq_len={c.seq_len}; use model.attention='xla' or a seq_len of "
            f"{-(-c.seq_len // SPLASH_BLOCK) * SPLASH_BLOCK}"
        )
    if not isinstance(m.fp8, bool):
        raise ConfigError(f"model.fp8 must be True or False, got {m.fp8!r}")
    _non_negative(c, "model.logits_chunk_size", "model.z_loss", "model.label_smoothing")
    if m.label_smoothing >= 1:
        raise ConfigError(f"model.label_smoothing must be < 1, got {m.label_smoothing}")
    if m.logits_chunk_size and c.seq_len % m.logits_chunk_size:
        raise ConfigError(
            f"seq_len={c.seq_len} must be divisible by model.logits_chunk_size={m.logits_chunk_size}"
        )

    if m.num_heads % m.num_kv_heads:
        raise ConfigError(
            f"model.num_heads={m.num_heads} must be divisible by model.num_kv_heads="
            f"{m.num_kv_heads} (grouped-query attention shares each kv head by a group of heads)"
        )
    if m.head_dim == 0:
        if m.d_model % m.num_heads:
            raise ConfigError(
                f"model.d_model={m.d_model} must be divisible by model.num_heads={m.num_heads} "
                "(or set model.head_dim)"
            )
        m.head_dim = m.d_model // m.num_heads
    if m.head_dim % 2:
        raise ConfigError(f"model.head_dim={m.head_dim} must be even for RoPE")
    if c.optim.warmup_steps > c.steps:
        raise ConfigError(
            f"optim.warmup_steps={c.optim.warmup_steps} is longer than steps={c.steps}"
        )
    if c.optim.decay_steps == 0:
        c.optim.decay_steps = c.steps

    mesh = resolve_mesh_shape(c.mesh, num_devices)
    c.mesh.update(mesh)
    check_dcn(c.mesh, num_granules)
    batch_shards = mesh["data"] * mesh["fsdp"]
    if c.batch_size % batch_shards:
        raise ConfigError(
            f"batch_size={c.batch_size} must be divisible by mesh.data x mesh.fsdp = "
            f"{mesh['data']} x {mesh['fsdp']} = {batch_shards}"
        )
    if c.batch_size % (accum * batch_shards):
        raise ConfigError(
            f"batch_size={c.batch_size} must be divisible by optim.grad_accum_steps x mesh.data x "
            f"mesh.fsdp = {accum} x {mesh['data']} x {mesh['fsdp']} = {accum * batch_shards} "
            "(each microbatch is split evenly over the data-parallel devices)"
        )
    _check_sequence(c, mesh["sequence"])
    _check_pipeline(c, mesh)
    tensor = mesh["tensor"]
    for key in ("num_heads", "num_kv_heads", "mlp_dim", "vocab_size"):
        if m[key] % tensor:
            raise ConfigError(
                f"model.{key}={m[key]} must be divisible by mesh.tensor={tensor}"
            )
    if m.d_model % mesh["fsdp"]:
        raise ConfigError(
            f"model.d_model={m.d_model} must be divisible by mesh.fsdp={mesh['fsdp']}"
        )
    _check_rules(c.mesh.rules)
    _check_data(c)
    return c


def _check_sequence(c, sequence: int):
    """Sequence parallelism (`mesh.sequence` > 1): each device holds seq_len / sequence positions of
    every activation; attention all-gathers keys and values, which only the XLA backend does."""
    if sequence == 1:
        return
    if c.seq_len % sequence:
        raise ConfigError(
            f"seq_len={c.seq_len} must be divisible by mesh.sequence={sequence} (each device holds "
            f"seq_len / mesh.sequence positions)"
        )
    if c.model.attention in ("cudnn", "splash"):
        raise ConfigError(
            f"model.attention={c.model.attention!r} does not support mesh.sequence={sequence} > 1 "
            "(its kernel needs the whole sequence on each device); use model.attention='xla' or 'auto'"
        )
    c.model.attention = "xla"  # what "auto" means under sequence parallelism


def _check_pipeline(c, mesh):
    """Pipeline parallelism (`mesh.stage` > 1): N/S layers per stage, a GPipe schedule over
    `model.pipeline_microbatches` microbatches of each (accumulation) microbatch."""
    m, stages = c.model, mesh["stage"]
    micro = m.pipeline_microbatches
    if not isinstance(micro, int) or isinstance(micro, bool) or micro < 1:
        raise ConfigError(f"model.pipeline_microbatches must be a positive int, got {micro!r}")
    if stages == 1:
        return
    if m.num_layers % stages:
        raise ConfigError(
            f"model.num_layers={m.num_layers} must be divisible by mesh.stage={stages} "
            "(each pipeline stage holds the same number of layers)"
        )
    if not m.scan_layers:
        raise ConfigError(f"mesh.stage={stages} > 1 needs model.scan_layers=True (stages split the scanned layers)")
    if m.attention in ("cudnn", "splash"):
        raise ConfigError(
            f"model.attention={m.attention!r} is not supported with mesh.stage={stages} > 1 (the "
            "pipeline runs the stages under vmap); use model.attention='xla' or 'auto'"
        )
    m.attention = "xla"  # what "auto" means in the pipeline
    shards = c.optim.grad_accum_steps * micro * mesh["data"] * mesh["fsdp"]
    if c.batch_size % shards:
        raise ConfigError(
            f"batch_size={c.batch_size} must be divisible by optim.grad_accum_steps x "
            f"model.pipeline_microbatches x mesh.data x mesh.fsdp = {c.optim.grad_accum_steps} x "
            f"{micro} x {mesh['data']} x {mesh['fsdp']} = {shards} (each pipeline microbatch is "
            "split evenly over the data-parallel devices)"
        )


def _check_loss_scale(o):
    for key in ("loss_scale_init", "loss_scale_min"):
        value = o[key]
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < math.inf:
            raise ConfigError(f"optim.{key} must be a positive finite number, got {value!r}")
    if o.loss_scale_init < o.loss_scale_min:
        raise ConfigError(
            f"optim.loss_scale_init={o.loss_scale_init:g} is below optim.loss_scale_min="
            f"{o.loss_scale_min:g}; start the loss scale at or above its minimum"
        )
    interval = o.loss_scale_growth_interval
    if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
        raise ConfigError(
            f"optim.loss_scale_growth_interval must be a positive int (good steps before the "
            f"loss scale doubles), got {interval!r}"
        )


def _check_data(c):
    d = c.data
    for key, choices in (("txt_documents", ("file", "paragraph")), ("bad_records", ("error", "skip"))):
        if d[key] not in choices:
            raise ConfigError(f"data.{key} must be one of {choices}, got {d[key]!r}")
    if not 0 <= d.validation_percent <= 100:
        raise ConfigError(f"data.validation_percent must be in [0, 100], got {d.validation_percent}")
    _non_negative(c, "data.tokenizer_vocab_size", "data.filters.min_words")
    _positive(c, "data.tokenizer_sample_docs")
    for key in ("max_symbol_ratio", "max_repeated_word_share"):
        if not 0 <= d.filters[key] <= 1:
            raise ConfigError(f"data.filters.{key} must be in [0, 1] (0 = off), got {d.filters[key]}")
    vocab = d.tokenizer_vocab_size
    if vocab and vocab > c.model.vocab_size:
        raise ConfigError(
            f"data.tokenizer_vocab_size={vocab} is more than model.vocab_size={c.model.vocab_size}"
        )


def _check_rules(rules):
    names = set()
    for rule in rules:
        if len(rule) != 2 or not isinstance(rule[0], str):
            raise ConfigError(f"mesh.rules entries must be (logical_name, mesh_axes), got {rule!r}")
        name, axes = rule
        if name in names:
            raise ConfigError(f"mesh.rules names {name!r} twice")
        names.add(name)
        for axis in (axes,) if isinstance(axes, str) or axes is None else axes:
            if axis is not None and axis not in MESH_AXES:
                raise ConfigError(
                    f"mesh.rules maps {name!r} to unknown mesh axis {axis!r}; "
                    f"mesh axes are {MESH_AXES}"
                )


def apply_overrides(config: ml_collections.ConfigDict, overrides: dict) -> ml_collections.ConfigDict:
    """Sets dotted keys ("optim.lr") in place, as `--config.optim.lr=...` would; returns `config`."""
    for key, value in overrides.items():
        node = config
        *path, last = key.split(".")
        for part in path:
            node = node[part]
        node[last] = value
    return config


def to_json(config: ml_collections.ConfigDict) -> str:
    return json.dumps(config.to_dict(), indent=2, sort_keys=True)
