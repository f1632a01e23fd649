"""Expert parallelism: an MoE layer's experts split over the mesh's `expert` axis, n devices each
holding E/n of them, and the tokens taken to their experts' devices and back.

    out_BLD = dropless(moe.dropless, x_BLD, experts_BLK, gates_BLK, w_gate_EDF, w_up_EDF, w_down_EFD, dtype)
    out_BLD = with_capacity(moe.dispatch_masks, moe.buffered_experts, x_BLD, experts_BLK, gates_BLK,
                            position_BLK, w_gate_EDF, w_up_EDF, w_down_EFD, capacity, dtype)

moe.py's layer calls these with its own functions for the local compute (this module imports
nothing of moe.py's), so a change to the single-device compute reaches both paths.

The routing (router matmul, top-k, the aux and z statistics, the capacity queue positions) stays
in the layer's ordinary GSPMD code, so its statistics are global: the 1-device numbers. Only the
expert compute runs in `jax.shard_map`, each device on its own tokens (its share of batch and
length: the `batch` rule includes `expert`) and its own experts:

- dropless (capacity 0): the tokens of the n devices along `expert` are all-gathered, each device
  runs `moe.dropless` on the slots routed to its experts, and a reduce-scatter sums the n partial
  outputs back onto the tokens' devices (Megatron-LM's "allgather" token dispatcher). Static
  shapes and exact. `jax.lax.ragged_all_to_all` (MaxText's dropless exchange) would move only the
  routed slots, but XLA:CPU cannot run it (jax 0.12: "HLO opcode ragged-all-to-all is not
  supported"), so it could be neither tested nor used here.
- capacity: GShard. Each device fills its tokens' [B, E, C, D] expert buffers (C per sequence:
  `moe.capacity`), an all-to-all over `expert` sends each expert's buffers to its device
  ([n·B, E/n, C, D] there), the experts run, and a second all-to-all brings the outputs back.
  Under sequence parallelism a row's buffers are filled by several devices: a reduce-scatter over
  the `length` axes joins them (each then holds C/s of the slots) and an all-gather splits them
  again after the return trip.

Weights: the experts dim split over `expert`; the D dim enters whole (jit all-gathers an fsdp
split at the boundary and reduce-scatters the gradients); a `tensor`-split F stays split, each
device computing its slice of the hidden units, and the down projection's partial sums are
psum'd over `tensor`.
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec


def _axes(logical: str, split_only: bool = False) -> tuple[str, ...]:
    """The mesh axes the active rules give `logical` (`split_only`: those of more than one device)."""
    axes = nn.logical_to_mesh_axes((logical,))[0]
    axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    sizes = jax.sharding.get_abstract_mesh().shape
    return tuple(a for a in axes if sizes[a] > 1 or not split_only)


def _entry(axes: tuple[str, ...]):
    """A PartitionSpec entry for `axes`."""
    return None if not axes else axes[0] if len(axes) == 1 else axes


def _devices(axes: tuple[str, ...]) -> int:
    return math.prod(jax.sharding.get_abstract_mesh().shape[a] for a in axes)


def active(x_BLD) -> bool:
    """Whether the split path runs here: a mesh is active, the `experts` rule maps onto axes of more
    than one device, and the tokens split evenly over the `batch` and `length` rules' axes. (Not
    so for init's one dummy row or a small generation batch: GSPMD's unsplit path then runs the
    layer, the same numbers.)"""
    if jax.sharding.get_abstract_mesh().empty or not _axes("experts", split_only=True):
        return False
    B, L, _ = x_BLD.shape
    return B % _devices(_axes("batch")) == 0 and L % _devices(_axes("length")) == 0


def _specs():
    """(expert axes, tensor axes, the tokens' spec, w_gate/w_up's spec, w_down's spec) under the
    active rules."""
    ep, batch, tensor = _axes("experts", split_only=True), _axes("batch"), _axes("mlp", split_only=True)
    if not set(ep) <= set(batch):
        raise ValueError(f"mesh.rules: the batch must be split over the experts' mesh axes {ep} (it is over "
                         f"{batch}): each device sends its own tokens to the experts")
    tokens = PartitionSpec(_entry(batch), _entry(_axes("length")), None)
    w_in, w_out = PartitionSpec(_entry(ep), None, _entry(tensor)), PartitionSpec(_entry(ep), _entry(tensor), None)
    return ep, tensor, tokens, w_in, w_out


def dropless(compute, x_BLD, experts_BLK, gates_BLK, w_gate_EDF, w_up_EDF, w_down_EFD, dtype,
             pallas: bool = False):
    """`compute` (`moe.dropless`) with the experts split over the mesh's expert axes: [B, L, D].
    `pallas`: `compute` calls a Pallas kernel (megablox), whose outputs carry no varying-axes
    type, so the shard_map cannot check them (check_vma off, as MaxText's MoE shard_map); the
    specs and the collectives below say how each value varies."""
    ep, tensor, tokens, w_in, w_out = _specs()
    local = functools.partial(_dropless_local, compute, ep=ep, tensor=tensor, dtype=dtype)
    return jax.shard_map(local, in_specs=(tokens,) * 3 + (w_in, w_in, w_out), out_specs=tokens,
                         check_vma=not pallas)(x_BLD, experts_BLK, gates_BLK, w_gate_EDF, w_up_EDF, w_down_EFD)


def with_capacity(dispatch_masks, compute, x_BLD, experts_BLK, gates_BLK, position_BLK, w_gate_EDF, w_up_EDF,
                  w_down_EFD, capacity: int, dtype):
    """`moe.with_capacity` with the experts split over the mesh's expert axes: [B, L, D].
    `position_BLK`: each slot's place in its sequence's queue (GSPMD code, over whole rows);
    `dispatch_masks`, `compute`: `moe.dispatch_masks` and `moe.buffered_experts`."""
    ep, tensor, tokens, w_in, w_out = _specs()
    local = functools.partial(_capacity_local, dispatch_masks, compute, num_experts=w_gate_EDF.shape[0],
                              capacity=capacity, ep=ep, tensor=tensor, length=_axes("length", split_only=True),
                              dtype=dtype)
    return jax.shard_map(local, in_specs=(tokens,) * 4 + (w_in, w_in, w_out), out_specs=tokens)(
        x_BLD, experts_BLK, gates_BLK, position_BLK, w_gate_EDF, w_up_EDF, w_down_EFD)


def _dropless_local(compute, x_BLD, experts_BLK, gates_BLK, w_gate_EDF, w_up_EDF, w_down_EFD, *, ep, tensor,
                    dtype):
    """One device: its E/n experts (the weights' shards) on every slot routed to them among the
    tokens of its `ep` group; returns its own tokens' outputs, summed over the group."""
    B, L, D = x_BLD.shape
    K, E_local = experts_BLK.shape[-1], w_gate_EDF.shape[0]
    gather = lambda a: jax.lax.all_gather(a.reshape(B * L, -1), ep, axis=0, tiled=True)  # noqa: E731
    x_TD, experts_TK, gates_TK = gather(x_BLD), gather(experts_BLK), gather(gates_BLK)
    T = x_TD.shape[0]
    # this device's experts are numbered from 0 here; other devices' slots get E_local: they sort
    # last and fall beyond the M rows kept, room for every local slot (at most min(K, E_local) a token)
    local_TK = experts_TK - jax.lax.axis_index(ep) * E_local
    local_N = jnp.where((local_TK >= 0) & (local_TK < E_local), local_TK, E_local).reshape(-1)
    M = T * min(K, E_local)
    order_N = jnp.argsort(local_N, stable=True)
    order_M = order_N[:M]
    mine_M = local_N[order_M] < E_local
    gates_M = jnp.where(mine_M, gates_TK.reshape(-1)[order_M], 0.0)
    y_MD = compute(x_TD[order_M // K], local_N[order_M][:, None], gates_M[:, None],
                   w_gate_EDF, w_up_EDF, w_down_EFD, dtype)
    y_MD = jnp.where(mine_M[:, None], y_MD, 0)  # rows past the local slots: whatever the matmul left
    # each slot's row is its rank in the sort; a rank of M or more is another device's slot: 0
    y_ND = y_MD.astype(jnp.float32).at[jnp.argsort(order_N)].get(mode="fill", fill_value=0.0)
    out_TD = y_ND.reshape(T, K, D).sum(axis=1)
    out_TD = jax.lax.psum_scatter(out_TD, ep, scatter_dimension=0, tiled=True)  # the group's parts, summed
    if tensor:  # each device computed its slice of the hidden units
        out_TD = jax.lax.psum(out_TD, tensor)
    return out_TD.astype(dtype).reshape(B, L, D)


def _capacity_local(dispatch_masks, compute, x_BLD, experts_BLK, gates_BLK, position_BLK, w_gate_EDF, w_up_EDF,
                    w_down_EFD, *, num_experts, capacity, ep, tensor, length, dtype):
    """One device: its tokens' buffers to the experts' devices (all-to-all), its E/n experts on
    the buffers it receives, and the outputs back (all-to-all); returns its own tokens' outputs."""
    dispatch_BLEC, combine_BLEC = dispatch_masks(experts_BLK, gates_BLK, position_BLK, num_experts, capacity, dtype)
    x_BECD = jnp.einsum("blec,bld->becd", dispatch_BLEC, x_BLD.astype(dtype))
    if length:  # this device filled its own tokens' slots of its rows: join the rows' shards, C/s each
        shards = _devices(length)
        padded = -(-capacity // shards) * shards
        x_BECD = jnp.pad(x_BECD, ((0, 0), (0, 0), (0, padded - capacity), (0, 0)))
        x_BECD = jax.lax.psum_scatter(x_BECD, length, scatter_dimension=2, tiled=True)
    x_BECD = jax.lax.all_to_all(x_BECD, ep, split_axis=1, concat_axis=0, tiled=True)  # [n·B, E/n, C, D]
    y_BECD = compute(x_BECD, w_gate_EDF, w_up_EDF, w_down_EFD, dtype)
    if tensor:  # each device computed its slice of the hidden units
        y_BECD = jax.lax.psum(y_BECD, tensor)
    y_BECD = jax.lax.all_to_all(y_BECD, ep, split_axis=0, concat_axis=1, tiled=True)  # [B, E, C, D]
    if length:
        y_BECD = jax.lax.all_gather(y_BECD, length, axis=2, tiled=True)[:, :, :capacity]
    out_BLD = jnp.einsum("blec,becd->bld", combine_BLEC, y_BECD, preferred_element_type=jnp.float32)
    return out_BLD.astype(dtype)
