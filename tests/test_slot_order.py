"""The dropless MoE's slot permutations (maxlm/model/moe/slot_order.py), with their gathered
backwards (top-3 and more), give the plain gathers' values and JAX's own gradients
(scatter-adds): all the slots, and a prefix of the sort as under expert parallelism."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxlm.model.moe import slot_order

T, K, D = 12, 3, 5


@pytest.mark.parametrize("M", [T * K, 20], ids=["all_slots", "a_prefix"])
def test_the_gathered_backwards_give_jaxs_gradients(M):
    assert K >= slot_order.GATHERED_BACKWARD_FROM_K  # the custom backwards, not JAX's
    keys = jax.random.split(jax.random.key(0), 3)
    x_TD = jax.random.normal(keys[0], (T, D))
    experts_N = jax.random.randint(keys[1], (T * K,), 0, 4)
    order_N = jnp.argsort(experts_N, stable=True)
    inverse_N = slot_order.inverse(order_N)
    np.testing.assert_array_equal(inverse_N, jnp.argsort(order_N))
    order_M = order_N[:M]
    w_MD = jax.random.normal(keys[2], (M, D))

    def ours(x_TD):
        x_MD = slot_order.by_expert(x_TD, order_M, inverse_N, K)
        return slot_order.by_token(jnp.sin(x_MD) * w_MD, order_M, inverse_N, K)

    def plain(x_TD):
        x_MD = x_TD[order_M // K]
        return (jnp.sin(x_MD) * w_MD).at[inverse_N].get(mode="fill", fill_value=0)

    np.testing.assert_array_equal(ours(x_TD), plain(x_TD))
    cotangent = jax.random.normal(jax.random.key(3), (T * K, D))
    got = jax.vjp(ours, x_TD)[1](cotangent)[0]
    want = jax.vjp(plain, x_TD)[1](cotangent)[0]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
