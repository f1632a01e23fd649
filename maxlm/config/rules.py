"""What a valid run config is: the kinds of domain a key may have and the rules between keys.

`config.resolve` runs these in order: first every key's domain, declared beside its default in
maxlm/config/ (`check_values`: the first value outside its domain raises), then the cross-field
rules, each raising a one-line `ConfigError` that names the keys and values involved. Some also
fill derived values (`model.head_dim`, `model.max_positions`, `optim.decay_steps`; `batch_size` and
`optim.warmup_steps` from the guides' units, `resolve_units`).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable

from maxlm.config import layer_kinds
from maxlm.runtime.errors import ConfigError

PLATFORMS = ("", "cpu", "gpu", "tpu")  # platform: what jax.default_backend() must say ("" = any)
DTYPES = ("float32", "bfloat16", "float16")  # model.dtype: compute; float16 turns on loss scaling
MU_DTYPES = ("float32", "bfloat16")  # optim.mu_dtype
OPTIMIZERS = ("adamw", "lion", "adafactor", "muon")  # optim.name; see maxlm/optim/optimizers.py
SCHEDULES = ("cosine", "linear", "polynomial", "step", "wsd", "constant", "inverse_sqrt")  # optim.schedule
LR_BATCH_SCALING = ("none", "sqrt", "linear")  # optim.lr_batch_scaling
REMAT = ("none", "full", "save_dots", "save_qkv_proj", "save_out_proj")  # see model.REMAT_POLICIES
ATTENTION = ("auto", "xla", "cudnn", "splash")  # see attention.attention_backend
POSITIONS = ("rope", "sinusoidal", "learned")  # model.positions: see maxlm/model/positions.py
ROPE_SCALINGS = ("none", "linear", "llama3", "yarn")  # model.rope_scaling: see maxlm/model/positions.py
ATTENTION_KINDS = ("gqa", "mla")  # model.attention_kind: transformer.py Attention, or mla.py LatentAttention
QK_NORMS = ("none", "per_head", "full")  # model.qk_norm: see maxlm/model/transformer.py Attention
NORM_PLACEMENTS = ("pre", "post", "sandwich")  # model.norm_placement: see maxlm/model/transformer.py Block
NORMS = ("rmsnorm", "layernorm")  # model.norm: see maxlm/model/norms.py
MLP_ACTIVATIONS = ("swiglu", "geglu", "gelu")  # model.mlp_activation: see maxlm/model/transformer.py MLP
ROUTERS = ("softmax", "sigmoid")  # model.router: see maxlm/model/moe/
LOAD_BALANCE = ("aux_loss", "bias", "none")  # model.load_balance: see maxlm/model/moe/router_bias.py for bias
GROUPED_MATMUL = ("auto", "ragged_dot", "tiled", "megablox")  # see grouped_matmul.grouped_matmul_backend
EXPERT_DISPATCH = ("auto", "all_gather", "ragged_all_to_all")  # see expert_parallel.dispatch_backend
CONTEXT_PARALLEL = ("all_gather", "ring", "ulysses")  # model.context_parallel: docs/long-context.md
SPLASH_BLOCK = 128  # splash attention's tiles are multiples of the TPU's 128 lanes (maxlm/model/attention.py)


# Domains: the values one key may take. Each key's domain is declared beside its default in
# maxlm/config/*_keys.py (`s.lr = key(3e-4, POSITIVE, doc)`); `check_values` checks them all, first.
@dataclasses.dataclass(frozen=True)
class Domain:
    """What a key's values must be (`what`: the error says "KEY must be WHAT, got VALUE"), the
    `test` a value passes when it is one of them, and their Python `type` (int, float, bool or
    str): a key's default is of it, and docs/config.md names it. No number domain holds NaN or an
    infinity; a float domain holds ints too (`--config.lr=1`)."""

    what: str
    test: Callable[[object], bool]
    type: type

    def described(self, what: str) -> Domain:
        """The same values, with `what` saying more of what they mean."""
        return Domain(what, self.test, self.type)


def _is_number(value, kinds=(int, float)) -> bool:
    """A finite int or float (not a bool): NaN and inf are in no key's domain."""
    return isinstance(value, kinds) and not isinstance(value, bool) and math.isfinite(value)


POSITIVE = Domain("a positive finite number", lambda v: _is_number(v) and v > 0, float)
NON_NEGATIVE = Domain("a finite number >= 0", lambda v: _is_number(v) and v >= 0, float)
POSITIVE_INT = Domain("a positive int", lambda v: _is_number(v, int) and v > 0, int)
NON_NEGATIVE_INT = Domain("an int >= 0", lambda v: _is_number(v, int) and v >= 0, int)
INT_OR_OFF = Domain("an int >= 0 or -1 (off)", lambda v: _is_number(v, int) and v >= -1, int)
MESH_SIZE = Domain("a positive int or -1", lambda v: _is_number(v, int) and (v > 0 or v == -1), int)  # -1: filled by resolve
BOOL = Domain("True or False", lambda v: isinstance(v, bool), bool)


def between(interval: str) -> Domain:
    """The finite numbers in `interval`, written as the error shows it: "[0, 1)", "(0, 1]", ..."""
    low, high = (float(x) for x in interval[1:-1].split(","))
    above = (lambda v: v >= low) if interval[0] == "[" else (lambda v: v > low)
    below = (lambda v: v <= high) if interval[-1] == "]" else (lambda v: v < high)
    return Domain(f"in {interval}", lambda v: _is_number(v) and above(v) and below(v), float)


def one_of(choices: tuple) -> Domain:
    return Domain(f"one of {choices}", lambda v: v in choices, type(choices[0]))


def _get(c, key):
    for part in key.split("."):
        c = c[part]
    return c


def check_values(c, domains: dict[str, Domain]) -> None:
    """Each key of `domains` ({dotted key: Domain}, in declaration order) against its domain: the
    first value outside it raises ConfigError."""
    for key, domain in domains.items():
        if not domain.test(value := _get(c, key)):
            raise ConfigError(f"{key} must be {domain.what}, got {value!r}")


def resolve_units(c, default, assigned=None, flags=frozenset()) -> None:
    """The guides' units, resolved to the keys the run reads (right after the domains, before
    any rule reads those): `batch_tokens` > 0 to `batch_size` = batch_tokens / seq_len sequences,
    `optim.warmup_fraction` > 0 to `optim.warmup_steps` = that share of `steps` (at least 1).

    Each is an alternative to the other key. `assigned`: the keys the user set (the config file's
    and the flags'; `flags`: the flags' alone). A unit given beside its alternative set to another
    value is refused, naming both, unless the unit came from a flag and the alternative from the
    file alone: the command line wins. Where what the user set is unknown (None: a config.json read
    back), the alternative must be at its default (`default`: the defaults' config) or hold the
    value resolved already, as a recorded config does, so that it resolves again to itself."""
    for unit, target, resolved, said in (("batch_tokens", "batch_size", _batch_sequences, "sequences of seq_len={c.seq_len}"),
                                         ("optim.warmup_fraction", "optim.warmup_steps", _warmup_steps, "of steps={c.steps}")):
        if not _get(c, unit):
            continue
        value, old = resolved(c), _get(c, target)
        if old != value:
            if assigned is None:
                conflict = old != _get(default, target)
            else:
                conflict = target in assigned and not (unit in flags and target not in flags)
            if conflict:
                where = "" if assigned is None else " (both in the config file, or both on the command line)"
                raise ConfigError(f"{unit}={_get(c, unit):g} (= {value} {said.format(c=c)}) and {target}={old} are both "
                                  f"set{where}: give one of them")
        section, _, name = target.rpartition(".")
        (c[section] if section else c)[name] = value


def _batch_sequences(c) -> int:
    sequences = c.batch_tokens // c.seq_len
    if c.batch_tokens % c.seq_len:
        nearest = " or ".join(str(n * c.seq_len) for n in (sequences, sequences + 1) if n)
        raise ConfigError(f"batch_tokens={c.batch_tokens} must be divisible by seq_len={c.seq_len}: the batch "
                          f"is whole sequences ({nearest} tokens)")
    return sequences


def _warmup_steps(c) -> int:
    return max(1, math.floor(c.optim.warmup_fraction * c.steps + 0.5))


def check_monitor(c) -> None:
    """Each watched range's bounds in order (a bound of 0 is none)."""
    for name in ("grad_norm", "update_ratio"):
        low, high = c.monitor[f"{name}_low"], c.monitor[f"{name}_high"]
        if low and high and low >= high:
            raise ConfigError(f"monitor.{name}_low={low:g} must be below monitor.{name}_high={high:g} "
                              "(0: no bound)")


def check_platform(c, num_devices: int, platform: str | None) -> None:
    if c.platform and platform is not None and platform != c.platform:
        raise ConfigError(
            f"platform={c.platform!r} but JAX runs on {platform!r} here (JAX_PLATFORMS="
            f"{os.environ.get('JAX_PLATFORMS', '')!r}): is jax for {c.platform.upper()} installed in "
            "this environment (a CUDA build for gpu, jax[tpu] for tpu) and the accelerator visible?")
    if c.num_devices and c.num_devices != num_devices:
        raise ConfigError(f"num_devices={c.num_devices} but JAX sees {num_devices} devices here")
    if c.model.grouped_matmul == "megablox" and platform not in (None, "tpu"):
        raise ConfigError(f"model.grouped_matmul='megablox' is a TPU kernel, and this runs on {platform!r}; "
                          "use 'auto' or 'ragged_dot'")
    kernel_platform = {"splash": "tpu", "cudnn": "gpu"}.get(c.model.attention)
    if kernel_platform and platform not in (None, kernel_platform):
        raise ConfigError(f"model.attention={c.model.attention!r} is a {kernel_platform.upper()} kernel, and this runs "
                          f"on {platform!r}; use 'auto' or 'xla'")


def _check_experts(c) -> None:
    """The mixture-of-experts keys against each other and the layers; fills model.expert_mlp_dim."""
    m = c.model
    if not m.num_experts:
        return
    if m.experts_per_token > m.num_experts:
        raise ConfigError(f"model.experts_per_token={m.experts_per_token} is more than model.num_experts="
                          f"{m.num_experts}: a token cannot go to more experts than there are")
    if m.first_dense_layers >= m.num_layers:
        raise ConfigError(f"model.first_dense_layers={m.first_dense_layers} leaves no MoE layer of "
                          f"model.num_layers={m.num_layers}; lower it, or set model.num_experts=0 for a dense model")
    if m.router_groups:
        if m.num_experts % m.router_groups:
            raise ConfigError(f"model.router_groups={m.router_groups} must divide model.num_experts={m.num_experts}")
        per_group = m.num_experts // m.router_groups
        if not 1 <= m.router_topk_groups <= m.router_groups or m.router_topk_groups * per_group < m.experts_per_token:
            raise ConfigError(f"model.router_topk_groups={m.router_topk_groups} must be in [1, router_groups="
                              f"{m.router_groups}] and hold at least experts_per_token={m.experts_per_token} "
                              f"experts ({per_group} a group)")
    if m.expert_mlp_dim == 0:
        m.expert_mlp_dim = m.mlp_dim


def _check_layer_kinds(c) -> None:
    """The MLP activation and biases, which the dense MLP has and the experts do not; Gemma's norm
    weight, which RMSNorm has and LayerNorm does not."""
    m = c.model
    if m.norm_plus_one and m.norm != "rmsnorm":
        raise ConfigError(f"model.norm_plus_one=True is Gemma's RMSNorm weight (1 + w); model.norm={m.norm!r} has "
                          "its own scale and bias: set model.norm='rmsnorm' or model.norm_plus_one=False")
    if m.num_experts and (m.mlp_activation != "swiglu" or m.use_bias):
        key = "model.mlp_activation=" + repr(m.mlp_activation) if m.mlp_activation != "swiglu" else "model.use_bias=True"
        raise ConfigError(f"{key} is not supported with model.num_experts={m.num_experts} (the experts are "
                          "SwiGLU without biases); use it with a dense model")


def _check_attention_shape(c) -> None:
    """The sliding window's length and the soft cap's kernels, and the layer pattern."""
    m = c.model
    if m.sliding_window and m.sliding_window >= c.seq_len:
        raise ConfigError(f"model.sliding_window={m.sliding_window} must be below seq_len={c.seq_len}, where it "
                          "would see every token anyway; use 0 (full causal attention)")
    if m.attn_logit_softcap and m.attention == "cudnn":
        raise ConfigError(f"model.attn_logit_softcap={m.attn_logit_softcap:g} is not supported with "
                          "model.attention='cudnn' (cuDNN has no soft cap); use 'auto' or 'xla'")
    _check_layer_pattern(c)


def _check_latent_attention(c) -> None:
    """Multi-head latent attention's keys against the rest of the block; fills model.head_dim with
    its query/key width (qk_nope_head_dim + qk_rope_head_dim)."""
    m = c.model
    if m.attention_kind != "mla":
        return
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    refused = [why for bad, why in (
        (m.positions != "rope", f"model.positions={m.positions!r} (its keys' RoPE dims are its own: 'rope')"),
        (m.qk_norm != "none", f"model.qk_norm={m.qk_norm!r} (its latents have their own norms: 'none')"),
        (m.use_bias or m.qkv_bias, "model.use_bias/qkv_bias=True (its projections have no biases)"),
        (m.num_kv_heads != m.num_heads, f"model.num_kv_heads={m.num_kv_heads} (each head has its own key and value "
                                        f"from the latent: set it to model.num_heads={m.num_heads})"),
        (m.head_dim not in (0, qk), f"model.head_dim={m.head_dim} (its query/key heads are qk_nope_head_dim + "
                                    f"qk_rope_head_dim = {qk} wide: set 0)"),
        (m.qk_rope_head_dim % 2, f"model.qk_rope_head_dim={m.qk_rope_head_dim} (RoPE rotates pairs: an even number)"),
    ) if bad]
    if refused:
        raise ConfigError("model.attention_kind='mla' is not supported with " + "; ".join(refused))
    m.head_dim = qk


def _check_layer_pattern(c) -> None:
    """model.layer_pattern's letters, its window and local RoPE base, and whole pattern groups per
    pipeline chunk (a stage's chunks run one compiled body, so every chunk's layers must be of
    the same kinds in the same order)."""
    m, pattern = c.model, c.model.layer_pattern
    if set(pattern) - {"L", "G"} or (pattern and "L" not in pattern):
        raise ConfigError(f"model.layer_pattern={pattern!r} must be '' or letters L (a local layer, "
                          "model.sliding_window) and G (a global one) with at least one L, e.g. 'LLLLLG' (Gemma 3)")
    if pattern and not m.sliding_window:
        raise ConfigError(f"model.layer_pattern={pattern!r} has local layers: set model.sliding_window > 0 "
                          "(their window, in tokens)")
    if m.rope_theta_local and len(set(pattern)) < 2:
        raise ConfigError(f"model.rope_theta_local={m.rope_theta_local:g} is the local layers' RoPE base under a "
                          "model.layer_pattern of local and global layers; without one, set model.rope_theta")
    missing = set(pattern) - set(layer_kinds.kinds(m))
    if missing:  # a pattern longer than the model: Gemma 3's LLLLLG on 2 layers holds no global layer
        kind = "global (G)" if layer_kinds.GLOBAL in missing else "local (L)"
        raise ConfigError(f"model.layer_pattern={pattern!r} repeats every {len(pattern)} layers, and "
                          f"model.num_layers={m.num_layers} holds no {kind} layer of it: use at least "
                          f"{len(pattern)} layers or a shorter pattern")
    units = c.mesh.stage * m.pipeline_repeats
    dense = m.first_dense_layers if m.num_experts else 0  # the model's layer groups: dense, then MoE
    for first, count in ((0, dense), (dense, m.num_layers - dense)):
        p = layer_kinds.period(layer_kinds.kinds(m, first, count)) if count else 1
        if c.mesh.stage > 1 and p > 1 and count % (p * units):
            raise ConfigError(
                f"model.layer_pattern={pattern!r} repeats every {p} layers, and each of mesh.stage={c.mesh.stage} "
                f"x model.pipeline_repeats={m.pipeline_repeats} pipeline chunks must hold whole repeats: "
                f"{count} layers do not split so; use a multiple of {p * units} layers")


def _check_mtp(c) -> None:
    """Multi-token prediction against the rows' length."""
    depth = c.model.mtp_depth
    if depth >= c.seq_len:
        raise ConfigError(f"model.mtp_depth={depth} must be less than seq_len={c.seq_len}: depth k predicts the "
                          "token k + 1 ahead, which must be in the row")


def check_model_and_optim(c) -> None:
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
        if m[key] % SPLASH_BLOCK or (m[key] and c.seq_len % m[key]):
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
    _check_latent_attention(c)
    if m.head_dim == 0:
        if m.d_model % m.num_heads:
            raise ConfigError(
                f"model.d_model={m.d_model} must be divisible by model.num_heads={m.num_heads} "
                "(or set model.head_dim)"
            )
        m.head_dim = m.d_model // m.num_heads
    _check_positions(c)
    _check_attention_shape(c)
    _check_layer_kinds(c)
    _check_experts(c)
    _check_mtp(c)
    if c.optim.warmup_steps > c.steps:
        raise ConfigError(f"optim.warmup_steps={c.optim.warmup_steps} is longer than steps={c.steps}")
    if c.optim.decay_steps == 0:
        c.optim.decay_steps = c.steps


def check_optimizer(c) -> None:
    """Cross-field rules of optim.name, optim.schedule and the lr's batch scaling (run after
    `check_model_and_optim` has filled optim.decay_steps)."""
    o = c.optim
    if o.name == "adafactor" and o.mu_dtype != "float32":
        raise ConfigError(f"optim.mu_dtype={o.mu_dtype!r} has no effect with optim.name='adafactor', "
                          "which keeps no first moment; leave it 'float32'")
    if o.lr_batch_scaling != "none" and o.lr_reference_batch <= 0:
        raise ConfigError(f"optim.lr_batch_scaling={o.lr_batch_scaling!r} needs optim.lr_reference_batch > 0 "
                          f"(the batch size optim.lr was tuned at), got {o.lr_reference_batch}")
    _check_boundaries(c)
    if o.schedule == "inverse_sqrt" and o.warmup_steps == 0:
        raise ConfigError("optim.schedule='inverse_sqrt' needs optim.warmup_steps > 0 "
                          "(after the warmup, lr = peak·sqrt(warmup_steps / step))")
    if o.schedule == "wsd":
        start = wsd_decay_start(o)
        if start == o.decay_steps:
            raise ConfigError(f"optim.decay_fraction={o.decay_fraction:g} of optim.decay_steps={o.decay_steps} "
                              "is less than one step: schedule 'wsd' would not decay")
        if start < o.warmup_steps:
            raise ConfigError(f"optim.schedule='wsd' decays over the last optim.decay_fraction="
                              f"{o.decay_fraction:g} of optim.decay_steps={o.decay_steps} (from step {start}), "
                              f"which starts before the warmup (optim.warmup_steps={o.warmup_steps}) ends")


def _check_boundaries(c) -> None:
    o, bounds = c.optim, c.optim.boundaries
    if o.schedule != "step":
        if bounds:
            raise ConfigError(f"optim.boundaries={tuple(bounds)} is read by optim.schedule='step' only, "
                              f"got optim.schedule={o.schedule!r}")
        return
    ok = (isinstance(bounds, (tuple, list)) and len(bounds) > 0
          and all(_is_number(b, int) for b in bounds)
          and all(a < b for a, b in zip(bounds, bounds[1:]))
          and o.warmup_steps < bounds[0] and bounds[-1] < c.steps)
    if not ok:
        raise ConfigError(f"optim.boundaries must be strictly increasing ints in (optim.warmup_steps, steps) "
                          f"= ({o.warmup_steps}, {c.steps}) for optim.schedule='step', got {bounds!r}")


def wsd_decay_start(optim) -> int:
    """The step where schedule "wsd" leaves its stable phase: its decay is the last
    `decay_fraction` of `decay_steps` (a resolved config's), rounded to whole steps."""
    return optim.decay_steps - round(optim.decay_fraction * optim.decay_steps)


def _check_positions(c) -> None:
    """Each position encoding's shape rules; fills model.max_positions for a learned table."""
    m = c.model
    if m.positions == "rope" and m.head_dim % 2:
        raise ConfigError(f"model.head_dim={m.head_dim} must be even for RoPE (model.positions='rope')")
    _check_rope_scaling(m)
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


def _check_rope_scaling(m) -> None:
    """model.rope_scaling's parameters: set with a scaling only, and each rule's own order."""
    scaled = m.rope_scaling != "none"
    if not scaled:
        for key in ("rope_scaling_factor", "rope_original_max_len"):
            if m[key]:
                raise ConfigError(f"model.{key}={m[key]} is read by model.rope_scaling='linear', 'llama3' or 'yarn' only, "
                                  "got model.rope_scaling='none'")
        return
    if m.positions != "rope":
        raise ConfigError(f"model.rope_scaling={m.rope_scaling!r} scales RoPE's frequencies, and "
                          f"model.positions={m.positions!r}: use model.positions='rope' or model.rope_scaling='none'")
    if m.rope_scaling_factor <= 1:
        raise ConfigError(f"model.rope_scaling_factor={m.rope_scaling_factor} must be > 1 with model.rope_scaling="
                          f"{m.rope_scaling!r} (how many times the original length the context grows)")
    if m.rope_original_max_len == 0 and m.rope_scaling != "linear":
        raise ConfigError(f"model.rope_original_max_len must be set with model.rope_scaling={m.rope_scaling!r}: "
                          "the sequence length the model was trained at before the extension")
    if m.rope_scaling == "llama3" and m.rope_high_freq_factor <= m.rope_low_freq_factor:
        raise ConfigError(f"model.rope_high_freq_factor={m.rope_high_freq_factor} must be more than "
                          f"model.rope_low_freq_factor={m.rope_low_freq_factor} (Llama 3.1's rule)")
    if m.rope_scaling == "yarn" and m.rope_beta_fast <= m.rope_beta_slow:
        raise ConfigError(f"model.rope_beta_fast={m.rope_beta_fast} must be more than "
                          f"model.rope_beta_slow={m.rope_beta_slow} (YaRN's ramp)")


def check_data(c):
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


def check_metrics(c):
    """metrics.wandb_project and metrics.wandb_run_id: names W&B accepts (its reserved characters
    refused here, before the run starts, not by wandb.init after it)."""
    m = c.metrics
    if m.wandb and (not 0 < len(m.wandb_project) <= 128 or any(ch in m.wandb_project for ch in "/\\#?%:")):
        raise ConfigError(f"metrics.wandb_project={m.wandb_project!r} must be a W&B project name: 1 to 128 "
                          "characters, none of / \\ # ? % :")
    if m.wandb_run_id and (m.wandb_run_id != m.wandb_run_id.strip() or any(ch in m.wandb_run_id for ch in ":;,#?/'")):
        raise ConfigError(f"metrics.wandb_run_id={m.wandb_run_id!r} must be a W&B run id: no space at either end, "
                          "none of : ; , # ? / '")


def check_checkpoint(c):
    local = c.checkpoint.local_dir
    if local and "://" in local:
        raise ConfigError(f"checkpoint.local_dir is a path on each host's own disk, got {local!r}: the persistent "
                          "tier (the workdir's checkpoints/) is the one on shared storage")
    if local and c.checkpoint.local_every_steps >= c.checkpoint.every_steps:
        raise ConfigError(f"checkpoint.local_every_steps={c.checkpoint.local_every_steps} is not below "
                          f"checkpoint.every_steps={c.checkpoint.every_steps}: the local tier saves more often "
                          "than the persistent one, or it adds nothing")


def check_eval(c):
    """eval.sets: (identifier, source) pairs; eval.tasks: .jsonl paths; every name (a set's, a
    task file's stem) used once, since each names metrics `eval/<name>/...`."""
    for key in ("eval.sets", "eval.tasks"):
        if not isinstance(value := _get(c, key), (tuple, list)):
            raise ConfigError(f"{key} must be a tuple, got {value!r}")
    if c.eval.position_buckets > c.seq_len:
        raise ConfigError(f"eval.position_buckets={c.eval.position_buckets} is more than seq_len={c.seq_len}: "
                          "a bucket holds one position at least")
    names = []
    for entry in c.eval.sets:
        if not (isinstance(entry, (tuple, list)) and len(entry) == 2 and isinstance(entry[0], str)
                and entry[0].isidentifier() and isinstance(entry[1], str) and entry[1]):
            raise ConfigError(f"eval.sets entries are (name, source) with a name like 'web', got {entry!r}")
        names.append(entry[0])
    for path in c.eval.tasks:
        if not (isinstance(path, str) and path.endswith(".jsonl")):
            raise ConfigError(f"eval.tasks entries are paths of .jsonl task files, got {path!r}")
        names.append(os.path.splitext(os.path.basename(path))[0])
    if len(set(names)) != len(names):
        raise ConfigError(f"eval.sets names and eval.tasks file stems must all differ, got {names}")


def check_context_parallel(c) -> None:
    """`model.context_parallel` and `model.context_load_balance` against the resolved mesh (run
    after `mesh_axes.check_mesh`). With mesh.sequence=1 both are no-ops: there is nothing to split."""
    m, sequence = c.model, c.mesh.sequence
    if m.context_load_balance and m.context_parallel != "ring":
        raise ConfigError(f"model.context_load_balance=True needs model.context_parallel='ring', got "
                          f"{m.context_parallel!r} (the all-gather mask is causal by array index)")
    if sequence == 1 or m.context_parallel == "all_gather":
        return
    if m.context_parallel == "ulysses" and m.num_heads % (sequence * c.mesh.tensor):
        shards = sequence * c.mesh.tensor
        raise ConfigError(
            f"model.num_heads={m.num_heads} must be divisible by mesh.sequence x mesh.tensor = {sequence} x "
            f"{c.mesh.tensor} = {shards} with model.context_parallel='ulysses' (each device attends with "
            f"num_heads / {shards} heads over the whole sequence)")
    if m.context_load_balance and c.seq_len % (2 * sequence):
        raise ConfigError(f"model.context_load_balance=True needs seq_len={c.seq_len} divisible by 2 x "
                          f"mesh.sequence = {2 * sequence} (each device holds an early and a late chunk)")
    if m.context_parallel == "ring" and (m.attention == "splash" or m.splash_block_q or m.splash_block_kv):
        part = c.seq_len // sequence // (2 if m.context_load_balance else 1)  # a ring block's smallest part
        for key, tile in (("attention", SPLASH_BLOCK), ("splash_block_q", m.splash_block_q),
                          ("splash_block_kv", m.splash_block_kv)):
            if tile and part % tile:
                raise ConfigError(
                    f"model.{key}={m[key]!r} with model.context_parallel='ring' needs seq_len={c.seq_len} / "
                    f"mesh.sequence={sequence}{' / 2 (zig-zag chunks)' if m.context_load_balance else ''} = {part} "
                    f"tokens, the part of a ring block splash attends to, divisible by its tile {tile}")
    if m.context_load_balance and m.mtp_depth:
        raise ConfigError(f"model.context_load_balance=True is not supported with model.mtp_depth={m.mtp_depth} "
                          "(its modules shift the targets along the length, which the reordering breaks)")
