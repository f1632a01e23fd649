"""The train state: its pytree, initialisation, shardings and abstract shapes.

    state = {"step", "params", "opt_state", "skipped_steps", "bad_streak"}
            + with float16 compute, loss_scale.STATE_KEYS {"loss_scale", "good_steps", "overflow_steps"}

A plain dict of arrays: `params` is `model.init_params`'s pytree, `opt_state` optax's, the rest
replicated int32/float32 scalars. Shardings come from the parameters' logical axis names through
the config's mesh rules (optimizer moments follow their parameter, Adafactor's factored ones
without the dim averaged away; with ZeRO-1 they also split over `data`). `create_sharded_state`
initialises every shard where it lives, and `abstract_state` (ShapeDtypeStructs with those
shardings) is orbax's restore target, so a checkpoint lands on any mesh.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from maxlm import model
from maxlm.optim import loss_scale
from maxlm.runtime import console
from maxlm.sharding import mesh as mesh_lib

State = dict[str, Any]


def init_state(cfg, tx: optax.GradientTransformation, rng: jax.Array) -> State:
    params = model.init_params(cfg.model, rng)
    zero = jnp.zeros((), jnp.int32)
    state = {"step": zero, "params": params, "opt_state": tx.init(params),
             "skipped_steps": zero, "bad_streak": zero}  # non-finite steps: total, consecutive
    if loss_scale.enabled(cfg):
        state.update(loss_scale.init(cfg.optim))
    return state


def logical_specs(cfg, tx: optax.GradientTransformation, shapes: State) -> State:
    """Logical PartitionSpecs for the whole state: optimizer moments follow their parameter
    (Adafactor's factored ones as `factored_specs` says)."""
    param_specs = model.param_logical_specs(cfg.model)
    # a partitioned optimizer's (Muon's) moments hold optax.MaskedNode for the parameters another
    # part updates: kept as they are (no array, no spec)
    masked = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731
    opt_specs = optax.tree_map_params(
        tx,
        lambda moment, spec: moment if masked(moment) else spec,
        shapes["opt_state"],
        param_specs,
        transform_non_params=lambda _: PartitionSpec(),
        is_leaf=lambda x: model.is_spec(x) or masked(x),
    )
    is_factored = lambda node: isinstance(node, optax.FactoredState)
    opt_specs = jax.tree.map(
        lambda node, spec: factored_specs(node, shapes["params"], param_specs) if is_factored(node) else spec,
        shapes["opt_state"], opt_specs, is_leaf=is_factored)
    # every other entry (step, counters, loss scale) is a replicated scalar
    return {**{key: PartitionSpec() for key in shapes}, "params": param_specs, "opt_state": opt_specs}


def factored_specs(state: optax.FactoredState, param_shapes, param_specs) -> optax.FactoredState:
    """Logical specs of `optax.scale_by_factored_rms`'s state (Adafactor's second moment).

    A factored parameter's `v_row` is its squared gradient averaged over its largest dim and
    `v_col` over its second largest, so each takes the parameter's spec without that dim; its `v`
    is a (1,) placeholder. A parameter not factored has a full `v` (its own spec) and (1,)
    placeholders as `v_row`/`v_col`. Placeholders are replicated.
    """

    def moment_specs(moments, averaged: int | None):  # averaged: 0 for v_row, 1 for v_col, None for v
        def spec_of(param, spec, moment):
            if moment.shape == param.shape:  # the full second moment of a parameter not factored
                return spec
            if moment.shape == (1,):  # a placeholder
                return PartitionSpec()
            dim = largest_dims(param.shape)[averaged]
            kept = [i for i in range(param.ndim) if i != dim]
            if tuple(param.shape[i] for i in kept) != moment.shape:
                raise ValueError(f"optax's factored moment {moment.shape} of a {param.shape} parameter is not "
                                 "the parameter averaged over its largest or second largest dim")
            names = (*spec, *(None,) * (param.ndim - len(spec)))
            return PartitionSpec(*(names[i] for i in kept))

        return jax.tree.map(spec_of, param_shapes, param_specs, moments)

    return optax.FactoredState(count=PartitionSpec(), v_row=moment_specs(state.v_row, 0),
                               v_col=moment_specs(state.v_col, 1), v=moment_specs(state.v, None))


def largest_dims(shape) -> tuple[int, int]:
    """(the largest dim, the second largest) of `shape`, ties broken as optax's factored second
    moment breaks them (`np.argsort` of the shape)."""
    order = np.argsort(shape)
    return int(order[-1]), int(order[-2])


def add_data_axis(shape, spec: PartitionSpec, logical: PartitionSpec, sizes) -> PartitionSpec:
    """ZeRO-1: `spec` (mesh axes) with `data` added to one dim: the `embed` dim if its size divides
    by its current shards × data, else the first dim that does; unchanged if none does (small
    vectors) or `data` is already used. `sizes`: the mesh's {axis: size}."""
    pad = lambda t: (*t, *(None,) * (len(shape) - len(t)))
    axes = [() if a is None else (a,) if isinstance(a, str) else tuple(a) for a in pad(spec)]
    if sizes["data"] == 1 or any("data" in a for a in axes):
        return spec
    names = pad(logical)
    for i in sorted(range(len(shape)), key=lambda i: names[i] != "embed"):  # embed first
        if shape[i] % (math.prod(sizes[a] for a in axes[i]) * sizes["data"]) == 0:
            axes[i] = (*axes[i], "data")
            return PartitionSpec(*(None if not a else a[0] if len(a) == 1 else a for a in axes))
    return spec


def shardings(cfg, tx, mesh, rules, shapes: State) -> State:
    """NamedShardings of the whole state: `logical_specs` through the mesh rules, then, with
    `optim.shard_state_over_data` (ZeRO-1), the optimizer's moments also split over `data`.
    Parameters stay replicated over `data`; GSPMD reduce-scatters the gradients into the moments'
    shards and all-gathers the updated parameters."""
    specs = logical_specs(cfg, tx, shapes)
    out = mesh_lib.logical_to_shardings(specs, mesh, rules)
    if not cfg.optim.shard_state_over_data or mesh.shape["data"] == 1:
        return out

    def zero1(leaf, logical):  # scalars and (1,) placeholders stay as they are: nothing divides
        spec = nn.logical_to_mesh_axes(logical, rules)
        return NamedSharding(mesh, add_data_axis(leaf.shape, spec, logical, mesh.shape))

    return dict(out, opt_state=jax.tree.map(zero1, shapes["opt_state"], specs["opt_state"]))


def param_shardings(model_cfg, mesh, rules):
    """NamedShardings of the parameters alone (what eval, generation and HF import need)."""
    return mesh_lib.logical_to_shardings(model.param_logical_specs(model_cfg), mesh, rules)


def abstract_state(cfg, tx, sharding=None) -> State:
    """The state's ShapeDtypeStructs, computed without allocating anything. `sharding`: a pytree
    of shardings like the state (`shardings(...)`: orbax's restore target, so a checkpoint lands
    directly on the current mesh), one sharding for every leaf, or None (shapes only)."""
    shapes = jax.eval_shape(functools.partial(init_state, cfg, tx), jax.random.key(0))
    return _with_sharding(shapes, sharding)


def abstract_params(model_cfg, sharding=None):
    """`abstract_state(...)["params"]` without an optimizer: the parameters' ShapeDtypeStructs."""
    shapes = jax.eval_shape(functools.partial(model.init_params, model_cfg), jax.random.key(0))
    return _with_sharding(shapes, sharding)


def _with_sharding(shapes, sharding):
    if sharding is None:
        return shapes
    if isinstance(sharding, jax.sharding.Sharding):
        sharding = jax.tree.map(lambda _: sharding, shapes)
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        shapes, sharding)


def create_sharded_state(cfg, tx, mesh, rules, rng) -> tuple[State, State]:
    """Initialises the state directly into its shards: no device ever holds the full state.

    Returns (state, its shardings).
    """
    init = functools.partial(init_state, cfg, tx)
    state_shardings = shardings(cfg, tx, mesh, rules, jax.eval_shape(init, rng))
    with mesh_lib.activate(mesh, rules):
        state = jax.jit(init, out_shardings=state_shardings)(rng)
    return state, state_shardings


def with_missing_from(restored: State, fallback: State, source: str) -> State:
    """`restored` plus the entries its checkpoint lacked, from `fallback`: only the loss scale can
    be missing (checkpoint.restore_state), when a float16 run resumes a checkpoint written
    without float16 compute (or before loss scaling existed)."""
    if any(key not in restored for key in fallback):
        console.warn(f"the checkpoint of step {int(restored['step'])} in {source} has no loss scale "
                 f"(written without float16 compute): using {float(fallback['loss_scale']):g}")
    return {**fallback, **restored}


def all_finite(tree) -> jax.Array:
    """A bool scalar: no NaN or inf in any floating-point leaf of `tree` (traceable)."""
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))
