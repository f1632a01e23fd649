"""One training step: loss and gradients, the optimizer update, non-finite steps skipped.

    train_fn = make_train_step(cfg, tx, mesh, rules, state_shardings)
    state, step_metrics = train_fn(state, batch)     # jitted; the old state's buffers are donated

`loss_and_grads` runs the model's forward and backward pass (over microbatches with gradient
accumulation, scaled with float16's dynamic loss scale); `train_step` applies the optax update
unless the step came out non-finite, and reports the step's metrics as device scalars (the loop
reads them back one step late).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from maxlm import model
from maxlm.model.moe import router_bias
from maxlm.observe import router_metrics
from maxlm.optim import loss_scale, optimizers as optim
from maxlm.sharding import mesh as mesh_lib
from maxlm.sharding.state import State

# model.loss_fn's aux entries that are per-token means: with gradient accumulation, each
# microbatch's is weighted by its tokens, as its loss is
WEIGHTED_AUX = ("router", "mtp")


def loss_and_grads(cfg, params, batch, scale=None):
    """((loss, aux), grads) of the whole batch, as `jax.value_and_grad(model.loss_fn)` gives them.

    With `optim.grad_accum_steps` = n > 1, a `lax.scan` runs forward + backward on one microbatch
    (B/n rows, `model.microbatches`) at a time, so activations scale with the microbatch. The loss
    is a mean over the batch's non-padding tokens, so each microbatch's mean loss and gradients are
    weighted by its token count and the sums divided by the batch's: the result equals the
    large-batch step (up to float summation order), however unevenly padding falls. (The router's
    and the multi-token prediction's terms, means over their own counts, are weighted alike: the
    large-batch values where those counts split as the tokens do, close to them otherwise.)

    With a loss `scale` (float16 compute, see maxlm/optim/loss_scale.py) each microbatch's objective is
    multiplied by it before differentiating and the summed gradients divided by it in float32: the
    loss and gradients returned are unscaled (non-finite where the float16 backward overflowed).
    """
    loss_fn = functools.partial(model.loss_fn, cfg.model)
    if scale is None:
        grad_fn, unscale = jax.value_and_grad(loss_fn, has_aux=True), lambda grads: grads
    else:
        grad_fn = loss_scale.value_and_scaled_grad(loss_fn, scale)
        unscale = functools.partial(loss_scale.unscale, loss_scale=scale)
    n = cfg.optim.grad_accum_steps
    if n == 1:
        (loss, aux), grads = grad_fn(params, batch)
        return (loss, aux), unscale(grads)

    def body(carry, micro):
        (loss_i, aux_i), grads_i = grad_fn(params, micro)
        w = aux_i["num_tokens"]  # the microbatch's mean × its tokens = its loss sum
        sums = {"loss": loss_i * w, "cross_entropy": aux_i["cross_entropy"] * w, "num_tokens": w,
                "weighted": jax.tree.map(lambda v: v * w, {key: aux_i[key] for key in weighted}),
                "grads": jax.tree.map(lambda g: g * w, grads_i)}
        return jax.tree.map(jnp.add, carry, sums), None

    zero = jnp.zeros((), jnp.float32)
    split = functools.partial(model.microbatches, n=n, axes=("batch", "length"))
    micro = jax.tree.map(split, batch)
    # the aux's other statistics (an MoE model's router, the MTP losses), as one microbatch's has them
    aux_shapes = jax.eval_shape(loss_fn, params, jax.tree.map(lambda x: x[0], micro))[1]
    weighted = {key: aux_shapes[key] for key in WEIGHTED_AUX if key in aux_shapes}
    init = {"loss": zero, "cross_entropy": zero, "num_tokens": zero,
            "weighted": jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), weighted),
            "grads": jax.tree.map(jnp.zeros_like, params)}
    sums, _ = jax.lax.scan(body, init, micro)
    denom = jnp.maximum(sums["num_tokens"], 1.0)
    grads = jax.tree.map(lambda g: g / denom, sums["grads"])
    aux = {"num_tokens": sums["num_tokens"], "cross_entropy": sums["cross_entropy"] / denom}
    aux.update(jax.tree.map(lambda v: v / denom, sums["weighted"]))  # weighted by their tokens, as the loss
    return (sums["loss"] / denom, aux), unscale(grads)


def train_step(cfg, tx, schedule, state: State, batch, lr_scale, inject_nan=None) -> tuple[State, dict]:
    """One update; a step whose loss, gradient norm or update norm is NaN/inf is not applied.

    `lr_scale` (a float scalar) multiplies the learning rate: restores after non-finite steps lower
    it (`checkpoint.restore_lr_scale`). An argument, so a restore runs the same compiled step; as
    every update of the chain ends in the learning rate (weight decay included), scaling the
    update is scaling the rate.

    A skipped step still advances `step` (its batch is consumed: the data position stays a pure
    function of the step) and counts in `skipped_steps` and `bad_streak` (reset by a good step).
    `inject_nan` (a bool scalar; fault injection, see `faults.with_nan_injection`) makes this
    step's gradients NaN.

    With float16 compute the state carries a dynamic loss scale (maxlm/optim/loss_scale.py): non-finite
    gradients while the scale can still halve are an overflow, skipped and counted in
    `overflow_steps` but not a bad step (`bad_streak` neither grows nor resets).
    """
    scale = state.get("loss_scale")  # None: no loss scaling (float32 / bfloat16 compute)
    (loss, aux), grads = loss_and_grads(cfg, state["params"], batch, scale)
    if inject_nan is not None:
        grads = jax.tree.map(lambda g: jnp.where(inject_nan, jnp.nan, g), grads)
    grad_norm = optax.tree.norm(grads)  # before clipping
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    updates = jax.tree.map(lambda u: (u * lr_scale).astype(u.dtype), updates)
    params = optax.apply_updates(state["params"], updates)
    if router_bias.enabled(cfg.model):  # the selection bias moves by the step's load, not by the optimizer
        params = router_bias.rebalanced(cfg.model, params, state["params"], aux["router"]["layers"]["load_E"])
    # how far this step moved the weights, relative to their size (about 4-12 x lr with AdamW:
    # docs/observability.md#the-updateparameter-ratio-which-one); the
    # optimizer's update only: a balancing bias's move is not in it (moe/layer_NN/bias_spread shows it)
    update_ratio = optax.tree.norm(updates) / optax.tree.norm(state["params"])
    grads_finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    # Scalars, not a pass over every leaf (6% of a small model's CPU step): from a finite state,
    # finite gradients with a finite Σg² keep every optimizer moment finite (running means of g
    # and g², clipped or sign-taken), and a finite update keeps the parameters finite. The
    # checkpointer checks every leaf before it writes, so nothing non-finite is ever saved.
    ok = grads_finite & jnp.isfinite(optax.tree.norm(updates))
    keep_if_bad = functools.partial(jax.tree.map, lambda new, old: jnp.where(ok, new, old))
    params = keep_if_bad(params, state["params"])
    # A skipped step rolls the optimizer state back, all but the schedule's count: the schedule
    # is indexed by the step, so the rate applied is the `lr` logged (schedule(step)) and the decay
    # ends when planned. Counts that measure applied updates (Adam's bias correction) roll back.
    opt_state = jax.tree.map(lambda new, old: new if isinstance(new, optax.ScaleByScheduleState)
                             else keep_if_bad(new, old), opt_state, state["opt_state"], is_leaf=_is_schedule_state)
    bad = ~ok
    if scale is not None:
        bad &= ~loss_scale.overflowed(cfg.optim, state, grads_finite)
    bad = bad.astype(jnp.int32)
    new_state = {
        "step": state["step"] + 1,
        "params": params,
        "opt_state": opt_state,
        "skipped_steps": state["skipped_steps"] + bad,
        "bad_streak": jnp.where(ok, 0, state["bad_streak"] + bad),
    }
    step_metrics = {
        "loss": aux["cross_entropy"],  # plain next-token loss; `loss` above adds z-loss etc.
        "grad_norm": grad_norm,
        "param_norm": optax.tree.norm(params),
        "update_ratio": jnp.where(ok, update_ratio, 0.0),  # 0: the update was not applied
        "lr": schedule(state["step"]) * lr_scale,  # the rate this update used
        "num_tokens": aux["num_tokens"],
        "skipped_steps": new_state["skipped_steps"],
        "bad_streak": new_state["bad_streak"],
        "applied": ok.astype(jnp.int32),  # 0: skipped (non-finite, or a float16 overflow)
        # an MoE model's router: moe_aux_loss, moe_load_max, ..., and per layer moe/layer_NN/...
        **router_metrics.of_step(cfg.model, aux.get("router"), params),
        **(model.mtp.metrics(aux["mtp"]) if "mtp" in aux else {}),  # mtp_loss (and mtp/loss_k) with model.mtp_depth
    }
    if cfg.optim.clip_norm > 0:  # optax.clip_by_global_norm's: scaled to clip_norm when above it
        step_metrics.update(clipped=(grad_norm > cfg.optim.clip_norm).astype(jnp.int32),  # StepLogger: clipped_fraction
                            clipped_grad_norm=jnp.minimum(grad_norm, cfg.optim.clip_norm))
    if scale is not None:
        new_state.update(loss_scale.update(cfg.optim, state, grads_finite, applied=ok))
        step_metrics.update(loss_scale=scale,  # the scale this step used, as `lr`
                            overflow_steps=new_state["overflow_steps"])
    return new_state, step_metrics


def _is_schedule_state(x) -> bool:
    return isinstance(x, optax.ScaleByScheduleState)


def make_train_step(cfg, tx, mesh, rules, state_shardings, inject_nan: bool = False):
    """`train_step` jitted with explicit in/out shardings, the state donated.

    Called as `(state, batch, lr_scale)`; with `inject_nan`, `(state, batch, lr_scale, inject)`, a
    bool scalar (fault injection).
    """
    batch_sharding = mesh_lib.batch_sharding(mesh, rules)
    scalars = mesh_lib.replicated(mesh)
    return jax.jit(
        functools.partial(train_step, cfg, tx, optim.learning_rate_schedule(cfg)),
        in_shardings=(state_shardings, batch_sharding, scalars) + ((scalars,) if inject_nan else ()),
        out_shardings=(state_shardings, scalars),
        donate_argnums=(0,),  # the old state's buffers become the new state's
    )
