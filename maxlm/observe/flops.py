"""Model FLOPs per token, peak FLOP/s and MFU.

FLOPs convention (read this before comparing MFU numbers):

* Matmuls only, 2 FLOPs per multiply-accumulate. Norms, RoPE, softmax, SwiGLU's
  elementwise product, residual adds and the embedding lookups (gathers; the
  learned position table's too) are not counted; they are a few percent at
  most and not what MFU measures.
* Training = 3 x forward: the backward pass does two matmuls (one for the
  activation gradient, one for the weight gradient) per forward matmul.
* Recomputation from activation checkpointing is NOT counted: this is model
  FLOPs utilisation (MFU), not hardware FLOPs utilisation (HFU).
* Causal attention scores (QK^T) and the weighted sum (AV) cost
  2*2*T*H*Dh per token when every position attends to all T positions; we
  count HALF of that, because under a causal mask only the lower triangle is
  useful work. This matches MaxText's causal convention. PaLM's appendix B
  (the usual "6N + 12*L*H*Dh*T" formula) counts it unhalved, so PaLM-style
  MFU numbers for the same run come out higher than ours.
* The LM head (2*d*V per token) is counted whether or not it shares its
  weights with the embedding table: tying saves parameters, not FLOPs.
* Multi-token prediction (`model.mtp_depth` = D, maxlm/model/mtp.py) adds per
  depth its [2d, d] projection ("mtp_proj"), one dense layer (in the layer
  parts: the remat policy recomputes it as it does the trunk's) and one more
  LM head.

With those rules the non-attention part of a training step is exactly
6 x (matmul parameters), where matmul parameters are every parameter except
the embedding tables (tokens; learned positions) and norm scales, plus the LM head.

Peak FLOP/s comes from a table of dense (non-sparse) datasheet peaks for known
accelerators, or, on CPU and unknown devices, from a short measured matmul (or, in its place,
the rate given in MAXLM_PEAK_FLOPS_PER_SEC; docs/performance.md).
"""

from __future__ import annotations

import functools
import math
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from maxlm.model import layer_stack, moe
from maxlm.runtime.errors import UserError

# ---------------------------------------------------------------------------
# Model FLOPs
# ---------------------------------------------------------------------------


def _head_dim(model_cfg) -> int:
    if model_cfg.head_dim:  # 0 (unresolved configs): d_model // num_heads
        return int(model_cfg.head_dim)
    if model_cfg.d_model % model_cfg.num_heads:
        raise ValueError(
            f"head_dim=0 needs d_model ({model_cfg.d_model}) divisible by "
            f"num_heads ({model_cfg.num_heads})"
        )
    return model_cfg.d_model // model_cfg.num_heads


def _mlp_flops(model_cfg) -> int:
    """Forward MLP FLOPs per token over the layers: (gate,) up and down of the dense MLPs (the
    multi-token prediction modules' too); in MoE layers those of the *active* experts (the K
    routed ones, the shared ones) and the router."""
    m = model_cfg
    dense = moe.dense_layers(m)
    per_moe_layer = 2 * (m.d_model * m.num_experts + 3 * m.d_model * m.expert_mlp_dim * (m.experts_per_token + m.shared_experts))
    matrices = 2 if getattr(m, "mlp_activation", "swiglu") == "gelu" else 3  # ungated: up and down only
    return (dense + m.mtp_depth) * matrices * 2 * m.d_model * m.mlp_dim + (m.num_layers - dense) * per_moe_layer


def _mean_keys_x2T(T: int, window: int) -> int:
    """2T x the keys a query attends to on average: T/2 under the causal mask (the convention
    above), W - W²/2T with a sliding window of W tokens."""
    return T * T if not window or window >= T else 2 * T * window - window * window


def _layer_windows(model_cfg) -> list[int]:
    """Each layer's sliding window (0: none), bottom first, then the multi-token prediction
    modules' (global layers): `model.sliding_window` on every layer, or on the local layers of a
    `model.layer_pattern`."""
    m, window = model_cfg, getattr(model_cfg, "sliding_window", 0)
    if not getattr(m, "layer_pattern", ""):
        return [window] * (m.num_layers + m.mtp_depth)
    return [window if kind == layer_stack.LOCAL else 0 for kind in layer_stack.kinds(m)] + [0] * m.mtp_depth


def _projection_flops(model_cfg, Dh: int) -> dict[str, int]:
    """One layer's forward projection FLOPs per token: grouped-query attention's, or multi-head
    latent attention's (maxlm/model/mla.py: the query bottleneck, the latent and its expansion)."""
    m = model_cfg
    d, H, K = m.d_model, m.num_heads, m.num_kv_heads
    if getattr(m, "attention_kind", "gqa") != "mla":
        return {"q_proj": 2 * d * H * Dh, "kv_proj": 2 * 2 * d * K * Dh, "out_proj": 2 * H * Dh * d}
    Q, C, R, N, V = m.q_lora_rank, m.kv_lora_rank, m.qk_rope_head_dim, m.qk_nope_head_dim, m.v_head_dim
    return {"q_proj": 2 * (d * Q + Q * H * Dh) if Q else 2 * d * H * Dh,
            "kv_proj": 2 * (d * (C + R) + C * H * (N + V)), "out_proj": 2 * H * V * d}


def forward_flops_breakdown(model_cfg, seq_len: int) -> dict[str, float]:
    """Forward-pass FLOPs per token, summed over layers, by component.

    Keys: q_proj, kv_proj, out_proj, mlp, attention (causal, halved), lm_head,
    mtp_proj, total. The layer parts and lm_head include the multi-token prediction
    modules' (`model.mtp_depth`). See the module docstring for what is and is not counted.
    """
    if seq_len <= 0:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    d, V, depth = model_cfg.d_model, model_cfg.vocab_size, model_cfg.mtp_depth
    H, K = model_cfg.num_heads, model_cfg.num_kv_heads
    L = model_cfg.num_layers + depth  # each MTP module runs one layer
    if H % K:
        raise ValueError(f"num_heads ({H}) must be a multiple of num_kv_heads ({K})")
    Dh, T = _head_dim(model_cfg), int(seq_len)
    projections = _projection_flops(model_cfg, Dh)
    Dv = model_cfg.v_head_dim if getattr(model_cfg, "attention_kind", "gqa") == "mla" else Dh
    # Python ints throughout so the counts are exact; floats only at the end.
    parts = {
        **{name: L * flops for name, flops in projections.items()},
        "mlp": _mlp_flops(model_cfg),
        # QK^T and AV: 2*T*H*(Dh + Dv) per token, halved for the causal mask; a sliding window of W
        # keys: W - W²/2T keys on average (T/2 at W = T), in each layer that has one
        "attention": (2 * H * (Dh + Dv)) * sum(_mean_keys_x2T(T, w) for w in _layer_windows(model_cfg)) // (2 * T),
        "lm_head": (1 + depth) * 2 * d * V,
        "mtp_proj": depth * 2 * 2 * d * d,
    }
    parts["total"] = sum(parts.values())
    return {name: float(flops) for name, flops in parts.items()}


def flops_per_token(model_cfg, seq_len: int) -> float:
    """Training (forward + backward = 3 x forward) model FLOPs per token."""
    return 3 * forward_flops_breakdown(model_cfg, seq_len)["total"]


# Forward FLOPs a remat policy computes again in the backward pass: the layer parts it does not
# save (model.REMAT_POLICIES). The last third of "mlp" is its down projection (the layer's output).
_RECOMPUTED = {
    "none": (),
    "save_dots": ("attention",),  # the attention einsums have batch dimensions: not saved
    "save_qkv_proj": ("out_proj", "mlp", "attention"),
    "save_out_proj": ("q_proj", "kv_proj", "attention", "mlp_gate_up"),
    "full": ("q_proj", "kv_proj", "out_proj", "mlp", "attention"),
}


def hardware_flops_per_token(model_cfg, seq_len: int) -> float:
    """What the chips compute per token in training: the model FLOPs (`flops_per_token`) plus the
    forward work `model.remat` recomputes in the backward pass. MFU counts only the former."""
    parts = forward_flops_breakdown(model_cfg, seq_len)
    parts["mlp_gate_up"] = parts["mlp"] * 2 / 3
    return flops_per_token(model_cfg, seq_len) + sum(parts[p] for p in _RECOMPUTED[model_cfg.remat])


# ---------------------------------------------------------------------------
# Peak FLOP/s
# ---------------------------------------------------------------------------

# Dense per-chip peaks from vendor datasheets, in FLOP/s. Matched against
# device.device_kind lowercased, first hit wins, so more specific patterns come
# first ("v5 lite" before "v5", "h100 pcie" before "h100").
#   bf16: bf16/fp16 tensor-core or MXU peak (identical on every chip listed).
#   tf32: what float32 matmuls get on NVIDIA under JAX's default precision.
#   fp32: true float32 (non-tensor-core); only reached at "highest" precision.
# TPUs have no float32 matmul unit: XLA runs f32 matmuls as bf16 passes, so
# their bf16 peak is the ceiling for every dtype.
_PEAK_TABLE: tuple[tuple[tuple[str, ...], dict[str, float]], ...] = (
    (("v6 lite", "v6e", "trillium"), {"bf16": 918e12}),
    (("v5 lite", "v5e", "v5litepod"), {"bf16": 197e12}),
    (("v5p", "tpu v5"), {"bf16": 459e12}),  # v5p reports device_kind "TPU v5"
    (("tpu v4",), {"bf16": 275e12}),
    (("tpu v3",), {"bf16": 123e12}),
    # GB200/B200: HGX B200 datasheet (1000 W); sparse figures halved.
    (("b200",), {"bf16": 2250e12, "tf32": 1100e12, "fp32": 75e12}),
    # H200 is the H100 SXM die with more HBM; GH200 matches here too.
    (("h200",), {"bf16": 989e12, "tf32": 495e12, "fp32": 67e12}),
    (("h100 pcie",), {"bf16": 756e12, "tf32": 378e12, "fp32": 51e12}),
    # Any other H100 (e.g. "NVIDIA H100 80GB HBM3") is taken to be SXM, the
    # part in nearly every training cluster; H100 NVL is ~15% lower.
    (("h100",), {"bf16": 989e12, "tf32": 495e12, "fp32": 67e12}),
    (("a100",), {"bf16": 312e12, "tf32": 156e12, "fp32": 19.5e12}),
)

_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16",
                  "fp32": "float32", "f32": "float32", "float": "float32"}


CPU_PROBE_DTYPE = "float32"  # the matmul a CPU's peak is measured with, whatever model.dtype


def dtype_name(dtype) -> str:
    name = _DTYPE_ALIASES.get(str(dtype).lower(), dtype)
    name = jnp.dtype(name).name
    if name not in ("bfloat16", "float16", "float32"):
        raise ValueError(f"no peak FLOP/s for dtype {dtype!r}")
    return name


def _full_fp32_matmuls() -> bool:
    """Whether f32 matmuls run at true f32 (not TF32) on NVIDIA right now."""
    precision = jax.config.jax_default_matmul_precision
    precision = getattr(precision, "name", precision)  # DotAlgorithmPreset
    return str(precision).lower() in ("highest", "float32", "f32_f32_f32")


def table_peak(device_kind: str, dtype_name: str) -> float | None:
    kind = device_kind.lower()
    for patterns, peaks in _PEAK_TABLE:
        if any(p in kind for p in patterns):
            if dtype_name != "float32":
                return peaks["bf16"]
            if "tf32" not in peaks:  # TPU: f32 matmuls are bf16 passes
                return peaks["bf16"]
            return peaks["fp32" if _full_fp32_matmuls() else "tf32"]
    return None


def _time_matmul(device, n: int, dtype_name: str, repeats: int = 5) -> float:
    """Best-of-`repeats` seconds for one jitted n x n @ n x n matmul on `device`.

    The fastest run, not the median: a peak is what the hardware can do, and on a shared host
    the slower runs measure the neighbours. (It also keeps MFU conservative.)
    """
    x = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    a = jax.device_put(jnp.asarray(x, dtype_name), device)
    matmul = jax.jit(jnp.matmul)
    for _ in range(2):  # compile, then one warm run
        matmul(a, a).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a, a).block_until_ready()
        times.append(time.perf_counter() - start)
    return min(times)


@functools.cache
def probe_size(device, dtype_name: str = "float32") -> int:
    """The side of the square matmul that `measure_matmul_flops_per_sec` times (cached)."""
    n = 1024
    while _time_matmul(device, n, dtype_name, repeats=1) < 0.05 and n < 8192:
        n *= 2
    return n


def matmul_flops_per_sec(device, dtype_name: str = "float32", repeats: int = 3) -> float:
    """One uncached reading of the probe at `probe_size`: benchmarks take it between their timed
    steps, so the peak is read in the same window as the work it divides (a shared host's rate
    moves several-fold between minutes)."""
    n = probe_size(device, dtype_name)
    return 2 * n**3 / _time_matmul(device, n, dtype_name, repeats)


@functools.cache
def measure_matmul_flops_per_sec(device, dtype_name: str = "float32") -> float:
    """Achieved FLOP/s of a square matmul on one device; cached per process.

    The matrix grows until one call takes >= 50 ms, so timer resolution and
    dispatch overhead stay small next to the work, and no larger, since the probe
    runs at every start (docs/performance.md#flops-and-mfu). Runs at JAX's default
    matmul precision in `dtype_name`, i.e. what the training step gets.
    """
    return matmul_flops_per_sec(device, dtype_name, repeats=5)


PEAK_ENV = "MAXLM_PEAK_FLOPS_PER_SEC"


def given_peak() -> float:
    """The rate in MAXLM_PEAK_FLOPS_PER_SEC, taken in place of the probe's measurement."""
    value = os.environ[PEAK_ENV]
    try:
        rate = float(value)
    except ValueError:
        rate = math.nan
    if not (math.isfinite(rate) and rate > 0):
        raise UserError(f"{PEAK_ENV} must be a positive number of FLOP/s, got {value!r}")
    return rate


def peak_flops(devices, dtype: str) -> dict[str, Any]:
    """Peak FLOP/s to divide by for MFU, for a homogeneous list of devices.

    Known accelerators use the datasheet table (source="table"); CPU and
    unknown kinds are measured with a short matmul probe (source="measured"),
    or take MAXLM_PEAK_FLOPS_PER_SEC's rate where it is set (source: its name).

    On CPU, total_flops_per_sec is the host's measured rate, NOT
    num_devices x it: fake devices from --xla_force_host_platform_device_count
    all share the same cores, and one matmul on one device already uses every
    host thread. per_device_flops_per_sec is then that rate split evenly.
    Elsewhere each device is a real chip and total = per-device x count.
    """
    devices = list(devices)
    if not devices:
        raise ValueError("peak_flops needs at least one device")
    kinds = {d.device_kind for d in devices}
    if len(kinds) > 1:
        raise ValueError(f"mixed device kinds have no single peak: {sorted(kinds)}")
    first, n = devices[0], len(devices)
    platform = getattr(first, "platform", "unknown")
    # XLA:CPU runs bfloat16 matmuls as float32 ones on converted operands (the compiled step
    # shows it), and its bfloat16 matmul kernel reads 2-3x slower: the CPU peak is float32's.
    name = CPU_PROBE_DTYPE if platform == "cpu" else dtype_name(dtype)

    per_device = None if platform == "cpu" else table_peak(first.device_kind, name)
    source = "table"
    if per_device is None and PEAK_ENV in os.environ:
        source, per_device = PEAK_ENV, given_peak()
    if per_device is None:
        source = "measured"
        per_device = measure_matmul_flops_per_sec(first, name)
    total = per_device if platform == "cpu" else per_device * n
    return {
        "total_flops_per_sec": float(total),
        "per_device_flops_per_sec": float(total / n),
        "source": source,
        "device_kind": first.device_kind,
        "num_devices": n,
        "platform": platform,
    }


def mfu(tokens_per_sec: float, flops_per_token: float, peak_total: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over peak FLOP/s."""
    if not peak_total > 0:
        raise ValueError(f"peak_total must be positive, got {peak_total}")
    return tokens_per_sec * flops_per_token / peak_total
