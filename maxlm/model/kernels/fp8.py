"""fp8 matmuls (`model.fp8`): a layer's weight matmuls with float8 operands, per-tensor scaled.

    y_BLF = fp8_einsum("bld,df->blf", x_BLD, w_DF)   # x in the compute dtype, w float32

Forward, both operands are quantized to float8_e4m3fn (3 mantissa bits, max 448), each with one
scale computed from its own absolute maximum in this very step ("current" scaling: no amax
history, so no extra state and the parameters stay a plain pytree), dequantized to the compute
dtype and multiplied. Backward, the gradient arriving at the output is quantized the same way to
float8_e5m2 (2 mantissa bits, max 57344: gradients need range more than precision) before the two
gradient matmuls, which therefore also see only float8 values; the quantizers themselves pass
gradients straight through. That is the standard FP8 training recipe (Transformer Engine's current
scaling; flax's fp8_ops, with amax histories). One custom VJP covers the whole einsum: the forward
keeps the float8 operands and their scales as residuals (half the memory of bfloat16 ones) and the
backward dequantizes them again, so remat policies still see the forward's dot (`save_dots`) and
the `checkpoint_name` tags around it, and every matmul, forward or backward, reads
`convert(float8) * scale` operands, even where a layer scan stacks the residuals.

Why quantize → dequantize → dot instead of a float8 dot: it is the pattern XLA's GPU GemmRewriter
turns into one cuBLASLt FP8 GEMM (`__cublas$lt$matmul$f8`, scales folded in) on GPUs of compute
capability >= 8.9 (Ada; Hopper: H100, H200). Elsewhere it runs as written: the matmul sees exactly
the float8-rounded operands, so the numbers are those of fp8 training, but it is not faster.

The scale is |x|max / float8 max rounded up to a power of two. Dividing and multiplying by a
power of two is exact in every dtype, so the only rounding is to float8 itself, the dequantized
operand is exactly `float8 value × scale` in bfloat16 too, and no value can exceed the float8 range
(no clipping). The cost is at most one binade of float8's range, at the bottom (tiny values reach
the subnormals a little earlier); the relative precision of every normal value is unchanged.
Non-finite inputs stay non-finite (float8_e4m3fn has no infinity: they become NaN).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

E4M3 = jnp.float8_e4m3fn  # forward operands: weights and activations
E5M2 = jnp.float8_e5m2  # backward: the output gradient

# Where XLA may use Triton GEMMs, it compiles these dots as 16-bit Triton GEMMs (seen compiling for
# H100 without a GPU), not cuBLASLt float8 GEMMs; with this flag every GEMM goes to cuBLAS(Lt) and
# the float8 ones appear (launch/gpu_env.sh sets it; tests/test_gpu_plan.py checks).
TRITON_GEMM_OFF = "--xla_gpu_enable_triton_gemm=false"


def scale_of(x: jax.Array, fp8_dtype) -> jax.Array:
    """The per-tensor scale (float32 scalar): |x|max / float8 max, rounded up to a power of 2.

    1 for an all-zero x. `x / scale` then lies within float8's range exactly.
    """
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    ratio = amax / jnp.finfo(fp8_dtype).max.astype(jnp.float32)
    mantissa, exponent = jnp.frexp(ratio)  # ratio = mantissa · 2^exponent, mantissa in [0.5, 1)
    return jnp.ldexp(jnp.float32(1), exponent - (mantissa == 0.5))  # the least 2^e >= ratio


def quantize(x: jax.Array, fp8_dtype) -> tuple[jax.Array, jax.Array]:
    """(x / scale as float8, scale)."""
    scale = scale_of(x, fp8_dtype)
    return (x / scale.astype(x.dtype)).astype(fp8_dtype), scale


def _dequantize(x_f8: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """`convert(x_f8) * broadcast(scale)` in `dtype`: the form the GemmRewriter folds into a GEMM."""
    return x_f8.astype(dtype) * scale.astype(dtype)


def quantize_dequantize(x: jax.Array, fp8_dtype, dtype) -> jax.Array:
    """x rounded to float8 with its per-tensor scale, returned in `dtype`."""
    return _dequantize(*quantize(x, fp8_dtype), dtype)


def fp8_einsum(spec: str, x: jax.Array, w: jax.Array, dtype=None) -> jax.Array:
    """`jnp.einsum(spec, x, w)` with float8 operands (and float8 output gradients), in `dtype`
    (default: x's). `w` may be float32: it is quantized from its own precision. The gradients
    come back in x's and w's dtypes."""
    dtype = x.dtype if dtype is None else jnp.dtype(dtype)
    return _fp8_einsum(spec, (dtype, x.dtype, w.dtype), x, w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _fp8_einsum(spec, dtypes, x, w):
    return _fp8_einsum_fwd(spec, dtypes, x, w)[0]


def _fp8_einsum_fwd(spec, dtypes, x, w):
    x_f8, x_scale = quantize(x, E4M3)
    w_f8, w_scale = quantize(w, E4M3)
    y = jnp.einsum(spec, _dequantize(x_f8, x_scale, dtypes[0]), _dequantize(w_f8, w_scale, dtypes[0]))
    # The backward pass dequantizes again from float8 residuals (half bfloat16's memory), so its
    # matmuls show the GEMM pattern too, even when a layer scan stacks the residuals.
    return y, (x_f8, x_scale, w_f8, w_scale)


def _fp8_einsum_bwd(spec, dtypes, residuals, g):
    dtype, x_dtype, w_dtype = dtypes
    x_f8, x_scale, w_f8, w_scale = residuals
    _, einsum_vjp = jax.vjp(
        functools.partial(jnp.einsum, spec),
        _dequantize(x_f8, x_scale, dtype), _dequantize(w_f8, w_scale, dtype),
    )
    dx, dw = einsum_vjp(quantize_dequantize(g, E5M2, dtype))  # g · wᵀ and xᵀ · g, float8 operands
    return dx.astype(x_dtype), dw.astype(w_dtype)


_fp8_einsum.defvjp(_fp8_einsum_fwd, _fp8_einsum_bwd)


def is_native(device: jax.Device) -> bool:
    """Whether XLA turns fp8 einsums into float8 GEMMs on `device`: an NVIDIA GPU of compute
    capability >= 8.9 (Ada, Hopper and later)."""
    if device.platform != "gpu":
        return False
    capability = getattr(device, "compute_capability", "0")
    major, _, minor = str(capability).partition(".")
    try:
        return (int(major), int(minor or 0)) >= (8, 9)
    except ValueError:
        return False
