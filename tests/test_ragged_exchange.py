"""The ragged all-to-all's CPU emulation (maxlm/model/moe/ragged_exchange.py) computes what
`jax.lax.ragged_all_to_all`'s documentation says the collective computes: its own example, and
random ragged slices checked against the documentation's pseudocode run in numpy, with one slice
per destination and with several (as the collective's vmap rule makes them)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from maxlm.model.moe.ragged_exchange import emulated


def exchange(n, *args):
    """`emulated` over n devices; each argument stacks the devices' own values on a leading axis."""
    mesh = jax.make_mesh((n,), ("x",), devices=jax.devices()[:n])
    f = jax.shard_map(lambda *a: emulated(*(x[0] for x in a), axis_name="x")[None], mesh=mesh,
                      in_specs=P("x"), out_specs=P("x"))
    return np.asarray(jax.jit(f)(*(jax.device_put(jnp.asarray(a), NamedSharding(mesh, P("x"))) for a in args)))


def test_the_documented_example():
    got = exchange(2, [[1, 2, 2], [3, 4, 0]], np.zeros((2, 4)), [[0, 1], [0, 1]], [[1, 2], [1, 1]],
                   [[0, 0], [1, 2]], [[1, 1], [2, 1]])
    np.testing.assert_array_equal(got, [[1, 3, 0, 0], [2, 2, 4, 0]])


@pytest.mark.parametrize("per_device", [1, 3])
def test_random_slices_land_where_the_documented_pseudocode_puts_them(per_device):
    n, out_rows = 4, 40
    rng = np.random.default_rng(per_device)
    slices = n * per_device
    rows = 3 * slices
    sizes = rng.integers(0, 3, (n, slices))  # [sender, slice]: at most 2 rows a slice, 2·n·per_device a receiver
    # slices laid out in the sender's operand, with gaps, and in the receivers' outputs, packed
    input_offsets = np.cumsum(sizes + 1, axis=1) - sizes - 1
    assert (input_offsets[:, -1] + sizes[:, -1] <= rows).all()
    dest = np.arange(slices) // per_device
    output_offsets = np.zeros_like(sizes)
    filled = np.zeros(n, int)
    for s in range(n):
        for i in range(slices):
            output_offsets[s, i], filled[dest[i]] = filled[dest[i]], filled[dest[i]] + sizes[s, i]
    recv_sizes = np.stack([sizes[:, r * per_device:(r + 1) * per_device].reshape(-1) for r in range(n)])
    operand = rng.normal(size=(n, rows, 2)).astype(np.float32)
    output = np.full((n, out_rows, 2), -1.0, np.float32)
    want = output.copy()
    for s in range(n):  # the documentation's SEND/RECEIVE
        for i in range(slices):
            start = output_offsets[s, i]
            want[dest[i], start:start + sizes[s, i]] = operand[s, input_offsets[s, i]:input_offsets[s, i] + sizes[s, i]]
    got = exchange(n, operand, output, input_offsets.astype(np.int32), sizes.astype(np.int32),
                   output_offsets.astype(np.int32), recv_sizes.astype(np.int32))
    np.testing.assert_array_equal(got, want)
    assert (got != -1).any(axis=-1).sum() == sizes.sum()
