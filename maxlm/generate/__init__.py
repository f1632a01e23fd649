"""Sampling with a KV cache: one prefill over the prompt, then one token per iteration of a jitted
`lax.while_loop` that feeds only the new token and attends to the cached keys and values. Greedy
when temperature is 0; top-k and nucleus (top-p) filtering otherwise; a row stops at EOS (the loop
ends when every row has). A model with a learned position table (`model.positions="learned"`)
cannot go past its `model.max_positions` (`check_length`). The command line is `__main__.py`.

The cached forward is a functional twin of `model.apply` over the same parameter pytree (scanned
`layers` with a leading layer axis, or unrolled `layer_i`): it calls the model's own pieces (the
norm and MLP modules, `embed`, the weight matmuls, the logits), positions.py's encodings and
attention.py's `xla_attention`, and only replaces where keys and values come from, so the two
cannot drift apart; the tests check its logits against `model.apply`'s at every position.

Shape suffixes as in model/transformer.py, plus T (new tokens this call), P (prompt), N (new tokens),
NL (layers).
"""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

from maxlm import model
from maxlm.model import attention, layer_stack, mla, positions
from maxlm.sharding import mesh as mesh_lib, state as state_lib

# ----------------------------------------------------------------------------- the cached forward

# {"k", "v"}: [NL, B, S, K, Dh] when scanned (multi-head latent attention: its latents, mla.init_cache);
# unrolled: a list of per-layer dicts
Cache = dict


def init_cache(model_cfg, params, batch_size: int, max_len: int) -> Cache | list:
    """Zeroed keys/values for `max_len` positions, in the parameters' layer layout."""
    if model_cfg.attention_kind == "mla":
        if "layers" in params:
            return mla.init_cache(model_cfg, batch_size, max_len, (model_cfg.num_layers,))
        return [mla.init_cache(model_cfg, batch_size, max_len) for _ in range(model_cfg.num_layers)]
    shape = (batch_size, max_len, model_cfg.num_kv_heads, model_cfg.head_dim)
    zeros = lambda *lead: jnp.zeros((*lead, *shape), model.compute_dtype(model_cfg))
    if "layers" in params:
        return {"k": zeros(model_cfg.num_layers), "v": zeros(model_cfg.num_layers)}
    return [{"k": zeros(), "v": zeros()} for _ in range(model_cfg.num_layers)]


def _norm(model_cfg, norm_params, x_BTD):
    """A block's or the final norm (`model.norm`)."""
    return model.block_norm(model_cfg)(model_cfg.norm_eps, model.compute_dtype(model_cfg)).apply(
        {"params": norm_params}, x_BTD)


def _attention(model_cfg, p, x_BTD, positions_BT, cache):
    """model.Attention for T new tokens whose keys/values go into the cache at slot = position;
    each attends to the cache's slots up to its own position."""
    cfg, dtype = model_cfg, model.compute_dtype(model_cfg)
    q_BTHDh = model.weight_matmul(cfg, "bld,dhk->blhk", x_BTD, p["wq"], dtype)
    k_BTKDh = model.weight_matmul(cfg, "bsd,dhk->bshk", x_BTD, p["wk"], dtype)
    v_BTKDh = model.weight_matmul(cfg, "bsd,dhk->bshk", x_BTD, p["wv"], dtype)
    if "bq" in p:  # model.use_bias or model.qkv_bias
        q_BTHDh, k_BTKDh, v_BTKDh = (x + p[b].astype(dtype) for x, b in ((q_BTHDh, "bq"), (k_BTKDh, "bk"), (v_BTKDh, "bv")))
    if cfg.qk_norm != "none":
        norm = lambda name, heads, x: model.qk_norm(cfg, dtype, heads).apply({"params": p[name]}, x)
        q_BTHDh, k_BTKDh = norm("q_norm", "heads", q_BTHDh), norm("k_norm", "kv_heads", k_BTKDh)
    q_BTHDh = positions.rotary(cfg, q_BTHDh, positions_BT)
    k_BTKDh = positions.rotary(cfg, k_BTKDh, positions_BT)
    rows_BT = jnp.broadcast_to(jnp.arange(x_BTD.shape[0])[:, None], positions_BT.shape)
    k_BSKDh = cache["k"].at[rows_BT, positions_BT].set(k_BTKDh)
    v_BSKDh = cache["v"].at[rows_BT, positions_BT].set(v_BTKDh)
    mask_BTS = attention.cache_mask(positions_BT, k_BSKDh.shape[1], cfg.sliding_window)
    out_BTHDh = attention.xla_attention(q_BTHDh, k_BSKDh, v_BSKDh, mask_BTS[:, None], cfg.attn_logit_softcap)
    out_BTD = model.weight_matmul(cfg, "blhk,hkd->bld", out_BTHDh, p["wo"], dtype)
    if "bo" in p:  # model.use_bias
        out_BTD = out_BTD + p["bo"].astype(dtype)
    return out_BTD, {"k": k_BSKDh, "v": v_BSKDh}


def _block(model_cfg, p, x_BTD, positions_BT, cache):
    """model.Block with the cached attention."""
    def norms(sublayer: str):
        return model.placed_norms(model_cfg, sublayer, lambda name: functools.partial(_norm, model_cfg, p[name]))

    def attend(h_BTD):
        nonlocal cache
        cached_attention = mla.decode_attention if model_cfg.attention_kind == "mla" else _attention
        out_BTD, cache = cached_attention(model_cfg, p["attn"], h_BTD, positions_BT, cache)
        return out_BTD

    x_BTD = model.residual(x_BTD, attend, *norms("attn"))
    if "router" in p["mlp"]:  # an MoE layer (maxlm/model/moe/)
        mlp = lambda h_BTD: model.MoE(model_cfg).apply({"params": p["mlp"]}, h_BTD)[0]  # noqa: E731
    else:
        mlp = functools.partial(model.MLP(model_cfg).apply, {"params": p["mlp"]})
    return model.residual(x_BTD, mlp, *norms("mlp")), cache


def forward(model_cfg, params, tokens_BT, positions_BT, cache):
    """Float32 logits [B, T, V] of T new tokens at `positions_BT` (one document per row, its
    earlier tokens in the cache), and the cache with their keys and values added."""
    x_BTD = model.embed(model_cfg, params["embed"], tokens_BT)
    x_BTD = positions.add_positions(model_cfg, x_BTD, positions_BT, params.get("pos_embed"))
    if "layers" in params:  # the scanned layout: one layer body (or pattern group) per group over its leading layer axis

        def step(kind, x_BTD, layer):
            layer_params, layer_cache = layer
            return _block(layer_stack.kind_config(model_cfg, kind), layer_params, x_BTD, positions_BT, layer_cache)

        caches, start = [], 0
        for name, length, _ in model.layer_groups(model_cfg):  # an MoE model's dense layers, then its MoE ones
            group_cache = jax.tree.map(lambda c, start=start, length=length: c[start:start + length], cache)
            x_BTD, group_cache = layer_stack.run(step, x_BTD, (params[name], group_cache),
                                                   layer_stack.kinds(model_cfg, start, length))
            caches.append(group_cache)
            start += length
        cache = jax.tree.map(lambda *c: jnp.concatenate(c), *caches)
    else:
        new_cache = []
        for i, (layer_cache, kind) in enumerate(zip(cache, layer_stack.kinds(model_cfg))):
            x_BTD, layer_cache = _block(layer_stack.kind_config(model_cfg, kind), params[f"layer_{i}"], x_BTD,
                                        positions_BT, layer_cache)
            new_cache.append(layer_cache)
        cache = new_cache
    x_BTD = _norm(model_cfg, params["final_norm"], x_BTD)
    return model.output_logits(model_cfg, x_BTD, model.head_weights(model_cfg, params)), cache


def check_length(model_cfg, prompt_len: int, max_new_tokens: int) -> None:
    """ValueError when a learned position table (`model.positions="learned"`) has no row for the
    last position a generation may reach: it knows `model.max_positions` positions, no more."""
    if model_cfg.positions == "learned" and prompt_len + max_new_tokens > model_cfg.max_positions:
        raise ValueError(
            f"prompt ({prompt_len} tokens) + max_new_tokens={max_new_tokens} = "
            f"{prompt_len + max_new_tokens} positions is more than model.max_positions="
            f"{model_cfg.max_positions}, the learned position table's length")


def prefill(model_cfg, params, prompt_BP, max_len: int):
    """Logits [B, P, V] of the prompt block (row b real up to its length; the rest is padding
    whose cache slots later tokens overwrite before anything can see them) and the cache."""
    B, P = prompt_BP.shape
    positions_BP = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
    return forward(model_cfg, params, prompt_BP, positions_BP, init_cache(model_cfg, params, B, max_len))


def decode_step(model_cfg, params, token_B, position_B, cache):
    """Logits [B, V] of one new token per row at `position_B`, and the updated cache."""
    logits_B1V, cache = forward(model_cfg, params, token_B[:, None], position_B[:, None], cache)
    return logits_B1V[:, 0], cache


# ----------------------------------------------------------------------------- sampling


def sample(logits_BV, rng, temperature=0.0, top_k=0, top_p=1.0):
    """Next tokens [B] int32: argmax when temperature is 0; else a draw from softmax(logits / T)
    restricted to the top_k most likely tokens (0 = all) and, of those, to the smallest set of
    most likely tokens whose probability reaches top_p (nucleus; 1 = all).

    The three settings may be traced scalars (one compiled program serves every setting), so
    greedy and the filters are selected with `where`, not Python branches.
    """
    logits_BV = logits_BV.astype(jnp.float32)
    V = logits_BV.shape[-1]
    greedy_B = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    scaled_BV = logits_BV / jnp.where(temperature > 0, temperature, 1.0)
    sorted_BV = jnp.sort(scaled_BV, axis=-1)[:, ::-1]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
    ranks_V = jnp.arange(V)
    sorted_BV = jnp.where(ranks_V < k, sorted_BV, -jnp.inf)  # top-k, in sorted order
    probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
    before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV  # mass of the more likely tokens
    keep_BV = (ranks_V < k) & ((before_BV < top_p) | (top_p >= 1.0) | (ranks_V == 0))
    threshold_B1 = jnp.min(jnp.where(keep_BV, sorted_BV, jnp.inf), axis=-1, keepdims=True)
    drawn_B = jax.random.categorical(
        rng, jnp.where(scaled_BV < threshold_B1, -jnp.inf, scaled_BV), axis=-1).astype(jnp.int32)
    return jnp.where(temperature > 0, drawn_B, greedy_B)


NO_LIMIT = np.iinfo(np.int32).max


def settings(seed: int = 0, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
             eos_id: int | None = None, pad_id: int = 0, vocab_limit: int | None = None) -> dict:
    """generate_tokens's run-time settings as typed scalars: changing them never recompiles.
    `eos_id` None: no stop token; `vocab_limit` None: every id of the model may be drawn."""
    return {"seed": np.uint32(seed), "temperature": np.float32(temperature), "top_k": np.int32(top_k),
            "top_p": np.float32(top_p), "eos_id": np.int32(-1 if eos_id is None else eos_id),
            "pad_id": np.int32(pad_id),
            "vocab_limit": np.int32(NO_LIMIT if vocab_limit is None else vocab_limit)}


def generate_tokens(model_cfg, params, prompt_BP, lengths_B, settings: dict, *, max_new_tokens: int):
    """(tokens [B, N], counts [B]): up to N = max_new_tokens tokens after each row's prompt
    (`prompt_BP` right-padded, row b's real length `lengths_B[b]` >= 1), drawn by `sample` with
    `settings` (see `settings()`). A row that draws `eos_id` keeps it and stops (`pad_id` after
    it); the loop ends when every row has stopped. Ids >= `vocab_limit` (the tokenizer's size,
    below a padded model vocabulary) are never drawn. Step t draws with `fold_in(key(seed), t)`:
    same seed, same sample."""
    seed, temperature, top_k, top_p, eos_id, pad_id, vocab_limit = (settings[k] for k in (
        "seed", "temperature", "top_k", "top_p", "eos_id", "pad_id", "vocab_limit"))
    B, P = prompt_BP.shape
    N = max_new_tokens
    check_length(model_cfg, P, N)
    rng = jax.random.key(seed)
    logits_BPV, cache = prefill(model_cfg, params, prompt_BP, P + N)
    last_B11 = (lengths_B - 1)[:, None, None]
    logits_BV = jnp.take_along_axis(logits_BPV, last_B11, axis=1)[:, 0]

    def allowed(logits_BV):
        return jnp.where(jnp.arange(logits_BV.shape[-1]) < vocab_limit, logits_BV, -jnp.inf)

    def cond(s):
        return (s["t"] < N) & ~jnp.all(s["done"])

    def body(s):
        t = s["t"]
        token_B = sample(allowed(s["logits"]), jax.random.fold_in(rng, t), temperature, top_k, top_p)
        token_B = jnp.where(s["done"], pad_id, token_B)
        counts_B = s["counts"] + (~s["done"]).astype(jnp.int32)
        done_B = s["done"] | (token_B == eos_id)
        logits_BV, cache = decode_step(model_cfg, params, token_B, lengths_B + t, s["cache"])
        return {"t": t + 1, "tokens": s["tokens"].at[:, t].set(token_B), "counts": counts_B,
                "done": done_B, "logits": logits_BV, "cache": cache}

    init = {"t": jnp.zeros((), jnp.int32), "tokens": jnp.full((B, N), pad_id, jnp.int32),
            "counts": jnp.zeros((B,), jnp.int32), "done": jnp.zeros((B,), bool),
            "logits": logits_BV, "cache": cache}
    final = jax.lax.while_loop(cond, body, init)
    return final["tokens"], final["counts"]


# ----------------------------------------------------------------------------- jitted, sharded


def decode_rules(rules) -> tuple:
    """The config's rules with `batch` and `length` replicated: a handful of prompts is not split
    over the data axes (their sizes need not divide it), nor one new token over `sequence`;
    parameters (neither axis) keep their shardings."""
    return tuple((name, None if name in ("batch", "length") else axes) for name, axes in rules)


def make_generate_fn(cfg, mesh=None, rules=None, *, max_new_tokens: int):
    """`fn(params, prompt_BP, lengths_B, settings) -> (tokens_BN, counts_B)` (generate_tokens),
    jitted; with a mesh the parameters are sharded by the config's rules and everything else
    replicated. Call (or `.lower(...)`) it inside `activation_context(mesh, rules)`. The same
    function comes back for the same arguments, so its compilations are reused: only the
    model, the mesh and max_new_tokens (and the prompts' shape) shape the program."""
    return _generate_fn(json.dumps(cfg.model.to_dict(), sort_keys=True), mesh, rules, max_new_tokens)


@functools.lru_cache(maxsize=16)
def _generate_fn(model_json: str, mesh, rules, max_new_tokens: int):
    import ml_collections

    model_cfg = ml_collections.ConfigDict(json.loads(model_json))
    fn = functools.partial(generate_tokens, model_cfg, max_new_tokens=max_new_tokens)
    if mesh is None:
        return jax.jit(fn)
    shardings = state_lib.param_shardings(model_cfg, mesh, rules)
    replicated = mesh_lib.replicated(mesh)
    return jax.jit(fn, in_shardings=(shardings,) + (replicated,) * 3, out_shardings=replicated)


def activation_context(mesh, rules):
    import contextlib

    return contextlib.nullcontext() if mesh is None else mesh_lib.activate(mesh, decode_rules(rules))


def pad_prompts(prompts, pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Token id lists → (right-padded int32 [B, P], lengths [B])."""
    lengths = np.array([len(p) for p in prompts], np.int32)
    if lengths.min() < 1:
        raise ValueError("every prompt needs at least one token (the tokenizer's bos)")
    out = np.full((len(prompts), lengths.max()), pad_id, np.int32)
    for row, ids in zip(out, prompts):
        row[: len(ids)] = ids
    return out, lengths


def generate(cfg, params, prompts, *, max_new_tokens: int, mesh=None, rules=None,
             **kwargs) -> list[list[int]]:
    """The new token ids of each prompt (lists of ids, `[bos] + ...` as training framed them),
    EOS included when drawn. `kwargs`: `settings()`'s (seed, temperature, top_k, top_p, eos_id,
    pad_id, vocab_limit)."""
    run_settings = settings(**kwargs)
    prompt_BP, lengths_B = pad_prompts(prompts, int(run_settings["pad_id"]))
    fn = make_generate_fn(cfg, mesh, rules, max_new_tokens=max_new_tokens)
    with activation_context(mesh, rules):
        tokens_BN, counts_B = jax.device_get(fn(params, prompt_BP, lengths_B, run_settings))
    return [row[:n].tolist() for row, n in zip(tokens_BN, counts_B)]


def distinct_n(samples, n: int) -> float | None:
    """Distinct-n (Li et al. 2016): distinct n-grams / all n-grams, over the n-grams of every
    sample (token id lists; an n-gram never spans two samples). None when no sample has n tokens."""
    ngrams = [tuple(ids[i:i + n]) for ids in samples for i in range(len(ids) - n + 1)]
    return len(set(ngrams)) / len(ngrams) if ngrams else None
