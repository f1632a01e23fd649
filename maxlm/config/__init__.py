"""Defaults, validation and derived values for a run (the rules themselves: maxlm/config/rules.py).

A run's config is an `ml_collections.ConfigDict`. `configs/NAME.py` files start from `defaults()`
and override what they need; command-line `--config.KEY=VALUE` flags override those. Each key's
domain, where it has one, is declared on its default's line (`s.lr = 3e-4, POSITIVE`). `resolve()`
then checks every constraint that needs only the config, the device count and the platform,
*before* anything is compiled or written (those that need the data, a checkpoint or a Hugging Face
folder follow it: docs/config.md#validation), fills the mesh's `-1`, and returns the config that
`DIR/config.json` records.
"""

from __future__ import annotations

import json
import os

import ml_collections

from maxlm.config import mesh_axes
from maxlm.config.mesh_axes import DEFAULT_RULES, MESH_AXES  # noqa: F401  (MESH_AXES: config_lib.MESH_AXES)
from maxlm.config.rules import (
    ATTENTION,
    ATTENTION_KINDS,
    BOOL,
    CONTEXT_PARALLEL,
    DTYPES,
    EXPERT_DISPATCH,
    GROUPED_MATMUL,
    INT_OR_OFF,
    LOAD_BALANCE,
    LR_BATCH_SCALING,
    MESH_SIZE,
    MLP_ACTIVATIONS,
    MU_DTYPES,
    NON_NEGATIVE,
    NON_NEGATIVE_INT,
    NORM_PLACEMENTS,
    NORMS,
    OPTIMIZERS,
    PLATFORMS,
    POSITIONS,
    POSITIVE,
    POSITIVE_INT,
    QK_NORMS,
    REMAT,
    ROPE_SCALINGS,
    ROUTERS,
    SCHEDULES,
    Domain,
    between,
    check_checkpoint,
    check_context_parallel,
    check_data,
    check_eval,
    check_metrics,
    check_model_and_optim,
    check_monitor,
    check_optimizer,
    check_platform,
    check_values,
    one_of,
    resolve_units,
)
from maxlm.runtime.errors import ConfigError  # noqa: F401  (config_lib.ConfigError)


class _Section:
    """One section of the defaults as it is declared: `s.key = default, DOMAIN` (the domains:
    maxlm/config/rules.py), or `s.key = default` for a string or tuple that any value of its type
    suits or that a cross-field rule checks. A number or a bool without a domain is refused here,
    so every such key has one. `defaults()` gives the plain values, `domains()` the domains."""

    def __init__(self):
        object.__setattr__(self, "keys", {})  # name: (default or _Section, Domain or None)

    def __setattr__(self, name, value):
        domain = None
        if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], Domain):
            value, domain = value
        if domain is None and isinstance(value, (bool, int, float)):
            raise TypeError(f"config key {name} = {value!r} needs a domain: `s.{name} = {value!r}, DOMAIN`")
        self.keys[name] = (value, domain)

    def __getattr__(self, name):  # `c.debug.nan_steps = ...` sets a key of the nested section
        if name not in self.keys:
            raise AttributeError(name)
        return self.keys[name][0]

    def values(self) -> ml_collections.ConfigDict:
        return ml_collections.ConfigDict({name: value.values() if isinstance(value, _Section) else value
                                          for name, (value, _) in self.keys.items()})

    def domains(self, prefix: str = "") -> dict[str, Domain]:
        out = {}
        for name, (value, domain) in self.keys.items():
            if isinstance(value, _Section):
                out.update(value.domains(f"{prefix}{name}."))
            elif domain is not None:
                out[prefix + name] = domain
        return out


def defaults() -> ml_collections.ConfigDict:
    """Every key a run reads, with its default. Config files override a subset."""
    return _declared().values()


def domains() -> dict[str, Domain]:
    """{dotted key: its Domain}, in declaration order: what `resolve` checks first."""
    return _declared().domains()


def _declared() -> _Section:
    c = _Section()
    c.name = "default"
    c.seed = 0, NON_NEGATIVE
    c.steps = 1000, POSITIVE
    c.batch_size = 8, POSITIVE  # global, in sequences
    # > 0: the global batch in tokens instead (the guides' unit), resolved to batch_size =
    # batch_tokens / seq_len; batch_size is then left at its default. 0 = off
    c.batch_tokens = 0, NON_NEGATIVE_INT
    c.seq_len = 256, POSITIVE
    c.log_every_steps = 10, POSITIVE
    # What the job expects to run on, so a GPU or TPU job never trains on the CPU by accident:
    # "cpu" | "gpu" | "tpu" ("" = wherever JAX runs), and the device count (0 = any). The GPU and
    # TPU launchers set the platform.
    c.platform = "", one_of(PLATFORMS)
    c.num_devices = 0, NON_NEGATIVE_INT
    # JAX's persistent compilation cache, local or gs:// (a shared one for a multi-host job): a
    # restart or requeue loads the compiled step instead of compiling it again ("" = JAX's own
    # setting, the JAX_COMPILATION_CACHE_DIR variable or off).
    c.compile_cache_dir = ""

    c.mesh = _mesh_defaults()
    c.model = _model_defaults()
    c.optim = _optim_defaults()
    c.data = _data_defaults()
    c.checkpoint = _checkpoint_defaults()

    c.debug = _Section()
    c.debug.nan_at_step = -1, INT_OR_OFF.described("a step >= 0 or -1 (off)")  # fault injection: step N's gradients are NaN
    c.debug.nan_steps = 1, POSITIVE  # ... and the next nan_steps - 1 steps' too
    c.debug.nan_transient = True, BOOL  # only the first time those steps run in this process
    # fault injection: the batch at this data position trains at a higher lr (and the next
    # spike_batches - 1 batches), of lr times spike_lr_scale: a loss spike (maxlm/resilience/anomaly.py)
    c.debug.spike_at_batch = -1, INT_OR_OFF.described("a data position >= 0 or -1 (off)")
    c.debug.spike_batches = 1, POSITIVE_INT
    c.debug.spike_lr_scale = 1000.0, POSITIVE

    c.anomaly = _Section()  # loss-spike recovery (maxlm/resilience/anomaly.py), off by default
    c.anomaly.enabled = False, BOOL
    c.anomaly.warmup = 100, NON_NEGATIVE_INT  # losses seen before spikes are looked for
    c.anomaly.ema = 0.99, between("(0, 1)")  # decay of the loss's running mean and variance
    c.anomaly.spike_sigma = 6.0, POSITIVE  # a spike: loss > mean + spike_sigma x deviation
    c.anomaly.max_spikes = 3, POSITIVE_INT  # consecutive spikes before rolling back
    c.anomaly.skip_batches = 200, POSITIVE_INT  # batches skipped from the restored step on (at least through the spike)
    c.anomaly.max_rollbacks = 3, NON_NEGATIVE_INT  # rollbacks without a checkpoint past the spike before stopping (exit 3)

    c.eval = _Section()
    c.eval.every_steps = 100, NON_NEGATIVE  # 0 disables periodic eval
    c.eval.steps = 4, POSITIVE  # validation batches per eval
    c.eval.sets = ()  # more held-out sets: ((name, source), ...), each logged as eval/<name>/loss
    c.eval.tasks = ()  # task .jsonl files scored at each eval (maxlm/eval/tasks.py): eval/<stem>/acc, ...
    c.eval.task_shots = 0, NON_NEGATIVE_INT  # few-shot examples before each task example
    # the validation loss in this many equal spans of the position in the document: is the context used? (0: off)
    c.eval.position_buckets = 8, NON_NEGATIVE_INT

    c.metrics = _Section()
    c.metrics.tensorboard = True, BOOL
    c.metrics.wandb = False, BOOL  # Weights & Biases too (the optional wandb package: make install-wandb)
    c.metrics.wandb_project = "maxlm"
    c.metrics.wandb_entity = ""  # the W&B team or user ("": the API key's default)
    c.metrics.wandb_run_id = ""  # "": the one made at the workdir's first start (WORKDIR/wandb_run_id)

    # The pretraining guides' ranges, watched on the logged rows (maxlm/observe/monitor.py): a
    # warning and a marker (monitor/<name>_out_of_range) when a quantity stays outside its range
    # for `patience` rows. A bound of 0 is none; a watch with none is off.
    c.monitor = _Section()
    c.monitor.enabled = True, BOOL  # False: no watch at all
    c.monitor.patience = 5, POSITIVE_INT  # consecutive logged rows outside before the warning
    c.monitor.grad_norm_low = 0.5, NON_NEGATIVE  # the guides' 0.5-2, after the warmup
    c.monitor.grad_norm_high = 2.0, NON_NEGATIVE
    # ||update|| / ||params|| of each step, after the warmup: about 10 x lr with AdamW (docs/observability.md)
    c.monitor.update_ratio_low = 1e-4, NON_NEGATIVE
    c.monitor.update_ratio_high = 3e-2, NON_NEGATIVE
    c.monitor.memory_high = 0.95, between("[0, 1]")  # the peak memory's share of the device's (GPU, TPU)
    c.monitor.mfu_low = 0.2, between("[0, 1]")  # accelerators only

    c.profile = _Section()  # a jax.profiler trace of a few steps (maxlm/observe/profiler.py)
    c.profile.start_step = 5, NON_NEGATIVE_INT  # the first traced step (after the compile and warm-up)
    c.profile.num_steps = 0, NON_NEGATIVE_INT  # 0 = off
    return c


def _mesh_defaults() -> _Section:
    s = _Section()  # each axis's size: -1 = all devices left after the other axes (one axis at most)
    s.stage = 1, MESH_SIZE  # pipeline parallelism: layers split over this many stages (GPipe)
    s.data = 1, MESH_SIZE
    s.fsdp = -1, MESH_SIZE
    s.expert = 1, MESH_SIZE  # expert parallelism: MoE experts split over it (data parallelism outside them)
    s.sequence = 1, MESH_SIZE  # sequence parallelism: activations split along the length dimension
    s.tensor = 1, MESH_SIZE
    # Multi-slice / multi-node: how many granules (TPU slices; GPU/CPU processes) the data, fsdp
    # and expert axes are split across, over DCN/the network; the rest of each axis is within a granule.
    s.dcn_data = 1, POSITIVE_INT
    s.dcn_fsdp = 1, POSITIVE_INT
    s.dcn_expert = 1, POSITIVE_INT
    s.rules = DEFAULT_RULES
    return s


def _model_defaults() -> _Section:
    s = _Section()
    s.num_layers = 4, POSITIVE
    s.d_model = 256, POSITIVE
    s.num_heads = 4, POSITIVE
    s.num_kv_heads = 4, POSITIVE
    s.head_dim = 0, NON_NEGATIVE  # 0: d_model // num_heads
    s.mlp_dim = 768, POSITIVE
    s.vocab_size = 384, POSITIVE
    s.tie_embeddings = False, BOOL
    s.rope_theta = 10000.0, POSITIVE
    s.positions = "rope", one_of(POSITIONS)  # rotary in attention, or added to the embeddings
    # RoPE scaling for context extension (maxlm/model/positions.py; transformers' rope_parameters
    # names): Llama 3.1's rule or YaRN, from a model trained at rope_original_max_len
    s.rope_scaling = "none", one_of(ROPE_SCALINGS)
    s.rope_scaling_factor = 0.0, NON_NEGATIVE  # > 1 with a scaling: how much longer (`factor`); 0: none
    s.rope_original_max_len = 0, NON_NEGATIVE_INT  # the length trained at before (`original_max_position_embeddings`)
    s.rope_low_freq_factor = 1.0, POSITIVE  # llama3: wavelengths above original/this are divided by factor
    s.rope_high_freq_factor = 4.0, POSITIVE  # llama3: wavelengths below original/this are kept
    s.rope_beta_fast = 32.0, POSITIVE  # yarn: rotations over the original length above which a frequency is kept
    s.rope_beta_slow = 1.0, POSITIVE  # yarn: ... below which it is divided by factor
    s.max_positions = 0, NON_NEGATIVE_INT  # the learned table's rows (positions="learned"); 0: seq_len
    s.norm_eps = 1e-5, POSITIVE
    # where each block's RMSNorms sit: before each sublayer (Llama), on its output before the
    # residual add (OLMo 2), or both (Gemma 2/3)
    s.norm_placement = "pre", one_of(NORM_PLACEMENTS)
    s.norm = "rmsnorm", one_of(NORMS)  # the blocks' and the final norm: RMSNorm, or LayerNorm with a bias (GPT-2)
    s.norm_plus_one = False, BOOL  # RMSNorm scales by 1 + w, w stored and initialised at 0 (Gemma)
    s.scale_embeddings = False, BOOL  # token embeddings times √d_model (Gemma)
    # the dense MLP: SiLU-gated (Llama), tanh-GeLU-gated (Gemma), or ungated tanh GeLU (GPT-2)
    s.mlp_activation = "swiglu", one_of(MLP_ACTIVATIONS)
    s.use_bias = False, BOOL  # biases in every projection, attention's and the MLP's (GPT-2)
    s.qkv_bias = False, BOOL  # biases in the query, key and value projections only (Qwen2)
    # > 0: each token attends to itself and the sliding_window - 1 tokens before it (Mistral; 0: the
    # whole causal prefix); the compute falls with it in the splash and cuDNN kernels
    s.sliding_window = 0, NON_NEGATIVE_INT
    # local (L: the sliding window) and global (G: the whole causal prefix) layers, the pattern
    # repeating from the bottom layer up: Gemma 3 "LLLLLG", OLMo 3 "LLLG" ("": every layer alike)
    s.layer_pattern = ""
    s.rope_theta_local = 0.0, NON_NEGATIVE  # with a layer_pattern: the local layers' RoPE base, unscaled (0: rope_theta)
    s.attn_logit_softcap = 0.0, NON_NEGATIVE  # > 0: attention scores = c·tanh(scores / c) (Gemma 2's 50); 0: off
    # grouped-query attention, or DeepSeek-V2/V3's multi-head latent attention (maxlm/model/mla.py),
    # whose keys and values come from a kv_lora_rank latent (the KV cache holds it) with RoPE on
    # qk_rope_head_dim separate dims; defaults: DeepSeek-V3's (transformers' names)
    s.attention_kind = "gqa", one_of(ATTENTION_KINDS)
    s.q_lora_rank = 1536, NON_NEGATIVE_INT  # mla: the queries' bottleneck (0: a full projection)
    s.kv_lora_rank = 512, POSITIVE_INT  # mla: the keys' and values' latent
    s.qk_nope_head_dim = 128, POSITIVE_INT  # mla: each head's query/key dims without RoPE
    s.qk_rope_head_dim = 64, POSITIVE_INT  # mla: ... with RoPE (one key for all heads)
    s.v_head_dim = 128, POSITIVE_INT  # mla: each head's value dims
    s.qk_norm = "none", one_of(QK_NORMS)  # RMSNorm of queries and keys before RoPE: each head's (Qwen3), or whole (OLMo 2)
    s.dtype = "float32", one_of(DTYPES)  # compute dtype; parameters are always float32
    s.init_std = 0.02, NON_NEGATIVE
    s.scan_layers = True, BOOL  # one compiled layer body (compile time flat in depth)
    s.pipeline_microbatches = 1, POSITIVE_INT  # with mesh.stage > 1: microbatches per step in the pipeline
    s.pipeline_repeats = 1, POSITIVE_INT  # > 1: circular pipeline, each stage holding this many layer chunks
    s.remat = "none", one_of(REMAT)  # activation rematerialisation policy
    s.attention = "auto", one_of(ATTENTION)  # the log says which one ran
    # how attention crosses mesh.sequence (docs/long-context.md): gather K/V whole, pass K/V blocks
    # around a ring (maxlm/model/parallel/ring_attention.py), or trade the length split for a heads split
    # (maxlm/model/parallel/ulysses.py); load balancing (ring): zig-zag token order
    s.context_parallel = "all_gather", one_of(CONTEXT_PARALLEL)
    s.context_load_balance = False, BOOL
    # splash attention's query and key/value tiles: multiples of 128 dividing seq_len (0: the
    # largest of 512, 256, 128 that divides it)
    s.splash_block_q = 0, NON_NEGATIVE_INT
    s.splash_block_kv = 0, NON_NEGATIVE_INT
    s.fp8 = False, BOOL  # layer weight matmuls with float8 operands (maxlm/model/kernels/fp8.py)
    s.logits_chunk_size = 0, NON_NEGATIVE  # >0: the loss computes logits this many positions at a time
    s.final_logit_softcap = 0.0, NON_NEGATIVE  # > 0: logits = c·tanh(logits / c), bounded by c (Gemma 2's 30); 0: off
    s.z_loss = 0.0, NON_NEGATIVE  # weight of log²Z in the objective (PaLM uses 1e-4)
    s.label_smoothing = 0.0, between("[0, 1)")
    # Mixture of experts (maxlm/model/moe/, docs/moe.md): the SwiGLU of every layer after the
    # first `first_dense_layers` becomes `num_experts` SwiGLU experts, `experts_per_token` per token
    s.num_experts = 0, NON_NEGATIVE_INT  # 0: a dense model
    s.experts_per_token = 2, POSITIVE_INT
    s.expert_mlp_dim = 0, NON_NEGATIVE_INT  # each expert's hidden size; 0: mlp_dim
    s.shared_experts = 0, NON_NEGATIVE_INT  # always-on experts beside the routed ones (DeepSeek, Qwen2-MoE)
    s.first_dense_layers = 0, NON_NEGATIVE_INT  # layers kept dense at the bottom (DeepSeek-V3: 3)
    s.router = "softmax", one_of(ROUTERS)  # softmax: Mixtral, Qwen3; sigmoid: DeepSeek-V3
    s.router_renormalize = True, BOOL  # softmax: the top-k gates scaled to sum 1
    s.router_scale = 1.0, POSITIVE  # the gates times this (DeepSeek-V3's routed scaling factor)
    s.router_groups = 0, NON_NEGATIVE_INT  # group-limited routing: experts in this many groups (0: off) ...
    s.router_topk_groups = 0, NON_NEGATIVE_INT  # ... of which each token's best this many are eligible
    s.load_balance = "aux_loss", one_of(LOAD_BALANCE)  # Switch/GShard's auxiliary loss, DeepSeek-V3's bias, or none
    s.load_balance_weight = 0.01, NON_NEGATIVE  # the auxiliary loss's weight
    s.bias_update_rate = 1e-3, POSITIVE  # load_balance=bias: each step's move of the bias (DeepSeek-V3's gamma)
    s.router_z_loss = 0.0, NON_NEGATIVE  # weight of the router's log²Z (ST-MoE uses 1e-3)
    s.capacity_factor = 0.0, NON_NEGATIVE  # 0: dropless; > 0: each expert takes this x its fair share, drops the rest
    s.grouped_matmul = "auto", one_of(GROUPED_MATMUL)  # dropless experts' kernel; auto: megablox on TPUs, tiled on CPUs and GPUs
    s.expert_dispatch = "auto", one_of(EXPERT_DISPATCH)  # dropless tokens to mesh.expert; auto: ragged_all_to_all on GPUs/TPUs
    # DeepSeek-V3's multi-token prediction (maxlm/model/mtp.py): this many modules after the trunk,
    # module k predicting the token k + 1 ahead; the objective adds mtp_loss_weight x their mean loss
    s.mtp_depth = 0, NON_NEGATIVE_INT  # 0: off
    s.mtp_loss_weight = 0.3, NON_NEGATIVE  # λ (DeepSeek-V3: 0.3, then 0.1 for the last tokens)
    return s


def _optim_defaults() -> _Section:
    s = _Section()
    s.name = "adamw", one_of(OPTIMIZERS)
    s.lr = 3e-4, POSITIVE  # peak, reached after warmup
    s.schedule = "cosine", one_of(SCHEDULES)  # docs/architecture.md#optimizers-and-schedules
    s.warmup_steps = 100, NON_NEGATIVE
    # > 0: the warmup as this share of `steps` instead (the guides' 1-3%), resolved to
    # warmup_steps (at least 1), which is then left at its default. 0 = off
    s.warmup_fraction = 0.0, between("[0, 1]")
    s.decay_steps = 0, NON_NEGATIVE  # 0: decay over the whole run (`steps`)
    s.min_lr_ratio = 0.1, between("[0, 1]")  # the decay's floor as a fraction of lr
    s.power = 1.0, POSITIVE  # schedule "polynomial": the decay's exponent
    s.boundaries = ()  # schedule "step": the steps where lr is multiplied by decay_factor
    s.decay_factor = 0.1, between("(0, 1)")  # schedule "step"
    s.decay_fraction = 0.2, between("(0, 1]")  # schedule "wsd": the share of decay_steps spent decaying, at the end
    # the peak lr times (batch_size / lr_reference_batch) ** (1/2 | 1)
    s.lr_batch_scaling = "none", one_of(LR_BATCH_SCALING)
    s.lr_reference_batch = 0, NON_NEGATIVE_INT  # the batch size optim.lr was tuned at (needed with scaling)
    s.clip_norm = 1.0, NON_NEGATIVE  # 0 disables clipping
    s.weight_decay = 0.1, NON_NEGATIVE
    s.b1 = 0.9, between("[0, 1)")
    s.b2 = 0.95, between("[0, 1)")
    s.eps = 1e-8, POSITIVE
    s.grad_accum_steps = 1, POSITIVE_INT  # microbatches per step, accumulated inside the jitted step
    s.shard_state_over_data = False, BOOL  # ZeRO-1: optimizer state also sharded over mesh.data
    s.mu_dtype = "float32", one_of(MU_DTYPES)  # first moment's dtype (adamw, lion, muon)
    # optim.name="muon" (maxlm/optim/muon.py): Muon on the weight matrices at optim.lr, AdamW (b1,
    # b2, eps) on the embeddings, head, norms and biases; weight_decay on the matrices of both
    s.muon_momentum = 0.95, between("[0, 1)")
    s.muon_nesterov = True, BOOL
    s.muon_ns_steps = 5, POSITIVE_INT  # Newton-Schulz iterations
    # the update's RMS, as AdamW's: x·sqrt(max(fan_in, fan_out)) (Moonlight's 0.2, so optim.lr
    # and weight_decay carry over from AdamW); 0: Keller Jordan's sqrt(max(1, fan_out / fan_in))
    s.muon_consistent_rms = 0.2, NON_NEGATIVE
    s.muon_adam_lr = 0.0, NON_NEGATIVE  # the AdamW part's peak lr (0: optim.lr), batch-scaled like it
    # dynamic loss scaling, on with model.dtype="float16" only (maxlm/optim/loss_scale.py)
    s.loss_scale_init = 2.0**15, POSITIVE
    s.loss_scale_growth_interval = 2000, POSITIVE_INT.described("a positive int (good steps before the loss scale doubles)")
    s.loss_scale_min = 1.0, POSITIVE  # halving stops here; a non-finite step at the min is a bad step
    return s


def _data_defaults() -> _Section:
    s = _Section()
    s.source = "tfds:python_stdlib"
    # several sources by weight instead: ((name, source, weight), ...); data.source is then unused
    s.mixture = ()
    s.tfds_dir = "~/.cache/maxlm/tensorflow_datasets"
    s.cache_dir = "~/.cache/maxlm/packed"
    s.tokenizer = "byte"  # "byte", or a sentencepiece .model, a HF tokenizer.json or a tiktoken file (docs/data.md#tokenizers)
    # a tokenizer file's bos/eos/pad tokens by their text; "" = found by name among its special tokens
    s.bos_token = ""
    s.eos_token = ""
    s.pad_token = ""  # "" and none found by name: eos
    s.tokenizer_pattern = ""  # a tiktoken file's pre-tokenizer regex; "" = Llama 3's
    s.tokenizer_special_tokens = ""  # a tiktoken file's special tokens after its ranks, comma-separated; "" = Llama 3's 256
    s.text_key = "text"  # the text field of .jsonl/.parquet files and TFDS examples
    s.txt_documents = "file", one_of(("file", "paragraph"))  # .txt: one document per file, or per blank-line block
    s.validation_percent = 2.0, between("[0, 100]")  # local files: share of documents (by stable hash) in validation
    # broken JSON line / missing text_key: "error" (exit 2) or "skip" (counted)
    s.bad_records = "error", one_of(("error", "skip"))
    s.tokenizer_vocab_size = 0, NON_NEGATIVE  # `python -m maxlm.data tokenizer`: 0 = model.vocab_size
    s.tokenizer_sample_docs = 20000, POSITIVE  # documents sampled to train the tokenizer
    s.workers = 0, NON_NEGATIVE_INT  # processes that prepare the packed cache (maxlm/data/prepare/build.py); 0 = one per core
    s.shard_mb = 64.0, POSITIVE  # local files: consecutive files of about this many MB form one shard
    s.shard_examples = 100_000, POSITIVE_INT  # TFDS sources: examples per shard
    # A resume where a key the batches depend on changed (batch_size, seq_len, seed, the source,
    # mixture, tokenizer or filters: data.STREAM_KEYS): "same" refuses it (exit 2), "tokens"
    # continues after the tokens already read, "start" reads the new stream from its beginning
    s.resume_position = "same", one_of(("same", "tokens", "start"))
    s.filters = _Section()
    s.filters.min_words = 0, NON_NEGATIVE  # 0 = off
    s.filters.max_symbol_ratio = 0.0, between("[0, 1]")  # 0 = off; else drop docs with more non-alnum, non-space chars
    s.filters.max_repeated_word_share = 0.0, between("[0, 1]")  # 0 = off; else drop docs whose top word exceeds this share
    s.filters.max_repeated_word_count = 0, NON_NEGATIVE_INT  # 0 = off; else drop docs whose top word occurs more often
    # Unicode NFKC form for the documents, before the other filters and the tokenizer (so trained on)
    s.filters.nfkc = False, BOOL
    s.filters.html = False, BOOL  # documents are HTML: keep their main text (resiliparse)
    s.filters.languages = ()  # keep only these languages by fastText's lid.176 ("en", "de", ...); () = all
    s.filters.min_language_score = 0.65, between("[0, 1]")  # ... with at least this probability (FineWeb's for English)
    s.filters.dedup = False, BOOL  # drop exact duplicates (content hash) within a split
    s.filters.near_dedup = False, BOOL  # drop near duplicates (MinHash-LSH) within a split
    s.filters.near_dedup_ngram = 5, POSITIVE_INT  # words per shingle
    s.filters.near_dedup_bands = 14, POSITIVE_INT  # LSH bands ...
    s.filters.near_dedup_rows = 8, POSITIVE_INT  # ... of this many hashes each (FineWeb's 14 x 8)
    return s


def _checkpoint_defaults() -> _Section:
    s = _Section()
    s.every_steps = 100, POSITIVE
    s.max_to_keep = 3, POSITIVE  # newest regular checkpoints kept
    s.keep_period = 0, NON_NEGATIVE  # also keep every step that is a multiple of this forever (0 = off)
    s.every_minutes = 0.0, NON_NEGATIVE  # time-based temporary saves, replaced by the next (0 = off)
    s.max_bad_steps = 3, POSITIVE  # consecutive non-finite (skipped) steps before a restore
    s.max_restores = 2, NON_NEGATIVE  # such restores without progress before stopping (exit 3)
    s.restore_lr_scale = 1.0, between("(0, 1]")  # lr multiplier applied at each such restore
    s.restore_from = ""  # start a fresh workdir from another run's checkpoint
    s.restore_params_only = False, BOOL  # with restore_from: params only (step 0, new optimizer)
    s.init_from_hf = ""  # a fresh workdir starts from a local HF Llama folder (maxlm/hf/files.py)
    # the host-local tier (docs/checkpoints.md#two-tiers): each host's own disk, "" = off; "{process}"
    # in the path becomes the process index (several processes on one machine or one filesystem)
    s.local_dir = ""
    s.local_every_steps = 10, POSITIVE_INT  # a local save every this many steps
    s.local_max_to_keep = 2, POSITIVE_INT  # newest local saves kept (never touches the persistent tier)
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
    check_values(c, domains())
    resolve_units(c, defaults())  # batch_tokens, optim.warmup_fraction: before the rules that read batch_size, warmup_steps
    check_monitor(c)
    check_platform(c, num_devices, platform)
    check_model_and_optim(c)
    check_optimizer(c)
    mesh_axes.check_mesh(c, num_devices, num_granules)
    check_context_parallel(c)
    check_data(c)
    check_eval(c)
    check_metrics(c)
    check_checkpoint(c)
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
