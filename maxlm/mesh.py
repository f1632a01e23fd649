"""The device mesh and the logical-axis → mesh-axis mapping.

Every parameter and main activation carries *logical* axis names (`batch`, `embed`, `heads`, ...).
The config's `mesh.rules` maps them onto the three mesh axes:

  data   : pure data parallelism (parameters replicated)
  fsdp   : data parallelism with parameters, gradients and optimizer state sharded (ZeRO-3)
  tensor : Megatron-style splits of heads, MLP hidden units and vocabulary

so a mesh sweep edits config only.
"""

from __future__ import annotations

import contextlib

import flax.linen as nn
import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from maxlm.config import MESH_AXES


def make_mesh(mesh_cfg, devices=None) -> Mesh:
    """A Mesh over `devices` (default: all) shaped by the resolved `mesh_cfg`.

    `jax.make_mesh` orders devices to follow the physical topology (ICI rings on TPU), so the
    innermost axis (`tensor`) gets the fastest links.
    """
    shape = tuple(int(mesh_cfg[axis]) for axis in MESH_AXES)
    devices = jax.devices() if devices is None else devices
    # Auto axes: GSPMD propagates shardings from the jit in/out shardings and our constraints.
    return jax.make_mesh(
        shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices
    )


def rules_of(mesh_cfg) -> tuple:
    """The config's rules as the tuple-of-pairs Flax expects (JSON round trips turn them to lists)."""
    return tuple(
        (name, tuple(axes) if isinstance(axes, (list, tuple)) else axes)
        for name, axes in mesh_cfg.rules
    )


def logical_to_shardings(logical_specs, mesh: Mesh, rules):
    """Maps a pytree of logical PartitionSpecs to NamedShardings on `mesh`."""
    return nn.logical_to_mesh_sharding(logical_specs, mesh, rules)


def batch_sharding(mesh: Mesh, rules) -> NamedSharding:
    """Sharding of a [batch, length] input array."""
    return logical_to_shardings(PartitionSpec("batch", "length"), mesh, rules)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


@contextlib.contextmanager
def activate(mesh: Mesh, rules):
    """Makes `mesh` and `rules` current while tracing, so the model's activation constraints bind."""
    with jax.sharding.set_mesh(mesh), nn.logical_axis_rules(rules):
        yield


def describe(tree) -> dict:
    """{path: PartitionSpec string} of a pytree of sharded arrays, for logs and tests."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {jax.tree_util.keystr(path): str(leaf.sharding.spec) for path, leaf in flat}

