"""The schedule's values at known steps, the weight-decay mask and clipping."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from maxlm import config as config_lib, model, optim
from tests.helpers import load_config


def optim_cfg(**overrides):
    cfg = load_config("tiny")
    cfg.steps = 1000
    cfg.optim.update(dict(lr=1e-3, warmup_steps=100, min_lr_ratio=0.1, decay_steps=0))
    cfg.optim.update(overrides)
    return config_lib.resolve(cfg, 1).optim


@pytest.mark.parametrize(
    "step, expected",
    [
        (0, 0.0),
        (50, 0.5e-3),  # halfway through the linear warmup
        (100, 1e-3),  # peak
        (550, 1e-4 + 0.5 * 0.9e-3),  # cosine midpoint: floor + half the range
        (1000, 1e-4),  # floor = lr * min_lr_ratio
        (5000, 1e-4),  # constant after decay_steps
    ],
)
def test_schedule_at_known_steps(step, expected):
    schedule = optim.learning_rate_schedule(optim_cfg())
    np.testing.assert_allclose(float(schedule(step)), expected, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("scan", [False, True])
def test_weight_decay_skips_norms(scan):
    cfg = config_lib.resolve(load_config("tiny"), 1)
    cfg.model.scan_layers = scan
    params = model.init_params(cfg.model, jax.random.key(0))
    mask = optim.weight_decay_mask(params)
    layer = mask["layers"] if scan else mask["layer_0"]
    assert layer["attn"]["wq"] and layer["mlp"]["w_down"] and mask["embed"] and mask["head"]
    assert not layer["attn_norm"]["scale"] and not mask["final_norm"]["scale"]


def test_decay_moves_matrices_but_not_norm_scales():
    tx = optim.make_optimizer(optim_cfg(weight_decay=0.5, warmup_steps=0, clip_norm=0.0))
    params = {"w": jnp.ones((2, 2)), "scale": jnp.ones((2,))}
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = tx.update(zeros, tx.init(params), params)
    assert float(jnp.abs(updates["w"]).sum()) > 0  # decay alone moves the matrix
    assert float(jnp.abs(updates["scale"]).sum()) == 0.0


def test_clipping_bounds_the_update_input():
    cfg = optim_cfg(clip_norm=1.0, warmup_steps=0)
    clip = optax.clip_by_global_norm(cfg.clip_norm)
    grads = {"a": jnp.full((4,), 10.0)}
    clipped, _ = clip.update(grads, clip.init(grads))
    np.testing.assert_allclose(float(optax.tree.norm(clipped)), 1.0, rtol=1e-6)
    tx = optim.make_optimizer(cfg)
    assert isinstance(tx.init(grads), tuple) and len(tx.init(grads)) == 2  # clip → adamw
