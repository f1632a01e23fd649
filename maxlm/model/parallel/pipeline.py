"""Pipeline parallelism: one scanned layer group split over the mesh's `stage` axis, run as a
GPipe schedule, or a circular one with `repeats` > 1.

    out_MbLD, stats = pipeline.run(layer, group_params, group_specs, x_MbLD, side_Mb, stages, repeats)

The SPMD form (MaxText's/praxis' pipeline): the group's N layers are cut into S·R chunks of
K = N/(S·R) layers, and stage s holds chunks s, s + S, s + 2S, ... (MaxText's
`num_pipeline_repeats`; with R = 1, layers s·N/S ... (s+1)·N/S - 1, GPipe). The params [N, ...]
keep their layout (the checkpoint does not depend on R) and are viewed as [S, R, K, ...], the
stage axis on the `stage` mesh axis (the `layers` rule); with R > 1 that view moves the chunks
to their stages once per pass (an all-to-all over `stage`, and its transpose for the gradients).

A state buffer [S, b, L, D] holds each stage's current microbatch; each of the R·M + S - 1
iterations runs every stage on its slot at once (vmap over the stage axis, which GSPMD splits
over `stage`), stage s on its chunk of the repeat its microbatch is in, then shifts the buffer
one stage on (jnp.roll: a collective permute). Stage 0 takes microbatch t in the first M
iterations, then each microbatch back from the last stage for its next repeat: it left the last
stage M - S + 1 iterations before (a buffer [M, b, L, D] holds it meanwhile, so M >= S). The
output is the last repeat's. Slots before a microbatch arrives or after it left compute on zeros
or stale values and are dropped (the bubble), their statistics too. The backward pass is
autodiff's: the same schedule reversed.

This module knows nothing of what a layer is: transformer.py passes one layer's function (its
Block), as it passes the block to mtp.py's modules, and embeds, norms and splits the batch.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np


def pipeline_stages() -> int:
    """The size of the active mesh's `stage` axis (1 without a mesh or without that axis)."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty or "stage" not in mesh.axis_names else mesh.shape["stage"]


def bubble_fraction(stages: int, num_microbatches: int, repeats: int = 1) -> float:
    """The share of a step each stage idles: (S - 1) / (R·M + S - 1) (GPipe's (S - 1) / (M + S - 1)
    at R = 1). The same for a model of several layer groups, each its own pipeline pass of that
    shape."""
    return (stages - 1) / (repeats * num_microbatches + stages - 1)


def _constrain(x, axes):
    return nn.with_logical_constraint(x, axes)


def _by_stage(params, specs, S: int, R: int):
    """The group's params [N, ...] as [S, R, N/(S·R), ...], [s, r] being chunk r·S + s; the stage
    axis where the layers' was."""
    def split(w, spec):
        chunks = w.reshape(R, S, w.shape[0] // (S * R), *w.shape[1:])
        if R > 1:  # stage s's chunks to stage s: an all-to-all over `stage`, which GSPMD otherwise
            # does by gathering the whole group on each device; with R >= S the gradients' way back
            # too (R < S cannot split R over the stages: GSPMD would replicate, so it gathers them)
            if R >= S:
                chunks = _constrain(chunks, (spec[0], None, None, *spec[1:]))  # the layers' own split
            chunks = _constrain(chunks, (None, spec[0], None, *spec[1:]))
        return _constrain(chunks.swapaxes(0, 1), (spec[0], None, None, *spec[1:]))
    return jax.tree.map(split, params, specs, is_leaf=lambda x: not isinstance(x, dict))


def _by_layer(stats_TSK, S: int, R: int, M: int, T: int):
    """Each layer's statistics [N, ...], averaged over the microbatches, from the iterations'
    [T, S, K, ...] (zero in the bubble): stage s worked on chunk r·S + s in iterations
    t = s + r·M ... s + r·M + M - 1."""
    passes_TS = np.arange(T)[:, None] - np.arange(S)  # microbatch passes before t
    def per_layer(a):
        chunks = [jnp.where((passes_TS // M == r).reshape(*passes_TS.shape, *[1] * (a.ndim - 2)), a, 0.0).sum(axis=0)
                  for r in range(R)]  # [R][S, K, ...] → [R·S·K, ...]: layer order
        return jnp.stack(chunks).reshape(-1, *a.shape[3:]) / M
    return jax.tree.map(per_layer, stats_TSK)


def run(layer, params, specs, x_MbLD, side_Mb: tuple, stages: int, repeats: int = 1):
    """(out [M, b, L, D], stats): the group's N layers on each of M microbatches `x_MbLD`, split
    over `stages` stages, each holding `repeats` chunks (M >= stages when repeats > 1).

    `layer(x_bLD, layer_params, *side_bL...)` → (x_bLD, its statistics or None) is one layer;
    `params` the group's stacked params [N, ...] and `specs` their logical PartitionSpecs;
    `side_Mb` the per-microbatch inputs every layer takes besides x (positions, mask, ...).
    stats: each layer's statistics averaged over the M microbatches, [N, ...] (None when the
    layer has none). The microbatches are equal in size, so for a statistic that is a mean over a
    microbatch's tokens this average is its mean over all the tokens.
    """
    S, R, M = stages, repeats, x_MbLD.shape[0]
    stage_params = _by_stage(params, specs, S, R)

    def stage(p, r, x_bLD, *side):  # one stage's chunk of repeat r: (x, its layers' statistics [K, ...])
        chunk = jax.tree.map(lambda w: w[r], p)
        return jax.lax.scan(lambda x, p_layer: layer(x, p_layer, *side), x_bLD, chunk)

    run_stages = jax.vmap(stage, spmd_axis_name=nn.logical_to_mesh_axes(("layers",))[0])
    state_axes = ("layers", "batch", "length", "act_embed")
    stage_ids_S = jnp.arange(S)

    def iteration(carry, t):
        state_SbLD, back_MbLD = carry
        feed_bLD = x_MbLD[jnp.minimum(t, M - 1)] * (t < M).astype(x_MbLD.dtype)
        if R > 1:  # from iteration M on, the microbatches come back for their next repeat
            feed_bLD = jnp.where(t < M, feed_bLD, back_MbLD[t % M])
        state_SbLD = _constrain(state_SbLD.at[0].set(feed_bLD), state_axes)
        passes_S = jnp.clip(t - stage_ids_S, 0, R * M - 1)  # the microbatch passes each stage did before
        m_S, r_S = passes_S % M, passes_S // M  # the microbatch each stage works on, and its repeat
        out_SbLD, stats = run_stages(stage_params, r_S, state_SbLD, *(a[m_S] for a in side_Mb))
        out_SbLD = _constrain(out_SbLD, state_axes)
        working_S = (t >= stage_ids_S) & (t - stage_ids_S < R * M)  # not in the bubble
        stats = jax.tree.map(
            lambda a: jnp.where(working_S.reshape(S, *[1] * (a.ndim - 1)), a, 0.0), stats)
        if R > 1:  # kept until stage 0 takes it back; a bubble write (t < S - 1, to slot 0) is
            # overwritten by microbatch 0 at t = S - 1, before stage 0 reads it at t = M >= S
            back_MbLD = _constrain(back_MbLD.at[m_S[S - 1]].set(out_SbLD[S - 1]), (None, *state_axes[1:]))
        return (_constrain(jnp.roll(out_SbLD, 1, axis=0), state_axes), back_MbLD), (out_SbLD[S - 1], stats)

    state_SbLD = _constrain(jnp.zeros((S, *x_MbLD.shape[1:]), x_MbLD.dtype), state_axes)
    back_MbLD = jnp.zeros_like(x_MbLD) if R > 1 else None
    T = R * M + S - 1
    _, (done_TbLD, stats_T) = jax.lax.scan(iteration, (state_SbLD, back_MbLD), jnp.arange(T))
    return done_TbLD[(R - 1) * M + S - 1:], _by_layer(stats_T, S, R, M, T)
