"""cuDNN's fused flash attention as two calls whose residuals we hold, batched under `vmap` by
folding the mapped axes into the batch:

    out, lse = cudnn.forward(q, k, v, bias, causal=True, scale=s, layout="BTNH")
    dq, dk, dv = cudnn.backward(q, k, v, bias, out, lse, dout, causal=True, scale=s, layout="BTNH")
    out_BLHDh = cudnn.attention(q_BLHDh, k_BSKDh, v_BSKDh, bias_B1LS, window)  # causal; the VJP of the two

`bias` is `attention.document_bias`: [B, 1, L, S], one for all heads; `lse` is the softmax's
float32 log-sum-exp [B, H, L] whatever the layout.

Why not only `jax.nn.dot_product_attention(implementation="cudnn")`, which attention.py runs
outside pipelines:
- the ring merges its blocks' outputs, and its backward pass must hand each block the whole rows'
  output and log-sum-exp, which the public VJP recomputes instead (maxlm/model/parallel/ring_blocks.py);
- the pipeline runs its stages under `vmap`, and JAX's batching rule for the cuDNN primitive
  reshapes a batched bias to [B, heads, L, S]: it fails for a bias shared by the heads.
  `_batch_folded` gives these calls their own rule: the mapped axes go into the batch axis, which
  the kernel is built for (and which GSPMD splits over `stage` and the batch axes alike).

Both calls bind JAX's private cuDNN primitives (`jax._src.cudnn.fused_attention_stablehlo`), as
its own VJP does; the locks pin the version. CI compiles them for H100s (tests/test_gpu_plan.py);
their values are checked against `xla_attention` on a GPU only (tests/test_cudnn.py).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp


def _binding():
    from jax._src.cudnn import fused_attention_stablehlo  # imported late: private, and only on the cuDNN path

    return fused_attention_stablehlo


def _batch_folded(fn):
    """`fn` (arrays with the batch first → arrays with the batch first) whose `vmap` runs it once on
    the mapped and batch axes merged into one batch axis, unbatched arguments broadcast."""
    folded = jax.custom_batching.custom_vmap(fn)

    @folded.def_vmap
    def rule(axis_size, in_batched, *args):
        def merge(x, batched):
            x = x if batched else jnp.broadcast_to(x, (axis_size, *x.shape))
            return x.reshape(axis_size * x.shape[1], *x.shape[2:])

        outs = folded(*map(merge, args, in_batched))  # `folded` again: an outer vmap folds its axis too
        return jax.tree.map(lambda y: y.reshape(axis_size, y.shape[0] // axis_size, *y.shape[1:]), outs), \
            jax.tree.map(lambda _: True, outs)

    return folded


def _mask(causal: bool):
    mask_type = _binding().MaskType
    return mask_type.CAUSAL if causal else mask_type.NO_MASK


def forward(q, k, v, bias, *, causal: bool, scale: float, layout: str, window: int = 0):
    """(out in q's dtype and `layout`, float32 log-sum-exp [B, H, L]) of q attending to k, v with
    the additive `bias` [B, 1, L, S], causal or not (within a sliding `window` of keys when > 0),
    scores scaled by `scale`."""
    return _forward(causal, scale, layout, window)(q, k, v, bias)


def backward(q, k, v, bias, out, lse, dout, *, causal: bool, scale: float, layout: str, window: int = 0):
    """(dq, dk, dv) of `forward`'s attention, given the rows' output and log-sum-exp (its own, or
    the ring's whole rows') and the output's cotangent `dout`."""
    return _backward(causal, scale, layout, window)(q, k, v, bias, out.astype(q.dtype), lse, dout.astype(q.dtype))


@functools.cache
def _forward(causal: bool, scale: float, layout: str, window: int):
    def run(q, k, v, bias):
        out, lse = _binding().dot_product_attention(q, k, v, bias=bias, scale=scale, qkv_layout=layout,
                                                    return_residual=True, mask_type=_mask(causal),
                                                    sliding_window_length=window or None)
        B, H, L = (q.shape[0], q.shape[1], q.shape[2]) if layout == "BNTH" else (q.shape[0], q.shape[2], q.shape[1])
        return out, lse.reshape(B, H, L)
    return _batch_folded(run)


@functools.cache
def _backward(causal: bool, scale: float, layout: str, window: int):
    def run(q, k, v, bias, out, lse, dout):
        binding = _binding()
        unused = jnp.zeros(0, q.dtype)  # sequence lengths, offsets, page tables: none
        return tuple(binding._dot_product_attention_bwd_p_wrapper.bind(
            q, k, v, bias, unused, unused, unused, unused, unused, unused, lse, out, dout, score_mod=None,
            scale=scale, seed=0, dropout_rate=0.0, variadic_args=(True, False),  # a bias, no bias gradient
            mask_type=_mask(causal), layout=binding._normalize_layout(layout).value,
            sliding_window_length=window or None)[:3])
    return _batch_folded(run)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def attention(q_BLHDh, k_BSKDh, v_BSKDh, bias_B1LS, window: int = 0):
    """Causal attention [B, L, H, Dh] (within a sliding `window` of keys when > 0) with the
    document `bias_B1LS`, grouped-query heads native: `jax.nn.dot_product_attention`'s cuDNN path,
    with a VJP that batches under vmap."""
    return _attention_forward(q_BLHDh, k_BSKDh, v_BSKDh, bias_B1LS, window)[0]


def _options(q_BLHDh, window: int) -> dict:
    return dict(causal=True, scale=1 / math.sqrt(q_BLHDh.shape[-1]), layout="BTNH", window=window)


def _attention_forward(q_BLHDh, k_BSKDh, v_BSKDh, bias_B1LS, window):
    out_BLHDh, lse_BHL = forward(q_BLHDh, k_BSKDh, v_BSKDh, bias_B1LS, **_options(q_BLHDh, window))
    return out_BLHDh, (q_BLHDh, k_BSKDh, v_BSKDh, bias_B1LS, out_BLHDh, lse_BHL)


def _attention_backward(window, residuals, dout_BLHDh):
    q_BLHDh, k_BSKDh, v_BSKDh, bias_B1LS, out_BLHDh, lse_BHL = residuals
    grads = backward(q_BLHDh, k_BSKDh, v_BSKDh, bias_B1LS, out_BLHDh, lse_BHL, dout_BLHDh, **_options(q_BLHDh, window))
    return (*grads, jnp.zeros_like(bias_B1LS))  # the bias comes from segment ids: nothing to learn


attention.defvjp(_attention_forward, _attention_backward)
