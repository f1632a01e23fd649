"""The train state: its pytree, initialisation, shardings and abstract shapes.

    state = {"step", "params", "opt_state", "skipped_steps", "bad_streak"}
            + with float16 compute, loss_scale.STATE_KEYS {"loss_scale", "good_steps", "overflow_steps"}

A plain dict of arrays: `params` is `model.init_params`'s pytree, `opt_state` optax's, the rest
replicated int32/float32 scalars. Shardings come from the parameters' logical axis names through
the config's mesh rules (optimizer moments follow their parameter; with ZeRO-1 they also split
over `data`). `create_sharded_state` initialises every shard where it lives, and `abstract_state`
(ShapeDtypeStructs with those shardings) is orbax's restore target, so a checkpoint lands on any
mesh.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from maxlm import cli, loss_scale, mesh as mesh_lib, model

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
    """Logical PartitionSpecs for the whole state: optimizer moments follow their parameter."""
    param_specs = model.param_logical_specs(cfg.model)
    opt_specs = optax.tree_map_params(
        tx,
        lambda _, spec: spec,
        shapes["opt_state"],
        param_specs,
        transform_non_params=lambda _: PartitionSpec(),
        is_leaf=model.is_spec,
    )
    # every other entry (step, counters, loss scale) is a replicated scalar
    return {**{key: PartitionSpec() for key in shapes}, "params": param_specs, "opt_state": opt_specs}


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
    `optim.shard_state_over_data` (ZeRO-1), Adam's moments also split over `data`. Parameters stay
    replicated over `data`; GSPMD reduce-scatters the gradients into the moments' shards and
    all-gathers the updated parameters."""
    out = mesh_lib.logical_to_shardings(logical_specs(cfg, tx, shapes), mesh, rules)
    if not cfg.optim.shard_state_over_data or mesh.shape["data"] == 1:
        return out

    def zero1(leaf, logical):
        spec = nn.logical_to_mesh_axes(logical, rules)
        return NamedSharding(mesh, add_data_axis(leaf.shape, spec, logical, mesh.shape))

    opt = optax.tree_map_params(
        tx, zero1, shapes["opt_state"], model.param_logical_specs(cfg.model),
        transform_non_params=lambda _: mesh_lib.replicated(mesh), is_leaf=model.is_spec,
    )
    return dict(out, opt_state=opt)


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
        cli.warn(f"the checkpoint of step {int(restored['step'])} in {source} has no loss scale "
                 f"(written without float16 compute): using {float(fallback['loss_scale']):g}")
    return {**fallback, **restored}


def all_finite(tree) -> jax.Array:
    """A bool scalar: no NaN or inf in any floating-point leaf of `tree` (traceable)."""
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))
