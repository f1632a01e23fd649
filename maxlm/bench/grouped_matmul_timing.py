"""`python -m maxlm.bench grouped_matmul --config=...`: the dropless MoE's grouped matmul on each
backend this platform runs, at the config's shapes, against a dense matmul of the same rows.

One expert projection, forward and backward: batch_size × seq_len × experts_per_token rows of
d_model, spread over num_experts experts by a uniform random router, times [E, d_model,
expert_mlp_dim] weights, in the model's compute dtype. The backends run in interleaved rounds
(one call each per round, after one untimed compile call), so a machine that drifts favours none;
the JSON has each one's median seconds and its median ratio to the dense floor.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from maxlm import model
from maxlm.model.moe import grouped_matmul as gm


def backends(platform: str) -> tuple[str, ...]:
    """The grouped-matmul backends `platform` runs (megablox is a TPU kernel)."""
    return ("ragged_dot", "tiled", "megablox") if platform == "tpu" else ("ragged_dot", "tiled")


def bench_grouped_matmul(cfg, rounds: int) -> dict:
    m = cfg.model
    E, D, F, dtype = m.num_experts, m.d_model, m.expert_mlp_dim, model.compute_dtype(m)
    rows = cfg.batch_size * cfg.seq_len * m.experts_per_token
    rng = np.random.default_rng(cfg.seed)
    sizes_E = jnp.asarray(np.bincount(rng.integers(0, E, rows), minlength=E), jnp.int32)
    keys = jax.random.split(jax.random.key(cfg.seed), 3)
    x_ND = jax.random.normal(keys[0], (rows, D), dtype)
    w_EDF = (jax.random.normal(keys[1], (E, D, F)) * D ** -0.5).astype(dtype)
    probe_NF = jax.random.normal(keys[2], (rows, F), jnp.float32)

    # the group sizes are an argument, as in training: a constant would have XLA fold the layout
    # (seconds of compilation, and a loop that the model never runs)
    def fwd_bwd(matmul):
        def loss(x_ND, w_EDF, sizes_E):
            return jnp.sum(matmul(x_ND, w_EDF, sizes_E).astype(jnp.float32) * probe_NF)
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))

    fns = {name: fwd_bwd(lambda x, w, s, name=name: gm.grouped_matmul(x, w, s, name))
           for name in backends(jax.default_backend())}
    fns["dense"] = fwd_bwd(lambda x, w, s: x @ w[0])  # the floor: the same rows through one matrix
    for fn in fns.values():
        jax.block_until_ready(fn(x_ND, w_EDF, sizes_E))  # compiles
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(x_ND, w_EDF, sizes_E))
            times[name].append(time.perf_counter() - start)
    return {
        "benchmark": "grouped_matmul", "config": cfg.name, "device_kind": jax.devices()[0].device_kind,
        "rows": rows, "experts": E, "d_model": D, "expert_mlp_dim": F, "dtype": str(jnp.dtype(dtype)),
        "rounds": rounds, "fwd_bwd_sec_median": {name: statistics.median(t) for name, t in times.items()},
        "over_dense_median": {name: statistics.median(a / b for a, b in zip(t, times["dense"]))
                              for name, t in times.items() if name != "dense"},
        "jax_version": jax.__version__,
    }
