"""Which kernels run attention for a config: the start-up log's `attention:` line and the plan's
`attention`, `context_parallel` and `splash_blocks` fields say the same thing from here.

    kernels(cfg, platform=None) -> {"attention": "splash", "context_parallel": "ring over 4 devices,
                                    zig-zag", "splash_blocks": [256, 256]}

`attention` is what each device's attention runs: the backend for whole rows (all-gather,
Ulysses), or for each block of the ring (`ring_attention.block_backend`: splash or XLA).
"""

from __future__ import annotations

from maxlm.model import attention
from maxlm.model.parallel import ring_attention, ring_blocks
from maxlm.model.transformer import compute_dtype


def kernels(cfg, platform: str | None = None) -> dict:
    """The attention kernel, the context-parallel strategy in words, and splash's (query,
    key/value) tiles when splash runs, for `cfg` compiled for `platform` (default: the mesh's)."""
    m, n, length = cfg.model, cfg.mesh.sequence, cfg.seq_len
    dtype = compute_dtype(m)
    ring = n > 1 and m.context_parallel == "ring"
    if ring:
        backend = ring_attention.block_backend(m, dtype, length, n, platform)
        strategy = f"ring over {n} devices{', zig-zag' if m.context_load_balance else ''}, {backend} per block"
    else:
        backend = attention.attention_backend(m.attention, dtype, length, platform=platform, softcap=m.attn_logit_softcap,
                                              head_dim=m.head_dim)
        strategy = {1: "none"}.get(n, f"{m.context_parallel} over {n} devices")
    plan = {"attention": backend, "context_parallel": strategy}
    if backend in attention.SPLASH:
        tiles = ring_blocks.BlockKernel(backend, m.context_load_balance, m.splash_block_q, m.splash_block_kv) \
            .tiles(length // n) if ring else attention.splash_tiles(length, m.splash_block_q, m.splash_block_kv)
        plan["splash_blocks"] = list(tiles)
    return plan
