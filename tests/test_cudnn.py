"""cuDNN attention: causal through the kernel's own mode, documents through `document_bias`.

The CPU checks that bias + causal is exactly the XLA path's mask; on a GPU (launch/gpu_check.sh
runs this file there), values and gradients are compared with the XLA path, for whole rows and
for the ring's blocks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxlm.model import attention, ring_blocks
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
@pytest.mark.parametrize("length", [256, 4096])
def test_cudnn_matches_xla_values_and_gradients(length):
    q, k, v, cotangent = bfloat16_qkv_and_cotangent(length, jnp.float32, seed=0)
    segment_ids = jnp.asarray(packed_rows(2, length))

    def loss(backend, q, k, v):
        mask = attention.document_mask(backend, segment_ids, jnp.bfloat16)
        out = attention.attend(backend, q, k, v, mask, segment_ids)
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
    """cuDNN per ring block (maxlm/model/ring_blocks.py: its forward's log-sum-exp, its backward
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
