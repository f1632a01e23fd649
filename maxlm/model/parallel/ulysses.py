"""Ulysses context parallelism (`model.context_parallel='ulysses'`; DeepSpeed-Ulysses, MaxText's
`context_parallel_strategy=ulysses`): under `mesh.sequence` = n, attention trades the length split
for a heads split and back.

    out_BLHDh = ulysses.attend(backend, q_BLHDh, k_BSKDh, v_BSKDh, segment_ids_BL, splash_blocks)

Outside attention every device holds L/n positions of each row (the `length` rule), as with the
all-gather strategy. Inside `jax.shard_map` over the `length` rule's mesh axes:

1. an all-to-all sends each device's L/n positions of every head to the head's new owner: each
   device then holds the whole length for H/n query heads and K/n kv heads (of those it held:
   H/(n·t) and K/(n·t) when the `heads` rule also splits them over `tensor` = t);
2. the segment ids ([B, L] ints, small) are all-gathered: each device sees its rows' documents;
3. attention runs on whole rows with the packed causal mask, with the configured backend: each
   device's work is an ordinary full-sequence attention, so cuDNN's and splash's kernels apply
   as they do without a mesh (XLA on CPU);
4. a second all-to-all sends each head's output positions back to their owners.

Per device, the keys and values of one layer are L·K/n (not L·K as when gathered), and each
all-to-all moves (n-1)/n of a device's share: the bytes per device stay constant as n grows with L.

Grouped-query attention with fewer kv heads than devices (K/t not divisible by n): each kv head
is repeated r = n / gcd(K/t, n) times before the exchange, as DeepSpeed's Ulysses (ALST) repeats
them when sp > kv heads, so query head h still reads kv head h // (H/K) (repeats are adjacent,
and a device's query heads and its repeated kv heads come from the same slice). The kv
all-to-all then moves r times the bytes; autodiff sums the repeats' gradients. MaxText refuses
this case (num_kv_heads divisible by the context axis); `config.resolve` checks only that
num_heads divides by sequence x tensor.
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from maxlm.model import attention


def _axes(logical: str) -> tuple[str, ...]:
    """The mesh axes the active rules give `logical` (none without rules)."""
    axes = nn.logical_to_mesh_axes((logical,))[0]
    return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


def _entry(axes: tuple[str, ...]):
    return None if not axes else axes[0] if len(axes) == 1 else axes


def _devices(axes: tuple[str, ...]) -> int:
    return math.prod(jax.sharding.get_abstract_mesh().shape[a] for a in axes)


def applies(model_cfg, batch: int, length: int) -> bool:
    """Whether attention runs the Ulysses way here: `model.context_parallel='ulysses'`, a mesh
    is active outside any shard_map, its `length` axes split the rows over several devices, and
    the batch and length split evenly. Otherwise the all-gather path runs (the same numbers)."""
    mesh = jax.sharding.get_abstract_mesh()
    if model_cfg.context_parallel != "ulysses" or mesh.empty or mesh.are_all_axes_manual:
        return False
    shards = _devices(_axes("length"))
    return shards > 1 and length % shards == 0 and batch % _devices(_axes("batch")) == 0


def attend(backend: str, q_BLHDh, k_BSKDh, v_BSKDh, segment_ids_BL, splash_blocks: tuple[int, int] = (0, 0),
           window: int = 0, softcap: float = 0.0):
    """Causal, per-document attention [B, L, H, Dh] of length-split q/k/v (`applies` holds),
    each device attending over whole rows with its share of the heads; `backend`, `window` and
    `softcap` as `attention.attend`'s (the backend resolved here for the whole length)."""
    backend = attention.attention_backend(backend, q_BLHDh.dtype, q_BLHDh.shape[1], softcap=softcap,
                                          head_dim=q_BLHDh.shape[-1])
    window = attention.row_window(window, q_BLHDh.shape[1])
    batch, length = _entry(_axes("batch")), _axes("length")
    heads, kv_heads = _entry(_axes("heads")), _entry(_axes("kv_heads"))
    shards = _devices(length)
    if q_BLHDh.shape[2] % (shards * _devices(_axes("heads"))):
        raise ValueError(f"ulysses: {q_BLHDh.shape[2]} query heads do not split over the {shards} devices "
                         f"of the length axes {length} (config.resolve checks model.num_heads)")
    tiles = attention.splash_tiles(q_BLHDh.shape[1], *splash_blocks) if backend in attention.SPLASH else None
    local = functools.partial(_local, backend=backend, axis=_entry(length), shards=shards, tiles=tiles, window=window,
                              softcap=softcap)
    spec_q, spec_kv = PartitionSpec(batch, _entry(length), heads, None), PartitionSpec(batch, _entry(length), kv_heads, None)
    return jax.shard_map(
        local,
        in_specs=(spec_q, spec_kv, spec_kv, PartitionSpec(batch, _entry(length))),
        out_specs=spec_q,
        check_vma=backend == "xla",  # pallas and cuDNN calls carry no varying-axes type; the specs say it all
    )(q_BLHDh, k_BSKDh, v_BSKDh, segment_ids_BL)


def kv_repeats(kv_heads: int, shards: int) -> int:
    """How many times each of a device's `kv_heads` is repeated so that they split over `shards`."""
    return shards // math.gcd(kv_heads, shards)


def _local(q_BlHDh, k_BlKDh, v_BlKDh, segment_ids_Bl, *, backend, axis, shards, tiles, window, softcap):
    """One device: its L/n positions of its heads in, the same out (l = L/n, h = H/n, k = K·r/n)."""
    repeats = kv_repeats(k_BlKDh.shape[2], shards)
    if repeats > 1:  # adjacent copies: query head i's group still maps to kv head i // (H/K)
        k_BlKDh, v_BlKDh = jnp.repeat(k_BlKDh, repeats, axis=2), jnp.repeat(v_BlKDh, repeats, axis=2)
    # the length split for a heads split: device i gets heads [i·H/n, (i+1)·H/n) of every position
    to_heads = functools.partial(jax.lax.all_to_all, axis_name=axis, split_axis=2, concat_axis=1, tiled=True)
    q_BLhDh, k_BSkDh, v_BSkDh = to_heads(q_BlHDh), to_heads(k_BlKDh), to_heads(v_BlKDh)
    segment_ids_BL = jax.lax.all_gather(segment_ids_Bl, axis, axis=1, tiled=True)
    out_BLhDh = _whole_rows(backend, q_BLhDh, k_BSkDh, v_BSkDh, segment_ids_BL, tiles, window, softcap)
    return jax.lax.all_to_all(out_BLhDh, axis, split_axis=1, concat_axis=2, tiled=True)


def _whole_rows(backend, q_BLhDh, k_BSkDh, v_BSkDh, segment_ids_BL, tiles, window, softcap):
    """Attention over whole rows on one device, with the backend's form of the documents."""
    if backend == "cudnn":
        bias_B1LS = attention.document_bias(segment_ids_BL, q_BLhDh.dtype)
        return attention.cudnn_attention(q_BLhDh, k_BSkDh, v_BSkDh, bias_B1LS, window)
    if backend in attention.SPLASH:
        return attention.splash_local(q_BLhDh, k_BSkDh, v_BSkDh, segment_ids_BL, block_q=tiles[0],
                                      block_kv=tiles[1], interpret=backend == attention.SPLASH_INTERPRET, window=window,
                                      softcap=softcap)
    if block := attention.band_block(segment_ids_BL.shape[1], window):
        mask_B1LS = attention.banded_mask(segment_ids_BL, window, block)
        return attention.banded_attention(q_BLhDh, k_BSkDh, v_BSkDh, mask_B1LS, softcap)
    mask_B1LS = attention.causal_mask(segment_ids_BL, segment_ids_BL, window)
    return attention.xla_attention(q_BLhDh, k_BSkDh, v_BSkDh, mask_B1LS, softcap)
