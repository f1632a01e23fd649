"""`jax.lax.ragged_all_to_all`, and the same exchange built from all-gathers for XLA:CPU, which
cannot run the collective ("HLO opcode ragged-all-to-all is not supported").

    result = ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                               recv_sizes, axis_name, platform)

The arguments are `jax.lax.ragged_all_to_all`'s (its docstring defines them): slice i of the
caller's `operand` (rows input_offsets[i] .. + send_sizes[i]) goes to device i // (len / n) of the
`axis_name` group, and lands there at rows output_offsets[i] .. + send_sizes[i] of its `output`.

On CPUs `emulated` computes the same result: every device's operand and offsets are all-gathered
and each device picks the rows sent to it. It moves every row to every device, so it saves none
of the bytes the collective exists to save; it is here so that the dispatch's offsets, the
collective's semantics and its gradient (a linear map, differentiated as any gather) are tested
on the machines the tests run on, and the CPU can train with `model.expert_dispatch=ragged_all_to_all`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name,
                      platform: str):
    """The collective on GPUs and TPUs, `emulated` on `platform` "cpu"."""
    exchange = emulated if platform == "cpu" else jax.lax.ragged_all_to_all
    return exchange(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name=axis_name)


def emulated(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name):
    """`jax.lax.ragged_all_to_all`'s result from all-gathers: the receiver's rows at each sender's
    output_offsets[i] .. + send_sizes[i], for the slices i addressed to it, come from that sender's
    operand rows input_offsets[i] .. ; every other row is `output`'s. (`recv_sizes` equals the
    senders' send_sizes by the collective's contract, so the senders' are used.)"""
    del recv_sizes
    n = jax.lax.psum(1, axis_name)
    per_device = input_offsets.shape[0] // n  # slices per destination
    me = jax.lax.axis_index(axis_name)
    operands = jax.lax.all_gather(operand, axis_name)  # [n, N, ...]
    # [sender, slice] of the slices addressed to this device
    mine = lambda a: jax.lax.dynamic_slice_in_dim(jax.lax.all_gather(a, axis_name), me * per_device, per_device, 1)  # noqa: E731
    starts_S, sizes_S, sources_S = mine(output_offsets).reshape(-1), mine(send_sizes).reshape(-1), mine(input_offsets).reshape(-1)
    rows_M = jnp.arange(output.shape[0])
    inside_MS = (rows_M[:, None] >= starts_S) & (rows_M[:, None] < starts_S + sizes_S)  # slices never overlap
    slice_M = jnp.argmax(inside_MS, axis=1)
    sender_M = slice_M // per_device
    row_M = jnp.clip(sources_S[slice_M] + rows_M - starts_S[slice_M], 0, operand.shape[0] - 1)
    received = operands[sender_M, row_M]
    hit = inside_MS.any(axis=1).reshape(-1, *(1,) * (output.ndim - 1))
    return jnp.where(hit, received, output)
