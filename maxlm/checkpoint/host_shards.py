"""A process's own shards of a sharded pytree as one byte buffer, and such buffers moved between
processes: what the host-local checkpoint tier (maxlm/checkpoint/local_tier.py) writes, replicates to a
neighbour and restores from.

A process's *layout* is a pure function of the tree's shapes, dtypes and shardings: for each leaf
(in tree order), the distinct indices (slices of the global array) held by the process's devices,
in device-id order, each at an offset in the buffer. Every process can compute every other's, so
a buffer travels as bytes alone, and a saved one is checked against the layout the run expects
(another mesh, device or process count gives another layout: that checkpoint is not used).
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import zlib
from typing import NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from maxlm.runtime import processes

CHUNK_BYTES = 64 << 20  # a transfer's piece: the device holds one at a time, not the whole state


class Entry(NamedTuple):
    leaf: int  # the leaf's position in the flattened tree
    index: tuple[tuple[int, int], ...]  # (start, stop) per dim of the global array
    dtype: str
    offset: int
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(stop - start for start, stop in self.index)


def _bounds(index, shape) -> tuple[tuple[int, int], ...]:
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def layout(tree, process: int) -> list[Entry]:
    """The entries of `process`'s buffer for `tree` (arrays or ShapeDtypeStructs with shardings)."""
    entries, offset = [], 0
    for number, leaf in enumerate(jax.tree.leaves(tree)):
        by_device = leaf.sharding.devices_indices_map(leaf.shape)
        seen = set()
        for device in sorted(by_device, key=lambda d: d.id):
            bounds = _bounds(by_device[device], leaf.shape)
            if device.process_index != process or bounds in seen:
                continue
            seen.add(bounds)
            dtype = np.dtype(leaf.dtype)
            nbytes = int(np.prod([b - a for a, b in bounds], dtype=np.int64)) * dtype.itemsize
            entries.append(Entry(number, bounds, dtype.name, offset, nbytes))
            offset += nbytes
    return entries


def total_bytes(entries: list[Entry]) -> int:
    return entries[-1].offset + entries[-1].nbytes if entries else 0


def pack(tree, entries: list[Entry], out: np.ndarray | None = None) -> np.ndarray:
    """This process's shards of `tree` (its `layout`), copied to one host buffer: `out` when it
    has the size (a buffer reused from save to save is not allocated and paged in again), else
    a new one."""
    leaves = jax.tree.leaves(tree)
    pieces = []
    for entry in entries:
        leaf = leaves[entry.leaf]
        shard = next(s for s in leaf.addressable_shards if _bounds(s.index, leaf.shape) == entry.index)
        pieces.append(shard.data)
    for piece in pieces:  # every transfer started before the first is waited for
        piece.copy_to_host_async()
    size = total_bytes(entries)
    buffer = out if out is not None and len(out) == size else np.empty(size, np.uint8)

    def copy(entry, piece):  # one copy into the buffer (on CPU, from the device's own memory)
        host = np.ascontiguousarray(np.asarray(piece)).reshape(-1).view(np.uint8)
        buffer[entry.offset:entry.offset + entry.nbytes] = host

    # numpy copies without the GIL: the host's cores share the copying
    with concurrent.futures.ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
        list(pool.map(copy, entries, pieces))
    return buffer


def unpack(buffer: np.ndarray, entries: list[Entry], abstract):
    """The pytree `abstract` (ShapeDtypeStructs with shardings) built from this process's `buffer`
    (laid out by `entries`): each of its devices gets its shard, and every leaf is one global array."""
    leaves, treedef = jax.tree.flatten(abstract)
    found = {(e.leaf, e.index): e for e in entries}
    arrays = []
    for number, leaf in enumerate(leaves):
        singles = []
        for device, index in leaf.sharding.addressable_devices_indices_map(leaf.shape).items():
            entry = found[(number, _bounds(index, leaf.shape))]
            data = buffer[entry.offset:entry.offset + entry.nbytes].view(np.dtype(leaf.dtype)).reshape(entry.shape)
            singles.append(jax.device_put(data, device))
        arrays.append(jax.make_array_from_single_device_arrays(leaf.shape, leaf.sharding, singles))
    return jax.tree.unflatten(treedef, arrays)


def checksum(buffer: np.ndarray) -> int:
    """CRC-32 of a buffer, in pieces (zlib releases the GIL: the training thread runs meanwhile)."""
    crc = 0
    view = memoryview(buffer).cast("B")
    for start in range(0, len(view), CHUNK_BYTES):
        crc = zlib.crc32(view[start:start + CHUNK_BYTES], crc)
    return crc


@functools.lru_cache(maxsize=None)
def _first_devices() -> tuple:
    """One device of each process, in process order: the ends of a transfer."""
    return tuple(min(jax.local_devices(process_index=p), key=lambda d: d.id) for p in range(jax.process_count()))


@functools.lru_cache(maxsize=None)
def _permute_fn(pairs: tuple[tuple[int, int], ...]):
    mesh = Mesh(np.array(_first_devices()), ("processes",))
    spec = PartitionSpec("processes")
    moved = jax.shard_map(lambda x: jax.lax.ppermute(x, "processes", pairs), mesh=mesh, in_specs=spec, out_specs=spec)
    return mesh, jax.jit(moved, out_shardings=NamedSharding(mesh, spec))


def send(buffer: np.ndarray | None, pairs: list[tuple[int, int]], receive_bytes: int,
         out: np.ndarray | None = None) -> np.ndarray | None:
    """Moves buffers between processes: for each (source, destination) in `pairs` (each process at
    most once a source and once a destination), `buffer` of the source becomes the result of the
    destination, `receive_bytes` long (None where this process receives nothing). A collective:
    every process calls it with the same `pairs`, in pieces of CHUNK_BYTES, all of the same size,
    so every process runs the same programs in the same order."""
    me = jax.process_index()
    longest = max([receive_bytes] + [len(buffer) if buffer is not None else 0])
    # every process must agree on the number of pieces: the longest buffer of any
    longest = int(processes.allgather(np.array([longest], np.int64)).max())
    mesh, permute = _permute_fn(tuple(pairs))
    sharding = NamedSharding(mesh, PartitionSpec("processes"))
    receiving = any(d == me for _, d in pairs)
    if not receiving:
        out = None
    elif out is None or len(out) != receive_bytes:  # `out`: a buffer reused, as in `pack`
        out = np.empty(receive_bytes, np.uint8)
    device = _first_devices()[me]
    for start in range(0, longest, CHUNK_BYTES):
        piece = np.zeros((1, min(CHUNK_BYTES, longest - start)), np.uint8)
        if buffer is not None and start < len(buffer):
            part = buffer[start:start + piece.shape[1]]
            piece[0, :len(part)] = part
        global_piece = jax.make_array_from_single_device_arrays(
            (jax.process_count(), piece.shape[1]), sharding, [jax.device_put(piece, device)])
        with jax.set_mesh(mesh):  # inside the training loop's mesh context too
            got = np.asarray(permute(global_piece).addressable_data(0))[0]
        if out is not None and start < receive_bytes:
            out[start:start + min(len(got), receive_bytes - start)] = got[:receive_bytes - start]
    return out
