"""The Transformer: parameter counts, causality, packing, dtypes, position encodings."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from maxlm import config as config_lib, model
from maxlm.model import attention, backward_order, positions as positions_lib
from tests.helpers import load_config, packed_batch, random_params, tiny

POSITIONS = pytest.mark.parametrize("positions", config_lib.POSITIONS)

PUBLISHED = {  # parameter counts of the architectures the configs claim
    "llama_1b": 1_235_814_400,  # Llama 3.2 1B
    "llama_8b": 8_030_261_248,  # Llama 3 8B
    "olmo2_1b": 1_484_916_736,  # OLMo 2 1B (OLMo-2-0425-1B): post-norm, whole-projection qk-norm
    "qwen3_0p6b": 596_049_920,  # Qwen3 0.6B: per-head qk-norm, head_dim 128 > d_model / heads
    "gpt2_124m": 124_439_808,  # GPT-2 small: learned positions, LayerNorm, GeLU, biases
    "gemma3_1b": 999_885_952,  # Gemma 3 1B: sandwich norms, GeGLU, a 262K tied vocabulary
    # the families' larger presets, each counted by transformers' own class (meta device)
    "qwen3_8b_h100x8": 8_190_735_360, "mistral_7b_h100x8": 7_241_732_096, "olmo3_7b_v5p64": 7_298_011_136,
    "gemma3_12b_h100x8": 11_766_034_176,
}


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("kv_heads, qk_norm, placement, kinds", [
    (1, "none", "pre", {}), (2, "none", "sandwich", {"norm": "layernorm", "mlp_activation": "gelu", "use_bias": True}),
    (4, "none", "pre", {"mlp_activation": "geglu", "qkv_bias": True}), (2, "per_head", "pre", {"mtp_depth": 1}),
    (1, "full", "post", {"norm": "layernorm", "use_bias": True, "mtp_depth": 1})])
def test_param_count_matches_formula(tie, kv_heads, qk_norm, placement, kinds):
    cfg = tiny(devices=1, model=dict(tie_embeddings=tie, num_kv_heads=kv_heads, qk_norm=qk_norm, norm_placement=placement,
                                     **kinds)).model
    params = jax.eval_shape(lambda: model.init_params(cfg, jax.random.key(0)))  # shapes: nothing to compile
    assert sum(p.size for p in jax.tree.leaves(params)) == model.count_params(cfg)
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(params))
    assert ("head" in params) != tie


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_sizes(name):
    cfg = load_config(name)
    cfg = config_lib.resolve(cfg, cfg.num_devices or 1)
    assert model.count_params(cfg.model) == PUBLISHED[name]
    shapes = jax.eval_shape(lambda: model.init_params(cfg.model, jax.random.key(0)))
    assert sum(int(np.prod(s.shape)) for s in jax.tree.leaves(shapes)) == PUBLISHED[name]


def test_125m_matches_gpt3_small_non_embedding_count():
    cfg = config_lib.resolve(load_config("llama_125m"), 1).model
    non_embedding = model.count_params(cfg) - cfg.vocab_size * cfg.d_model
    norms = (2 * cfg.num_layers + 1) * cfg.d_model
    assert non_embedding - norms == 12 * cfg.num_layers * cfg.d_model**2  # GPT-3's 12·L·d²


def single_doc_batch(tokens):
    B, L = tokens.shape
    return {
        "inputs": tokens,
        "targets": tokens,
        "segment_ids": jnp.ones((B, L), jnp.int32),
        "positions": jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L)),
    }


def test_causality_through_gradients():
    """d logits[t] / d input[s] is exactly zero for every s > t and nonzero for s <= t."""
    cfg = tiny(devices=1, model=dict(tie_embeddings=False)).model
    params = model.init_params(cfg, jax.random.key(0))
    L, t = 16, 6
    tokens = jnp.arange(3, 3 + L, dtype=jnp.int32)[None]  # distinct: one embedding row per position

    def logits_at_t(embed_VD):
        return model.apply(cfg, {**params, "embed": embed_VD}, single_doc_batch(tokens))[0, t].sum()

    grad_VD = jax.grad(logits_at_t)(params["embed"])
    per_position = np.abs(np.asarray(grad_VD[tokens[0]])).sum(axis=-1)
    assert np.all(per_position[t + 1 :] == 0.0), per_position
    assert np.all(per_position[: t + 1] > 0.0), per_position


@POSITIONS
def test_packed_equals_separate_documents(positions):
    """A row packing two documents gives each the logits it gets alone, whatever the position
    encoding: each sees its own positions from 0."""
    cfg = tiny(devices=1, model=dict(positions=positions)).model
    params = model.init_params(cfg, jax.random.key(0))
    doc_a = jax.random.randint(jax.random.key(1), (1, 10), 3, cfg.vocab_size)
    doc_b = jax.random.randint(jax.random.key(2), (1, 6), 3, cfg.vocab_size)
    packed = {
        "inputs": jnp.concatenate([doc_a, doc_b], axis=1),
        "targets": jnp.concatenate([doc_a, doc_b], axis=1),
        "segment_ids": jnp.array([[1] * 10 + [2] * 6], jnp.int32),
        "positions": jnp.array([list(range(10)) + list(range(6))], jnp.int32),
    }
    logits = np.asarray(model.apply(cfg, params, packed))
    alone_a = np.asarray(model.apply(cfg, params, single_doc_batch(doc_a)))
    alone_b = np.asarray(model.apply(cfg, params, single_doc_batch(doc_b)))
    np.testing.assert_allclose(logits[:, :10], alone_a, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(logits[:, 10:], alone_b, rtol=1e-5, atol=1e-5)


def test_loss_ignores_padding():
    cfg = tiny(devices=1).model
    params = model.init_params(cfg, jax.random.key(0))
    batch = packed_batch(2, 16, cfg.vocab_size)
    padded = {k: np.concatenate([v, np.zeros_like(v[:, :4])], axis=1) for k, v in batch.items()}
    loss, aux = model.loss_fn(cfg, params, batch)
    padded_loss, padded_aux = model.loss_fn(cfg, params, padded)
    assert float(aux["num_tokens"]) == float(padded_aux["num_tokens"]) == 32
    np.testing.assert_allclose(float(loss), float(padded_loss), rtol=1e-6)


def test_initial_loss_is_near_uniform():
    cfg = tiny(devices=1).model
    params = model.init_params(cfg, jax.random.key(0))
    loss, _ = model.loss_fn(cfg, params, packed_batch(4, 32, cfg.vocab_size))
    assert abs(float(loss) - np.log(cfg.vocab_size)) < 0.1


def reference_logits(cfg, params, batch):
    """Logits [B, L, V] in float64 numpy, written out from the model's definition: token embeddings
    (plus the sinusoid or learned rows at each position); per layer a pre-norm residual attention
    (RMSNorm before, after or around each sublayer as model.norm_placement says; queries and keys
    RMS-normed per head or whole with model.qk_norm, then rotated by
    RoPE pairing dims (i, i + Dh/2); query head h reading kv
    head h // (H/K), softmax of q·k/sqrt(Dh) over the earlier tokens of the same document) and a
    pre-norm residual SwiGLU MLP; a final RMSNorm; the head (the embedding itself when tied).
    Gemma's pieces: norms scaling by 1 + w, embeddings times √D, scores soft-capped, and a
    `layer_pattern` of local (windowed, own RoPE base) and global layers, layer i of kind
    pattern[i mod len(pattern)]."""
    p = jax.tree.map(lambda x: np.asarray(x, np.float64), params)
    tokens, segments, positions = (np.asarray(batch[k]) for k in ("inputs", "segment_ids", "positions"))
    B, L = tokens.shape

    def norm(x, scale, over=(-1,)):
        return x / np.sqrt((x * x).mean(over, keepdims=True) + cfg.norm_eps) * (1 + scale if cfg.norm_plus_one else scale)

    def block_norm(x, params):  # model.norm: RMSNorm, or LayerNorm (centred, with a bias)
        if cfg.norm == "layernorm":
            return norm(x - x.mean(-1, keepdims=True), params["scale"]) + params["bias"]
        return norm(x, params["scale"])

    def tanh_gelu(x):
        return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))

    def qk_norm(x, norm_params):  # [B, L, heads, Dh]: each head's (per_head) or all heads' (full)
        return {"none": lambda: x, "per_head": lambda: norm(x, norm_params["scale"]),
                "full": lambda: norm(x, norm_params["scale"], over=(-2, -1))}[cfg.qk_norm]()

    def rope(x, theta):  # [B, L, heads, Dh]
        half = x.shape[-1] // 2
        angle = positions[:, :, None, None] * theta ** (-np.arange(half) / half)
        a, b = x[..., :half], x[..., half:]
        return np.concatenate([a * np.cos(angle) - b * np.sin(angle), b * np.cos(angle) + a * np.sin(angle)], -1)

    x = p["embed"][tokens] * (np.sqrt(cfg.d_model) if cfg.scale_embeddings else 1.0)
    if cfg.positions == "sinusoidal":
        angle = positions[..., None] / 10000.0 ** (np.arange(0, cfg.d_model, 2) / cfg.d_model)
        x = x + np.stack([np.sin(angle), np.cos(angle)], -1).reshape(B, L, cfg.d_model)
    elif cfg.positions == "learned":
        x = x + p["pos_embed"][positions]
    causal = np.tril(np.ones((L, L), bool)) & (segments[:, :, None] == segments[:, None, :])  # [B, L, S]
    in_window = np.arange(L)[:, None] - np.arange(L)[None, :] < cfg.sliding_window  # key j near query i: i - j < W
    group = cfg.num_heads // cfg.num_kv_heads
    for i in range(cfg.num_layers):
        layer = jax.tree.map(lambda w: w[i], p["layers"]) if "layers" in p else p[f"layer_{i}"]
        local = cfg.sliding_window and (not cfg.layer_pattern or cfg.layer_pattern[i % len(cfg.layer_pattern)] == "L")
        visible = causal & in_window if local else causal
        theta = cfg.rope_theta_local if local and cfg.rope_theta_local else cfg.rope_theta
        attn, mlp = layer["attn"], layer["mlp"]

        def attention(h):
            bias = lambda name: attn.get(name, 0.0)  # noqa: E731  (model.use_bias / qkv_bias)
            q = qk_norm(np.einsum("bld,dhk->blhk", h, attn["wq"]) + bias("bq"), attn.get("q_norm"))
            k = np.repeat(qk_norm(np.einsum("bld,dhk->blhk", h, attn["wk"]) + bias("bk"), attn.get("k_norm")), group, axis=2)
            v = np.repeat(np.einsum("bld,dhk->blhk", h, attn["wv"]) + bias("bv"), group, axis=2)
            if cfg.positions == "rope":
                q, k = rope(q, theta), rope(k, theta)
            scores = np.einsum("blhk,bshk->bhls", q, k) / np.sqrt(cfg.head_dim)
            if cfg.attn_logit_softcap:
                scores = cfg.attn_logit_softcap * np.tanh(scores / cfg.attn_logit_softcap)
            scores = np.where(visible[:, None], scores, -np.inf)
            probs = np.exp(scores - scores.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
            return np.einsum("bhls,bshk,hkd->bld", probs, v, attn["wo"]) + bias("bo")

        def latent_attention(h):  # DeepSeek's MLA: keys and values from a latent, RoPE on separate dims
            N, C = cfg.qk_nope_head_dim, cfg.kv_lora_rank
            latent_norm = lambda x, params: x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * params["scale"]  # noqa: E731
            if cfg.q_lora_rank:
                q = np.einsum("blq,qhk->blhk", latent_norm(h @ attn["wq_a"], attn["q_a_norm"]), attn["wq_b"])
            else:
                q = np.einsum("bld,dhk->blhk", h, attn["wq"])
            kv = h @ attn["wkv_a"]
            k_nope, v = np.split(np.einsum("blc,che->blhe", latent_norm(kv[..., :C], attn["kv_a_norm"]), attn["wkv_b"]),
                                 [N], axis=-1)
            q = np.concatenate([q[..., :N], rope(q[..., N:], theta)], -1)
            k_rope = np.broadcast_to(rope(kv[..., None, C:], theta), (*k_nope.shape[:3], cfg.qk_rope_head_dim))
            k = np.concatenate([k_nope, k_rope], -1)
            scores = np.where(visible[:, None], np.einsum("blhk,bshk->bhls", q, k) / np.sqrt(q.shape[-1]), -np.inf)
            probs = np.exp(scores - scores.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
            return np.einsum("bhls,bshv,hvd->bld", probs, v, attn["wo"])

        def feed_forward(h):  # model.mlp_activation
            up = h @ mlp["w_up"] + mlp.get("b_up", 0.0)
            if cfg.mlp_activation == "gelu":
                hidden = tanh_gelu(up)
            else:
                gate = h @ mlp["w_gate"] + mlp.get("b_gate", 0.0)
                hidden = (gate / (1 + np.exp(-gate)) if cfg.mlp_activation == "swiglu" else tanh_gelu(gate)) * up
            return hidden @ mlp["w_down"] + mlp.get("b_down", 0.0)

        mixing = latent_attention if cfg.attention_kind == "mla" else attention
        for name, sublayer in (("attn", mixing), ("mlp", feed_forward)):  # pre: x + f(norm(x)); post: x + norm(f(x))
            h = block_norm(x, layer[f"{name}_norm"]) if cfg.norm_placement in ("pre", "sandwich") else x
            out = sublayer(h)
            x = x + (block_norm(out, layer[f"{name}_out_norm"]) if cfg.norm_placement in ("post", "sandwich") else out)
    x = block_norm(x, p["final_norm"])
    logits = x @ (p["embed"].T if cfg.tie_embeddings else p["head"])
    cap = cfg.final_logit_softcap
    return cap * np.tanh(logits / cap) if cap else logits


def reference_case(positions="rope", **overrides):
    """(model config, random params with logits of a few units, a packed batch of 2 x 64, its
    reference logits), for each encoding a variant: RoPE untied with head_dim 24 (not d_model/H),
    a non-default base and norm eps; the sinusoid tied; the learned table untied."""
    variant = {"rope": dict(tie_embeddings=False, head_dim=24, rope_theta=5e5, norm_eps=1e-6),
               "sinusoidal": dict(tie_embeddings=True), "learned": dict(tie_embeddings=False)}[positions]
    cfg = tiny(devices=1, model=dict(positions=positions, **variant, **overrides)).model
    params = random_params(cfg, std=0.1)
    batch = packed_batch(2, 64, cfg.vocab_size)
    kinds = {k: cfg[k] for k in ("qk_norm", "norm_placement", "sliding_window", "norm", "mlp_activation", "use_bias",
                                 "qkv_bias", "final_logit_softcap", "norm_plus_one", "scale_embeddings", "layer_pattern",
                                 "rope_theta_local", "attn_logit_softcap", "num_layers", "attention_kind",
                                 "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                                 "num_kv_heads")}
    reference_cfg = tiny(devices=1, model=dict(positions=positions, **variant, **kinds)).model
    return cfg, params, batch, reference_logits(reference_cfg, params, batch)


GPT2_LIKE = {"norm": "layernorm", "mlp_activation": "gelu", "use_bias": True}
# DeepSeek-V3's multi-head latent attention, with and without the query bottleneck: 4 heads of
# 16 + 8 query/key dims (the RoPE case's head_dim of 24) and 12 value dims from a 32-wide latent
MLA = {"attention_kind": "mla", "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12,
       "num_kv_heads": 4}
# Gemma 3's block on 7 layers of the pattern local, local, global: two groups of three scanned and
# a layer unrolled after them; the local layers' RoPE base differs, the scores are capped
GEMMA3_LIKE = {"mlp_activation": "geglu", "norm_plus_one": True, "scale_embeddings": True, "num_layers": 7,
               "layer_pattern": "LLG", "rope_theta_local": 1e3, "attn_logit_softcap": 1.5}


@pytest.mark.parametrize("positions, qk_norm, placement, window, kinds",
                         [(p, "none", "pre", 0, {}) for p in config_lib.POSITIONS]
                         + [("rope", "per_head", "pre", 0, {}), ("rope", "full", "post", 0, {}),
                            ("sinusoidal", "none", "sandwich", 0, {"mlp_activation": "geglu", "final_logit_softcap": 2.5}),
                            ("rope", "none", "pre", 7, {"qkv_bias": True}), ("learned", "none", "pre", 0, GPT2_LIKE),
                            ("rope", "per_head", "sandwich", 7, GEMMA3_LIKE),
                            ("rope", "none", "pre", 0, {**MLA, "q_lora_rank": 24}),
                            ("rope", "none", "pre", 0, {**MLA, "q_lora_rank": 0})],
                         ids=["rope", "sinusoidal", "learned", "qk_per_head", "post_norm", "sandwich_geglu_softcap",
                              "window_qkv_bias", "gpt2_like", "gemma3_like", "mla", "mla_no_q_lora"])
def test_logits_equal_a_reference_implementation(positions, qk_norm, placement, window, kinds):
    """The forward pass (jitted, packed rows of 3 documents, 2 kv heads for 4 query heads) against
    the float64 transcription above: 1e-4 on logits of a few units (2e-6 measured); a sliding
    window of 7 tokens, shorter than the documents; GPT-2's LayerNorm, GeLU MLP and biases; logits
    soft-capped at 2.5, below the largest (Gemma 2's final soft-cap); Gemma 3's block and layer
    pattern with scores capped at 1.5, below the largest."""
    cfg, params, batch, reference = reference_case(positions, qk_norm=qk_norm, norm_placement=placement,
                                                   sliding_window=window, **kinds)
    logits = np.asarray(jax.jit(functools.partial(model.apply, cfg))(params, batch))
    assert np.abs(reference).max() > 2.0  # far from zero: the comparison means something
    np.testing.assert_allclose(logits, reference, rtol=0, atol=1e-4)


def test_bfloat16_compute_matches_the_reference_to_bfloat16_precision():
    """bfloat16 activations and matmuls (float32 parameters and logits) give the float64
    reference's logits up to bfloat16's rounding: an RMS error under 2% of the logits' RMS (0.8%
    measured; a bfloat16 mantissa holds 8 bits), no logit off by more than 0.15 (0.04 measured),
    and the loss within 1e-3 relative."""
    cfg, params, batch, reference = reference_case("rope", dtype="bfloat16")
    logits = model.apply(cfg, params, batch)
    assert logits.dtype == jnp.float32  # logits always float32
    error = np.asarray(logits, np.float64) - reference
    assert np.sqrt(np.mean(error**2)) < 0.02 * np.sqrt(np.mean(reference**2)), np.sqrt(np.mean(error**2))
    assert np.abs(error).max() < 0.15, np.abs(error).max()
    log_p = reference - np.log(np.exp(reference).sum(-1, keepdims=True))
    reference_loss = -np.take_along_axis(log_p, batch["targets"][..., None], -1).mean()
    np.testing.assert_allclose(float(model.loss_fn(cfg, params, batch)[0]), reference_loss, rtol=1e-3)


def test_rope_is_relative():
    """q·k after RoPE depends only on the distance between positions."""
    q = jax.random.normal(jax.random.key(0), (1, 1, 1, 16))
    k = jax.random.normal(jax.random.key(1), (1, 1, 1, 16))

    def score(pq, pk):
        rq = positions_lib.rope(q, jnp.array([[pq]]), 10000.0)
        rk = positions_lib.rope(k, jnp.array([[pk]]), 10000.0)
        return float((rq * rk).sum())

    np.testing.assert_allclose(score(5, 2), score(103, 100), rtol=1e-4)
    assert abs(score(5, 2) - score(5, 4)) > 1e-4


@POSITIONS
def test_logical_specs_cover_every_param(positions):
    cfg = tiny(devices=1, model=dict(positions=positions)).model
    specs = model.param_logical_specs(cfg)
    params = model.init_params(cfg, jax.random.key(0))
    spec_leaves = jax.tree.leaves(specs, is_leaf=model.is_spec)
    assert len(spec_leaves) == len(jax.tree.leaves(params))
    for spec, param in zip(spec_leaves, jax.tree.leaves(params)):
        assert len(spec) == param.ndim and all(name is not None for name in spec)


def test_remat_choices_match_the_policies():
    assert tuple(model.REMAT_POLICIES) == config_lib.REMAT


@pytest.mark.parametrize("remat", config_lib.REMAT)
def test_scan_and_remat_equal_unrolled(remat):
    """Scanned (any remat policy) and unrolled layers: same loss, same gradients."""
    assert_scanned_equals_unrolled(tiny(devices=1, model=dict(scan_layers=False, remat="none")).model,
                                   tiny(devices=1, model=dict(scan_layers=True, remat=remat)).model)


@pytest.mark.parametrize("remat", ["none", pytest.param("full", marks=pytest.mark.ci)])  # full: ci, 13 s
def test_layer_pattern_scanned_equals_unrolled(remat):
    """Local and global layers (`GEMMA3_LIKE`: two scanned groups of the pattern, a layer after them)
    give the unrolled layers' loss and gradients, with and without remat (gradients of about 1e-3
    through 7 layers of sandwiched norms: 1e-6 absolute, float32's summation orders apart)."""
    gemma = {**GEMMA3_LIKE, "sliding_window": 7, "qk_norm": "per_head", "norm_placement": "sandwich"}
    assert_scanned_equals_unrolled(tiny(devices=1, model=dict(scan_layers=False, remat="none", **gemma)).model,
                                   tiny(devices=1, model=dict(scan_layers=True, remat=remat, **gemma)).model, atol=1e-6)


def assert_scanned_equals_unrolled(unrolled, scanned, atol: float = 1e-7):
    """Same loss and gradients from both layer layouts of one initialisation; the scanned grads."""
    params = model.init_params(unrolled, jax.random.key(0))
    batch = packed_batch(2, 32, unrolled.vocab_size)
    value_and_grad = lambda cfg: jax.value_and_grad(lambda p: model.loss_fn(cfg, p, batch)[0])
    loss_u, grads_u = value_and_grad(unrolled)(params)
    loss_s, grads_s = value_and_grad(scanned)(model.stack_layers(params))
    np.testing.assert_allclose(float(loss_s), float(loss_u), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(model.stack_layers(grads_u)), jax.tree.leaves(grads_s)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=atol)
    return grads_s


@pytest.mark.parametrize("extras", [{}, {"z_loss": 1e-3, "label_smoothing": 0.1}], ids=["plain", "extras"])
def test_chunked_logits_equal_full(extras):
    full = tiny(devices=1, model=extras).model
    chunked = tiny(devices=1, model=dict(logits_chunk_size=8, **extras)).model
    params = model.init_params(full, jax.random.key(0))
    batch = packed_batch(2, 32, full.vocab_size)
    (loss_f, aux_f), grads_f = jax.value_and_grad(lambda p: model.loss_fn(full, p, batch), has_aux=True)(params)
    (loss_c, aux_c), grads_c = jax.value_and_grad(lambda p: model.loss_fn(chunked, p, batch), has_aux=True)(params)
    np.testing.assert_allclose(float(loss_c), float(loss_f), rtol=1e-6)
    np.testing.assert_allclose(float(aux_c["cross_entropy"]), float(aux_f["cross_entropy"]), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads_f), jax.tree.leaves(grads_c)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-7)


def test_z_loss_and_label_smoothing_match_their_definitions():
    cfg = tiny(devices=1, model=dict(z_loss=1e-2, label_smoothing=0.2)).model
    params = model.init_params(cfg, jax.random.key(0))
    batch = packed_batch(2, 16, cfg.vocab_size)
    objective, aux = model.loss_fn(cfg, params, batch)
    logits = np.asarray(model.apply(cfg, params, batch), np.float64)
    log_z = np.log(np.exp(logits).sum(-1))
    log_p = logits - log_z[..., None]
    nll = -np.take_along_axis(log_p, batch["targets"][..., None], -1)[..., 0]
    uniform = -log_p.mean(-1)
    expected = (0.8 * nll + 0.2 * uniform + 1e-2 * log_z**2).mean()
    np.testing.assert_allclose(float(objective), expected, rtol=1e-5)
    np.testing.assert_allclose(float(aux["cross_entropy"]), nll.mean(), rtol=1e-5)


@POSITIONS
def test_position_parameters_and_count(positions):
    """Only the learned encoding has parameters: a [max_positions, D] table (0 = seq_len), counted
    by count_params; RoPE's parameters (and numbers) are the same as before the choice existed."""
    cfg = tiny(devices=1, model=dict(positions=positions)).model
    params = jax.eval_shape(lambda: model.init_params(cfg, jax.random.key(0)))  # shapes: nothing to compile
    assert sum(p.size for p in jax.tree.leaves(params)) == model.count_params(cfg)
    assert ("pos_embed" in params) == (positions == "learned")
    if positions == "learned":
        assert params["pos_embed"].shape == (load_config("tiny").seq_len, cfg.d_model)
        assert model.param_logical_specs(cfg)["pos_embed"] == PartitionSpec("positions", "embed")
        longer = tiny(devices=1, model=dict(positions=positions, max_positions=100)).model
        assert model.count_params(longer) == model.count_params(cfg) + 36 * cfg.d_model


def test_sinusoid_is_the_original_transformers():
    """PE[p, 2i] = sin(p / 10000^(2i/D)), PE[p, 2i+1] = cos(p / 10000^(2i/D))."""
    positions = np.array([[0, 1, 7, 300]])
    got = np.asarray(positions_lib.sinusoidal(jnp.asarray(positions), 8))
    angle = positions[0][:, None] / 10000.0 ** (np.arange(0, 8, 2) / 8)
    np.testing.assert_allclose(got[0, :, 0::2], np.sin(angle), atol=1e-5)
    np.testing.assert_allclose(got[0, :, 1::2], np.cos(angle), atol=1e-5)


@POSITIONS
def test_absolute_encodings_see_absolute_positions(positions):
    """Shifting every position by the same amount changes nothing under RoPE (relative) and
    changes the logits under the encodings added to the embeddings (absolute): the model reads
    the batch's positions, not the token index."""
    cfg = tiny(devices=1, model=dict(positions=positions, max_positions=64)).model
    params = model.init_params(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (1, 12), 3, cfg.vocab_size)
    batch = single_doc_batch(tokens)
    logits = np.asarray(model.apply(cfg, params, batch))
    shifted = np.asarray(model.apply(cfg, params, {**batch, "positions": batch["positions"] + 5}))
    if positions == "rope":
        np.testing.assert_allclose(shifted, logits, rtol=1e-4, atol=1e-4)
    else:
        assert np.abs(shifted - logits).max() > 1e-3


def test_learned_positions_scanned_equal_unrolled():
    """Both layer layouts, same loss and gradients, the table's included (the sinusoid takes the
    same path, `positions.add_positions`, without a parameter)."""
    grads_s = assert_scanned_equals_unrolled(tiny(devices=1, model=dict(scan_layers=False, positions="learned")).model,
                                             tiny(devices=1, model=dict(scan_layers=True, positions="learned")).model)
    assert float(jnp.abs(grads_s["pos_embed"]).max()) > 0  # the table trains


def _qkv(dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (2, 16, 4, 8), dtype)
    k = jax.random.normal(keys[1], (2, 16, 2, 8), dtype)
    v = jax.random.normal(keys[2], (2, 16, 2, 8), dtype)
    segment_ids = jnp.array([[1] * 10 + [2] * 6, [1] * 16], jnp.int32)
    return q, k, v, attention.attention_mask(segment_ids)


def test_xla_attention_matches_jax_reference():
    """Same semantics as jax.nn.dot_product_attention (what the cuDNN backend calls)."""
    q, k, v, mask = _qkv()
    ours = attention.xla_attention(q, k, v, mask)
    reference = jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")
    np.testing.assert_allclose(np.asarray(ours), np.asarray(reference), rtol=1e-5, atol=1e-6)


def test_auto_attention_on_cpu_is_xla():
    assert attention.attention_backend("auto", jnp.bfloat16) == ("cudnn" if jax.default_backend() == "gpu" else "xla")
    if jax.default_backend() != "gpu":
        with pytest.raises(ValueError, match="needs an NVIDIA GPU"):
            attention.attention_backend("cudnn", jnp.bfloat16)




@pytest.mark.parametrize("weight_spec", ["dv", "vd"])
def test_output_projection_gradients_equal_the_plain_einsums(weight_spec):
    # maxlm/model/output_projection.py writes the backward pass out (the weight gradient in the weight's layout)
    from maxlm.model import output_projection

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(2, 8, 16)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(16, 40) if weight_spec == "dv" else (40, 16)), jnp.float32)
    g = jnp.asarray(rng.normal(size=(2, 8, 40)), jnp.float32)
    ours = jax.grad(lambda x, w: (output_projection.project(weight_spec, x, w) * g).sum(), (0, 1))(x, w)
    plain = jax.grad(lambda x, w: (jnp.einsum(f"bld,{weight_spec}->blv", x, w) * g).sum(), (0, 1))(x, w)
    for a, b in zip(ours, plain):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    bf16 = jax.grad(lambda x, w: output_projection.project(weight_spec, x, w).astype(jnp.float32).sum(), (0, 1))(
        x.astype(jnp.bfloat16), w.astype(jnp.bfloat16))
    assert [a.dtype for a in bf16] == [jnp.bfloat16, jnp.bfloat16]


def test_unrolled_layers_release_their_input_gradient_only_with_their_weight_gradients():
    """Each unrolled layer's backward ends in one barrier over its weight gradients and its input
    gradient (so XLA cannot put weight gradients off to the end of the backward pass), and the
    gradients are bitwise those of the layers left free."""
    cfg = tiny(devices=1, model=dict(scan_layers=False, remat="full")).model
    params = model.init_params(cfg, jax.random.key(0))
    batch = packed_batch(2, 32, cfg.vocab_size)
    loss = lambda p: model.loss_fn(cfg, p, batch)[0]
    grad = jax.jit(jax.grad(loss))
    operand_types = [sorted(line.split(" : ")[-1].split(", "))
                     for line in grad.lower(params).as_text().splitlines() if "optimization_barrier" in line]
    tensor_type = lambda shape: "tensor<" + "x".join(map(str, shape)) + "xf32>"
    for i in range(cfg.num_layers):  # the layer's parameter gradients and the input's, exactly
        layer = [tensor_type(p.shape) for p in jax.tree.leaves(params[f"layer_{i}"])]
        assert sorted([*layer, tensor_type((2, 32, cfg.d_model))]) in operand_types, (i, operand_types)

    free = jax.jit(jax.grad(loss))
    with pytest.MonkeyPatch.context() as patch:  # the same layers without the barrier
        patch.setattr(backward_order, "call_in_order", backward_order.call)
        expected = free(params)
    for a, b in zip(jax.tree.leaves(grad(params)), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
