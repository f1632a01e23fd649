"""Which layers are local and which global under `model.layer_pattern`: the pattern's letters
repeated from the bottom layer up, L a local layer (`model.sliding_window`), G a global one.

    kinds(model_cfg)        # "LLLLLGLLLLLG...", bottom first
    period("LLLLLGLL")      # 6: how many consecutive layers one scanned body holds

Config-level (pure strings), so the config rules and the model read the same layout; what a
kind runs and the scan over groups are maxlm/model/layer_stack.py's.
"""

from __future__ import annotations

LOCAL, GLOBAL = "L", "G"


def kinds(model_cfg, first: int = 0, count: int | None = None) -> str:
    """The kinds of layers first .. first + count - 1 (default: all), bottom first. Without a
    pattern every layer is of the one kind GLOBAL, which runs the model's own config (with its
    `model.sliding_window` on every layer, if set: Mistral; layer_stack.kind_config)."""
    pattern = model_cfg.layer_pattern or GLOBAL
    count = model_cfg.num_layers - first if count is None else count
    return "".join(pattern[i % len(pattern)] for i in range(first, first + count))


def period(layer_kinds: str) -> int:
    """The shortest p with layer_kinds[i] == layer_kinds[i % p] for all i: how many consecutive
    layers one scanned body holds (1 for layers of one kind, as without a pattern)."""
    for p in range(1, len(layer_kinds) + 1):
        if all(layer_kinds[i] == layer_kinds[i % p] for i in range(len(layer_kinds))):
            return p
    return len(layer_kinds)
