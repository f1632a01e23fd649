"""The grouped matmul of the dropless MoE, on the backend `model.grouped_matmul` chooses.

    y_NF = grouped_matmul(x_ND, w_EDF, sizes_E, backend)

Rows come sorted by group: the first sizes_E[0] rows of x_ND are multiplied by w_EDF[0], the next
sizes_E[1] by w_EDF[1], ... (sum(sizes_E) = N, or less under expert parallelism: the rows past
the groups are zeros). Two backends, the same numbers:

  ragged_dot `jax.lax.ragged_dot`: XLA's own, on any backend (CPU, GPU, TPU).
  megablox   the Pallas grouped-matmul kernel for TPUs (`jax.experimental.pallas.ops.tpu.megablox`,
             MaxText's `megablox=True`), with its own VJP: `gmm` for x's gradient and `tgmm` for
             the weights'. `grouped_matmul_backend` resolves "auto" to it on TPUs.

What the kernel needs (read from its source, jax 0.12): float32 or bfloat16 operands, int32 group
sizes, and a row count divisible by the row tile. Rows are padded to the tile here and the padded
rows cut from the output: they belong to no group, so the kernel never writes them (their values
are whatever the memory held) and its weight gradient masks them out. Tiles (rows, contraction,
output columns) are the largest of 512/256/128 dividing each dimension (128 otherwise: the kernel
masks a ragged last tile), as MaxText's defaults are 512s on v5p.

A Pallas call cannot be partitioned by GSPMD, so under a mesh the kernel runs inside
`jax.shard_map`: the (globally sorted) rows split evenly over the mesh axes of the `batch` rule,
each device given the group sizes of its own rows (`local_sizes`), the weights whole on each
device (gathered as FSDP gathers a dense layer's).
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import megablox
from jax.sharding import PartitionSpec

from maxlm.errors import ConfigError
from maxlm.model.attention import target_platform

TILES = (512, 256, 128)  # tried largest first
# Tests only, never in config.GROUPED_MATMUL: the megablox kernel run by the Pallas interpreter on
# any backend (slow), so the model's megablox path can be checked on CPU.
MEGABLOX_INTERPRET = "megablox_interpret"
MEGABLOX = ("megablox", MEGABLOX_INTERPRET)


def grouped_matmul_backend(name: str, dtype, platform: str | None = None) -> str:
    """Resolves `model.grouped_matmul` for `platform` (default: `attention.target_platform()`):
    "auto" is megablox on TPUs for float32/bfloat16 compute (the kernel's dtypes), ragged_dot
    otherwise; megablox anywhere but a TPU is a ConfigError."""
    platform = platform or target_platform()
    kernel_dtype = jnp.dtype(dtype) in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
    if name == "auto":
        return "megablox" if platform == "tpu" and kernel_dtype else "ragged_dot"
    if name == "megablox" and platform != "tpu":
        raise ConfigError(f"model.grouped_matmul='megablox' needs a TPU, not {platform}; use 'auto' or 'ragged_dot'")
    if name == "megablox" and not kernel_dtype:
        raise ConfigError(f"model.grouped_matmul='megablox' computes in float32 or bfloat16, not "
                          f"{jnp.dtype(dtype).name} (model.dtype); use 'ragged_dot'")
    return name


def tiling(rows: int, contract: int, out: int) -> tuple[int, int, int]:
    """The kernel's (row, contraction, output-column) tiles: the largest of TILES dividing each
    dimension (the rows are padded to theirs: at most 512, at least 128), 128 where none does."""
    def tile(size: int) -> int:
        return next((t for t in TILES if size % t == 0), TILES[-1])

    return min(TILES[0], -(-rows // TILES[-1]) * TILES[-1]), tile(contract), tile(out)


def megablox_matmul(x_ND, w_EDF, sizes_E, interpret: bool = False):
    """The megablox kernel on one device's rows: [N, F] in x's dtype, float32 accumulation."""
    N, D = x_ND.shape
    tiles = tiling(N, D, w_EDF.shape[2])
    padded_N = -(-N // tiles[0]) * tiles[0]
    x_ND = jnp.pad(x_ND, ((0, padded_N - N), (0, 0)))
    y_NF = megablox.gmm(x_ND, w_EDF, sizes_E.astype(jnp.int32), x_ND.dtype, tiles, interpret=interpret)
    return y_NF[:N]


def _megablox_past_the_groups(x_ND, w_EDF, sizes_E, interpret: bool):
    """`megablox_matmul` where the groups may end before the rows do (expert parallelism gives a
    device room for more slots than its experts get): the kernel never writes those rows, in y
    nor in x's gradient, so they are zeroed both ways, as ragged_dot gives them. Only here: an
    extra pass over x and y that the other paths, whose groups fill the rows, need not pay."""
    grouped_N1 = (jnp.arange(x_ND.shape[0]) < jnp.sum(sizes_E))[:, None]
    y_NF = megablox_matmul(jnp.where(grouped_N1, x_ND, 0), w_EDF, sizes_E, interpret)
    return jnp.where(grouped_N1, y_NF, 0)


def local_sizes(sizes_E, num_shards: int, rows: int):
    """[num_shards, E]: how many of each group's rows fall in each shard when `rows` sorted rows
    are split evenly into `num_shards` (a group's rows may straddle shards)."""
    ends_E = jnp.cumsum(sizes_E)
    starts_E = ends_E - sizes_E
    per_shard = rows // num_shards
    lo_S1 = jnp.arange(num_shards)[:, None] * per_shard
    overlap_SE = jnp.minimum(ends_E, lo_S1 + per_shard) - jnp.maximum(starts_E, lo_S1)
    return jnp.maximum(overlap_SE, 0).astype(jnp.int32)


def _sharded_megablox(x_ND, w_EDF, sizes_E, interpret: bool):
    """`megablox_matmul` under the active mesh: rows over the `batch` rule's axes."""
    mesh = jax.sharding.get_abstract_mesh()
    batch = nn.logical_to_mesh_axes(("batch",))[0]
    axes = () if batch is None else (batch,) if isinstance(batch, str) else tuple(batch)
    num_shards = math.prod(mesh.shape[axis] for axis in axes)
    if x_ND.shape[0] % num_shards:
        axes, num_shards = (), 1  # rows that do not split evenly: every device computes them all
    rows = PartitionSpec(axes or None)

    def local(x_ND, w_EDF, sizes_1E):
        return megablox_matmul(x_ND, w_EDF, sizes_1E[0], interpret)

    return jax.shard_map(
        local, in_specs=(rows, PartitionSpec(), rows), out_specs=rows,
        check_vma=False,  # pallas_call outputs carry no varying-axes type; the specs say it all
    )(x_ND, w_EDF, local_sizes(sizes_E, num_shards, x_ND.shape[0]))


def grouped_matmul(x_ND, w_EDF, sizes_E, backend: str = "auto"):
    """[N, F] in x's dtype: row block e of `x_ND` (sizes_E[e] rows, blocks in order) times
    w_EDF[e], with the resolved `backend` ("auto", "ragged_dot", "megablox")."""
    backend = grouped_matmul_backend(backend, x_ND.dtype)
    if backend in MEGABLOX:
        interpret = backend == MEGABLOX_INTERPRET
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty:
            return megablox_matmul(x_ND, w_EDF, sizes_E, interpret)
        if mesh.are_all_axes_manual:  # one device's rows already (in shard_map: expert parallelism)
            return _megablox_past_the_groups(x_ND, w_EDF, sizes_E, interpret)
        return _sharded_megablox(x_ND, w_EDF, sizes_E, interpret)
    return jax.lax.ragged_dot(x_ND, w_EDF, sizes_E)
