"""Ring attention (`model.context_parallel="ring"`) and its zig-zag load balancing
(`model.context_load_balance`): the same numbers as plain attention, the config's rules."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ml_collections import ConfigDict

from maxlm import config as config_lib
from maxlm.bench import plan as plan_lib
from maxlm.model import attention, attention_plan
from maxlm.model.parallel import ring_attention, ring_blocks, zigzag
from maxlm.sharding import mesh as mesh_lib
from tests.helpers import (
    assert_sharded_apply_equals_unsharded,
    load_config,
    one_device_padded_losses,
    padded_losses,
    padded_packed_batch,
    random_qkv,
    ring_blocks_one_after_another,
    weighted_sum_of_squares,
)


def ring_config(data=2, fsdp=1, sequence=4, tensor=1, **overrides):
    cfg = load_config("tiny")
    cfg.mesh.update(data=data, fsdp=fsdp, sequence=sequence, tensor=tensor)
    cfg.model.update(num_heads=4, num_kv_heads=2)  # grouped-query: 2 heads per kv head
    config_lib.apply_overrides(cfg, {"model.context_parallel": "ring", **overrides})
    return config_lib.resolve(cfg, data * fsdp * sequence * tensor * cfg.mesh.stage)


@pytest.mark.parametrize("load_balance", [False, True], ids=["in_order", "zigzag"])
def test_ring_output_and_gradients_equal_xla_attention(load_balance):
    """sequence=4 × data=2, GQA, several documents per row and padding: the ring's output and
    gradients are xla_attention's with the full mask, in the original order or zig-zag."""
    cfg = ring_config()
    mesh, rules = mesh_lib.make_mesh(cfg.mesh), mesh_lib.rules_of(cfg.mesh)
    q, k, v = random_qkv()
    L = q.shape[1]
    segment_ids = jnp.asarray(padded_packed_batch(2, L, 10, seed=1)["segment_ids"])
    expected = weighted_sum_of_squares(lambda q, k, v: attention.xla_attention(q, k, v, attention.attention_mask(segment_ids)))
    order = zigzag.token_order(L, 4) if load_balance else np.arange(L)
    ring = weighted_sum_of_squares(lambda q, k, v: ring_attention.ring_attention(
        q[:, order], k[:, order], v[:, order], segment_ids[:, order], jnp.asarray(order))[:, np.argsort(order)])
    value, grads = jax.value_and_grad(expected, argnums=(0, 1, 2))(q, k, v)
    with mesh_lib.activate(mesh, rules):
        ring_value, ring_grads = jax.jit(jax.value_and_grad(ring, argnums=(0, 1, 2)))(q, k, v)
    np.testing.assert_allclose(ring_value, value, rtol=1e-5)
    for name, a, b in zip("qkv", grads, ring_grads):
        np.testing.assert_allclose(b, a, atol=1e-5, rtol=1e-5, err_msg=f"d{name}")


@pytest.mark.parametrize("load_balance", [False, True], ids=["in_order", "zigzag"])
def test_the_ring_takes_a_window_a_soft_cap_and_narrower_values(load_balance):
    """XLA's ring blocks with a sliding window of 5 tokens (blocks of 8 beyond it skipped), scores
    capped at 0.5 and values of 6 dims for keys of 8: xla_attention's output and gradients."""
    cfg = ring_config()
    mesh, rules = mesh_lib.make_mesh(cfg.mesh), mesh_lib.rules_of(cfg.mesh)
    q, k, v = random_qkv()
    v = v[..., :6]
    L = q.shape[1]
    segment_ids = jnp.asarray(padded_packed_batch(2, L, 10, seed=1)["segment_ids"])
    mask = attention.attention_mask(segment_ids, 5)
    expected = weighted_sum_of_squares(lambda q, k, v: attention.xla_attention(q, k, v, mask, 0.5))
    order = zigzag.token_order(L, 4) if load_balance else np.arange(L)
    ring = weighted_sum_of_squares(lambda q, k, v: ring_attention.ring_attention(
        q[:, order], k[:, order], v[:, order], segment_ids[:, order], jnp.asarray(order), None, 5, 0.5)[:, np.argsort(order)])
    value, grads = jax.value_and_grad(expected, argnums=(0, 1, 2))(q, k, v)
    with mesh_lib.activate(mesh, rules):
        ring_value, ring_grads = jax.jit(jax.value_and_grad(ring, argnums=(0, 1, 2)))(q, k, v)
    np.testing.assert_allclose(ring_value, value, rtol=1e-5)
    for name, a, b in zip("qkv", grads, ring_grads):
        np.testing.assert_allclose(b, a, atol=1e-5, rtol=1e-5, err_msg=f"d{name}")


@pytest.mark.parametrize("overrides", [
    {"model.sliding_window": 12, "model.layer_pattern": "LG", "model.attn_logit_softcap": 2.0},
    {"model.attention_kind": "mla", "model.q_lora_rank": 24, "model.kv_lora_rank": 32, "model.qk_nope_head_dim": 16,
     "model.qk_rope_head_dim": 8, "model.v_head_dim": 12, "model.num_kv_heads": 4},
], ids=["gemma_like", "mla"])
def test_the_model_runs_the_ring_for_local_layers_and_latent_attention(overrides):
    """Local and global layers with capped scores, and multi-head latent attention, over a ring of 4
    (XLA's blocks, `block_backend`): the unsharded logits."""
    cfg = ring_config(**overrides, **{"model.context_load_balance": True})
    assert attention_plan.kernels(cfg)["context_parallel"] == "ring over 4 devices, zig-zag, xla per block"
    assert_sharded_apply_equals_unsharded(cfg)


def test_ring_keeps_keys_split_and_passes_blocks():
    """Per device, keys and values stay [B/2, L/4, ...]: the compiled step permutes them around the
    ring and never all-gathers them."""
    cfg = ring_config()
    mesh, rules = mesh_lib.make_mesh(cfg.mesh), mesh_lib.rules_of(cfg.mesh)
    q, k, v = random_qkv(L=64)
    segment_ids = jnp.ones(q.shape[:2], jnp.int32)
    with mesh_lib.activate(mesh, rules):
        hlo = jax.jit(lambda q, k, v: ring_attention.ring_attention(q, k, v, segment_ids, jnp.arange(64))) \
            .lower(q, k, v).compile().as_text()
    assert "collective-permute" in hlo
    assert "all-gather" not in hlo


def test_zigzag_order_gives_each_device_an_early_and_a_late_chunk():
    order = zigzag.token_order(16, 4).reshape(4, 4)  # 4 devices, chunks of 2
    assert order.tolist() == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    batch = {"x": jnp.arange(32).reshape(2, 16)}
    np.testing.assert_array_equal(zigzag.restore(zigzag.reorder(batch, 4)["x"], 4, ("batch", "length")),
                                  batch["x"])


def test_ring_training_equals_one_device():
    """3 train steps with sequence=4 × data=2, zig-zag order, equal the 1-device run (packed rows
    with padding). In order, over 20 steps: the ci test below."""
    losses = padded_losses(ring_config(**{"model.context_load_balance": True}), 3)
    np.testing.assert_allclose(losses, one_device_padded_losses(3), rtol=1e-4)


@pytest.mark.ci
@pytest.mark.parametrize("load_balance", [False, True], ids=["in_order", "zigzag"])
def test_ring_training_equals_one_device_over_20_steps(load_balance):
    cfg = ring_config(data=1, fsdp=2, **{"model.context_load_balance": load_balance})
    np.testing.assert_allclose(padded_losses(cfg, 20), one_device_padded_losses(20), rtol=1e-4)


@pytest.mark.ci  # 11 to 13 s each: make test keeps within its 12 minutes
@pytest.mark.parametrize("strategy", ["ring", "ulysses"])
def test_context_parallelism_in_the_pipeline_equals_one_device(strategy):
    """mesh.stage=2 × sequence=4: the stages run under vmap (spmd axis `stage`), the ring's and
    Ulysses' shard_maps inside them; 3 steps equal the 1-device run, and the compiled step passes
    key/value blocks and gathers none (ring) or exchanges them by all-to-all (Ulysses)."""
    cfg = ring_config(data=1, sequence=4, **{"model.context_parallel": strategy, "mesh.stage": 2,
                                            "model.pipeline_microbatches": 2})
    np.testing.assert_allclose(padded_losses(cfg, 3), one_device_padded_losses(3), rtol=1e-4)
    # weights whole over `sequence` (fsdp is 1), so that any all-gather would be of activations
    cfg.mesh.rules = tuple((name, "fsdp" if name == "embed" else axes) for name, axes in cfg.mesh.rules)
    hlo = plan_lib.compile_step(cfg, jax.devices())[0].as_text()
    if strategy == "ring":
        assert "collective-permute(" in hlo and "all-gather(" not in hlo
    else:
        assert "all-to-all(" in hlo


@pytest.mark.ci
def test_ring_training_is_bitwise_deterministic():
    cfg = ring_config(**{"model.context_load_balance": True})
    np.testing.assert_array_equal(padded_losses(cfg, 2), padded_losses(cfg, 2))


def test_context_parallel_config_errors():
    with pytest.raises(config_lib.ConfigError, match="model.context_parallel"):
        ring_config(**{"model.context_parallel": "rings"})
    with pytest.raises(config_lib.ConfigError, match="model.context_load_balance=True needs model.context_parallel"):
        ring_config(**{"model.context_parallel": "all_gather", "model.context_load_balance": True})
    with pytest.raises(config_lib.ConfigError, match="needs seq_len=36 divisible by 2 x mesh.sequence = 8"):
        ring_config(**{"seq_len": 36, "model.context_load_balance": True})
    with pytest.raises(config_lib.ConfigError, match="with model.mtp_depth=1"):
        ring_config(**{"model.context_load_balance": True, "model.mtp_depth": 1})
    assert ring_config(sequence=1, data=8).model.context_parallel == "ring"  # a no-op, allowed


def test_ring_logits_come_back_in_the_batch_order():
    """`apply` under zig-zag load balancing restores the order: the unsharded logits, per position."""
    assert_sharded_apply_equals_unsharded(ring_config(**{"model.context_load_balance": True}))


@pytest.mark.parametrize("load_balance", [pytest.param(False, marks=pytest.mark.ci), True],  # in_order: ci
                         ids=["in_order", "zigzag"])
def test_ring_with_splash_blocks_equals_xla_attention(load_balance):
    """Each block through the splash kernel (the Pallas interpreter here; natively on TPUs), its
    backward pass fed the whole rows' output and log-sum-exp: the output and gradients are
    xla_attention's, in order and zig-zag (L/n = 128 tokens a block, 2 chunks of 128 in zig-zag)."""
    cfg = ring_config()
    mesh, rules = mesh_lib.make_mesh(cfg.mesh), mesh_lib.rules_of(cfg.mesh)
    L = 1024 if load_balance else 512
    q, k, v = random_qkv(L=L, Dh=16)
    segment_ids = jnp.asarray(padded_packed_batch(2, L, 10, seed=1)["segment_ids"])
    expected = weighted_sum_of_squares(lambda q, k, v: attention.xla_attention(q, k, v, attention.attention_mask(segment_ids)))
    order = zigzag.token_order(L, 4) if load_balance else np.arange(L)
    kernel = ring_blocks.BlockKernel(attention.SPLASH_INTERPRET, zigzag=load_balance)
    ring = weighted_sum_of_squares(lambda q, k, v: ring_attention.ring_attention(
        q[:, order], k[:, order], v[:, order], segment_ids[:, order], jnp.asarray(order), kernel)[:, np.argsort(order)])
    value, grads = jax.value_and_grad(expected, argnums=(0, 1, 2))(q, k, v)
    with mesh_lib.activate(mesh, rules):
        ring_value, ring_grads = jax.jit(jax.value_and_grad(ring, argnums=(0, 1, 2)))(q, k, v)
    np.testing.assert_allclose(ring_value, value, rtol=1e-5)
    for name, a, b in zip("qkv", grads, ring_grads):
        # float32 rounding of gradients up to a few hundred: 2e-6 of the largest
        np.testing.assert_allclose(b, a, atol=2e-6 * float(jnp.abs(a).max()), rtol=1e-5, err_msg=f"d{name}")


def test_the_ring_runs_splash_per_block_where_the_config_asks():
    """`model.attention` reaches the ring's blocks: auto is splash on a TPU when a block's part
    (L/n, half that in zig-zag) tiles by 128, cuDNN on a GPU with 16-bit compute, XLA einsums
    otherwise; the start-up line and the plan say which."""
    cfg = ring_config(seq_len=1024, **{"model.context_load_balance": True})
    kernels = attention_plan.kernels(cfg, platform="tpu")
    assert kernels == {"attention": "splash", "context_parallel": "ring over 4 devices, zig-zag, splash per block",
                       "splash_blocks": [128, 128]}
    halves = ring_config(seq_len=512, **{"model.context_load_balance": True})  # zig-zag chunks of 64
    assert attention_plan.kernels(halves, platform="tpu")["attention"] == "xla"
    assert attention_plan.kernels(ring_config(seq_len=512), platform="tpu")["splash_blocks"] == [128, 128]
    assert attention_plan.kernels(cfg, platform="gpu")["attention"] == "xla"  # float32: cuDNN has no kernel
    bf16 = ring_config(seq_len=1024, **{"model.dtype": "bfloat16"})
    assert attention_plan.kernels(bf16, platform="gpu")["context_parallel"] == "ring over 4 devices, cudnn per block"
    assert attention_plan.kernels(ring_config(sequence=1, data=8), platform="tpu")["context_parallel"] == "none"
    with pytest.raises(config_lib.ConfigError, match=r"model.attention='splash' .* = 64 tokens.* its tile 128"):
        ring_config(seq_len=512, **{"model.context_load_balance": True, "model.attention": "splash"})


def test_the_model_runs_the_ring_with_splash_blocks():
    """The model under the ring with the (interpreted) splash kernel per block gives the
    unsharded logits: the transformer passes its config's kernel to the ring."""
    cfg = ring_config(seq_len=512, **{"model.num_layers": 1})
    splash = ConfigDict(cfg.model.to_dict())
    splash.attention = attention.SPLASH_INTERPRET  # tests only: resolve() knows no interpreter
    with mesh_lib.activate(mesh_lib.make_mesh(cfg.mesh), mesh_lib.rules_of(cfg.mesh)):
        assert ring_attention.block_kernel(splash, jnp.float32, 512) is not None
    assert_sharded_apply_equals_unsharded(cfg, padded_packed_batch(2, 512, cfg.model.vocab_size, seed=3), splash)


def test_the_ring_blocks_run_one_after_another_give_the_ring():
    """tests.helpers.ring_blocks_one_after_another, which checks the cuDNN blocks on a single GPU
    (tests/test_cudnn.py), gives xla_attention's output and gradients with the splash blocks."""
    L = 512  # 2 devices in zig-zag order: chunks of 128
    q, k, v = random_qkv(L=L, Dh=16)
    segment_ids = jnp.asarray(padded_packed_batch(2, L, 10, seed=4)["segment_ids"])
    dout = jnp.asarray(np.random.default_rng(5).normal(size=q.shape), jnp.float32)
    out, vjp = jax.vjp(lambda q, k, v: attention.xla_attention(q, k, v, attention.attention_mask(segment_ids)), q, k, v)
    kernel = ring_blocks.BlockKernel(attention.SPLASH_INTERPRET, zigzag=True)
    ring = jax.jit(lambda *a: ring_blocks_one_after_another(kernel, *a, segment_ids, 2, dout))(q, k, v)
    for name, expected, got in zip(["out", "dq", "dk", "dv"], (out, *vjp(dout)), ring):
        np.testing.assert_allclose(got, expected, atol=2e-6 * float(jnp.abs(expected).max()), err_msg=name)
