"""Defaults, validation and derived values for a run (the rules themselves: maxlm/config_rules.py).

A run's config is an `ml_collections.ConfigDict`. `configs/NAME.py` files start from `defaults()`
and override what they need; command-line `--config.KEY=VALUE` flags override those. `resolve()`
then checks every constraint that needs only the config, the device count and the platform,
*before* anything is compiled or written (those that need the data, a checkpoint or a Hugging Face
folder follow it: docs/config.md#validation), fills the mesh's `-1`, and returns the config that
`DIR/config.json` records.
"""

from __future__ import annotations

import json
import os

import ml_collections

from maxlm import axes
from maxlm.axes import DEFAULT_RULES, MESH_AXES  # noqa: F401  (MESH_AXES: config_lib.MESH_AXES)
from maxlm.config_rules import (  # noqa: F401  (the choices, as config_lib.REMAT etc.)
    ATTENTION,
    DTYPES,
    LR_BATCH_SCALING,
    MU_DTYPES,
    OPTIMIZERS,
    PLATFORMS,
    POSITIONS,
    REMAT,
    SCHEDULES,
    SPLASH_BLOCK,
    check_data,
    check_eval,
    check_model_and_optim,
    check_optimizer,
    check_platform,
    check_values,
)
from maxlm.errors import ConfigError  # noqa: F401  (config_lib.ConfigError)


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
    c.debug.spike_at_batch = -1  # fault injection: the batch at this data position trains at a
    c.debug.spike_batches = 1  # ... higher lr (and the next spike_batches - 1 batches) (-1 = off)
    c.debug.spike_lr_scale = 1000.0  # ... of lr times this: a loss spike (maxlm/train/anomaly.py)

    c.anomaly = ml_collections.ConfigDict()  # loss-spike recovery (maxlm/train/anomaly.py), off by default
    c.anomaly.enabled = False
    c.anomaly.warmup = 100  # losses seen before spikes are looked for
    c.anomaly.ema = 0.99  # decay of the loss's running mean and variance
    c.anomaly.spike_sigma = 6.0  # a spike: loss > mean + spike_sigma x deviation
    c.anomaly.max_spikes = 3  # consecutive spikes before rolling back
    c.anomaly.skip_batches = 200  # batches skipped from the restored step on (at least through the spike)
    c.anomaly.max_rollbacks = 3  # rollbacks without a checkpoint past the spike before stopping (exit 3)

    c.eval = ml_collections.ConfigDict()
    c.eval.every_steps = 100  # 0 disables periodic eval
    c.eval.steps = 4  # validation batches per eval
    c.eval.sets = ()  # more held-out sets: ((name, source), ...), each logged as eval/<name>/loss
    c.eval.tasks = ()  # task .jsonl files scored at each eval (maxlm/train/tasks.py): eval/<stem>/acc, ...
    c.eval.task_shots = 0  # few-shot examples before each task example

    c.metrics = ml_collections.ConfigDict()
    c.metrics.tensorboard = True

    c.profile = ml_collections.ConfigDict()  # a jax.profiler trace of a few steps (maxlm/train/profiler.py)
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
    s.fp8 = False  # layer weight matmuls with float8 operands (maxlm/model/fp8.py)
    s.logits_chunk_size = 0  # >0: the loss computes logits this many positions at a time
    s.z_loss = 0.0  # weight of log²Z in the objective (PaLM uses 1e-4)
    s.label_smoothing = 0.0
    return s


def _optim_defaults() -> ml_collections.ConfigDict:
    s = ml_collections.ConfigDict()
    s.name = "adamw"  # one of OPTIMIZERS
    s.lr = 3e-4  # peak, reached after warmup
    s.schedule = "cosine"  # one of SCHEDULES (docs/architecture.md#optimizers-and-schedules)
    s.warmup_steps = 100
    s.decay_steps = 0  # 0: decay over the whole run (`steps`)
    s.min_lr_ratio = 0.1  # the decay's floor as a fraction of lr
    s.power = 1.0  # schedule "polynomial": the decay's exponent
    s.boundaries = ()  # schedule "step": the steps where lr is multiplied by decay_factor
    s.decay_factor = 0.1  # schedule "step"
    s.decay_fraction = 0.2  # schedule "wsd": the share of decay_steps spent decaying, at the end
    # the peak lr times (batch_size / lr_reference_batch) ** (1/2 | 1): one of LR_BATCH_SCALING
    s.lr_batch_scaling = "none"
    s.lr_reference_batch = 0  # the batch size optim.lr was tuned at (needed with scaling)
    s.clip_norm = 1.0  # 0 disables clipping
    s.weight_decay = 0.1
    s.b1 = 0.9
    s.b2 = 0.95
    s.eps = 1e-8
    s.grad_accum_steps = 1  # microbatches per step, accumulated inside the jitted step
    s.shard_state_over_data = False  # ZeRO-1: optimizer state also sharded over mesh.data
    s.mu_dtype = "float32"  # first moment's dtype (adamw, lion): "float32" or "bfloat16"
    # dynamic loss scaling, on with model.dtype="float16" only (maxlm/train/loss_scale.py)
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
    s.init_from_hf = ""  # a fresh workdir starts from a local HF Llama folder (maxlm/hf/files.py)
    return s


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
    check_values(c)
    check_platform(c, num_devices, platform)
    check_model_and_optim(c)
    check_optimizer(c)
    axes.check_mesh(c, num_devices, num_granules)
    check_data(c)
    check_eval(c)
    return c



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
