"""The optimizer: global-norm clipping → AdamW on a warmup + cosine schedule.

Gradient accumulation (`optim.grad_accum_steps`) lives in `maxlm/step.py` (it needs the loss
function): a scan over microbatches inside the jitted step, then one update of this chain.

Weight decay applies to matrices only: norm scales (and biases, should a model grow them) are
1-D and decaying them towards zero only hurts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def learning_rate_schedule(optim_cfg) -> optax.Schedule:
    """Linear warmup 0 → lr over `warmup_steps`, then cosine decay to `lr·min_lr_ratio` at
    `decay_steps`, constant after."""
    peak = optim_cfg.lr
    warmup = optim_cfg.warmup_steps
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=peak,
        warmup_steps=warmup,
        decay_steps=max(optim_cfg.decay_steps, warmup + 1),
        end_value=peak * optim_cfg.min_lr_ratio,
    )


def weight_decay_mask(params):
    """True for parameters that take weight decay: matrices, not vectors (norm scales).

    Scanned layers (`params["layers"]`) carry a leading layer axis that does not count.
    """

    def is_matrix(path, p):
        scanned = getattr(path[0], "key", None) == "layers"
        return p.ndim - scanned >= 2

    return jax.tree_util.tree_map_with_path(is_matrix, params)


def make_optimizer(optim_cfg) -> optax.GradientTransformation:
    adamw = optax.adamw(
        learning_rate=learning_rate_schedule(optim_cfg),
        b1=optim_cfg.b1,
        b2=optim_cfg.b2,
        eps=optim_cfg.eps,
        weight_decay=optim_cfg.weight_decay,
        mask=weight_decay_mask,
        # bfloat16 halves the first moment's memory; the second moment (whose square root divides
        # the update, and which spans a wide range) stays float32.
        mu_dtype=jnp.bfloat16 if optim_cfg.mu_dtype == "bfloat16" else None,
    )
    if optim_cfg.clip_norm > 0:
        return optax.chain(optax.clip_by_global_norm(optim_cfg.clip_norm), adamw)
    return adamw
