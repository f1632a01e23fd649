"""The grouped matmul of the dropless MoE, on the backend `model.grouped_matmul` chooses.

    y_NF = grouped_matmul(x_ND, w_EDF, sizes_E, backend)

Rows come sorted by group: the first sizes_E[0] rows of x_ND are multiplied by w_EDF[0], the next
sizes_E[1] by w_EDF[1], ... (sum(sizes_E) = N; rows past the groups, as expert parallelism leaves,
are unspecified and its caller zeroes them). Three backends, the same numbers:

  ragged_dot `jax.lax.ragged_dot`: XLA's own, on any backend (CPU, GPU, TPU). XLA:CPU computes it
             as a dense product over every group, so its cost grows with the number of experts;
             on an H200 it ran at 1/84 of a dense matmul's speed with 128 experts, and its
             buffers grow with rows x experts (a 4-layer Qwen3-30B-A3B step asked for 128 GiB).
  tiled      maxlm's loop of dense tile matmuls (maxlm/model/kernels/tiled_matmul.py), on any backend;
             "auto" on CPUs and GPUs: on 2 CPU cores 5x ragged_dot's speed with 8 experts and 16x
             with 64 (docs/performance.md#moe-side-by-side), on an H200 16x with 128 (docs/moe.md).
  megablox   the Pallas grouped-matmul kernel for TPUs (`jax.experimental.pallas.ops.tpu.megablox`,
             MaxText's `megablox=True`), with its own VJP: `gmm` for x's gradient and `tgmm` for
             the weights'. "auto" on TPUs.

What the kernel needs (read from its source): float32 or bfloat16 operands, int32 group
sizes, and a row count divisible by the row tile. Rows are padded to the tile here and the padded
rows cut from the output: they belong to no group, so the kernel never writes them (their values
are whatever the memory held) and its weight gradient masks them out. Tiles (rows, contraction,
output columns) are 512 rows (fewer for fewer rows) and 1024 columns (fewer for narrower
dimensions; the kernel masks a ragged last tile), as MaxText's v5p defaults (512, 1024, 1024).

Neither a Pallas call nor the tiled loop is partitioned well by GSPMD, so under a mesh they run inside
`jax.shard_map`: the (globally sorted) rows split evenly over the mesh axes of the `batch` rule,
each device given the group sizes of its own rows (`local_sizes`), the weights whole on each
device (gathered as FSDP gathers a dense layer's).
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import megablox
from jax.sharding import PartitionSpec

from maxlm.model.attention import target_platform
from maxlm.model.kernels.tiled_matmul import tiled_matmul
from maxlm.runtime.errors import ConfigError

ROW_TILES = (512, 128)  # the widest and the granule
COLUMN_TILES = (1024, 128)  # contraction and output columns: MaxText's 1024 on v5p
# Tests only, never in config.GROUPED_MATMUL: the megablox kernel run by the Pallas interpreter on
# any backend (slow), so the model's megablox path can be checked on CPU.
MEGABLOX_INTERPRET = "megablox_interpret"
MEGABLOX = ("megablox", MEGABLOX_INTERPRET)


def grouped_matmul_backend(name: str, dtype, platform: str | None = None) -> str:
    """Resolves `model.grouped_matmul` for `platform` (default: `attention.target_platform()`):
    "auto" is megablox on TPUs for float32/bfloat16 compute (the kernel's dtypes), ragged_dot on
    TPUs otherwise, tiled on CPUs and GPUs; megablox anywhere but a TPU is a ConfigError."""
    platform = platform or target_platform()
    kernel_dtype = jnp.dtype(dtype) in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
    if name == "auto":
        if platform == "tpu" and kernel_dtype:
            return "megablox"
        return "ragged_dot" if platform == "tpu" else "tiled"
    if name == "megablox" and platform != "tpu":
        raise ConfigError(f"model.grouped_matmul='megablox' needs a TPU, not {platform}; use 'auto' or 'ragged_dot'")
    if name == "megablox" and not kernel_dtype:
        raise ConfigError(f"model.grouped_matmul='megablox' computes in float32 or bfloat16, not "
                          f"{jnp.dtype(dtype).name} (model.dtype); use 'ragged_dot'")
    return name


def tiling(rows: int, contract: int, out: int) -> tuple[int, int, int]:
    """The kernel's (row, contraction, output-column) tiles: rows padded to a multiple of 128, at
    most 512; each other dimension rounded up to 128, at most 1024 (the kernel masks a ragged
    last tile). Wider column tiles read the rows fewer times (bytes accessed fall with them)."""
    def tile(size: int, widest: int) -> int:
        return min(widest, -(-size // ROW_TILES[-1]) * ROW_TILES[-1])

    return tile(rows, ROW_TILES[0]), tile(contract, COLUMN_TILES[0]), tile(out, COLUMN_TILES[0])


def megablox_matmul(x_ND, w_EDF, sizes_E, interpret: bool = False):
    """The megablox kernel on one device's rows: [N, F] in x's dtype, float32 accumulation."""
    N, D = x_ND.shape
    tiles = tiling(N, D, w_EDF.shape[2])
    padded_N = -(-N // tiles[0]) * tiles[0]
    x_ND = jnp.pad(x_ND, ((0, padded_N - N), (0, 0)))
    y_NF = megablox.gmm(x_ND, w_EDF, sizes_E.astype(jnp.int32), x_ND.dtype, tiles, interpret=interpret)
    return y_NF[:N]


def local_sizes(sizes_E, num_shards: int, rows: int):
    """[num_shards, E]: how many of each group's rows fall in each shard when `rows` sorted rows
    are split evenly into `num_shards` (a group's rows may straddle shards)."""
    ends_E = jnp.cumsum(sizes_E)
    starts_E = ends_E - sizes_E
    per_shard = rows // num_shards
    lo_S1 = jnp.arange(num_shards)[:, None] * per_shard
    overlap_SE = jnp.minimum(ends_E, lo_S1 + per_shard) - jnp.maximum(starts_E, lo_S1)
    return jnp.maximum(overlap_SE, 0).astype(jnp.int32)


def _sharded(kernel, x_ND, w_EDF, sizes_E):
    """`kernel(x_ND, w_EDF, sizes_E)` on each device's rows under the active mesh: rows over the
    `batch` rule's axes."""
    mesh = jax.sharding.get_abstract_mesh()
    batch = nn.logical_to_mesh_axes(("batch",))[0]
    axes = () if batch is None else (batch,) if isinstance(batch, str) else tuple(batch)
    num_shards = math.prod(mesh.shape[axis] for axis in axes)
    if x_ND.shape[0] % num_shards:
        axes, num_shards = (), 1  # rows that do not split evenly: every device computes them all
    rows = PartitionSpec(axes or None)

    def local(x_ND, w_EDF, sizes_1E):
        return kernel(x_ND, w_EDF, sizes_1E[0])

    return jax.shard_map(
        local, in_specs=(rows, PartitionSpec(), rows), out_specs=rows,
        check_vma=False,  # pallas_call outputs carry no varying-axes type; the specs say it all
    )(x_ND, w_EDF, local_sizes(sizes_E, num_shards, x_ND.shape[0]))


def grouped_matmul(x_ND, w_EDF, sizes_E, backend: str = "auto"):
    """[N, F] in x's dtype: row block e of `x_ND` (sizes_E[e] rows, blocks in order) times
    w_EDF[e], with the resolved `backend` ("auto", "ragged_dot", "tiled", "megablox")."""
    backend = grouped_matmul_backend(backend, x_ND.dtype)
    if backend == "ragged_dot":
        return jax.lax.ragged_dot(x_ND, w_EDF, sizes_E)
    if backend == "tiled":
        kernel = tiled_matmul
    else:
        kernel = functools.partial(megablox_matmul, interpret=backend == MEGABLOX_INTERPRET)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.are_all_axes_manual:  # one device's rows already (in shard_map: expert parallelism)
        return kernel(x_ND, w_EDF, sizes_E)
    return _sharded(kernel, x_ND, w_EDF, sizes_E)
