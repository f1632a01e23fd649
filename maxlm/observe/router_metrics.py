"""An MoE model's router metrics: the step's device scalars, and their one-line console summary.

    step_metrics.update(router_metrics.of_step(model_cfg, aux.get("router"), params))   # jitted
    line = router_metrics.console_line(step, row)                                        # host

Aggregates keep their flat `moe_*` names; per-layer values are named
`moe/layer_NN/<metric>` (NN: the layer's index in the model, so `moe/layer_03/load_max` is
`layer_3`'s), already grouped like `eval/<name>/loss`: TensorBoard shows them under these
names, in its `moe` section. docs/observability.md lists them, docs/moe.md says how to read them.
"""

from __future__ import annotations

import re

from maxlm.model import moe
from maxlm.model.moe import router_bias

PER_LAYER = ("load_max", "dropped", "aux_loss", "z_loss", "bias_spread")  # bias_spread: load_balance=bias


def layer_key(layer: int, name: str) -> str:
    return f"moe/layer_{layer:02d}/{name}"


def of_step(model_cfg, router: dict | None, params) -> dict:
    """{name: device scalar} of `model.loss_fn`'s "router" aux (None or {} for a dense model): the
    `moe_*` aggregates, each MoE layer's `PER_LAYER` values, and with the balancing bias
    `moe_bias_spread`, the largest of the layers' max − min bias in `params` (after the step)."""
    if not router:
        return {}
    out = {f"moe_{name}": value for name, value in router.items() if name != "layers"}
    stats = router["layers"]
    per_layer = {"load_max": stats["load_E"].max(axis=-1), "dropped": stats["dropped"],
                 "aux_loss": stats["aux_loss"], "z_loss": stats["z_loss"]}
    if router_bias.enabled(model_cfg):
        bias_ME = router_bias.layer_biases(model_cfg, params)
        per_layer["bias_spread"] = bias_ME.max(axis=-1) - bias_ME.min(axis=-1)
        out["moe_bias_spread"] = per_layer["bias_spread"].max()
    first = moe.dense_layers(model_cfg)
    for m in range(stats["load_E"].shape[0]):
        out.update({layer_key(first + m, name): values[m] for name, values in per_layer.items()})
    return out


_LAYER_KEY = re.compile(r"moe/layer_(\d+)/(\w+)$")


def console_line(step: int, row: dict) -> str | None:
    """`step    100 | moe load_max 1.84 (layer 5) | dropped 0.3% (layer 5) | bias_spread 0.012
    (layer 3)`: the worst layer of each, none named where every layer has 0 (dropless runs); None
    for a row without per-layer router metrics."""
    worst: dict[str, tuple[float, int]] = {}
    for key, value in row.items():
        if (match := _LAYER_KEY.match(key)) and value > worst.get(match[2], (-1.0, 0))[0]:
            worst[match[2]] = (value, int(match[1]))
    if not worst:
        return None
    formats = {"load_max": "moe load_max {:.2f}", "dropped": "dropped {:.1%}", "bias_spread": "bias_spread {:.3g}"}
    parts = [fmt.format(worst[name][0]) + (f" (layer {worst[name][1]})" if worst[name][0] else "")
             for name, fmt in formats.items() if name in worst]
    return " | ".join([f"step {step:>6}", *parts])
