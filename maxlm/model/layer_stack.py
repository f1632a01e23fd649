"""Layers of two kinds (`model.layer_pattern`): local layers attend within `model.sliding_window`
tokens, global ones to the whole causal prefix, the pattern repeating from the bottom layer up.

    kinds(model_cfg)                       # "LLLLLGLLLLLG..": each layer's kind, bottom first
    kind_config(model_cfg, "L")            # the model config a local layer runs with
    x, outs = run(step, x, stacked, kinds)  # stacked layers, one scan over whole repeats

Gemma 3 is "LLLLLG" (five local layers to one global), OLMo 3 "LLLG", as transformers'
`layer_types` list them. Local layers rotate with `model.rope_theta_local` (0: rope_theta) and no
RoPE scaling, global ones with `model.rope_theta` and `model.rope_scaling`: a long-context
extension stretches only the layers that see that far (both families do so).

A layer's parameters do not depend on its kind: the checkpoint keeps one stacked `layers` group
and only the compiled program knows the pattern. `run` scans over groups of consecutive layers
whose kinds repeat (one body of `len(pattern)` layers, each with its kind's static window and
mask, so the kernels skip the tiles a window hides), and unrolls the layers after the last
whole group.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_collections

from maxlm.config.layer_kinds import GLOBAL, LOCAL, kinds, period  # noqa: F401  (layer_stack.kinds etc.)


def kind_config(model_cfg, kind: str):
    """`model_cfg` as a layer of `kind` runs it: a global layer of a pattern without the window, a
    local one with the local RoPE base and no scaling; `model_cfg` itself without a pattern."""
    if not model_cfg.layer_pattern:
        return model_cfg
    if kind == GLOBAL:
        changes = {"sliding_window": 0}
    else:
        changes = {"rope_theta": model_cfg.rope_theta_local or model_cfg.rope_theta, "rope_scaling": "none"}
    layer_cfg = ml_collections.ConfigDict(model_cfg.to_dict())
    layer_cfg.update(changes)
    return layer_cfg


def run(step, x, stacked, layer_kinds: str, remat_policy=None):
    """(x after the layers, their outputs stacked over the layers or None): `step(kind, x, layer)`
    → (x, out) runs one layer, `layer` being its slice of `stacked` (a pytree whose leaves have a
    leading axis of len(layer_kinds)). The layers run in whole groups of `period(layer_kinds)`
    as one `lax.scan` (a group's j-th layer has kind layer_kinds[j]; a single group unrolled),
    the rest unrolled; each layer rematerialised by `remat_policy` when given."""
    n = len(layer_kinds)
    p = period(layer_kinds)
    def layer_fn(kind: str, scanned: bool):
        fn = functools.partial(step, kind)
        # prevent_cse only matters outside scan, where XLA could merge the recomputation away
        return fn if remat_policy is None else jax.checkpoint(fn, policy=remat_policy, prevent_cse=not scanned)

    group_fns = [layer_fn(kind, scanned=True) for kind in layer_kinds[:p]]
    groups = n // p

    def group(x, layers):
        outs = []
        for j, fn in enumerate(group_fns):
            x, out = fn(x, jax.tree.map(lambda a, j=j: a[j], layers))
            outs.append(out)
        return x, None if outs[0] is None else jax.tree.map(lambda *o: jnp.stack(o), *outs)

    if p == 1:  # one kind: the plain scan over the layers
        x, outs = jax.lax.scan(lambda x, layer: group_fns[0](x, layer), x, stacked)
        return x, outs
    outs = []
    if groups > 1:
        grouped = jax.tree.map(lambda a: a[:groups * p].reshape(groups, p, *a.shape[1:]), stacked)
        x, group_outs = jax.lax.scan(group, x, grouped)
        if group_outs is not None:
            outs.append(jax.tree.map(lambda a: a.reshape(groups * p, *a.shape[2:]), group_outs))
    else:  # one group: a scan of one iteration would only add its loop (8% of a 6-layer CPU step)
        groups = 0
    for i in range(groups * p, n):  # the layers after the last scanned group
        x, out = layer_fn(layer_kinds[i], scanned=False)(x, jax.tree.map(lambda a, i=i: a[i], stacked))
        if out is not None:
            outs.append(jax.tree.map(lambda a: a[None], out))
    return x, jax.tree.map(lambda *o: jnp.concatenate(o), *outs) if outs else None
