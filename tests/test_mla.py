"""Multi-head latent attention (maxlm/model/mla.py): sharded equals unsharded, splash with values
narrower than the keys equals XLA, generation's latent cache gives the full forward pass's
logits, the parameter and FLOP counts, and what it is not built with is refused (exit 2).
Its logits against a float64 transcription: tests/test_model.py; against transformers'
DeepseekV3ForCausalLM: tests/test_hf_architectures.py."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxlm import config as config_lib, generate as gen, model
from maxlm.model import attention, mla
from maxlm.observe import flops
from maxlm.sharding import mesh as mesh_lib
from tests.helpers import load_config, packed_batch, with_overrides

# configs/tiny.py's shape with 4 heads of 16 + 8 query/key dims and 12 value dims from a 32-wide latent
MLA = {"model.attention_kind": "mla", "model.q_lora_rank": 24, "model.kv_lora_rank": 32, "model.qk_nope_head_dim": 16,
       "model.qk_rope_head_dim": 8, "model.v_head_dim": 12, "model.num_kv_heads": 4}


def mla_config(**overrides):
    return config_lib.resolve(with_overrides(load_config("tiny"), {**MLA, **overrides}), jax.device_count())


def test_the_parameters_are_deepseeks_and_counted():
    cfg = mla_config()
    params = model.init_params(cfg.model, jax.random.key(0))
    shapes = jax.tree.map(lambda a: a.shape[1:], params["layers"]["attn"])  # less the layer axis
    assert shapes == {"wq_a": (64, 24), "q_a_norm": {"scale": (24,)}, "wq_b": (24, 4, 24), "wkv_a": (64, 40),
                      "kv_a_norm": {"scale": (32,)}, "wkv_b": (32, 4, 28), "wo": (4, 12, 64)}
    assert cfg.model.head_dim == 24  # qk_nope_head_dim + qk_rope_head_dim
    assert sum(a.size for a in jax.tree.leaves(params)) == model.count_params(cfg.model)
    no_q_lora = mla_config(**{"model.q_lora_rank": 0})
    assert "wq" in model.init_params(no_q_lora.model, jax.random.key(0))["layers"]["attn"]
    # per token: q (64→24→4·24), the latent (64→40), its expansion (32→4·28), out (4·12→64)
    parts = flops.forward_flops_breakdown(cfg.model, 64)
    assert (parts["q_proj"], parts["kv_proj"], parts["out_proj"]) == (2 * 2 * (64 * 24 + 24 * 96),
                                                                      2 * 2 * (64 * 40 + 32 * 112), 2 * 2 * 48 * 64)
    assert parts["attention"] == 2 * 2 * 4 * (24 + 12) * 64 * 64 / (2 * 64)  # QK^T of 24 dims, AV of 12, causal


def test_fsdp_and_tensor_sharding_give_the_unsharded_loss_and_gradients():
    """fsdp 4 x tensor 2 (the latent dims split over fsdp in the up-projections, the heads over
    tensor): the same loss and gradients as one device's."""
    cfg = mla_config(**{"mesh.data": 1, "mesh.fsdp": 4, "mesh.tensor": 2})
    params = model.init_params(cfg.model, jax.random.key(0))
    batch = {k: jnp.asarray(v) for k, v in packed_batch(8, 64, cfg.model.vocab_size).items()}
    loss_and_grads = jax.value_and_grad(lambda p, b: model.loss_fn(cfg.model, p, b)[0])
    want, want_grads = jax.jit(loss_and_grads)(params, batch)
    mesh, rules = mesh_lib.make_mesh(cfg.mesh), mesh_lib.rules_of(cfg.mesh)
    shardings = mesh_lib.logical_to_shardings(model.param_logical_specs(cfg.model), mesh, rules)
    layer_axis, latent, heads, _ = shardings["layers"]["attn"]["wkv_b"].spec  # [layers, C, H, N + V]
    assert "fsdp" in latent and heads == "tensor"
    with mesh_lib.activate(mesh, rules):
        loss, grads = jax.jit(loss_and_grads)(jax.device_put(params, shardings), mesh_lib.global_batch(batch, mesh, rules))
    np.testing.assert_allclose(loss, want, rtol=1e-6)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(want_grads), jax.tree.leaves(grads)):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-7, err_msg=jax.tree_util.keystr(path))


def test_splash_takes_values_narrower_than_the_keys():
    """The interpreted splash kernel with 24-dim queries and keys and 12-dim values (MLA's shapes):
    XLA's output and gradients."""
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (2, 256, 4, 24))
    k = jax.random.normal(keys[1], (2, 256, 4, 24))
    v = jax.random.normal(keys[2], (2, 256, 4, 12))
    segment_ids = jnp.asarray([[1] * 100 + [2] * 100 + [0] * 56, [1] * 128 + [2] * 64 + [3] * 64], jnp.int32)
    mask = jax.jit(attention.attention_mask)(segment_ids)

    def grads(attend):
        return jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(attend(q, k, v) ** 2), argnums=(0, 1, 2)))(q, k, v)

    want = grads(lambda q, k, v: attention.xla_attention(q, k, v, mask))
    got = grads(lambda q, k, v: attention.splash_attention(q, k, v, segment_ids, block_q=128, block_kv=128, interpret=True))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5 * float(jnp.abs(b).max()))


@pytest.mark.parametrize("scan", [True, False], ids=["scanned", "unrolled"])
@pytest.mark.parametrize("q_lora", [24, 0], ids=["q_lora", "no_q_lora"])
def test_the_latent_cache_gives_apply_logits(scan, q_lora):
    """Prefill of ragged prompts, then one token at a time through the cache of latents (the
    query and output folded through the latent's expansion): every position's logits are
    model.apply's, within 1e-5; the cache holds C + R = 40 numbers a token and layer."""
    cfg = mla_config(**{"model.q_lora_rank": q_lora, "model.scan_layers": scan, "model.init_std": 0.2,
                        "model.vocab_size": 64})
    params = model.init_params(cfg.model, jax.random.key(1))
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, 64, (2, 12)), jnp.int32)
    batch = {"inputs": tokens, "segment_ids": jnp.ones_like(tokens), "positions": jnp.broadcast_to(jnp.arange(12), (2, 12))}
    expected = jax.jit(functools.partial(model.apply, cfg.model))(params, batch)
    cache = gen.init_cache(cfg.model, params, 2, 12)
    assert sum(a.size for a in jax.tree.leaves(cache)) == 2 * 2 * 12 * (32 + 8)  # layers x rows x slots x (C + R)
    lengths = np.array([5, 3])
    prompt = np.asarray(tokens[:, :5]).copy()
    prompt[1, 3:] = 0
    logits, cache = jax.jit(functools.partial(gen.prefill, cfg.model, max_len=12))(params, prompt)
    for b, n in enumerate(lengths):
        np.testing.assert_allclose(logits[b, :n], expected[b, :n], atol=1e-5, rtol=0)
    decode = jax.jit(functools.partial(gen.decode_step, cfg.model))
    for t in range(7):
        positions = jnp.asarray(lengths + t, jnp.int32)
        logits, cache = decode(params, tokens[jnp.arange(2), positions], positions, cache)
        np.testing.assert_allclose(logits, expected[jnp.arange(2), positions], atol=1e-5, rtol=0)


@pytest.mark.parametrize("overrides, message", [
    ({"model.num_kv_heads": 2}, "model.num_kv_heads=2 (each head has its own key and value from the latent: set it "
                                "to model.num_heads=4)"),
    ({"model.head_dim": 16}, "model.head_dim=16 (its query/key heads are qk_nope_head_dim + qk_rope_head_dim = 24 "
                             "wide: set 0)"),
    ({"model.qk_norm": "per_head"}, "model.qk_norm='per_head' (its latents have their own norms: 'none')"),
    ({"model.positions": "learned"}, "model.positions='learned'"),
    ({"model.qk_rope_head_dim": 7}, "model.qk_rope_head_dim=7 (RoPE rotates pairs: an even number)"),
])
def test_what_it_is_not_built_with_is_refused(overrides, message):
    cfg = with_overrides(load_config("tiny"), {**MLA, **overrides})
    with pytest.raises(config_lib.ConfigError, match="^model.attention_kind='mla' is not supported with .*"
                       + message.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        config_lib.resolve(cfg, 8)


def test_the_cache_is_the_latent():
    cfg = mla_config()
    cache = mla.init_cache(cfg.model, 3, 16, (2,))
    assert jax.tree.map(lambda a: a.shape, cache) == {"c": (2, 3, 16, 32), "k_rope": (2, 3, 16, 8)}
