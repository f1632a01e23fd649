"""Expert parallelism: an MoE layer's experts split over the mesh's `expert` axis, n devices each
holding E/n of them, and the tokens taken to their experts' devices and back.

    out_BLD = dropless(moe.sorted_experts, x_BLD, experts_BLK, gates_BLK, w_gate_EDF, w_up_EDF, w_down_EFD, dtype,
                       dispatch_backend(model_cfg.expert_dispatch))
    out_BLD = with_capacity(moe.dispatch_masks, moe.buffered_experts, x_BLD, experts_BLK, gates_BLK,
                            position_BLK, w_gate_EDF, w_up_EDF, w_down_EFD, capacity, dtype)

The dropless layer runs here also when no axis splits the experts but the tokens are split (data,
fsdp, sequence): each device then sorts and computes its own tokens' slots, with all the experts'
weights, where GSPMD's global sort would gather every device's token-slots.

The MoE layer calls these with its own functions for the local compute (this module imports
nothing of the layer's), so a change to the single-device compute reaches both paths. The routing
stays in the layer's ordinary GSPMD code, so its statistics are global (the 1-device numbers);
only the expert compute runs in `jax.shard_map`, each device on its own tokens (the `batch` rule
includes `expert`) and its own experts: dropless through the ragged all-to-all or the all-gather
exchange (`model.expert_dispatch`), capacity through GShard's two all-to-alls. Both dropless
exchanges have static shapes and are exact. How each exchange moves the tokens and the weights'
splits: docs/moe.md#parallelism.
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from maxlm.model.attention import target_platform
from maxlm.model.moe import slot_order
from maxlm.model.moe.ragged_exchange import ragged_all_to_all


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


def active(x_BLD, dropless: bool) -> bool:
    """Whether the split path runs here: a mesh is active, the tokens split evenly over the `batch`
    and `length` rules' axes, and either the `experts` rule maps onto axes of more than one device
    or (`dropless`) the tokens are split at all: each device then sorts only its own tokens, where
    GSPMD's global sort of the token-slots would gather every device's. (Not so for init's one
    dummy row or a small generation batch: GSPMD's unsplit path then runs the layer, the same
    numbers.)"""
    if jax.sharding.get_abstract_mesh().empty:
        return False
    tokens_split = _devices(_axes("batch") + _axes("length")) > 1
    if not (_axes("experts", split_only=True) or (dropless and tokens_split)):
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


def dispatch_backend(name: str, platform: str | None = None) -> str:
    """Resolves `model.expert_dispatch` for `platform` (default: the target's): "auto" is
    ragged_all_to_all on GPUs and TPUs, all_gather on CPUs (XLA:CPU cannot run the collective,
    which moves no fewer bytes there: it is emulated with all-gathers, maxlm/model/moe/ragged_exchange.py)."""
    if name != "auto":
        return name
    return "all_gather" if (platform or target_platform()) == "cpu" else "ragged_all_to_all"


def dropless(compute, x_BLD, experts_BLK, gates_BLK, w_gate_EDF, w_up_EDF, w_down_EFD, dtype, dispatch: str):
    """The dropless layer with the experts split over the mesh's expert axes, and each device's
    tokens sorted on that device: [B, L, D]. `compute`: `moe.sorted_experts`; `dispatch`:
    `model.expert_dispatch` ("all_gather" or "ragged_all_to_all", resolved).
    The types go unchecked (`check_vma=False`, as MaxText runs its sparse matmul's shard_map):
    the megablox kernel's outputs carry no varying-axes type, and the tiled loop's carries start
    as plain zeros. The gradients are the checked path's (tests/test_grouped_matmul.py)."""
    ep, tensor, tokens, w_in, w_out = _specs()
    if ep and dispatch == "ragged_all_to_all":
        local = functools.partial(_dropless_ragged_local, compute, ep=ep, tensor=tensor, dtype=dtype,
                                  platform=target_platform())
    else:  # without expert axes no token leaves its device: the two dispatches are the same
        local = functools.partial(_dropless_local, compute, ep=ep, tensor=tensor, dtype=dtype)
    return jax.shard_map(local, in_specs=(tokens,) * 3 + (w_in, w_in, w_out), out_specs=tokens, check_vma=False)(
        x_BLD, experts_BLK, gates_BLK, w_gate_EDF, w_up_EDF, w_down_EFD)


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
    gather = lambda a: a.reshape(B * L, -1)  # noqa: E731  (no expert axes: this device's tokens only)
    if ep:
        gather = lambda a: jax.lax.all_gather(a.reshape(B * L, -1), ep, axis=0, tiled=True)  # noqa: E731
    x_TD, experts_TK, gates_TK = gather(x_BLD), gather(experts_BLK), gather(gates_BLK)
    T = x_TD.shape[0]
    # this device's experts are numbered from 0 here; other devices' slots get E_local: they sort
    # last and fall beyond the M rows kept, room for every local slot (at most min(K, E_local) a token)
    local_TK = experts_TK - (jax.lax.axis_index(ep) * E_local if ep else 0)
    mine_TK = (local_TK >= 0) & (local_TK < E_local)
    local_N = jnp.where(mine_TK, local_TK, E_local).reshape(-1)
    M = T * min(K, E_local)
    order_N = jnp.argsort(local_N, stable=True)
    order_M, inverse_N = order_N[:M], slot_order.inverse(order_N)
    mine_M = local_N[order_M] < E_local
    sizes_E = jnp.bincount(local_N, length=E_local + 1)[:E_local].astype(jnp.int32)
    # rows past the local slots (only with expert axes) are unspecified both ways, in y and in x's
    # gradient (megablox never writes them): zeroed on the way in and out
    keep = (lambda a: jnp.where(mine_M[:, None], a, jnp.zeros((), a.dtype))) if ep else (lambda a: a)
    x_MD = keep(slot_order.by_expert(x_TD.astype(dtype), order_M, inverse_N, K))
    y_MD = keep(compute(x_MD, sizes_E, w_gate_EDF, w_up_EDF, w_down_EFD, dtype))
    # each slot's row is its rank in the sort; a rank of M or more is another device's slot: 0
    y_TKD = slot_order.by_token(y_MD, order_M, inverse_N, K).reshape(T, K, D)
    gates_TK = jnp.where(mine_TK, gates_TK, 0.0)  # other devices' slots: their outputs come from there
    out_TD = jnp.einsum("tkd,tk->td", y_TKD, gates_TK.astype(dtype), preferred_element_type=jnp.float32)
    if ep:
        out_TD = jax.lax.psum_scatter(out_TD, ep, scatter_dimension=0, tiled=True)  # the group's parts, summed
    if tensor:  # each device computed its slice of the hidden units
        out_TD = jax.lax.psum(out_TD, tensor)
    return out_TD.astype(dtype).reshape(B, L, D)


def _exclusive_cumsum(a, axis: int = 0):
    return jnp.cumsum(a, axis=axis) - a


def _dropless_ragged_local(compute, x_BLD, experts_BLK, gates_BLK, w_gate_EDF, w_up_EDF, w_down_EFD, *, ep,
                           tensor, dtype, platform):
    """One device, MaxText's dropless exchange: its own token-slots sorted by expert and sent, each
    run of slots to its experts' device only (`ragged_all_to_all`); the slots received from the
    group put in its local experts' order, its E/n experts run on them, and the outputs sent back the same
    way; returns its own tokens' outputs. Shape suffixes as `_dropless_local`'s, n the devices of
    `ep`, R the receive buffer's rows (every slot the group could send here: n·T·min(K, E/n))."""
    B, L, D = x_BLD.shape
    T, K, E_local = B * L, experts_BLK.shape[-1], w_gate_EDF.shape[0]
    n, me = jax.lax.psum(1, ep), jax.lax.axis_index(ep)
    experts_N = experts_BLK.reshape(-1)
    order_N = jnp.argsort(experts_N, stable=True)  # by expert, so by destination device
    inverse_N = slot_order.inverse(order_N)
    x_ND = slot_order.by_expert(x_BLD.reshape(T, D).astype(dtype), order_N, inverse_N, K)
    # every device's slots per expert, [sender, receiver, local expert]: the exchange's sizes
    counts_SRE = jax.lax.all_gather(jnp.bincount(experts_N, length=n * E_local).astype(jnp.int32), ep)
    counts_SRE = counts_SRE.reshape(n, n, E_local)
    chunks_SR = counts_SRE.sum(axis=-1)  # slots sender s sends receiver r
    # a receiver's buffer holds its senders' runs in sender order, each run sorted by expert
    placed_SR = _exclusive_cumsum(chunks_SR, axis=0)  # where s's run starts in r's buffer
    taken_SR = _exclusive_cumsum(chunks_SR, axis=1)  # where s's run for r starts in s's sorted slots
    R = n * T * min(K, E_local)
    recv_RD = ragged_all_to_all(x_ND, jnp.zeros((R, D), dtype), taken_SR[me], chunks_SR[me], placed_SR[me],
                                chunks_SR[:, me], ep, platform)
    # The buffer holds runs by (sender, local expert); the grouped matmuls want them by (local
    # expert, sender). Each received row's place in that order is computed, not sorted for: its
    # expert's first row + the rows of that expert from earlier senders + its place in its run.
    counts_SE = counts_SRE[:, me]
    counts_X = counts_SE.reshape(-1)  # [sender · local expert], the buffer's runs in order
    ends_X = jnp.cumsum(counts_X)
    rows_R = jnp.arange(R)
    received_R = rows_R < ends_X[-1]  # the first rows, in either order; the rest nobody sent
    run_R = jnp.minimum(jnp.searchsorted(ends_X, rows_R, side="right"), ends_X.shape[0] - 1)
    sender_R, expert_R = run_R // E_local, run_R % E_local
    sizes_E = counts_SE.sum(axis=0)
    place_R = (_exclusive_cumsum(sizes_E)[expert_R] + _exclusive_cumsum(counts_SE, axis=0)[sender_R, expert_R]
               + rows_R - (ends_X - counts_X)[run_R])
    place_R = jnp.where(received_R, place_R, rows_R)  # a permutation of the R rows
    # rows past the received ones are unspecified both ways (megablox never writes them): zeroed
    keep = lambda a: jnp.where(received_R[:, None], a, jnp.zeros((), a.dtype))  # noqa: E731
    by_expert_RD = recv_RD[slot_order.inverse(place_R)]
    y_RD = keep(compute(keep(by_expert_RD), sizes_E, w_gate_EDF, w_up_EDF, w_down_EFD, dtype))
    y_RD = y_RD[place_R]  # back to the buffer's order, for the return trip
    # each run goes back to where its sender took it from
    back_ND = ragged_all_to_all(y_RD, jnp.zeros((T * K, D), dtype), placed_SR[:, me], chunks_SR[:, me],
                                taken_SR[:, me], chunks_SR[me], ep, platform)
    y_TKD = slot_order.by_token(back_ND, order_N, inverse_N, K).reshape(T, K, D)
    out_TD = jnp.einsum("tkd,tk->td", y_TKD, gates_BLK.reshape(T, K).astype(dtype), preferred_element_type=jnp.float32)
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
