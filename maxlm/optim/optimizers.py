"""The optimizer: global-norm clipping → `optim.name`'s update on `optim.schedule`'s learning rate.

    tx = make_optimizer(cfg)              # the whole config: the peak lr may scale with batch_size
    schedule = learning_rate_schedule(cfg)

`optim.name`, all built from optax:
  adamw      `optax.adamw` (the default).
  lion       `optax.lion`: the sign of an interpolated momentum, one moment (b1, b2, mu_dtype).
  adafactor  optax's factored second moment (`scale_by_factored_rms`), update clipping by block
             RMS, no first moment, and AdamW's decoupled, lr-scaled weight decay (`adafactor`).
  muon       `optax.contrib.scale_by_muon` (Newton–Schulz-orthogonalised momentum) on the weight
             matrices, `optax.adamw` on the embeddings, the head, norms and biases
             (maxlm/optim/muon.py says which is which, from the logical axis names).
Each takes weight decay on matrices only (`weight_decay_mask`): norm scales (and biases, should a
model grow them) are 1-D and decaying them towards zero only hurts. docs/architecture.md
(#optimizers-and-schedules) gives the settings each reads and the usual values.

`optim.schedule`: a linear warmup 0 → peak over `warmup_steps`, then cosine | linear | polynomial
| step | wsd | constant | inverse_sqrt, from optax's schedules. The peak is `peak_lr(cfg)`:
`optim.lr`, times the batch-size scaling of `optim.lr_batch_scaling`.

Gradient accumulation (`optim.grad_accum_steps`) lives in `maxlm/train/step.py` (it needs the loss
function): a scan over microbatches inside the jitted step, then one update of this chain.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from maxlm import model
from maxlm.config.rules import wsd_decay_start
from maxlm.optim import muon

BATCH_SCALING_EXPONENT = {"sqrt": 0.5, "linear": 1.0}  # optim.lr_batch_scaling (besides "none")


def peak_lr(cfg, lr: float | None = None) -> float:
    """The peak learning rate: `optim.lr` (or `lr`), times (batch_size / lr_reference_batch) **
    (1/2 or 1) with `optim.lr_batch_scaling` "sqrt" or "linear". The recorded config keeps `optim.lr`."""
    o = cfg.optim
    lr = o.lr if lr is None else lr
    if o.lr_batch_scaling == "none":
        return lr
    return lr * (cfg.batch_size / o.lr_reference_batch) ** BATCH_SCALING_EXPONENT[o.lr_batch_scaling]


def describe(cfg) -> str:
    """The run's optimizer, schedule and peak learning rate, for its log."""
    o = cfg.optim
    peak = f"peak lr {peak_lr(cfg):.4g}"
    if o.lr_batch_scaling != "none":
        exponent = BATCH_SCALING_EXPONENT[o.lr_batch_scaling]
        peak += f" = optim.lr {o.lr:g} x ({cfg.batch_size} / {o.lr_reference_batch})^{exponent:g}"
    name = o.name
    if o.name == "muon":
        shapes = jax.eval_shape(lambda: model.init_params(cfg.model, jax.random.key(0)))
        name = muon.describe(o, model.param_logical_specs(cfg.model), shapes)
    return f"{name}, schedule {o.schedule}, {peak}"


def learning_rate_schedule(cfg, lr: float | None = None) -> optax.Schedule:
    """`optim.schedule` with its linear warmup from 0 (a resolved config: `decay_steps` filled), to
    the peak of `optim.lr` (or of `lr`: Muon's AdamW part, `optim.muon_adam_lr`)."""
    o, peak = cfg.optim, peak_lr(cfg, lr)
    if o.schedule == "cosine":  # optax's warmup + cosine in one: today's numbers, bit for bit
        return optax.warmup_cosine_decay_schedule(
            init_value=0.0, peak_value=peak, warmup_steps=o.warmup_steps,
            decay_steps=o.warmup_steps + _decay_length(o), end_value=peak * o.min_lr_ratio)
    after = _AFTER_WARMUP[o.schedule](o, peak)
    if o.warmup_steps == 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, peak, o.warmup_steps), after], [o.warmup_steps])


def _decay_length(o) -> int:
    """Steps from the end of the warmup to `decay_steps` (at least 1)."""
    return max(o.decay_steps, o.warmup_steps + 1) - o.warmup_steps


def _linear(o, peak):
    return optax.linear_schedule(peak, peak * o.min_lr_ratio, _decay_length(o))


def _polynomial(o, peak):
    return optax.polynomial_schedule(peak, peak * o.min_lr_ratio, o.power, _decay_length(o))


def _step(o, peak):
    # the schedule after the warmup counts from its end; the boundaries are absolute steps
    return optax.piecewise_constant_schedule(peak, {b - o.warmup_steps: o.decay_factor for b in o.boundaries})


def _wsd(o, peak):
    """Warmup-stable-decay: the peak until `wsd_decay_start`, then linear to lr·min_lr_ratio."""
    start = wsd_decay_start(o)
    decay = optax.linear_schedule(peak, peak * o.min_lr_ratio, o.decay_steps - start)
    return optax.join_schedules([optax.constant_schedule(peak), decay], [start - o.warmup_steps])


def _constant(o, peak):
    return optax.constant_schedule(peak)


def _inverse_sqrt(o, peak):
    """peak·sqrt(warmup / step) (optax has no such schedule); `s` counts from the warmup's end.
    Clamped at the peak: `join_schedules` evaluates it during the warmup too (s < 0)."""
    warmup = o.warmup_steps
    return lambda s: peak * jnp.sqrt(warmup / jnp.maximum(warmup + s, warmup))


_AFTER_WARMUP = {"linear": _linear, "polynomial": _polynomial, "step": _step, "wsd": _wsd,
                 "constant": _constant, "inverse_sqrt": _inverse_sqrt}


def weight_decay_mask(params):
    """True for parameters that take weight decay: matrices, not vectors, norm scales (a
    `scale`, which is [heads, head_dim] for model.qk_norm=full) nor biases (the query, key and
    value projections' are [heads, head_dim]).

    Scanned layers (`params["layers"]`, an MoE model's `params["dense_layers"]`) carry a leading
    layer axis that does not count.
    """

    def is_matrix(path, p):
        scanned = getattr(path[0], "key", None) in ("layers", "dense_layers")
        return p.ndim - scanned >= 2 and getattr(path[-1], "key", None) not in ("scale", "bq", "bk", "bv")

    return jax.tree_util.tree_map_with_path(is_matrix, params)


def adafactor(weight_decay: float, schedule: optax.Schedule) -> optax.GradientTransformation:
    """Adafactor from optax's parts, with AdamW's weight decay.

    optax's own defaults throughout: the second moment factored into row and column means for
    parameters whose two largest dims are both >= 128 (a full one otherwise), its decay
    1 - (t+1)^-0.8, epsilon 1e-30 on the squared gradient, and the update clipped to RMS 1 per
    parameter. Unlike `optax.adafactor`: no scaling by the parameters' RMS (`optim.lr` is the
    absolute step, as with AdamW), and the decay is decoupled and multiplied by the learning rate
    (`optax.adafactor`'s `weight_decay_rate` is not, so 0.1 would take 10% of a weight per step).
    """
    return optax.chain(
        optax.scale_by_factored_rms(),
        optax.clip_by_block_rms(1.0),
        optax.add_decayed_weights(weight_decay, weight_decay_mask),
        optax.scale_by_learning_rate(schedule),
    )


def make_optimizer(cfg, param_specs=None) -> optax.GradientTransformation:
    """The whole chain for a resolved config: clipping, then `optim.name` on `optim.schedule`.
    `param_specs`: the parameters' logical specs, which Muon splits by (default: the model's;
    a test's own parameters name theirs)."""
    o = cfg.optim
    schedule = learning_rate_schedule(cfg)
    # bfloat16 halves the first moment's memory; Adam's second moment (whose square root divides
    # the update, and which spans a wide range) stays float32.
    mu_dtype = jnp.bfloat16 if o.mu_dtype == "bfloat16" else None
    if o.name == "lion":
        update = optax.lion(learning_rate=schedule, b1=o.b1, b2=o.b2, mu_dtype=mu_dtype,
                            weight_decay=o.weight_decay, mask=weight_decay_mask)
    elif o.name == "adafactor":
        update = adafactor(o.weight_decay, schedule)
    elif o.name == "muon":
        specs = model.param_logical_specs(cfg.model) if param_specs is None else param_specs
        adam_schedule = learning_rate_schedule(cfg, o.muon_adam_lr) if o.muon_adam_lr else schedule
        update = muon.muon(o, schedule, adam_schedule, specs, mu_dtype, weight_decay_mask)
    else:
        update = optax.adamw(learning_rate=schedule, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay,
                             mask=weight_decay_mask, mu_dtype=mu_dtype)
    if o.clip_norm > 0:
        return optax.chain(optax.clip_by_global_norm(o.clip_norm), update)
    return update
