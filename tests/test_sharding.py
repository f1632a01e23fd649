"""Sharded training: the same numbers on every mesh, and state really sharded as the rules say."""

import jax
import numpy as np
import pytest

from maxlm import config as config_lib, mesh as mesh_lib
from tests.helpers import load_config, packed_batch, train_losses

MESHES = [(8, 1, 1), (1, 8, 1), (2, 2, 2), (1, 2, 4), (2, 1, 4)]
STEPS = 10


def mesh_config(data, fsdp, tensor):
    cfg = load_config("tiny")
    cfg.mesh.update(data=data, fsdp=fsdp, tensor=tensor)
    cfg.model.update(num_heads=8, num_kv_heads=4, d_model=64)  # heads divisible by tensor=4
    return config_lib.resolve(cfg, jax.device_count())


def run(cfg, steps=STEPS):
    """Losses of `steps` train steps on fixed synthetic batches; also returns the final state."""
    return train_losses(
        cfg, steps, lambda step: packed_batch(cfg.batch_size, cfg.seq_len, cfg.model.vocab_size, seed=step)
    )


@pytest.fixture(scope="module")
def reference_losses():
    return run(mesh_config(1, 1, 1) if jax.device_count() == 1 else mesh_config(8, 1, 1))[0]


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: "x".join(map(str, s)))
def test_same_losses_on_every_mesh(shape, reference_losses):
    losses, _ = run(mesh_config(*shape))
    assert losses[-1] < losses[0]  # it trains
    np.testing.assert_allclose(losses, reference_losses, rtol=1e-4)


def test_state_is_sharded_as_the_rules_say():
    cfg = mesh_config(2, 2, 2)
    _, state = run(cfg, steps=1)
    specs = mesh_lib.describe(state)
    wq = "['layers']['attn']['wq']"
    # params: embed dim over fsdp (ZeRO-3), heads over tensor (Megatron); data replicates;
    # the scanned `layers` axis is not sharded.
    assert specs[f"['params']{wq}"] == "P(None, 'fsdp', 'tensor', None)"
    assert specs["['params']['layers']['mlp']['w_down']"] == "P(None, 'tensor', 'fsdp')"
    assert specs["['params']['embed']"] == "P('tensor', 'fsdp')"
    assert specs["['params']['final_norm']['scale']"] == "P('fsdp',)"
    # Adam's moments follow their parameter, so optimizer state is sharded the same way.
    moment_specs = {k: v for k, v in specs.items() if k.endswith(f".mu{wq}") or k.endswith(f".nu{wq}")}
    assert len(moment_specs) == 2
    assert set(moment_specs.values()) == {"P(None, 'fsdp', 'tensor', None)"}
    # And each device really holds only its shard: 1/(fsdp*tensor) of the matrix.
    wq_array = state["params"]["layers"]["attn"]["wq"]
    shard = wq_array.addressable_shards[0].data
    assert shard.size * 4 == wq_array.size


def test_rules_are_config_data():
    """Changing one rule in the config moves the parameter, no model change needed."""
    cfg = load_config("tiny")
    cfg.mesh.update(data=1, fsdp=8, tensor=1)
    cfg.mesh.rules = tuple(
        (name, None if name == "embed" else axes) for name, axes in cfg.mesh.rules
    )
    cfg = config_lib.resolve(cfg, jax.device_count())
    _, state = run(cfg, steps=1)
    assert mesh_lib.describe(state)["['params']['layers']['mlp']['w_up']"] == "P(None, None, 'tensor')"


def test_bitwise_deterministic():
    cfg = mesh_config(2, 2, 2)
    first, state_a = run(cfg, steps=4)
    second, state_b = run(cfg, steps=4)
    np.testing.assert_array_equal(first, second)
    for a, b in zip(jax.tree.leaves(state_a["params"]), jax.tree.leaves(state_b["params"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
