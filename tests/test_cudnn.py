"""cuDNN attention: causal through the kernel's own mode, documents through `document_bias`.

The CPU checks that bias + causal is exactly the XLA path's mask; on a GPU (launch/gpu_check.sh
runs this file there), values and gradients are compared with the XLA path, for whole rows and
for the ring's blocks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxlm.model import attention
from maxlm.model.kernels import cudnn
from maxlm.model.parallel import ring_blocks
from tests.helpers import ring_blocks_one_after_another


def packed_rows(batch: int, length: int, seed: int = 0) -> np.ndarray:
    """Segment ids as the packer writes them: documents 1, 2, ... of random lengths, then padding (0)."""
    rng = np.random.default_rng(seed)
    rows = np.zeros((batch, length), np.int32)
    for row in rows:
        position, doc = 0, 1
        while position < length - 8:
            size = int(rng.integers(1, length // 3))
            row[position:position + size] = doc
            position, doc = position + size, doc + 1
    return rows


def test_document_bias_and_the_causal_mode_are_the_xla_mask():
    segment_ids = jnp.asarray(packed_rows(4, 64))
    bias = attention.document_bias(segment_ids, jnp.bfloat16)
    causal = jnp.tril(jnp.ones((64, 64), bool))
    np.testing.assert_array_equal(np.asarray((bias == 0) & causal), np.asarray(attention.attention_mask(segment_ids)))
    assert bias.dtype == jnp.bfloat16 and float(bias.min()) == -2.0**41  # finite: cuDNN subtracts it
    with pytest.raises(ValueError, match="needs 16-bit compute"):
        attention.document_bias(segment_ids, jnp.float32)


def bfloat16_qkv_and_cotangent(length: int, cotangent_dtype, seed: int):
    """Random bfloat16 q [2, L, 8, 128], k and v [2, L, 2, 128] (grouped-query), and an output
    cotangent of `cotangent_dtype`."""
    B, H, K, Dh = 2, 8, 2, 128
    keys = jax.random.split(jax.random.key(seed), 4)
    return (jax.random.normal(keys[0], (B, length, H, Dh), jnp.bfloat16),
            jax.random.normal(keys[1], (B, length, K, Dh), jnp.bfloat16),
            jax.random.normal(keys[2], (B, length, K, Dh), jnp.bfloat16),
            jax.random.normal(keys[3], (B, length, H, Dh), cotangent_dtype))


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN attention needs an NVIDIA GPU")
@pytest.mark.parametrize("length, window", [(256, 0), (4096, 0), (4096, 1000)])
def test_cudnn_matches_xla_values_and_gradients(length, window):
    """Whole rows of packed documents, causal or with model.sliding_window (cuDNN's own)."""
    q, k, v, cotangent = bfloat16_qkv_and_cotangent(length, jnp.float32, seed=0)
    segment_ids = jnp.asarray(packed_rows(2, length))

    def loss(backend, q, k, v):
        mask = attention.document_mask(backend, segment_ids, jnp.bfloat16, window)
        out = attention.attend(backend, q, k, v, mask, segment_ids, window=window)
        return (out.astype(jnp.float32) * cotangent).sum(), out

    for backend in ("cudnn", "xla"):
        assert attention.attention_backend(backend, jnp.bfloat16, length) == backend
    (_, out_cudnn), grads_cudnn = jax.jit(jax.value_and_grad(
        lambda *a: loss("cudnn", *a), argnums=(0, 1, 2), has_aux=True))(q, k, v)
    (_, out_xla), grads_xla = jax.jit(jax.value_and_grad(
        lambda *a: loss("xla", *a), argnums=(0, 1, 2), has_aux=True))(q, k, v)
    np.testing.assert_allclose(np.asarray(out_cudnn, np.float32), np.asarray(out_xla, np.float32),
                               rtol=2e-2, atol=2e-2)
    for g_cudnn, g_xla in zip(grads_cudnn, grads_xla):
        scale = float(jnp.abs(g_xla.astype(jnp.float32)).max())
        np.testing.assert_allclose(np.asarray(g_cudnn, np.float32), np.asarray(g_xla, np.float32),
                                   rtol=0, atol=3e-2 * scale)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN attention needs an NVIDIA GPU")
@pytest.mark.parametrize("zigzag", [False, True], ids=["in_order", "zigzag"])
def test_the_rings_cudnn_blocks_match_xla_values_and_gradients(zigzag):
    """cuDNN per ring block (maxlm/model/parallel/ring_blocks.py: its forward's log-sum-exp, its backward
    primitive fed the whole rows' residuals), 4 blocks run one after another on the one GPU."""
    length = 4096
    q, k, v, dout = bfloat16_qkv_and_cotangent(length, jnp.bfloat16, seed=1)
    segment_ids = jnp.asarray(packed_rows(2, length))
    out, vjp = jax.vjp(lambda q, k, v: attention.xla_attention(q, k, v, attention.attention_mask(segment_ids)), q, k, v)
    kernel = ring_blocks.BlockKernel("cudnn", zigzag=zigzag)
    ring = jax.jit(lambda *a: ring_blocks_one_after_another(kernel, *a, segment_ids, 4, dout))(q, k, v)
    for name, expected, got in zip(["out", "dq", "dk", "dv"], (out, *vjp(dout)), ring):
        scale = float(jnp.abs(expected.astype(jnp.float32)).max())
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(expected, np.float32), rtol=0,
                                   atol=3e-2 * scale, err_msg=name)


class XlaStandIn:
    """What maxlm/model/kernels/cudnn.py binds, with XLA's attention in place of the kernel: a forward with
    its log-sum-exp, and a backward that takes the residuals and the output's cotangent. JAX's
    batching rule is not involved: the calls batch through `_batch_folded`, which is under test."""

    class MaskType:
        CAUSAL, NO_MASK = "causal", "none"

    @staticmethod
    def _normalize_layout(layout):
        return type("Layout", (), {"value": layout})

    @staticmethod
    def _reference(q, k, v, bias, scale, causal, window):
        """out and float32 lse [B, H, L] of BTNH q/k/v and a [B, 1, L, S] bias; keys (pos - window, pos]."""
        scores_BHLS = jnp.einsum("blhd,bshd->bhls", q, jnp.repeat(k, q.shape[2] // k.shape[2], axis=2)) * scale + bias
        if causal:
            visible = jnp.tril(jnp.ones(scores_BHLS.shape[-2:], bool))
            visible = visible & ~jnp.tril(visible, -window) if window else visible
            scores_BHLS = jnp.where(visible, scores_BHLS, -jnp.inf)
        lse_BHL = jax.nn.logsumexp(scores_BHLS, axis=-1)
        probs_BHLS = jnp.exp(scores_BHLS - lse_BHL[..., None])
        return jnp.einsum("bhls,bshd->blhd", probs_BHLS, jnp.repeat(v, q.shape[2] // v.shape[2], axis=2)), lse_BHL

    @classmethod
    def dot_product_attention(cls, q, k, v, *, bias, scale, qkv_layout, return_residual, mask_type,
                              sliding_window_length):
        assert qkv_layout == "BTNH" and return_residual and bias.shape[1] == 1
        assert q.ndim == 4  # the batch folded: one batch axis, as cuDNN's primitive takes it
        return cls._reference(q, k, v, bias, scale, mask_type == "causal", sliding_window_length)

    class _dot_product_attention_bwd_p_wrapper:  # noqa: N801 (the binding's name)
        @staticmethod
        def bind(q, k, v, bias, *rest, scale, mask_type, layout, sliding_window_length, **_):
            lse, out, dout = rest[6:9]
            assert layout == "BTNH" and q.ndim == 4 and lse.shape == q.shape[:1] + q.shape[2:3] + q.shape[1:2]
            _, vjp = jax.vjp(lambda q, k, v: XlaStandIn._reference(q, k, v, bias, scale, mask_type == "causal",
                                                                   sliding_window_length)[0], q, k, v)
            return vjp(dout)


@pytest.mark.parametrize("window", [0, 5], ids=["causal", "window5"])
def test_cudnn_attention_batches_under_vmap_with_a_bias_shared_by_the_heads(monkeypatch, window):
    """maxlm/model/kernels/cudnn.py's calls, with an XLA stand-in for the kernel, under the pipeline's vmap
    over stages and a second vmap around it: the stage axes fold into the batch (the kernel only
    ever sees [B, L, H, Dh]), and values and gradients are xla_attention's for each stage's rows,
    causal or within a sliding window (which reaches the kernel as cuDNN's sliding_window_length)."""
    monkeypatch.setattr(cudnn, "_binding", lambda: XlaStandIn)
    rng = np.random.default_rng(0)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
    q, k, v = normal(3, 2, 2, 16, 4, 8), normal(3, 2, 2, 16, 2, 8), normal(3, 2, 2, 16, 2, 8)  # [outer, stage, B, ...]
    segment_ids = jnp.asarray(np.stack([packed_rows(2, 16, seed) for seed in range(6)]).reshape(3, 2, 2, 16))
    bias = jax.vmap(jax.vmap(lambda ids: attention.document_bias(ids, jnp.bfloat16).astype(jnp.float32)))(segment_ids)
    cotangent = normal(*q.shape)

    def objective(fn):
        return lambda q, k, v: (jax.vmap(jax.vmap(fn))(q, k, v, segment_ids, bias) * cotangent).sum()

    xla = objective(lambda q, k, v, ids, bias: attention.xla_attention(q, k, v, attention.attention_mask(ids, window)))
    folded = objective(lambda q, k, v, ids, bias: cudnn.attention(q, k, v, bias, window))
    value, grads = jax.jit(jax.value_and_grad(xla, argnums=(0, 1, 2)))(q, k, v)
    got_value, got_grads = jax.jit(jax.value_and_grad(folded, argnums=(0, 1, 2)))(q, k, v)
    np.testing.assert_allclose(got_value, value, rtol=1e-5)
    for name, a, b in zip("qkv", grads, got_grads):
        np.testing.assert_allclose(b, a, atol=1e-5, rtol=1e-5, err_msg=f"d{name}")


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN attention needs an NVIDIA GPU")
def test_the_pipelines_cudnn_call_matches_jaxs_under_vmap():
    """maxlm/model/kernels/cudnn.py's attention (the pipeline's, batched over 2 stages by folding) gives
    jax.nn.dot_product_attention's cuDNN values and gradients, stage by stage."""
    q, k, v, cotangent = bfloat16_qkv_and_cotangent(1024, jnp.float32, seed=2)
    segment_ids = jnp.asarray(packed_rows(2, 1024, seed=3))
    bias = attention.document_bias(segment_ids, jnp.bfloat16)
    stages = lambda x: jnp.stack([x, x[::-1]])  # noqa: E731  (two stages, different rows)

    def public(q_S, k_S, v_S, bias_S):  # jax's own call, one stage after another (its batching rule fails here)
        return jnp.stack([jax.nn.dot_product_attention(q_S[s], k_S[s], v_S[s], bias=bias_S[s], is_causal=True,
                                                       implementation="cudnn") for s in range(2)])

    def loss(stages_fn, q, k, v):
        out = stages_fn(stages(q), stages(k), stages(v), stages(bias))
        return (out.astype(jnp.float32) * stages(cotangent)).sum(), out

    (_, out), grads = jax.jit(jax.value_and_grad(lambda *a: loss(jax.vmap(cudnn.attention), *a),
                                                 argnums=(0, 1, 2), has_aux=True))(q, k, v)
    (_, want), want_grads = jax.jit(jax.value_and_grad(lambda *a: loss(public, *a), argnums=(0, 1, 2),
                                                       has_aux=True))(q, k, v)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32), rtol=0, atol=1e-2)
    for g, want_g in zip(grads, want_grads):
        scale = float(jnp.abs(want_g.astype(jnp.float32)).max())
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(want_g, np.float32), rtol=0, atol=1e-2 * scale)
