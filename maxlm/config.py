"""Defaults, validation and derived values for a run, in one place.

A run's config is an `ml_collections.ConfigDict`. `configs/NAME.py` files start from `defaults()`
and override what they need; command-line `--config.KEY=VALUE` flags override those. `resolve()`
then checks every cross-field constraint *before* anything is compiled or written, fills the mesh's
`-1`, and returns the config that `DIR/config.json` records.
"""

from __future__ import annotations

import json
import math
import os

import ml_collections

from maxlm import axes
from maxlm.axes import DEFAULT_RULES, MESH_AXES  # noqa: F401  (MESH_AXES: config_lib.MESH_AXES)
from maxlm.errors import ConfigError

PLATFORMS = ("", "cpu", "gpu", "tpu")  # platform: what jax.default_backend() must say ("" = any)
DTYPES = ("float32", "bfloat16", "float16")  # model.dtype: compute; float16 turns on loss scaling
MU_DTYPES = ("float32", "bfloat16")  # optim.mu_dtype
REMAT = ("none", "full", "save_dots", "save_qkv_proj", "save_out_proj")  # see model.REMAT_POLICIES
ATTENTION = ("auto", "xla", "cudnn", "splash")  # see attention.attention_backend
POSITIONS = ("rope", "sinusoidal", "learned")  # model.positions: see maxlm/positions.py
SPLASH_BLOCK = 128  # splash attention's tiles are multiples of the TPU's 128 lanes (maxlm/attention.py)


def defaults() -> ml_collections.ConfigDict:
    """Every key a run reads, with its default. Config files override a subset."""
    c = ml_collections.ConfigDict()
    c.name = "default"
    c.seed = 0
    c.steps = 1000
    c.batch_size = 8  # global, in sequences
    c.seq_len = 256
    c.log_every_steps = 10
    # What the job expects to run on, so a GPU or TPU job never trains on the CPU by accident:
    # "cpu" | "gpu" | "tpu" ("" = wherever JAX runs), and the device count (0 = any). The GPU and
    # TPU launchers set the platform.
    c.platform = ""
    c.num_devices = 0
    # JAX's persistent compilation cache, local or gs:// (a shared one for a multi-host job): a
    # restart or requeue loads the compiled step instead of compiling it again ("" = JAX's own
    # setting, the JAX_COMPILATION_CACHE_DIR variable or off).
    c.compile_cache_dir = ""

    c.mesh = _mesh_defaults()
    c.model = _model_defaults()
    c.optim = _optim_defaults()
    c.data = _data_defaults()
    c.checkpoint = _checkpoint_defaults()

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


def _mesh_defaults() -> ml_collections.ConfigDict:
    s = ml_collections.ConfigDict()
    s.stage = 1  # pipeline parallelism: layers split over this many stages (GPipe)
    s.data = 1
    s.fsdp = -1  # -1: all devices left after the other axes
    s.sequence = 1  # sequence parallelism: activations split along the length dimension
    s.tensor = 1
    # Multi-slice / multi-node: how many granules (TPU slices; GPU/CPU processes) the data and
    # fsdp axes are split across, over DCN/the network; the rest of each axis is within a granule.
    s.dcn_data = 1
    s.dcn_fsdp = 1
    s.rules = DEFAULT_RULES
    return s


def _model_defaults() -> ml_collections.ConfigDict:
    s = ml_collections.ConfigDict()
    s.num_layers = 4
    s.d_model = 256
    s.num_heads = 4
    s.num_kv_heads = 4
    s.head_dim = 0  # 0: d_model // num_heads
    s.mlp_dim = 768
    s.vocab_size = 384
    s.tie_embeddings = False
    s.rope_theta = 10000.0
    s.positions = "rope"  # one of POSITIONS: rotary in attention, or added to the embeddings
    s.max_positions = 0  # the learned table's rows (positions="learned"); 0: seq_len
    s.norm_eps = 1e-5
    s.dtype = "float32"  # compute dtype; parameters are always float32
    s.init_std = 0.02
    s.scan_layers = True  # one compiled layer body (compile time flat in depth)
    s.pipeline_microbatches = 1  # with mesh.stage > 1: microbatches per step in the pipeline
    s.remat = "none"  # activation rematerialisation policy, one of REMAT
    s.attention = "auto"  # one of ATTENTION; the log says which one ran
    # splash attention's query and key/value tiles: multiples of 128 dividing seq_len (0: the
    # largest of 512, 256, 128 that divides it)
    s.splash_block_q = 0
    s.splash_block_kv = 0
    s.fp8 = False  # layer weight matmuls with float8 operands (maxlm/fp8.py)
    s.logits_chunk_size = 0  # >0: the loss computes logits this many positions at a time
    s.z_loss = 0.0  # weight of log²Z in the objective (PaLM uses 1e-4)
    s.label_smoothing = 0.0
    return s


def _optim_defaults() -> ml_collections.ConfigDict:
    s = ml_collections.ConfigDict()
    s.lr = 3e-4  # peak, reached after warmup
    s.warmup_steps = 100
    s.decay_steps = 0  # 0: decay over the whole run (`steps`)
    s.min_lr_ratio = 0.1  # cosine floor as a fraction of lr
    s.clip_norm = 1.0  # 0 disables clipping
    s.weight_decay = 0.1
    s.b1 = 0.9
    s.b2 = 0.95
    s.eps = 1e-8
    s.grad_accum_steps = 1  # microbatches per step, accumulated inside the jitted step
    s.shard_state_over_data = False  # ZeRO-1: Adam moments also sharded over mesh.data
    s.mu_dtype = "float32"  # Adam first moment's dtype: "float32" or "bfloat16"
    # dynamic loss scaling, on with model.dtype="float16" only (maxlm/loss_scale.py)
    s.loss_scale_init = 2.0**15
    s.loss_scale_growth_interval = 2000  # consecutive applied steps before the scale doubles
    s.loss_scale_min = 1.0  # halving stops here; a non-finite step at the min is a bad step
    return s


def _data_defaults() -> ml_collections.ConfigDict:
    s = ml_collections.ConfigDict()
    s.source = "tfds:python_stdlib"
    # several sources by weight instead: ((name, source, weight), ...); data.source is then unused
    s.mixture = ()
    s.tfds_dir = "~/.cache/maxlm/tensorflow_datasets"
    s.cache_dir = "~/.cache/maxlm/packed"
    s.tokenizer = "byte"  # "byte" or a sentencepiece .model path
    s.text_key = "text"  # the text field of .jsonl/.parquet files and TFDS examples
    s.txt_documents = "file"  # .txt: "file" = one document per file, "paragraph" = per blank-line block
    s.validation_percent = 2.0  # local files: share of documents (by stable hash) in validation
    s.bad_records = "error"  # broken JSON line / missing text_key: "error" (exit 2) or "skip" (counted)
    s.tokenizer_vocab_size = 0  # `python -m maxlm.data tokenizer`: 0 = model.vocab_size
    s.tokenizer_sample_docs = 20000  # documents sampled to train the tokenizer
    s.workers = 0  # processes that prepare the packed cache (maxlm/data/build.py); 0 = one per core
    s.shard_mb = 64.0  # local files: consecutive files of about this many MB form one shard
    s.shard_examples = 100_000  # TFDS sources: examples per shard
    s.filters = ml_collections.ConfigDict()
    s.filters.min_words = 0  # 0 = off
    s.filters.max_symbol_ratio = 0.0  # 0 = off; else drop docs with more non-alnum, non-space chars
    s.filters.max_repeated_word_share = 0.0  # 0 = off; else drop docs whose top word exceeds this share
    s.filters.html = False  # documents are HTML: keep their main text (resiliparse)
    s.filters.languages = ()  # keep only these languages by fastText's lid.176 ("en", "de", ...); () = all
    s.filters.min_language_score = 0.65  # ... with at least this probability (FineWeb's for English)
    s.filters.dedup = False  # drop exact duplicates (content hash) within a split
    s.filters.near_dedup = False  # drop near duplicates (MinHash-LSH) within a split
    s.filters.near_dedup_ngram = 5  # words per shingle
    s.filters.near_dedup_bands = 14  # LSH bands ...
    s.filters.near_dedup_rows = 8  # ... of this many hashes each (FineWeb's 14 x 8)
    return s


def _checkpoint_defaults() -> ml_collections.ConfigDict:
    s = ml_collections.ConfigDict()
    s.every_steps = 100
    s.max_to_keep = 3  # newest regular checkpoints kept
    s.keep_period = 0  # also keep every step that is a multiple of this forever (0 = off)
    s.every_minutes = 0.0  # time-based temporary saves, replaced by the next (0 = off)
    s.max_bad_steps = 3  # consecutive non-finite (skipped) steps before a restore
    s.max_restores = 2  # such restores without progress before stopping (exit 3)
    s.restore_lr_scale = 1.0  # lr multiplier applied at each such restore
    s.restore_from = ""  # start a fresh workdir from another run's checkpoint
    s.restore_params_only = False  # with restore_from: params only (step 0, new optimizer)
    s.init_from_hf = ""  # a fresh workdir starts from a local HF Llama folder (maxlm/hf.py)
    return s


# Single-key rules, checked first by `resolve` (cross-field rules follow there).
POSITIVE = ("steps", "batch_size", "seq_len", "log_every_steps", "optim.lr", "model.num_layers",
            "model.d_model", "model.num_heads", "model.num_kv_heads", "model.mlp_dim",
            "model.vocab_size", "model.rope_theta", "model.norm_eps", "checkpoint.every_steps",
            "checkpoint.max_to_keep", "checkpoint.max_bad_steps", "eval.steps", "debug.nan_steps",
            "data.tokenizer_sample_docs", "data.shard_mb")
NON_NEGATIVE = ("seed", "checkpoint.keep_period", "checkpoint.every_minutes", "checkpoint.max_restores",
                "optim.warmup_steps", "optim.decay_steps", "optim.clip_norm", "optim.weight_decay",
                "optim.min_lr_ratio", "eval.every_steps", "model.head_dim", "model.init_std",
                "model.logits_chunk_size", "model.z_loss", "model.label_smoothing",
                "data.tokenizer_vocab_size", "data.filters.min_words")
POSITIVE_INTS = {"optim.grad_accum_steps": "", "model.pipeline_microbatches": "", "data.shard_examples": "",
                 "data.filters.near_dedup_ngram": "", "data.filters.near_dedup_bands": "",
                 "data.filters.near_dedup_rows": "",
                 "optim.loss_scale_growth_interval": " (good steps before the loss scale doubles)"}
NON_NEGATIVE_INTS = ("profile.start_step", "profile.num_steps", "num_devices", "data.workers",
                     "model.max_positions")
CHOICES = {"platform": PLATFORMS, "model.dtype": DTYPES, "model.remat": REMAT, "model.attention": ATTENTION,
           "model.positions": POSITIONS,
           "optim.mu_dtype": MU_DTYPES, "data.txt_documents": ("file", "paragraph"),
           "data.bad_records": ("error", "skip")}
RANGES = {  # key: (test, what the message says it must be)
    "checkpoint.restore_lr_scale": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "optim.b1": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "optim.b2": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "optim.min_lr_ratio": (lambda v: v <= 1, "<= 1"),
    "optim.loss_scale_init": (lambda v: 0 < v < math.inf, "a positive finite number"),
    "optim.loss_scale_min": (lambda v: 0 < v < math.inf, "a positive finite number"),
    "model.label_smoothing": (lambda v: v < 1, "< 1"),
    "data.validation_percent": (lambda v: 0 <= v <= 100, "in [0, 100]"),
    "data.filters.max_symbol_ratio": (lambda v: 0 <= v <= 1, "in [0, 1] (0 = off)"),
    "data.filters.max_repeated_word_share": (lambda v: 0 <= v <= 1, "in [0, 1] (0 = off)"),
    "data.filters.min_language_score": (lambda v: 0 <= v <= 1, "in [0, 1]"),
}


def _is_number(value, kinds=(int, float)) -> bool:
    return isinstance(value, kinds) and not isinstance(value, bool)


def _get(c, key):
    for part in key.split("."):
        c = c[part]
    return c


def _positive_int(c, key: str, what: str = "") -> None:
    if not _is_number(value := _get(c, key), int) or value < 1:
        raise ConfigError(f"{key} must be a positive int{what}, got {value!r}")


def _check_values(c) -> None:
    """The single-key rules above, in order: the first broken one raises ConfigError."""
    for key in POSITIVE:
        if not _is_number(value := _get(c, key)) or value <= 0:
            raise ConfigError(f"{key} must be a positive number, got {value!r}")
    for key in NON_NEGATIVE:
        if not _is_number(value := _get(c, key)) or value < 0:
            raise ConfigError(f"{key} must be >= 0, got {value!r}")
    for key, what in POSITIVE_INTS.items():
        _positive_int(c, key, what)
    for key in NON_NEGATIVE_INTS:
        if not _is_number(value := _get(c, key), int) or value < 0:
            raise ConfigError(f"{key} must be an int >= 0, got {value!r}")
    for key, choices in CHOICES.items():
        if (value := _get(c, key)) not in choices:
            raise ConfigError(f"{key} must be one of {choices}, got {value!r}")
    for key, (test, what) in RANGES.items():
        if not _is_number(value := _get(c, key)) or not test(value):
            raise ConfigError(f"{key} must be {what}, got {value!r}")
    if not isinstance(c.model.fp8, bool):
        raise ConfigError(f"model.fp8 must be True or False, got {c.model.fp8!r}")


def load_file(path: str) -> ml_collections.ConfigDict:
    """`get_config()` of the config file at `path`: how a config file builds on another, e.g.
    `load_file(os.path.join(os.path.dirname(__file__), "llama_1b.py"))` in configs/."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def resolve(config: ml_collections.ConfigDict, num_devices: int,
            num_granules: int | None = None, platform: str | None = None) -> ml_collections.ConfigDict:
    """Validates `config` for `num_devices` and returns a copy with derived values filled in.

    `num_granules`: how many TPU slices (processes on GPU/CPU) the devices come in, checked
    against `mesh.dcn_*` (None: not checked; `mesh.make_mesh` checks it again). `platform`: the
    platform JAX runs on (`jax.default_backend()`), checked against the config's `platform`
    (None: not checked). Raises ConfigError with a one-line message on the first problem found.
    """
    c = ml_collections.ConfigDict(config.to_dict())
    _check_values(c)
    _check_platform(c, num_devices, platform)
    _check_model_and_optim(c)
    axes.check_mesh(c, num_devices, num_granules)
    _check_data(c)
    return c


def _check_platform(c, num_devices: int, platform: str | None) -> None:
    if c.platform and platform is not None and platform != c.platform:
        raise ConfigError(
            f"platform={c.platform!r} but JAX runs on {platform!r} here (JAX_PLATFORMS="
            f"{os.environ.get('JAX_PLATFORMS', '')!r}): is jax for {c.platform.upper()} installed in "
            "this environment (a CUDA build for gpu, jax[tpu] for tpu) and the accelerator visible?")
    if c.num_devices and c.num_devices != num_devices:
        raise ConfigError(f"num_devices={c.num_devices} but JAX sees {num_devices} devices here")


def _check_model_and_optim(c) -> None:
    """Cross-field rules within the model and optimizer; fills model.head_dim, optim.decay_steps."""
    m = c.model
    if c.optim.loss_scale_init < c.optim.loss_scale_min:
        raise ConfigError(
            f"optim.loss_scale_init={c.optim.loss_scale_init:g} is below optim.loss_scale_min="
            f"{c.optim.loss_scale_min:g}; start the loss scale at or above its minimum"
        )
    if m.attention == "splash" and c.seq_len % SPLASH_BLOCK:
        raise ConfigError(
            f"model.attention='splash' needs seq_len divisible by {SPLASH_BLOCK} (the kernel's tile), "
            f"got seq_len={c.seq_len}; use model.attention='xla' or a seq_len of "
            f"{-(-c.seq_len // SPLASH_BLOCK) * SPLASH_BLOCK}"
        )
    for key in ("splash_block_q", "splash_block_kv"):
        if m[key] < 0 or m[key] % SPLASH_BLOCK or (m[key] and c.seq_len % m[key]):
            raise ConfigError(f"model.{key}={m[key]} must be 0 (automatic) or a multiple of "
                              f"{SPLASH_BLOCK} that divides seq_len={c.seq_len}")
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
    _check_positions(c)
    if c.optim.warmup_steps > c.steps:
        raise ConfigError(f"optim.warmup_steps={c.optim.warmup_steps} is longer than steps={c.steps}")
    if c.optim.decay_steps == 0:
        c.optim.decay_steps = c.steps


def _check_positions(c) -> None:
    """Each position encoding's shape rules; fills model.max_positions for a learned table."""
    m = c.model
    if m.positions == "rope" and m.head_dim % 2:
        raise ConfigError(f"model.head_dim={m.head_dim} must be even for RoPE (model.positions='rope')")
    if m.positions == "sinusoidal" and m.d_model % 2:
        raise ConfigError(f"model.d_model={m.d_model} must be even for model.positions='sinusoidal' "
                          "(sin/cos pairs)")
    if m.positions != "learned":
        return
    if m.max_positions == 0:
        m.max_positions = c.seq_len
    if c.seq_len > m.max_positions:
        raise ConfigError(f"seq_len={c.seq_len} is longer than model.max_positions={m.max_positions}, "
                          "the learned position table's length")


def _check_data(c):
    if (vocab := c.data.tokenizer_vocab_size) and vocab > c.model.vocab_size:
        raise ConfigError(f"data.tokenizer_vocab_size={vocab} is more than model.vocab_size={c.model.vocab_size}")
    languages = c.data.filters.languages
    if not (isinstance(languages, (tuple, list)) and all(isinstance(x, str) and x for x in languages)):
        raise ConfigError(f"data.filters.languages is a tuple of language codes such as ('en',), got {languages!r}")
    names = []
    for entry in c.data.mixture:
        if not (isinstance(entry, (tuple, list)) and len(entry) == 3 and isinstance(entry[0], str)
                and entry[0].isidentifier() and isinstance(entry[1], str) and entry[1]
                and isinstance(entry[2], (int, float)) and not isinstance(entry[2], bool) and entry[2] > 0):
            raise ConfigError(f"data.mixture entries are (name, source, weight > 0) with a name like "
                              f"'web', got {entry!r}")
        names.append(entry[0])
    if len(set(names)) != len(names):
        raise ConfigError(f"data.mixture names must differ, got {names}")


def from_recorded(recorded: dict) -> ml_collections.ConfigDict:
    """A config an earlier run recorded (its `config.json`, a checkpoint's `config` item), with
    every key added to `defaults()` since then filled in with its default: the one place an
    older run's config is read, so no other code needs a fallback for a missing key."""

    def merged(base: dict, over: dict) -> dict:
        out = dict(base)
        for key, value in over.items():
            nested = isinstance(value, dict) and isinstance(base.get(key), dict)
            out[key] = merged(base[key], value) if nested else value
        return out

    return ml_collections.ConfigDict(merged(defaults().to_dict(), recorded))


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
