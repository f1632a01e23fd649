"""Speed kernels: splash attention (Pallas, TPU; interpreted here) and fp8 matmuls."""

import functools
import math
import types

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from maxlm import config as config_lib, model
from maxlm.model import attention
from maxlm.model.kernels import fp8
from maxlm.optim import optimizers as optim
from maxlm.sharding import mesh as mesh_lib, state as state_lib
from maxlm.train import step as step_lib
from tests.helpers import load_config, packed_batch, padded_packed_batch, tiny


def assert_close(actual, expected, tol, what=""):
    """max |actual - expected| <= tol · max |expected| (one scale per array: attention outputs and
    gradients have no meaningful per-element relative error near zero)."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert np.isfinite(actual).all(), f"{what}: non-finite values"
    error = np.abs(actual - expected).max() / np.abs(expected).max()
    assert error <= tol, f"{what}: max error {error:.2e} of the largest value > {tol:.0e}"


# ----------------------------------------------------------------------------- splash attention

# Two rows of 256 tokens: documents that straddle the 128-token kernel blocks, one that ends
# exactly on a block edge, and trailing padding (segment 0) in row 0.
SEGMENT_IDS = np.array(
    [[1] * 90 + [2] * 70 + [3] * 40 + [0] * 56,
     [1] * 128 + [2] * 100 + [3] * 28],
    np.int32,
)


def _qkv(kv_heads, batch=2, seq_len=256, heads=4, head_dim=64, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (batch, seq_len, heads, head_dim), jnp.float32)
    k = jax.random.normal(keys[1], (batch, seq_len, kv_heads, head_dim), jnp.float32)
    v = jax.random.normal(keys[2], (batch, seq_len, kv_heads, head_dim), jnp.float32)
    cotangent = jax.random.normal(keys[3], q.shape, jnp.float32)
    return q, k, v, cotangent


def _outputs_and_grads(attend_fn, q, k, v, cotangent):
    out, vjp = jax.vjp(attend_fn, q, k, v)
    return (out, *vjp(cotangent))


def _compare_with_xla(q, k, v, cotangent, segment_ids, splash_fn, window=0, softcap=0.0):
    """Splash's output and (q, k, v) gradients against `attention.xla_attention` with the model's mask;
    returns the jitted splash function (output, dq, dk, dv).

    Both compute in float32 with a float32 softmax; they differ only in summation order (splash's
    online softmax rescales per 128-key block), so they agree to a few float32 ulps of the
    accumulated sums: 2e-5 of the largest value (measured: ~1e-6).
    """
    # jitted: its sharding constraints need a trace under a mesh
    mask = jax.jit(attention.attention_mask, static_argnums=1)(segment_ids, window)
    expected = _outputs_and_grads(lambda q, k, v: attention.xla_attention(q, k, v, mask, softcap), q, k, v, cotangent)
    run = jax.jit(lambda *a: _outputs_and_grads(splash_fn, *a))
    for name, a, e in zip(("output", "dq", "dk", "dv"), run(q, k, v, cotangent), expected):
        assert_close(a, e, 2e-5, name)  # also: every value finite, padding rows included
    return run


@pytest.mark.parametrize("kv_heads", [2, 4], ids=["gqa", "mha"])
def test_splash_matches_xla(kv_heads):
    """4 query heads over 2 kv heads (GQA: k/v passed unrepeated) and plain MHA, 2 x 2 blocks of
    128 (the upper-right one skipped by the causal mask), packed documents and padding.
    And directly: changing every token from position 128 on leaves the documents that end
    before it (row 0: [0, 90); row 1: [0, 128)) exactly as they were."""
    q, k, v, cotangent = _qkv(kv_heads)
    segment_ids = jnp.asarray(SEGMENT_IDS)
    splash = lambda q, k, v: attention.splash_attention(q, k, v, segment_ids, block_q=128, block_kv=128, interpret=True)
    run = _compare_with_xla(q, k, v, cotangent, segment_ids, splash)
    changed = lambda x: x.at[:, 128:].multiply(-3.0)
    before, after = run(q, k, v, cotangent)[0], run(changed(q), changed(k), changed(v), cotangent)[0]
    for row, end in ((0, 90), (1, 128)):
        np.testing.assert_array_equal(np.asarray(before[row, :end]), np.asarray(after[row, :end]))
    assert not np.allclose(np.asarray(before[1, 128:]), np.asarray(after[1, 128:]))


def test_splash_with_unequal_query_and_kv_tiles_matches_xla():
    """model.splash_block_q / splash_block_kv: one 256-token query tile over two 128-token key
    tiles (forward and both backward kernels), the same numbers."""
    q, k, v, cotangent = _qkv(2)
    segment_ids = jnp.asarray(SEGMENT_IDS)
    _compare_with_xla(q, k, v, cotangent, segment_ids, lambda q, k, v: attention.splash_attention(
        q, k, v, segment_ids, block_q=256, block_kv=128, interpret=True))


def test_splash_with_a_sliding_window_matches_xla_and_skips_the_tiles_outside():
    """model.sliding_window=100 over 256 tokens in tiles of 128: splash's local mask gives XLA's
    windowed mask's numbers; over 1024 tokens its kernel visits 15 tiles where the causal one does 36."""
    q, k, v, cotangent = _qkv(2)
    segment_ids = jnp.asarray(SEGMENT_IDS)
    _compare_with_xla(q, k, v, cotangent, segment_ids, lambda q, k, v: attention.splash_attention(
        q, k, v, segment_ids, block_q=128, block_kv=128, interpret=True, window=100), window=100)
    def tiles(kernel):  # the (query, key) tile pairs the forward kernel computes
        return int((np.asarray(kernel.fwd_mask_info.block_mask) > 0).sum())

    causal, local = (attention.make_kernel(1, 1024, 128, 128, interpret=True, window=w) for w in (0, 100))
    assert (tiles(causal), tiles(local)) == (36, 15)  # 8 query tiles: the lower triangle; each tile and the one before


@pytest.mark.parametrize("window", [5, 32, 100])
def test_banded_attention_is_the_dense_masks_and_computes_a_band(window):
    """XLA's sliding window in blocks (`attention.banded_attention`): over 256 packed tokens with
    padding, the dense windowed mask's output and gradients (summation order apart), scores of
    [.., L, 2b] for the block b `band_block` picks (the smallest of at least the window dividing
    the length into 4 or more), the soft cap included."""
    q, k, v, cotangent = _qkv(2)
    segment_ids = jnp.asarray(SEGMENT_IDS)
    block = attention.band_block(256, window)
    assert block == {5: 8, 32: 32, 100: 0}[window]  # 100: no block of 100-64 tokens divides 256 into 4
    if not block:
        return
    dense_mask = jax.jit(attention.attention_mask, static_argnums=1)(segment_ids, window)
    band_mask = jax.jit(attention.banded_mask, static_argnums=(1, 2))(segment_ids, window, block)
    assert band_mask.shape == (2, 1, 256, 2 * block)
    for softcap in (0.0, 0.5):
        want = _outputs_and_grads(lambda q, k, v: attention.xla_attention(q, k, v, dense_mask, softcap), q, k, v, cotangent)
        got = _outputs_and_grads(lambda q, k, v: attention.banded_attention(q, k, v, band_mask, softcap), q, k, v, cotangent)
        for name, a, e in zip(("output", "dq", "dk", "dv"), got, want):
            assert_close(a, e, 2e-5, name)


def test_splash_with_a_soft_cap_matches_xla():
    """model.attn_logit_softcap=0.5 (below the largest scores of these inputs, so the cap bends
    them): splash's capped scores give XLA's output and gradients; without the cap they differ."""
    q, k, v, cotangent = _qkv(2)
    segment_ids = jnp.asarray(SEGMENT_IDS)
    scores = jnp.einsum("blhd,bshd->bhls", q, jnp.repeat(k, 2, axis=2)) / np.sqrt(q.shape[-1])
    assert float(jnp.abs(scores).max()) > 1.0
    run = _compare_with_xla(q, k, v, cotangent, segment_ids, lambda q, k, v: attention.splash_attention(
        q, k, v, segment_ids, block_q=128, block_kv=128, interpret=True, window=100, softcap=0.5), window=100, softcap=0.5)
    uncapped = attention.xla_attention(q, k, v, jax.jit(attention.attention_mask, static_argnums=1)(segment_ids, 100))
    assert float(jnp.abs(run(q, k, v, cotangent)[0] - uncapped).max()) > 1e-3


def test_splash_residuals_made_at_the_forward_kernel_change_no_number(monkeypatch):
    """The optimization barrier that holds splash's output with its residuals (so that its
    128-lane log-sum-exp is cut to one lane at the forward kernel, not kept until the backward
    kernels: the memory of the TPU plans, docs/performance.md) leaves the output and the
    gradients bitwise what the kernel's own VJP gives."""
    q, k, v, cotangent = _qkv(2)
    segment_ids = jnp.asarray(SEGMENT_IDS)
    splash = lambda q, k, v: attention.splash_attention(q, k, v, segment_ids, block_q=128, block_kv=128, interpret=True)

    def run():  # a new function each time: jit's cache would otherwise keep the first trace
        grads = jax.jit(lambda *a: _outputs_and_grads(splash, *a))
        return grads(q, k, v, cotangent), grads.lower(q, k, v, cotangent).as_text().count("optimization_barrier")

    with_barrier, count = run()
    monkeypatch.setattr(attention, "_residuals_made_in_forward", lambda fn: fn)
    without_barrier, count_without = run()
    assert count_without == count - 1
    for a, b in zip(with_barrier, without_barrier):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_splash_sharded_over_mesh_matches_xla():
    """Under a data=2 x fsdp=2 x tensor=2 mesh: one shard_map, batch split 4 ways, the 4 heads and
    2 kv heads 2 ways (each device: 2 query heads on their 1 kv head); same numbers as unsharded.
    Then with heads replicated (a rule mapping them to no axis): still the same numbers."""
    cfg = tiny(mesh=(2, 2, 2))
    mesh, rules = mesh_lib.make_mesh(cfg.mesh), mesh_lib.rules_of(cfg.mesh)
    q, k, v, cotangent = _qkv(2, batch=4)
    segment_ids = jnp.asarray(np.concatenate([SEGMENT_IDS, SEGMENT_IDS[::-1]]))
    splash = lambda q, k, v: attention.splash_attention(q, k, v, segment_ids, block_q=128, block_kv=128, interpret=True)
    with mesh_lib.activate(mesh, rules):
        assert "shard_map" in str(jax.make_jaxpr(splash)(q, k, v))
        _compare_with_xla(q, k, v, cotangent, segment_ids, splash)
    heads_replicated = tuple((n, None if n in ("heads", "kv_heads") else a) for n, a in rules)
    with mesh_lib.activate(mesh, heads_replicated):
        _compare_with_xla(q, k, v, cotangent, segment_ids, splash)


@pytest.fixture(scope="module")
def tiny_state():
    """configs/tiny.py resolved for one device, and its initial train state (shared: init is slow)."""
    cfg = tiny(devices=1)
    init = functools.partial(state_lib.init_state, cfg, optim.make_optimizer(cfg))
    return cfg, jax.jit(init)(jax.random.key(cfg.seed))


def _copy(cfg):
    return config_lib.ml_collections.ConfigDict(cfg.to_dict())


def test_model_with_splash_matches_xla(tiny_state):
    """The whole model (tiny: GQA, scanned layers; one device: the mesh path and the gradients are
    tested above) computes the same loss on 128-token rows with the splash path (interpreted) as
    with the XLA path. Init traces the plain path (its 1 x 8 dummy batch suits no kernel tile)."""
    cfg, state = tiny_state
    batch = packed_batch(2, 128, cfg.model.vocab_size, docs_per_row=4)
    batch["segment_ids"][0, 100:] = 0  # padding
    splash_cfg = _copy(cfg.model)
    splash_cfg.attention = attention.SPLASH_INTERPRET
    splash_shapes = jax.eval_shape(lambda: model.init_params(splash_cfg, jax.random.key(0)))
    assert jax.tree.map(lambda a: a.shape, splash_shapes) == jax.tree.map(lambda a: a.shape, state["params"])
    loss = lambda model_cfg: float(jax.jit(lambda p: model.loss_fn(model_cfg, p, batch)[0])(state["params"]))
    np.testing.assert_allclose(loss(splash_cfg), loss(cfg.model), rtol=1e-6)


@pytest.mark.parametrize("strategy", ["all_gather", pytest.param("ulysses", marks=pytest.mark.ci),  # ring, ulysses: ci
                                      pytest.param("ring", marks=pytest.mark.ci), "layer_pattern"])
def test_the_pipeline_runs_splash_under_its_vmap(strategy):
    """mesh.stage=2 runs its stages under vmap; the splash kernel (interpreted) runs inside: on
    whole rows with fsdp 2 x tensor 2, or over sequence=4 as Ulysses or as the ring's blocks; and
    on whole rows for Gemma-like local and global layers (each stage holding one group of the
    pattern "LG", a window of 32 tokens, scores soft-capped). The loss and gradients of a packed
    batch with padding are the unpipelined XLA model's."""
    cfg = load_config("tiny")
    if strategy == "layer_pattern":
        config_lib.apply_overrides(cfg, {"model.num_layers": 4, "model.layer_pattern": "LG", "model.sliding_window": 32,
                                         "model.attn_logit_softcap": 1.0, "model.rope_theta_local": 100.0})
        strategy = "all_gather"
    sequence = 1 if strategy == "all_gather" else 4
    cfg.mesh.update(stage=2, data=1, fsdp=2 if sequence == 1 else 1, sequence=sequence, tensor=2 if sequence == 1 else 1)
    config_lib.apply_overrides(cfg, {"seq_len": 512 if sequence > 1 else 128, "model.num_heads": 4, "model.num_kv_heads": 2,
                                     "model.pipeline_microbatches": 2, "model.context_parallel": strategy})
    cfg = config_lib.resolve(cfg, 8)
    params = model.init_params(cfg.model, jax.random.key(0))
    batch = {k: jnp.asarray(v) for k, v in padded_packed_batch(4, cfg.seq_len, cfg.model.vocab_size, seed=3).items()}
    loss_and_grads = lambda model_cfg: jax.jit(jax.value_and_grad(lambda p, b: model.loss_fn(model_cfg, p, b)[0]))  # noqa: E731
    want, want_grads = loss_and_grads(cfg.model)(params, batch)
    cfg.model.attention = attention.SPLASH_INTERPRET  # tests only: resolve() knows no interpreter
    mesh, rules = mesh_lib.make_mesh(cfg.mesh), mesh_lib.rules_of(cfg.mesh)
    with mesh_lib.activate(mesh, rules):
        loss, grads = loss_and_grads(cfg.model)(params, mesh_lib.global_batch(batch, mesh, rules))
    np.testing.assert_allclose(loss, want, rtol=1e-6)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(want_grads), jax.tree.leaves(grads)):
        np.testing.assert_allclose(b, a, atol=1e-5, rtol=1e-4, err_msg=jax.tree_util.keystr(path))


def test_block_size():
    assert [attention.block_size(n) for n in (128, 256, 384, 512, 768, 2048, 8192)] == [
        128, 256, 128, 512, 256, 512, 512]
    with pytest.raises(ValueError, match="divisible by 128"):
        attention.block_size(100)


def test_attention_backend_choice(monkeypatch):
    assert attention.attention_backend("auto", jnp.bfloat16, 256) == "xla"  # CPU
    with pytest.raises(ValueError, match="model.attention='splash' needs a TPU, not cpu"):
        attention.attention_backend("splash", jnp.bfloat16)
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert attention.attention_backend("auto", jnp.bfloat16, 256) == "splash"
    assert attention.attention_backend("auto", jnp.float32) == "splash"
    assert attention.attention_backend("auto", jnp.bfloat16, 100) == "xla"  # no 128-multiple tiling
    assert attention.attention_backend("splash", jnp.bfloat16) == "splash"
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert attention.attention_backend("auto", jnp.bfloat16, 256) == "cudnn"
    assert attention.attention_backend("auto", jnp.float32, 256) == "xla"
    assert attention.attention_backend("auto", jnp.bfloat16, 256, softcap=50.0) == "xla"  # cuDNN has no soft cap
    assert attention.attention_backend("auto", jnp.bfloat16, 256, head_dim=128) == "cudnn"
    assert attention.attention_backend("auto", jnp.bfloat16, 256, head_dim=256) == "xla"  # Gemma's heads


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"model.attention": "splash", "seq_len": 200},
         "model.attention='splash' needs seq_len divisible by 128 (the kernel's tile), got "
         "seq_len=200; use model.attention='xla' or a seq_len of 256"),
        ({"model.attention": "flash"}, "model.attention must be one of"),
        ({"model.splash_block_q": 192}, "model.splash_block_q=192 must be 0 (automatic) or a multiple of 128 "
                                        "that divides seq_len=64"),
        ({"seq_len": 384, "model.splash_block_kv": 256}, "model.splash_block_kv=256 must be 0"),
        ({"model.sliding_window": 64}, "model.sliding_window=64 must be below seq_len=64, where it would see "
                                       "every token anyway; use 0 (full causal attention)"),
        ({"model.num_experts": 4, "model.mlp_activation": "geglu"},
         "model.mlp_activation='geglu' is not supported with model.num_experts=4 (the experts are SwiGLU without "
         "biases); use it with a dense model"),
        ({"model.num_experts": 4, "model.use_bias": True}, "model.use_bias=True is not supported with model.num_experts=4"),
        ({"model.attn_logit_softcap": 50.0, "model.attention": "cudnn"},
         "model.attn_logit_softcap=50 is not supported with model.attention='cudnn' (cuDNN has no soft cap)"),
        ({"model.layer_pattern": "LLX", "model.sliding_window": 16}, "model.layer_pattern='LLX' must be '' or letters L"),
        ({"model.layer_pattern": "GG", "model.sliding_window": 16}, "model.layer_pattern='GG' must be '' or letters L"),
        ({"model.layer_pattern": "LG"}, "model.layer_pattern='LG' has local layers: set model.sliding_window > 0"),
        # issue 54: accepted, it gave a model without a global layer, which its own export then refused
        ({"model.layer_pattern": "LLLLLG", "model.sliding_window": 16},
         "model.layer_pattern='LLLLLG' repeats every 6 layers, and model.num_layers=2 holds no global (G) layer of "
         "it: use at least 6 layers or a shorter pattern"),
        ({"model.rope_theta_local": 1e4}, "model.rope_theta_local=10000 is the local layers' RoPE base under a "
                                          "model.layer_pattern of local and global layers"),
        ({"model.layer_pattern": "LLG", "model.sliding_window": 16, "model.num_layers": 4, "mesh.stage": 2,
          "mesh.fsdp": 4}, "model.layer_pattern='LLG' repeats every 3 layers, and each of mesh.stage=2 x "
                           "model.pipeline_repeats=1 pipeline chunks must hold whole repeats: 4 layers do not split "
                           "so; use a multiple of 6 layers"),
        ({"model.norm_plus_one": True, "model.norm": "layernorm"}, "model.norm_plus_one=True is Gemma's RMSNorm weight"),
    ],
)
def test_config_rejects(overrides, message):
    cfg = config_lib.apply_overrides(load_config("tiny"), overrides)
    with pytest.raises(config_lib.ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        config_lib.resolve(cfg, 8)


@pytest.mark.parametrize("kernel, platform", [("splash", "cpu"), ("splash", "gpu"), ("cudnn", "cpu"), ("cudnn", "tpu")])
def test_config_rejects_a_kernel_for_another_platform(kernel, platform):
    cfg = config_lib.apply_overrides(load_config("tiny"), {"model.attention": kernel, "seq_len": 128})
    with pytest.raises(config_lib.ConfigError, match=f"model.attention='{kernel}' is a .* kernel, and this runs on "
                                                     f"'{platform}'; use 'auto' or 'xla'"):
        config_lib.resolve(cfg, 8, platform=platform)
    assert config_lib.resolve(cfg, 8, platform="tpu" if kernel == "splash" else "gpu").model.attention == kernel


def test_config_rejects_non_bool_fp8():
    raw = load_config("tiny").to_dict()  # a plain dict: ConfigDict's own type check is bypassed
    raw["model"]["fp8"] = "yes"
    with pytest.raises(config_lib.ConfigError, match="model.fp8 must be True or False, got 'yes'"):
        config_lib.resolve(config_lib.ml_collections.ConfigDict(raw), 8)


def test_config_accepts_splash_and_fp8():
    cfg = config_lib.apply_overrides(
        load_config("tiny"), {"model.attention": "splash", "seq_len": 384, "model.fp8": True})
    resolved = config_lib.resolve(cfg, 8)
    assert (resolved.model.attention, resolved.model.fp8) == ("splash", True)


# ----------------------------------------------------------------------------- fp8


def _reference_qdq(x, fp8_dtype):
    """Independent float64/ml_dtypes rounding of x to float8 with the per-tensor power-of-2 scale."""
    x = np.asarray(x, np.float64)
    scale = 2.0 ** np.ceil(np.log2(np.abs(x).max() / float(ml_dtypes.finfo(fp8_dtype).max)))
    return (x / scale).astype(fp8_dtype).astype(np.float64) * scale


def _fp8_case(seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(keys[0], (4, 32, 256), jnp.float32)
    w = 0.02 * jax.random.normal(keys[1], (256, 96), jnp.float32)
    cotangent = jax.random.normal(keys[2], (4, 32, 96), jnp.float32)
    return x, w, cotangent


def test_fp8_scale():
    scale = lambda values, dtype=fp8.E4M3: float(fp8.scale_of(jnp.asarray(values, jnp.float32), dtype))
    assert scale([0.0, 0.0]) == 1.0
    assert scale([448.0, -3.0]) == 1.0  # amax exactly the float8 max: no scaling
    assert scale([-449.0]) == 2.0  # just above: the next power of two
    assert scale([0.02, -0.1]) == 2.0**-12  # 0.1 / 448 = 2.2e-4 ∈ (2^-13, 2^-12]
    assert scale([57344.0], fp8.E5M2) == 1.0
    x = jax.random.normal(jax.random.key(0), (1000,)) * 37.0
    x_f8, s = fp8.quantize(x, fp8.E4M3)
    assert x_f8.dtype == jnp.float8_e4m3fn and np.isfinite(np.asarray(x_f8, np.float32)).all()
    assert 224.0 < float(jnp.abs(x / s).max()) <= 448.0  # the top binade is used, never exceeded
    # Non-finite values stay non-finite (so a bad step is still detected as one).
    assert np.isnan(np.asarray(fp8.quantize_dequantize(jnp.array([1.0, jnp.inf]), fp8.E4M3, jnp.float32))[1])
    assert np.isnan(np.asarray(fp8.quantize_dequantize(jnp.array([1.0, jnp.nan]), fp8.E5M2, jnp.float32))[1])


def test_fp8_einsum_forward():
    """Exactly the dot of the float8-rounded operands (rounded independently here); against the
    float32 einsum, within float8's rounding error.

    e4m3 keeps 3 mantissa bits: one operand's relative rounding error is at most 2^-4 = 6.25%
    (half an ulp), about 2.5% RMS. Both operands' errors are independent and enter each product,
    so a dot's relative (Frobenius) error is about sqrt(2) x 2.5% = 3.5% (the errors do not
    average out relative to the output: they grow like the sum itself): bound 5%. Per element the
    worst case is (1 + 2^-4)^2 - 1 < 13% of sum |x||w| (plus the subnormals' absolute error).
    """
    x, w, _ = _fp8_case()
    y = fp8.fp8_einsum("bld,df->blf", x, w)
    reference = np.einsum("bld,df->blf", _reference_qdq(x, ml_dtypes.float8_e4m3fn),
                          _reference_qdq(w, ml_dtypes.float8_e4m3fn))
    np.testing.assert_allclose(np.asarray(y), reference, rtol=1e-5, atol=1e-6)

    exact = np.einsum("bld,df->blf", np.asarray(x, np.float64), np.asarray(w, np.float64))
    error = np.asarray(y, np.float64) - exact
    assert np.linalg.norm(error) / np.linalg.norm(exact) < 0.05
    magnitude = np.einsum("bld,df->blf", np.abs(np.asarray(x, np.float64)), np.abs(np.asarray(w, np.float64)))
    assert (np.abs(error) <= 0.13 * magnitude + 1e-5).all()


def test_fp8_einsum_gradients():
    """Backward: the output gradient rounded to e5m2 (2 mantissa bits), then dx = g_q · w_qᵀ and
    dw = x_qᵀ · g_q with the forward's e4m3 operands: exactly that (rounded independently here),
    and within 10% (Frobenius) of the float32 gradients (e5m2's RMS rounding error is ~5%)."""
    x, w, cotangent = _fp8_case()
    _, vjp = jax.vjp(lambda x, w: fp8.fp8_einsum("bld,df->blf", x, w), x, w)
    dx, dw = vjp(cotangent)
    assert dx.dtype == x.dtype and dw.dtype == w.dtype
    x_q, w_q = (_reference_qdq(a, ml_dtypes.float8_e4m3fn) for a in (x, w))
    g_q = _reference_qdq(cotangent, ml_dtypes.float8_e5m2)
    np.testing.assert_allclose(np.asarray(dx), np.einsum("blf,df->bld", g_q, w_q), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(dw), np.einsum("bld,blf->df", x_q, g_q), rtol=1e-5, atol=1e-5)

    _, vjp32 = jax.vjp(lambda x, w: jnp.einsum("bld,df->blf", x, w), x, w)
    for actual, expected in zip((dx, dw), vjp32(cotangent)):
        expected = np.asarray(expected, np.float64)
        assert np.linalg.norm(np.asarray(actual, np.float64) - expected) / np.linalg.norm(expected) < 0.1


def test_fp8_einsum_exact_on_representable_inputs():
    """Integers up to 16 (4 significant bits) times a power of two are e4m3 values, up to 8 are
    e5m2 values, and their dot products are exact in float32: no error anywhere, either pass."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.integers(-16, 17, (2, 8, 64)) * 2.0**-3, jnp.float32)
    w = jnp.asarray(rng.integers(-16, 17, (64, 4, 16)) * 2.0**-9, jnp.float32)
    cotangent = jnp.asarray(rng.integers(-8, 9, (2, 8, 4, 16)) * 2.0**5, jnp.float32)
    spec = "bld,dhk->blhk"
    y, vjp = jax.vjp(lambda x, w: fp8.fp8_einsum(spec, x, w), x, w)
    y32, vjp32 = jax.vjp(lambda x, w: jnp.einsum(spec, x, w), x, w)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y32))
    for actual, expected in zip(vjp(cotangent), vjp32(cotangent)):
        np.testing.assert_array_equal(np.asarray(actual), np.asarray(expected))


def test_fp8_bfloat16_compute():
    """bfloat16 compute: a bfloat16 output, gradients in each operand's dtype, and the dequantized
    operand equal to the float32 one (power-of-2 scales make dequantization exact in bfloat16)."""
    x, w, _ = _fp8_case()
    x16 = x.astype(jnp.bfloat16)
    y, vjp = jax.vjp(lambda x, w: fp8.fp8_einsum("bld,df->blf", x, w), x16, w)
    assert y.dtype == jnp.bfloat16
    dx, dw = vjp(jnp.ones_like(y))
    assert (dx.dtype, dw.dtype) == (jnp.bfloat16, jnp.float32)
    for a in (x16, w):
        np.testing.assert_array_equal(
            np.asarray(fp8.quantize_dequantize(a, fp8.E4M3, jnp.bfloat16), np.float32),
            np.asarray(fp8.quantize_dequantize(a.astype(jnp.float32), fp8.E4M3, jnp.float32)))


def test_fp8_keeps_remat_policies(capsys):
    """Each remat policy saves the same residuals (the `checkpoint_name` tags, the weight-matmul
    outputs) with model.fp8 on as off, and without remat the matmul operands are kept as float8
    (traced only; the training test below runs fp8 with remat)."""
    base = tiny(devices=1).model
    batch = packed_batch(2, 64, base.vocab_size)

    def model_cfg(fp8_on, remat):
        cfg = config_lib.ml_collections.ConfigDict(base.to_dict())
        cfg.update(fp8=fp8_on, remat=remat, scan_layers=False, num_layers=1)
        return cfg

    params = jax.eval_shape(lambda: model.init_params(model_cfg(True, "none"), jax.random.key(0)))
    loss = lambda cfg: lambda p: model.loss_fn(cfg, p, batch)[0]

    def residuals(fp8_on, remat):
        jax.ad_checkpoint.print_saved_residuals(loss(model_cfg(fp8_on, remat)), params)
        lines = capsys.readouterr().out.splitlines()
        named = sorted(line.split("named ")[1].split()[0] for line in lines if "named '" in line)
        return (len(lines), named, sum("output of dot_general" in line for line in lines),
                sum(line.startswith("f8_e4m3fn") for line in lines))

    named, dots = residuals(True, "save_qkv_proj"), residuals(True, "save_dots")
    assert named == residuals(False, "save_qkv_proj") and dots == residuals(False, "save_dots")
    assert named[1] == ["'k_proj'", "'q_proj'", "'v_proj'"]
    assert dots[2] == 6  # q, k, v, o, gate, up: down's output is not needed for the gradients
    # Without remat, fp8 keeps both operands of its 7 matmuls as float8 residuals.
    assert residuals(True, "none")[3] == 14 and residuals(False, "none")[3] == 0


def _train_losses_one_device(cfg, state, steps, batch):
    """`steps` of `step_lib.train_step` (jitted, one device) from `state` on the same batch: the losses."""
    tx = optim.make_optimizer(cfg)
    step_fn = jax.jit(functools.partial(step_lib.train_step, cfg, tx, optim.learning_rate_schedule(cfg)))
    losses = []
    for _ in range(steps):
        state, step_metrics = step_fn(state, batch, 1.0)
        losses.append(float(step_metrics["loss"]))
    return np.array(losses)


# e4m3 keeps 3 mantissa bits: rounding to nearest moves an operand by at most half an ulp, 2^-4 of
# it (relative: 2^-4 at the bottom of a binade, 2^-5 at its top), so by at most 2^-4/sqrt(3) RMS. Both
# operands of a product are rounded independently: the product's RMS relative error is sqrt(2) times
# that, and a matmul's output keeps it (test_fp8_einsum_forward: the errors grow with the sum).
E4M3_PRODUCT_RMS_ERROR = math.sqrt(2) * 2.0**-4 / math.sqrt(3)  # 5.1%


def fp8_loss_tolerance(losses32, vocab_size):
    """How far fp8's losses may be from float32's (`losses32`), at each step, to first order in the
    rounding errors.

    The cross-entropy of logits z is log V (V = `vocab_size`) at z = 0, and the logits' departure
    from 0 is what moves it from there: z scaled by 1 + e moves it by e × (L - log V) to first order
    (the logits are small: tiny's losses stay within about a nat of log V). Every logit comes through
    fp8 matmuls, so e is at most their products' RMS relative error, E4M3_PRODUCT_RMS_ERROR. On top of
    that, each update was computed through the same rounded matmuls: the loss's fall from step 0 is
    made of updates off by the same relative error. Errors that do not line up with z (most of them)
    move the loss less, so this bounds it; measured, it is 6 (step 0) to 45 (step 7) times the
    difference (2026-12-07)."""
    losses32 = np.asarray(losses32, np.float64)
    return E4M3_PRODUCT_RMS_ERROR * (np.abs(losses32 - math.log(vocab_size)) + (losses32[0] - losses32))


def test_fp8_training_tracks_float32(tiny_state):
    """configs/tiny.py on a fixed packed batch (so the loss must fall) for 8 steps from the same
    initial state: with model.fp8 (and remat save_dots: fp8's gradients under rematerialisation)
    the loss is finite, falls, and stays within `fp8_loss_tolerance` of float32's at every step."""
    cfg, state = tiny_state
    batch = packed_batch(cfg.batch_size, cfg.seq_len, cfg.model.vocab_size, seed=3)
    batch["segment_ids"][0, 40:] = 0
    losses32 = _train_losses_one_device(cfg, state, 8, batch)
    cfg = _copy(cfg)
    cfg.model.update(fp8=True, remat="save_dots")
    losses8 = _train_losses_one_device(cfg, state, 8, batch)
    assert np.isfinite(losses8).all()
    assert losses8[-1] < losses8[0] - 0.3, losses8
    tolerance = fp8_loss_tolerance(losses32, cfg.model.vocab_size)
    assert (np.abs(losses8 - losses32) <= tolerance).all(), (losses8 - losses32, tolerance)


def test_only_model_fp8_puts_float8_in_the_compiled_step(tiny_state):
    """The default config's compiled train step holds no float8 value anywhere; with model.fp8
    its matmuls' operands are e4m3 and the output gradients e5m2 (the matmuls themselves run on
    the dequantized values here: XLA:CPU has no float8 GEMM)."""
    cfg, state = tiny_state
    batch = packed_batch(cfg.batch_size, cfg.seq_len, cfg.model.vocab_size, seed=3)

    def hlo(cfg):
        tx = optim.make_optimizer(cfg)
        step = jax.jit(functools.partial(step_lib.train_step, cfg, tx, optim.learning_rate_schedule(cfg)))
        return step.lower(state, batch, 1.0).compile().as_text()

    assert "f8e" not in hlo(cfg)  # the float8 types: f8e4m3fn, f8e5m2, f8e4m3b11fnuz, ...
    fp8_cfg = _copy(cfg)
    fp8_cfg.model.fp8 = True
    text = hlo(fp8_cfg)
    assert "f8e4m3fn[" in text and "f8e5m2[" in text


def test_fp8_is_native():
    gpu = lambda cc: types.SimpleNamespace(platform="gpu", compute_capability=cc)
    assert [fp8.is_native(gpu(cc)) for cc in ("8.0", "8.6", "8.9", "9.0", "10.0")] == [
        False, False, True, True, True]
    assert not fp8.is_native(types.SimpleNamespace(platform="cpu"))
    assert not fp8.is_native(types.SimpleNamespace(platform="tpu"))


def _hopper():
    if jax.default_backend() != "gpu":
        return False
    major = str(getattr(jax.devices()[0], "compute_capability", "0")).split(".")[0]
    return int(major) >= 9


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="float8 GEMMs need an NVIDIA GPU of compute capability >= 9.0")
def test_fp8_einsum_compiles_to_cublaslt_f8_gemm():
    """XLA's GemmRewriter turns the quantize → dequantize → dot pattern into cuBLASLt float8 GEMMs,
    forward and in both gradient matmuls."""
    x = jnp.ones((8, 128, 512), jnp.bfloat16)
    w = jnp.ones((512, 1024), jnp.float32)
    forward = jax.jit(lambda x, w: fp8.fp8_einsum("bld,df->blf", x, w))
    assert "__cublas$lt$matmul$f8" in forward.lower(x, w).compile().as_text()
    # a random probe: with sum() the output gradient is a constant, which XLA folds into reductions
    # instead of GEMMs (seen on an H200)
    probe = jax.random.normal(jax.random.key(0), (8, 128, 1024))
    loss = lambda x, w, p: (fp8.fp8_einsum("bld,df->blf", x, w).astype(jnp.float32) * p).sum()
    hlo = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, w, probe).compile().as_text()
    assert hlo.count("__cublas$lt$matmul$f8") >= 2, "the backward matmuls are not float8 GEMMs"
