"""Muon (`optim.name=muon`): orthogonalised momentum on the weight matrices, AdamW on the rest.

    tx = muon.muon(cfg.optim, schedule, adam_schedule, param_specs, mu_dtype, decay_mask)

Which parameters get Muon is read from their logical axis names (`model.param_logical_specs`):
  - `layers` and `experts` are batch axes: a scanned layer's [L, in, out] weight is L matrices
    and an MoE layer's [L, E, in, out] is L·E, each orthogonalised on its own;
  - a `heads` or `kv_heads` dim followed by `head_dim` counts as one dim, as in the models that
    store the attention projections as [embed, heads·head_dim] and [heads·head_dim, embed];
  - a parameter with exactly two dims left is a Muon matrix, the first its input (reduction) dim,
    the second its output dim; one with a `vocab` or `positions` axis (the token embedding, the
    output head, the learned position table) is not, whatever its dims.
Everything else (norm scales, biases, the embeddings and the head) is AdamW's: the split of
Keller Jordan's Muon, Moonlight (Kimi) and MaxText.

A Muon matrix's update is optax's (`optax.contrib.scale_by_muon`): the momentum
m ← β·m + (1 − β)·g (optax's bias-corrected Nesterov form by default), orthogonalised by
`muon_ns_steps` quintic Newton–Schulz iterations on m / ‖m‖_F, then scaled to an RMS like AdamW's
(Moonlight: 0.2·√max(fan_in, fan_out), `muon_consistent_rms`; `0` scales by Keller Jordan's
√max(1, fan_out / fan_in) instead), then AdamW's decoupled decay lr·`weight_decay`·W, then −lr.
It runs inside the jitted step on the sharded momentum: GSPMD adds the collectives that the
Newton–Schulz products need over fsdp-, tensor- or data-sharded dims (tests/test_optim.py checks
it against one device).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec
from optax.contrib import MuonDimensionNumbers, scale_by_muon

BATCH_AXES = ("layers", "experts")  # stacked matrices: each is orthogonalised on its own
ADAMW_AXES = ("vocab", "positions")  # the token embedding, the output head, the learned position table
HEAD_AXES = ("heads", "kv_heads")  # followed by head_dim: one dim of the matrix


def dimension_numbers(spec: PartitionSpec) -> MuonDimensionNumbers | None:
    """The Muon matrix a parameter of logical spec `spec` is (its reduction and output axes; the
    others are batch axes), or None for a parameter AdamW updates."""
    names = tuple(spec)
    if any(name in ADAMW_AXES for name in names):
        return None
    dims: list[list[int]] = []
    for i, name in enumerate(names):
        if name in BATCH_AXES:
            continue
        if name == "head_dim" and dims and names[dims[-1][-1]] in HEAD_AXES:
            dims[-1].append(i)  # heads·head_dim
        else:
            dims.append([i])
    if len(dims) != 2:
        return None
    return MuonDimensionNumbers(reduction_axis=tuple(dims[0]), output_axis=tuple(dims[1]))


def _is_leaf(x) -> bool:
    return x is None or isinstance(x, (PartitionSpec, MuonDimensionNumbers))


def dimension_numbers_tree(param_specs):
    """`dimension_numbers` of every parameter: a tree like the parameters', None for AdamW's."""
    return jax.tree.map(dimension_numbers, param_specs, is_leaf=_is_leaf)


def labels(param_specs):
    """"muon" or "adamw" for every parameter."""
    return jax.tree.map(lambda d: "adamw" if d is None else "muon", dimension_numbers_tree(param_specs),
                        is_leaf=_is_leaf)


def _fans(shape, dims: MuonDimensionNumbers) -> tuple[int, int]:
    return (math.prod(shape[a] for a in dims.reduction_axis), math.prod(shape[a] for a in dims.output_axis))


def scale_by_shape(dims, consistent_rms: float) -> optax.GradientTransformation:
    """Each orthogonalised matrix times consistent_rms·√max(fan_in, fan_out) (its update's RMS is
    then about consistent_rms, AdamW's usual ~0.2: Moonlight), or with consistent_rms 0 times
    √max(1, fan_out / fan_in) (Keller Jordan's). `dims`: `dimension_numbers` per parameter,
    optax.MaskedNode where the partition hides AdamW's. optax.contrib.muon's formula (not exported)."""

    def scale(update, d):
        fan_in, fan_out = _fans(update.shape, d)
        if consistent_rms:
            return jnp.sqrt(jnp.maximum(fan_in, fan_out)) * consistent_rms * update
        return jnp.sqrt(jnp.maximum(1, fan_out / fan_in)) * update

    def update_fn(updates, state, params=None):
        del params
        return jax.tree.map(scale, updates, dims, is_leaf=lambda x: isinstance(x, MuonDimensionNumbers)), state

    return optax.GradientTransformation(optax.init_empty_state, update_fn)


def muon(o, schedule, adam_schedule, param_specs, mu_dtype, decay_mask) -> optax.GradientTransformation:
    """Muon on the matrices `dimension_numbers` picks, `optax.adamw` (maxlm's: b1, b2, eps, decay on
    `decay_mask`) on the other parameters. `o`: the config's optim section; `adam_schedule`: the
    AdamW part's learning rate (`optim.muon_adam_lr`)."""
    dims = dimension_numbers_tree(param_specs)
    # the Muon branch sees optax.MaskedNode where AdamW's parameters are (optax.partition)
    masked = jax.tree.map(lambda d: optax.MaskedNode() if d is None else d, dims, is_leaf=_is_leaf)
    matrices = optax.chain(
        scale_by_muon(ns_steps=o.muon_ns_steps, beta=o.muon_momentum, mu_dtype=mu_dtype,
                      nesterov=o.muon_nesterov, weight_dimension_numbers=masked),
        scale_by_shape(masked, o.muon_consistent_rms),
        optax.add_decayed_weights(o.weight_decay),  # every Muon parameter is a matrix
        optax.scale_by_learning_rate(schedule),
    )
    rest = optax.adamw(learning_rate=adam_schedule, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay,
                       mask=decay_mask, mu_dtype=mu_dtype)
    return optax.partition({"muon": matrices, "adamw": rest}, labels(param_specs))


def split(param_specs, shapes) -> dict[str, tuple[int, int]]:
    """{"muon" | "embeddings" | "other": (parameters, their elements)}: what Muon updates and what
    AdamW does, the token embedding, head and position table apart from the norms and biases."""
    out = {"muon": [0, 0], "embeddings": [0, 0], "other": [0, 0]}

    def count(spec, shape):
        kind = ("muon" if dimension_numbers(spec) is not None
                else "embeddings" if any(name in ADAMW_AXES for name in spec) else "other")
        out[kind][0] += 1
        out[kind][1] += math.prod(shape.shape)

    jax.tree.map(count, param_specs, shapes, is_leaf=_is_leaf)
    return {k: (n, size) for k, (n, size) in out.items()}


def describe(o, param_specs, shapes) -> str:
    """Muon's settings and its split, for the log's `optimizer:` line."""
    parts = split(param_specs, shapes)
    scale = (f"update RMS {o.muon_consistent_rms:g}·sqrt(max(fan_in, fan_out))" if o.muon_consistent_rms
             else "update scale sqrt(max(1, fan_out/fan_in))")
    lr = f"lr {o.muon_adam_lr:g}" if o.muon_adam_lr else "lr as optim.lr"
    (n, size), (e, e_size), (r, r_size) = parts["muon"], parts["embeddings"], parts["other"]
    return (f"muon (momentum {o.muon_momentum:g}{', Nesterov' if o.muon_nesterov else ''}, "
            f"{o.muon_ns_steps} Newton-Schulz steps, {scale}) on {n} matrices ({size:,} weights); "
            f"adamw ({lr}) on {e + r} others ({e} embedding/head, {r} norm/bias: {e_size + r_size:,} weights)")
