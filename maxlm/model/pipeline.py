"""Pipeline parallelism: one scanned layer group split over the mesh's `stage` axis, run as a
GPipe schedule.

    out_MbLD, stats = pipeline.run(layer, group_params, group_specs, x_MbLD, side_Mb, stages)

The SPMD form (MaxText's/praxis' pipeline): the group's params [N, ...] become [S, N/S, ...],
stage s holding layers s·N/S ... (s+1)·N/S - 1 (the `layers` rule puts the leading axis on the
`stage` mesh axis). A state buffer [S, b, L, D] holds each stage's current microbatch; each of
the M + S - 1 iterations runs every stage on its slot at once (vmap over the stage axis, which
GSPMD splits over `stage`), then shifts the buffer one stage on (jnp.roll: a collective permute),
feeding microbatch t into stage 0 and collecting the one leaving the last stage. Slots before a
microbatch arrives or after it left compute on zeros and are dropped (the bubble), their
statistics too. The backward pass is autodiff's: the same schedule reversed.

This module knows nothing of what a layer is: transformer.py passes one layer's function (its
Block), as it passes the block to mtp.py's modules, and embeds, norms and splits the batch.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp


def pipeline_stages() -> int:
    """The size of the active mesh's `stage` axis (1 without a mesh or without that axis)."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty or "stage" not in mesh.axis_names else mesh.shape["stage"]


def bubble_fraction(stages: int, num_microbatches: int) -> float:
    """The share of a GPipe step each stage idles: (S - 1) / (M + S - 1). The same for a model of
    several layer groups, each its own pipeline pass of that shape."""
    return (stages - 1) / (num_microbatches + stages - 1)


def _constrain(x, axes):
    return nn.with_logical_constraint(x, axes)


def _by_stage(params, specs, S: int):
    """The group's params [N, ...] as [S, N/S, ...], the stage axis where the layers' was."""
    def split(w, spec):
        return _constrain(w.reshape(S, w.shape[0] // S, *w.shape[1:]), (spec[0], None, *spec[1:]))
    return jax.tree.map(split, params, specs, is_leaf=lambda x: not isinstance(x, dict))


def run(layer, params, specs, x_MbLD, side_Mb: tuple, stages: int):
    """(out [M, b, L, D], stats): the group's N layers on each of M microbatches `x_MbLD`, split
    over `stages` stages.

    `layer(x_bLD, layer_params, *side_bL...)` → (x_bLD, its statistics or None) is one layer;
    `params` the group's stacked params [N, ...] and `specs` their logical PartitionSpecs;
    `side_Mb` the per-microbatch inputs every layer takes besides x (positions, mask, ...).
    stats: each layer's statistics averaged over the M microbatches, [N, ...] (None when the
    layer has none). The microbatches are equal in size, so for a statistic that is a mean over a
    microbatch's tokens this average is its mean over all the tokens.
    """
    S, M = stages, x_MbLD.shape[0]
    stage_params = _by_stage(params, specs, S)
    N = jax.tree.leaves(params)[0].shape[0]

    def stage(p, x_bLD, *side):  # one stage's N/S layers: (x, their statistics [N/S, ...])
        return jax.lax.scan(lambda x, p_layer: layer(x, p_layer, *side), x_bLD, p)

    run_stages = jax.vmap(stage, spmd_axis_name=nn.logical_to_mesh_axes(("layers",))[0])
    state_axes = ("layers", "batch", "length", "act_embed")
    stage_ids_S = jnp.arange(S)

    def iteration(state_SbLD, t):
        feed_bLD = x_MbLD[jnp.minimum(t, M - 1)] * (t < M).astype(x_MbLD.dtype)
        state_SbLD = _constrain(state_SbLD.at[0].set(feed_bLD), state_axes)
        m_S = jnp.clip(t - stage_ids_S, 0, M - 1)  # the microbatch each stage works on
        out_SbLD, stats = run_stages(stage_params, state_SbLD, *(a[m_S] for a in side_Mb))
        out_SbLD = _constrain(out_SbLD, state_axes)
        working_S = (t >= stage_ids_S) & (t - stage_ids_S < M)  # not in the bubble
        stats = jax.tree.map(
            lambda a: jnp.where(working_S.reshape(S, *[1] * (a.ndim - 1)), a, 0.0), stats)
        return _constrain(jnp.roll(out_SbLD, 1, axis=0), state_axes), (out_SbLD[S - 1], stats)

    state_SbLD = _constrain(jnp.zeros((S, *x_MbLD.shape[1:]), x_MbLD.dtype), state_axes)
    _, (done_TbLD, stats_T) = jax.lax.scan(iteration, state_SbLD, jnp.arange(M + S - 1))
    # each stage worked on each microbatch once: summed over the iterations, [S, N/S, ...] → [N, ...]
    stats = jax.tree.map(lambda a: a.sum(axis=0).reshape(N, *a.shape[3:]) / M, stats_T)
    return done_TbLD[S - 1:], stats
