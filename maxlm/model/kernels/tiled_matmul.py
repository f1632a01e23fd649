"""A grouped matmul in plain JAX: each group's rows padded to whole tiles, a loop of dense tile matmuls.

    y_NF = tiled_matmul(x_ND, w_EDF, sizes_E, tile)

The same contract as `jax.lax.ragged_dot` (rows sorted by group; sizes_E rows per group), and the
same algorithm as the megablox kernel, written with XLA's own ops so that it runs on any backend.
Why: XLA:CPU lowers ragged_dot to a dense product over every group and masks the result, so its
cost grows with the number of experts (`bench grouped_matmul`'s figures: docs/moe.md#compute).
Here each tile is one group's rows, so a tile costs one [tile, D] x [D, F] matmul whatever
the number of groups.

Layout: group e's rows move to a run of ceil(sizes_E[e] / tile) tiles; tiles left over at the end
(the bound below is static) and the padding rows of a group's last tile hold zeros. A `lax.scan`
takes `tiles_per_step` tiles a step, gathers each one's group's weights and multiplies them as one
batched matmul, and skips (`lax.cond`) the steps past the used tiles. Several tiles a step matter
on GPUs, where every step costs kernel launches (`default_tiles_per_step`). The backward pass (a
custom VJP) is a second scan over the same steps: x's gradient, and the weights' gradient
accumulated per group in float32 (padding rows are zeros, so they add nothing). The trip count is static so that the loop batches under `vmap` (the pipeline's stages)
without a reduction over the batch; there a cond becomes a select, and unused tiles are computed.

Inside `shard_map` it runs with the types unchecked (`check_vma=False`, as the megablox kernel
must): its loops' carries start as plain zeros, which a checked shard_map would reject.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def _layout(sizes_E, rows: int, tile: int, tiles_per_step: int):
    """Where each row goes and what each tile holds, for `rows` rows sorted by group:
    dest_N (each row's slot in the padded [num_tiles * tile] layout), src_P and valid_P (each slot's
    row, and whether it holds one), group_T (each tile's group) and num_used (tiles holding rows).
    num_tiles is a whole number of steps."""
    E = sizes_E.shape[0]
    num_tiles = -(-rows // tile) + E  # sum_e ceil(s_e / tile) <= ceil(rows / tile) + E - 1
    num_tiles = -(-num_tiles // tiles_per_step) * tiles_per_step
    sizes_E = sizes_E.astype(jnp.int32)
    tiles_E = -(-sizes_E // tile)
    tile_starts_E = jnp.cumsum(tiles_E) - tiles_E
    row_starts_E = jnp.cumsum(sizes_E) - sizes_E

    row_group_N = jnp.searchsorted(jnp.cumsum(sizes_E), jnp.arange(rows), side="right")
    dest_N = tile_starts_E[row_group_N] * tile + jnp.arange(rows) - row_starts_E[row_group_N]

    slot_P = jnp.arange(num_tiles * tile)
    group_T = jnp.minimum(jnp.searchsorted(jnp.cumsum(tiles_E), jnp.arange(num_tiles), side="right"), E - 1)
    num_used = jnp.sum(tiles_E)  # the used tiles come first
    slot_group_P = jnp.repeat(group_T, tile, total_repeat_length=num_tiles * tile)
    offset_P = slot_P - tile_starts_E[slot_group_P] * tile
    valid_P = (slot_P < num_used * tile) & (offset_P < sizes_E[slot_group_P])
    src_P = jnp.where(valid_P, row_starts_E[slot_group_P] + offset_P, 0)
    return dest_N, src_P, valid_P, group_T, num_used, num_tiles


def _to_tiles(x_ND, src_P, valid_P, num_tiles: int, tile: int):
    """[num_tiles, tile, D]: the rows in the padded layout, zeros in the padding."""
    x_PD = jnp.where(valid_P[:, None], x_ND[src_P], jnp.zeros((), x_ND.dtype))
    return x_PD.reshape(num_tiles, tile, x_ND.shape[1])


def _from_tiles(y_TtF, dest_N):
    """[N, F]: the rows back from the padded layout."""
    return y_TtF.reshape(-1, y_TtF.shape[2])[dest_N]


def _steps(a_T, tiles_per_step: int):
    """[T, ...] -> [T / tiles_per_step, tiles_per_step, ...]: the tiles each loop step takes."""
    return a_T.reshape((-1, tiles_per_step) + a_T.shape[1:])


def _tile_products(x_TtD, w_EDF, group_T, num_used, tiles_per_step: int):
    """[T, tile, F]: each of the first `num_used` tiles times its group's weights (float32
    accumulation, x's dtype out), `tiles_per_step` tiles at a time as one batched matmul; steps
    holding no used tile are zeros, their matmuls skipped."""
    C = tiles_per_step
    zeros_CtF = jnp.zeros((C,) + x_TtD.shape[1:2] + w_EDF.shape[2:], x_TtD.dtype)

    def one_step(_, step_inputs):
        first_tile, x_CtD, group_C = step_inputs
        product = lambda: jnp.einsum("ctd,cdf->ctf", x_CtD, w_EDF[group_C],  # noqa: E731
                                     preferred_element_type=jnp.float32).astype(x_TtD.dtype)
        return None, jax.lax.cond(first_tile < num_used, product, lambda: zeros_CtF)

    first_tiles = jnp.arange(0, x_TtD.shape[0], C)
    y_SCtF = jax.lax.scan(one_step, None, (first_tiles, _steps(x_TtD, C), _steps(group_T, C)))[1]
    return y_SCtF.reshape(x_TtD.shape[:2] + w_EDF.shape[2:])


def _tile_gradients(x_TtD, dy_TtF, w_EDF, group_T, num_used, tiles_per_step: int):
    """x's gradient per tile ([T, tile, D]) and the weights' ([E, D, F], summed over each group's
    tiles in float32), `tiles_per_step` tiles at a time."""
    C = tiles_per_step
    zeros = (jnp.zeros((C,) + x_TtD.shape[1:], x_TtD.dtype), jnp.zeros((C,) + w_EDF.shape[1:], jnp.float32))

    def one_step(dw_EDF, step_inputs):
        first_tile, x_CtD, dy_CtF, group_C = step_inputs

        def products():
            dx_CtD = jnp.einsum("ctf,cdf->ctd", dy_CtF, w_EDF[group_C],
                                preferred_element_type=jnp.float32).astype(x_TtD.dtype)
            return dx_CtD, jnp.einsum("ctd,ctf->cdf", x_CtD, dy_CtF, preferred_element_type=jnp.float32)

        dx_CtD, dw_CDF = jax.lax.cond(first_tile < num_used, products, lambda: zeros)
        # the big accumulator stays out of the cond; a group's consecutive tiles add up (.add
        # sums repeated indices), and unused tiles add zeros
        return dw_EDF.at[group_C].add(dw_CDF), dx_CtD

    first_tiles = jnp.arange(0, x_TtD.shape[0], C)
    dw_EDF, dx_SCtD = jax.lax.scan(one_step, jnp.zeros(w_EDF.shape, jnp.float32),
                                   (first_tiles, _steps(x_TtD, C), _steps(dy_TtF, C), _steps(group_T, C)))
    return dx_SCtD.reshape(x_TtD.shape), dw_EDF.astype(w_EDF.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _tiled(x_ND, w_EDF, sizes_E, tile: int, tiles_per_step: int):
    dest_N, src_P, valid_P, group_T, num_used, num_tiles = _layout(sizes_E, x_ND.shape[0], tile, tiles_per_step)
    x_TtD = _to_tiles(x_ND, src_P, valid_P, num_tiles, tile)
    return _from_tiles(_tile_products(x_TtD, w_EDF, group_T, num_used, tiles_per_step), dest_N)


def _tiled_fwd(x_ND, w_EDF, sizes_E, tile: int, tiles_per_step: int):
    return _tiled(x_ND, w_EDF, sizes_E, tile, tiles_per_step), (x_ND, w_EDF, sizes_E)


def _tiled_bwd(tile: int, tiles_per_step: int, residuals, dy_NF):
    x_ND, w_EDF, sizes_E = residuals
    dest_N, src_P, valid_P, group_T, num_used, num_tiles = _layout(sizes_E, x_ND.shape[0], tile, tiles_per_step)
    dx_TtD, dw_EDF = _tile_gradients(_to_tiles(x_ND, src_P, valid_P, num_tiles, tile),
                                     _to_tiles(dy_NF, src_P, valid_P, num_tiles, tile), w_EDF, group_T,
                                     num_used, tiles_per_step)
    return _from_tiles(dx_TtD, dest_N), dw_EDF, None


_tiled.defvjp(_tiled_fwd, _tiled_bwd)


STEP_WEIGHT_BYTES = 128 << 20  # at most this much of the experts' weights gathered per loop step


def default_tile(rows: int, num_groups: int) -> int:
    """Rows per tile: 256 when the groups average at least 512 rows (the padding, half a tile per
    group on average, is then at most a quarter of the rows), else 128 (the measured choice:
    docs/moe.md#compute)."""
    return 256 if rows >= 2 * 256 * num_groups else 128


def default_tiles_per_step(rows: int, w_EDF, tile: int) -> int:
    """Tiles per loop step: a power of two, as many as keep the gathered weights (one [D, F] matrix
    per tile) within STEP_WEIGHT_BYTES, and no more than the tiles there are. Fewer, fuller steps
    matter most on GPUs, where each step costs kernel launches (docs/moe.md#compute)."""
    E, D, F = w_EDF.shape
    fit = max(1, STEP_WEIGHT_BYTES // (D * F * jnp.dtype(w_EDF.dtype).itemsize))
    most = min(fit, -(-rows // tile) + E)
    return 1 << (most.bit_length() - 1)


def tiled_matmul(x_ND, w_EDF, sizes_E, tile: int | None = None, tiles_per_step: int | None = None):
    """[N, F] in x's dtype: row block e of `x_ND` (sizes_E[e] rows, blocks in order) times w_EDF[e],
    `tile` rows at a time (None: `default_tile`), `tiles_per_step` tiles per loop step (None:
    `default_tiles_per_step`), float32 accumulation. Differentiable in x and w."""
    w_EDF = w_EDF.astype(x_ND.dtype)
    if tile is None:
        tile = default_tile(x_ND.shape[0], w_EDF.shape[0])
    if tiles_per_step is None:
        tiles_per_step = default_tiles_per_step(x_ND.shape[0], w_EDF, tile)
    return _tiled(x_ND, w_EDF, sizes_E, tile, tiles_per_step)
