"""A Llama-style decoder-only Transformer, used functionally.

    params = init_params(model_cfg, rng)            # a plain pytree of float32 arrays
    logits_BLV = apply(model_cfg, params, batch)    # no hidden state

Blocks are x + Attention(RMSNorm(x)), then x + MLP(RMSNorm(x)) (pre-norm, Llama's), or with
the norm on each sublayer's output, x + RMSNorm(Attention(x)) (post, OLMo 2's), or both
(sandwich, Gemma's): `model.norm_placement`. Attention is grouped-query, its queries and keys
optionally RMS-normed before RoPE (`model.qk_norm`).
Positions are rotary embeddings in attention or an absolute encoding added to the
token embeddings (`model.positions`: maxlm/model/positions.py). A batch is packed: `segment_ids` name
the document each token belongs to (0 = padding) and `positions` restart at 0 for each document,
so attention never crosses documents and every encoding sees per-document positions.

Shape suffixes: B batch, L length (queries), S length (keys), D d_model, H heads, K kv heads,
G heads per kv head (H = K·G), Dh head dim, F mlp hidden, V vocab, P max positions.
Every parameter carries logical axis names (see maxlm/sharding/mesh.py); activations are constrained with
the same names, which only bind while a mesh and rules are active.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec

from maxlm.model import attention, backward_order, layer_stack, mla, moe, mtp, output_projection, positions
from maxlm.model.norms import block_norm, placed_norms, qk_norm, residual
from maxlm.model.parallel import pipeline, ring_attention, ulysses, zigzag
from maxlm.model.weights import (
    attend_heads,
    bias as _bias,
    compute_dtype,
    constrain as _constrain,
    normal as _normal,
    param as _param,
    weight_matmul,
)

Batch = dict[str, jax.Array]

def embed(model_cfg, embed_VD, tokens_BL):
    """Token embeddings [B, L, D] in the compute dtype, times √d_model with `model.scale_embeddings`
    (Gemma's; the scale rounded to the compute dtype, as transformers rounds it to the weights').
    Rows are gathered from a table whose embed dim is whole (ZeRO-3 all-gathers it as it would any
    weight). A lookup that leaves the table sharded saves bytes (0.7% of Llama 3 8B's step on a
    v5p-64) but planned more memory: 0.8 GB per device for that preset, 0.3 GB for the tied 1B
    (docs/performance.md#compiled-for-v5p-no-tpu)."""
    dtype = compute_dtype(model_cfg)
    table_VD = _constrain(embed_VD, ("vocab", "act_embed"))
    x_BLD = jnp.take(table_VD, tokens_BL, axis=0).astype(dtype)
    if model_cfg.scale_embeddings:
        x_BLD = x_BLD * jnp.asarray(math.sqrt(model_cfg.d_model), dtype)
    return _constrain(x_BLD, ("batch", "length", "act_embed"))


def microbatches(x, n: int, axes):
    """[B, ...] → [n, B/n, ...], microbatch i = rows i, i+n, i+2n, ... (`axes`: x's logical axes).

    Strided rather than contiguous rows: with the batch sharded over (data, fsdp) in contiguous
    blocks, every device then holds B/(n·devices) rows of *every* microbatch, so slicing one out
    moves no data (config.resolve checks that B divides accordingly). Gradient accumulation and
    the pipeline's microbatches both split this way.
    """
    x = _constrain(x.reshape(x.shape[0] // n, n, *x.shape[1:]), (axes[0], None, *axes[1:]))
    return _constrain(x.swapaxes(0, 1), (None, *axes))


# What the backward pass may keep instead of recomputing (`model.remat`). The names are the
# `checkpoint_name` tags in Attention and MLP.
REMAT_POLICIES = {
    "none": None,  # no rematerialisation: keep every activation
    "full": jax.checkpoint_policies.nothing_saveable,  # keep only each layer's input
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # every weight matmul
    "save_qkv_proj": jax.checkpoint_policies.save_only_these_names("q_proj", "k_proj", "v_proj"),
    "save_out_proj": jax.checkpoint_policies.save_only_these_names("attn_out", "mlp_out"),
}


class Attention(nn.Module):
    cfg: Any

    def _out(self, out_BLHDh, wo_HDhD):
        """The output projection, with its bias under `model.use_bias`."""
        cfg, dtype = self.cfg, compute_dtype(self.cfg)
        out_BLD = weight_matmul(cfg, "blhk,hkd->bld", out_BLHDh, wo_HDhD, dtype)
        return out_BLD + _bias(self, "bo", (cfg.d_model,), ("embed",), dtype) if cfg.use_bias else out_BLD

    @nn.compact
    def __call__(self, x_BLD, positions_BL, mask_B1LS, segment_ids_BL):
        cfg = self.cfg
        dtype = compute_dtype(cfg)
        D, H, K, Dh = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)  # GPT-2: residual writes shrink with depth
        wq_DHDh = _param(self, "wq", _normal(cfg.init_std), (D, H, Dh), ("embed", "heads", "head_dim"))
        wk_DKDh = _param(self, "wk", _normal(cfg.init_std), (D, K, Dh), ("embed", "kv_heads", "head_dim"))
        wv_DKDh = _param(self, "wv", _normal(cfg.init_std), (D, K, Dh), ("embed", "kv_heads", "head_dim"))
        wo_HDhD = _param(self, "wo", _normal(out_std), (H, Dh, D), ("heads", "head_dim", "embed"))

        q_BLHDh = weight_matmul(cfg, "bld,dhk->blhk", x_BLD, wq_DHDh, dtype)
        k_BSKDh = weight_matmul(cfg, "bsd,dhk->bshk", x_BLD, wk_DKDh, dtype)
        v_BSKDh = weight_matmul(cfg, "bsd,dhk->bshk", x_BLD, wv_DKDh, dtype)
        if cfg.use_bias or cfg.qkv_bias:
            q_BLHDh = q_BLHDh + _bias(self, "bq", (H, Dh), ("heads", "head_dim"), dtype)
            k_BSKDh = k_BSKDh + _bias(self, "bk", (K, Dh), ("kv_heads", "head_dim"), dtype)
            v_BSKDh = v_BSKDh + _bias(self, "bv", (K, Dh), ("kv_heads", "head_dim"), dtype)
        q_BLHDh, k_BSKDh = checkpoint_name(q_BLHDh, "q_proj"), checkpoint_name(k_BSKDh, "k_proj")
        v_BSKDh = checkpoint_name(v_BSKDh, "v_proj")
        if cfg.qk_norm != "none":  # before RoPE, as Qwen3 and OLMo 2 do: bounds the attention logits
            q_BLHDh = qk_norm(cfg, dtype, "heads", name="q_norm")(q_BLHDh)
            k_BSKDh = qk_norm(cfg, dtype, "kv_heads", name="k_norm")(k_BSKDh)
        q_BLHDh = _constrain(positions.rotary(cfg, q_BLHDh, positions_BL), ("batch", "length", "heads", "head_dim"))
        k_BSKDh = positions.rotary(cfg, k_BSKDh, positions_BL)
        out_BLHDh = attend_heads(cfg, q_BLHDh, k_BSKDh, v_BSKDh, mask_B1LS, segment_ids_BL, self.is_initializing())
        return checkpoint_name(self._out(out_BLHDh, wo_HDhD), "attn_out")


class MLP(nn.Module):
    """The dense MLP, `model.mlp_activation`: down(silu(gate(x)) · up(x)) (swiglu), the same with
    tanh-GeLU (geglu), or down(gelu(up(x))) (gelu, no gate); biases with `model.use_bias`."""
    cfg: Any

    @nn.compact
    def __call__(self, x_BLD):
        cfg = self.cfg
        dtype = compute_dtype(cfg)
        D, F = cfg.d_model, cfg.mlp_dim
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)

        def project(name, spec, x, shape, axes, init):
            y = weight_matmul(cfg, spec, x, _param(self, f"w_{name}", init, shape, axes), dtype)
            return y + _bias(self, f"b_{name}", shape[-1:], axes[-1:], dtype) if cfg.use_bias else y

        if cfg.mlp_activation == "gelu":
            hidden_BLF = nn.gelu(project("up", "bld,df->blf", x_BLD, (D, F), ("embed", "mlp"), _normal(cfg.init_std)),
                                 approximate=True)
        else:  # gate first: the parameters' init draws in the order they were always made
            gate_BLF = project("gate", "bld,df->blf", x_BLD, (D, F), ("embed", "mlp"), _normal(cfg.init_std))
            up_BLF = project("up", "bld,df->blf", x_BLD, (D, F), ("embed", "mlp"), _normal(cfg.init_std))
            act = nn.silu if cfg.mlp_activation == "swiglu" else functools.partial(nn.gelu, approximate=True)
            hidden_BLF = act(gate_BLF) * up_BLF
        hidden_BLF = _constrain(hidden_BLF, ("batch", "length", "mlp"))
        out_BLD = project("down", "blf,fd->bld", hidden_BLF, (F, D), ("mlp", "embed"), _normal(out_std))
        return checkpoint_name(out_BLD, "mlp_out")


class Block(nn.Module):
    """One layer; `experts`: its MLP is the mixture of experts (maxlm/model/moe/), whose router
    statistics it returns as the scan's per-layer output."""
    cfg: Any
    experts: bool = False

    @nn.compact
    def __call__(self, x_BLD, positions_BL, mask_B1LS, segment_ids_BL):
        cfg = self.cfg
        dtype = compute_dtype(cfg)
        def norms(sublayer: str):
            return placed_norms(cfg, sublayer, lambda name: block_norm(cfg)(cfg.norm_eps, dtype, name=name))

        attention_class = mla.LatentAttention if cfg.attention_kind == "mla" else Attention
        attend = functools.partial(attention_class(cfg, name="attn"), positions_BL=positions_BL, mask_B1LS=mask_B1LS,
                                   segment_ids_BL=segment_ids_BL)
        x_BLD = residual(x_BLD, attend, *norms("attn"))
        stats = None
        if self.experts:
            def mlp(h_BLD):
                nonlocal stats
                mlp_BLD, stats = moe.MoE(cfg, name="mlp")(h_BLD)
                return mlp_BLD
        else:
            mlp = MLP(cfg, name="mlp")
        x_BLD = residual(x_BLD, mlp, *norms("mlp"))
        return _constrain(x_BLD, ("batch", "length", "act_embed")), stats  # (carry, out) for scan


def layer_groups(model_cfg) -> list[tuple[str, int, bool]]:
    """(scanned name, layers, experts?) of the layer groups, bottom first: a dense model's
    `layers`; an MoE model's `first_dense_layers` as `dense_layers`, then its MoE `layers`."""
    if not model_cfg.num_experts:
        return [("layers", model_cfg.num_layers, False)]
    dense = moe.dense_layers(model_cfg)
    return [("dense_layers", dense, False)] * bool(dense) + [("layers", model_cfg.num_layers - dense, True)]


def _document_masks(cfg, segment_ids_BL, dtype) -> dict:
    """{layer kind: `_document_mask` of that kind's layers} for the kinds the model has (one,
    GLOBAL, without a `model.layer_pattern`) and GLOBAL, the multi-token prediction modules' kind."""
    return {kind: _document_mask(layer_stack.kind_config(cfg, kind), segment_ids_BL, dtype)
            for kind in sorted(set(layer_stack.kinds(cfg)) | {layer_stack.GLOBAL})}


def _document_mask(cfg, segment_ids_BL, dtype):
    """What every layer's attention takes as its mask, made once per step: the backend's form of the
    documents (`attention.document_mask`), or None where attention masks from the segment ids in
    each layer (splash, the ring, Ulysses)."""
    if ring_attention.active(cfg) or ulysses.applies(cfg, *segment_ids_BL.shape):
        return None
    backend = attention.attention_backend(cfg.attention, dtype, segment_ids_BL.shape[1], softcap=cfg.attn_logit_softcap,
                                          head_dim=cfg.head_dim)
    return attention.document_mask(backend, segment_ids_BL, dtype, cfg.sliding_window)


class Transformer(nn.Module):
    cfg: Any

    @nn.compact
    def __call__(self, tokens_BL, segment_ids_BL, positions_BL, targets_BL=None):
        """The final-normed hidden states; given the batch's `targets_BL`, a model with
        `model.mtp_depth` also runs its multi-token prediction modules and sows their final-normed
        states as "mtp", depth 1 first (maxlm/model/mtp.py)."""
        cfg = self.cfg
        dtype = compute_dtype(cfg)
        embed_VD = _param(self, "embed", _normal(cfg.init_std), (cfg.vocab_size, cfg.d_model), ("vocab", "embed"))
        pos_embed_PD = _param(self, "pos_embed", _normal(cfg.init_std), (cfg.max_positions, cfg.d_model),
                              ("positions", "embed")) if cfg.positions == "learned" else None
        x_BLD = positions.add_positions(cfg, embed(cfg, embed_VD, tokens_BL), positions_BL, pos_embed_PD)
        # Init only needs the parameters' shapes (see Attention): the plain path's mask then.
        masks = {kind: attention.attention_mask(segment_ids_BL) for kind in layer_stack.kinds(cfg) + layer_stack.GLOBAL} \
            if self.is_initializing() else _document_masks(cfg, segment_ids_BL, dtype)
        block = _block_class(cfg)
        router_stats = []  # per MoE layer
        if cfg.scan_layers:  # one compiled layer body per group whatever the depth; params get a `layers` axis
            first = 0
            for name, length, experts in layer_groups(cfg):
                group_kinds, first = layer_stack.kinds(cfg, first, length), first + length
                if layer_stack.period(group_kinds) > 1 and not self.is_initializing():
                    # local and global layers: a scan over groups of the pattern (maxlm/model/layer_stack.py)
                    def step(kind, x_BLD, layer_params, experts=experts):
                        return Block(layer_stack.kind_config(cfg, kind), experts, parent=None).apply(
                            {"params": layer_params}, x_BLD, positions_BL, masks[kind], segment_ids_BL)
                    x_BLD, stats = layer_stack.run(step, x_BLD, self.variables["params"][name], group_kinds,
                                                     REMAT_POLICIES[cfg.remat])
                    if experts:
                        router_stats.append(stats)
                    continue
                mask_B1LS = masks[group_kinds[0]]
                layer_cfg = layer_stack.kind_config(cfg, group_kinds[0])
                layers = nn.scan(
                    block,
                    variable_axes={"params": 0},
                    split_rngs={"params": True},
                    in_axes=(nn.broadcast, nn.broadcast, nn.broadcast),
                    length=length,
                    metadata_params={nn.PARTITION_NAME: "layers"},
                )
                x_BLD, stats = layers(layer_cfg, experts, name=name)(x_BLD, positions_BL, mask_B1LS, segment_ids_BL)
                if experts:  # stacked over the group's layers by the scan
                    router_stats.append(stats)
        else:
            for i, kind in enumerate(layer_stack.kinds(cfg)):
                layer = block(layer_stack.kind_config(cfg, kind), i >= moe.dense_layers(cfg), name=f"layer_{i}")
                x_BLD, stats = backward_order.call_in_order(layer, x_BLD, positions_BL, masks[kind], segment_ids_BL)
                if stats is not None:
                    router_stats.append(jax.tree.map(lambda a: a[None], stats))
        if router_stats:  # [MoE layers, ...], read by `forward` (the objective, the metrics)
            self.sow("intermediates", "router_stats", jax.tree.map(lambda *a: jnp.concatenate(a), *router_stats))
        if not cfg.tie_embeddings:  # declared here so init creates it; used by `head_weights`
            _param(self, "head", _normal(cfg.init_std), (cfg.d_model, cfg.vocab_size), ("embed", "vocab"))
        final_norm = block_norm(cfg)(cfg.norm_eps, dtype, name="final_norm")  # shared by the MTP modules' heads
        if targets_BL is not None:  # the modules attend as global layers
            mtp_cfg = layer_stack.kind_config(cfg, layer_stack.GLOBAL)
            depths = [mtp.Depth(mtp_cfg, block, block_norm(cfg), name=f"mtp_{k}") for k in range(cfg.mtp_depth)]
            for state_BLD in _mtp_states(cfg, depths, final_norm, embed_VD, x_BLD, targets_BL, positions_BL,
                                         masks[layer_stack.GLOBAL], segment_ids_BL):
                self.sow("intermediates", "mtp", state_BLD)
        return final_norm(x_BLD)


def _block_class(cfg):
    """Block, remat-wrapped by `model.remat`'s policy when it has one."""
    if REMAT_POLICIES[cfg.remat] is None:
        return Block
    # prevent_cse only matters outside scan, where XLA could merge the recomputation away.
    return nn.remat(Block, policy=REMAT_POLICIES[cfg.remat], prevent_cse=not cfg.scan_layers)


def _mtp_states(cfg, depths, final_norm, embed_VD, x_BLD, targets_BL, positions_BL, mask_B1LS, segment_ids_BL):
    """The multi-token prediction modules' final-normed states, depth 1 first: `depths` are the
    modules (mtp.Depth, bound or applied), h^0 = `x_BLD` the trunk's output before `final_norm`."""
    h_BLD, states = x_BLD, []
    for k, depth in enumerate(depths, start=1):
        embeds_BLD = embed(cfg, embed_VD, mtp.input_tokens(targets_BL, k))
        h_BLD = depth(h_BLD, embeds_BLD, positions_BL, mask_B1LS, segment_ids_BL)
        states.append(final_norm(h_BLD))
    return tuple(states)


def _dummy_inputs(length: int = 8):
    ids = jnp.zeros((1, length), jnp.int32)
    return ids, jnp.ones_like(ids), jnp.arange(length, dtype=jnp.int32)[None], ids  # targets: MTP's params too


def _scanned(model_cfg):
    """`model_cfg` with the scanned layer layout (itself when it has it)."""
    if model_cfg.scan_layers:
        return model_cfg
    scanned = ml_collections.ConfigDict(model_cfg.to_dict())
    scanned.scan_layers = True
    return scanned


def init_params(model_cfg, rng: jax.Array):
    """Float32 parameters as a plain pytree (logical-axis boxes removed).

    Both layer layouts start from the same numbers: the scanned tree is initialised, and for
    `scan_layers=False` its stacked layers are split into `layer_0`, `layer_1`, ... So flipping the
    layout to debug changes nothing but the compiled program.
    """
    params = nn.unbox(Transformer(_scanned(model_cfg)).init(rng, *_dummy_inputs())["params"])
    return params if model_cfg.scan_layers else unstack_layers(params)


def param_logical_specs(model_cfg):
    """A pytree of PartitionSpecs of logical axis names, matching `init_params`'s output."""
    boxed = jax.eval_shape(lambda: Transformer(_scanned(model_cfg)).init(jax.random.key(0), *_dummy_inputs()))
    specs = nn.get_partition_spec(boxed["params"])
    if model_cfg.scan_layers:
        return specs
    # an unrolled layer's spec is the stacked one without its leading `layers` axis
    groups = {name: jax.tree.map(lambda spec: PartitionSpec(*spec[1:]), specs[name], is_leaf=is_spec)
              for name, _, _ in layer_groups(model_cfg)}
    dense = moe.dense_layers(model_cfg) if model_cfg.num_experts else 0  # a dense model's are `layers`
    return unstack_layers({**specs, **groups}, num_layers=model_cfg.num_layers, stacked=False, num_dense=dense)


def forward(model_cfg, params, batch: Batch) -> tuple[jax.Array, dict | None]:
    """(the final-normed hidden states [B, L, D] (compute dtype) of a packed batch, the router
    statistics of an MoE model stacked over its MoE layers (maxlm/model/moe/), else None);
    pipelined over the mesh's `stage` axis when it has one of size > 1 (same numbers)."""
    x_BLD, sown = forward_intermediates(model_cfg, params, batch, with_mtp=False)
    return x_BLD, sown.get("router_stats")


def forward_intermediates(model_cfg, params, batch: Batch, with_mtp: bool) -> tuple[jax.Array, dict]:
    """`forward`'s hidden states, and what the network sowed: "router_stats" (`forward`'s) and,
    `with_mtp`, the multi-token prediction modules' final-normed states "mtp" (a tuple, depth 1
    first; none without `model.mtp_depth`)."""
    if pipeline.pipeline_stages() > 1:
        return pipelined_forward(model_cfg, params, batch, pipeline.pipeline_stages(), with_mtp)
    x_BLD, sown = Transformer(model_cfg).apply(
        {"params": params}, batch["inputs"], batch["segment_ids"], batch["positions"],
        batch["targets"] if with_mtp else None, mutable=["intermediates"])
    sown = dict(sown.get("intermediates", {}))
    if "router_stats" in sown:  # sown once
        sown["router_stats"] = sown["router_stats"][0]
    return x_BLD, sown


def hidden_states(model_cfg, params, batch: Batch) -> jax.Array:
    """`forward`'s hidden states, in the batch's order (also under `model.context_load_balance`)."""
    n = zigzag.shards(model_cfg)
    if not n:
        return forward(model_cfg, params, batch)[0]
    x_BLD = forward(model_cfg, params, zigzag.reorder(batch, n))[0]
    return zigzag.restore(x_BLD, n, ("batch", "length", "act_embed"))


# ----------------------------------------------------------------------------- pipeline parallelism


def pipelined_forward(model_cfg, params, batch: Batch, stages: int, with_mtp: bool) -> tuple[jax.Array, dict]:
    """`forward_intermediates` with each layer group (`layer_groups`: an MoE model's dense layers,
    then its MoE layers) split over `stages` pipeline stages, one GPipe pass each (circular with
    `model.pipeline_repeats` > 1: maxlm/model/parallel/pipeline.py), on `model.pipeline_microbatches` strided microbatches
    (`microbatches`). The same numbers: the router statistics are each microbatch's, combined
    into the whole batch's (`moe.whole_batch_stats`); the embedding, the final norm and the
    multi-token prediction modules run outside the pipeline, on the whole batch."""
    cfg = model_cfg
    dtype = compute_dtype(cfg)
    M = cfg.pipeline_microbatches
    tokens_BL, segment_ids_BL, positions_BL = batch["inputs"], batch["segment_ids"], batch["positions"]
    B, L = tokens_BL.shape
    x_BLD = embed(cfg, params["embed"], tokens_BL)
    x_BLD = positions.add_positions(cfg, x_BLD, positions_BL, params.get("pos_embed"))
    # the documents as each layer kind's backend takes them (none for splash, the ring and
    # Ulysses), per microbatch
    masks = {kind: mask for kind, mask in _document_masks(cfg, segment_ids_BL, dtype).items() if mask is not None}
    x_MbLD = microbatches(x_BLD, M, ("batch", "length", "act_embed"))
    side_Mb = (microbatches(positions_BL, M, ("batch", "length")),
               microbatches(segment_ids_BL, M, ("batch", "length")),
               *(microbatches(mask, M, ("batch", None, "length", None)) for mask in masks.values()))
    specs = param_logical_specs(cfg)
    sown, first = {}, 0
    for name, length, experts in layer_groups(cfg):
        group_kinds, first = layer_stack.kinds(cfg, first, length), first + length
        # one pipelined unit: a layer, or with local and global layers a group of the pattern
        # (config.resolve checks that whole groups fill each stage's chunks)
        p = layer_stack.period(group_kinds)

        def layer_of(kind, experts=experts):
            def layer(x_bLD, layer_params, positions_bL, segment_ids_bL, *masks_b1LS):
                mask_b1LS = dict(zip(masks, masks_b1LS)).get(kind)
                return Block(layer_stack.kind_config(cfg, kind), experts).apply(
                    {"params": layer_params}, x_bLD, positions_bL, mask_b1LS, segment_ids_bL)
            return layer if REMAT_POLICIES[cfg.remat] is None else jax.checkpoint(layer, policy=REMAT_POLICIES[cfg.remat])

        unit, unit_params, unit_specs = layer_of(group_kinds[0]), params[name], specs[name]
        if p > 1:
            def unit(x_bLD, group_params, *side_b, layers=[layer_of(kind) for kind in group_kinds[:p]]):
                outs = []
                for j, layer in enumerate(layers):
                    x_bLD, out = layer(x_bLD, jax.tree.map(lambda a, j=j: a[j], group_params), *side_b)
                    outs.append(out)
                return x_bLD, None if outs[0] is None else jax.tree.map(lambda *o: jnp.stack(o), *outs)

            unit_params = jax.tree.map(lambda a: a.reshape(a.shape[0] // p, p, *a.shape[1:]), params[name])
            unit_specs = jax.tree.map(lambda spec: PartitionSpec(spec[0], None, *spec[1:]), specs[name], is_leaf=is_spec)
        x_MbLD, stats = pipeline.run(unit, unit_params, unit_specs, x_MbLD, side_Mb, stages, cfg.pipeline_repeats)
        if experts:
            if p > 1:  # [layers / p, p, ...] → [layers, ...]
                stats = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), stats)
            sown["router_stats"] = moe.whole_batch_stats(stats)
    x_BLD = _constrain(x_MbLD.swapaxes(0, 1).reshape(B, L, cfg.d_model), ("batch", "length", "act_embed"))
    final_norm = functools.partial(block_norm(cfg)(cfg.norm_eps, dtype).apply, {"params": params["final_norm"]})
    if with_mtp and cfg.mtp_depth:
        mtp_cfg = layer_stack.kind_config(cfg, layer_stack.GLOBAL)
        depths = [functools.partial(mtp.Depth(mtp_cfg, _block_class(cfg), block_norm(cfg)).apply,
                                    {"params": params[f"mtp_{k}"]}) for k in range(cfg.mtp_depth)]
        sown["mtp"] = _mtp_states(cfg, depths, final_norm, params["embed"], x_BLD, batch["targets"],
                                  positions_BL, masks.get(layer_stack.GLOBAL), segment_ids_BL)
    return final_norm(x_BLD), sown


def head_weights(model_cfg, params) -> jax.Array:
    """The output projection: `head` [D, V], or the embedding [V, D] itself when tied."""
    return params["embed"] if model_cfg.tie_embeddings else params["head"]


def output_logits(model_cfg, x_BLD, w_head):
    """Float32 logits [B, L, V] of final hidden states (`w_head` from `head_weights`), soft-capped
    at ±`model.final_logit_softcap` when it is set (every loss, eval and generation reads them here)."""
    logits_BLV = output_projection.project("vd" if model_cfg.tie_embeddings else "dv", x_BLD, w_head.astype(x_BLD.dtype))
    logits_BLV = logits_BLV.astype(jnp.float32)
    logits_BLV = attention.soft_cap(logits_BLV, model_cfg.final_logit_softcap)
    return _constrain(logits_BLV, ("batch", "length", "vocab"))


def apply(model_cfg, params, batch: Batch) -> jax.Array:
    """Float32 logits [B, L, V] for a packed batch {inputs, segment_ids, positions}."""
    return output_logits(model_cfg, hidden_states(model_cfg, params, batch), head_weights(model_cfg, params))


def _token_losses(model_cfg, x_BLD, w_head, targets_BL) -> dict:
    """{"objective", "cross_entropy", "correct"} per token, float32 [B, L].

    The objective adds label smoothing (cross-entropy against a mix of the target and the uniform
    distribution) and z-loss (PaLM: z_loss · log²Z keeps the softmax normaliser near 1). `correct`
    is 1 where the argmax prediction is the target (evaluation reads it; a training step never
    does, so XLA drops it there).
    """
    logits_BLV = output_logits(model_cfg, x_BLD, w_head)
    log_z_BL = jax.nn.logsumexp(logits_BLV, axis=-1)
    # a select-and-sum, not a gather: it fuses with the upcast of the compute-dtype logits, which
    # a gather made XLA store as a float32 copy ([B, L, V]: 4 GB a chunk for Llama 3 on a v5p), and
    # its gradient is a select instead of a scatter; exact, as every other term is 0
    is_target_BLV = jnp.arange(logits_BLV.shape[-1]) == targets_BL[..., None]
    target_logit_BL = jnp.where(is_target_BLV, logits_BLV, 0.0).sum(axis=-1)
    cross_entropy_BL = log_z_BL - target_logit_BL
    objective_BL = cross_entropy_BL
    if model_cfg.label_smoothing:
        uniform_BL = log_z_BL - logits_BLV.mean(axis=-1)
        objective_BL = (1 - model_cfg.label_smoothing) * cross_entropy_BL + model_cfg.label_smoothing * uniform_BL
    if model_cfg.z_loss:
        objective_BL = objective_BL + model_cfg.z_loss * jnp.square(log_z_BL)
    correct_BL = (jnp.argmax(logits_BLV, axis=-1) == targets_BL).astype(jnp.float32)
    return {"objective": objective_BL, "cross_entropy": cross_entropy_BL, "correct": correct_BL}


def _chunked_token_losses(model_cfg, x_BLD, w_head, targets_BL) -> dict:
    """`_token_losses` one length-chunk at a time, so [B, L, V] float32 logits never exist.

    Each chunk is rematerialised in the backward pass too (jax.checkpoint), so its logits are
    recomputed there rather than stored.
    """
    B, L, D = x_BLD.shape
    C = model_cfg.logits_chunk_size
    x_NBCD = x_BLD.reshape(B, L // C, C, D).swapaxes(0, 1)
    targets_NBC = targets_BL.reshape(B, L // C, C).swapaxes(0, 1)
    chunk_losses = jax.checkpoint(functools.partial(_token_losses, model_cfg))

    def body(carry, chunk):
        return carry, chunk_losses(chunk[0], w_head, chunk[1])

    _, per_token_NBC = jax.lax.scan(body, None, (x_NBCD, targets_NBC))
    return jax.tree.map(lambda a: a.swapaxes(0, 1).reshape(B, L), per_token_NBC)


def token_losses(model_cfg, params, batch: Batch, x_BLD=None) -> dict:
    """{"objective", "cross_entropy", "correct"} per token [B, L] (see `_token_losses`), and
    "weights": 1 for real tokens, 0 for padding; of the hidden states `x_BLD` (default: the
    batch's). Logits are computed `model.logits_chunk_size` positions at a time when that is set."""
    x_BLD = hidden_states(model_cfg, params, batch) if x_BLD is None else x_BLD
    w_head = head_weights(model_cfg, params)
    chunk = model_cfg.logits_chunk_size
    per_token = _chunked_token_losses if chunk and chunk < x_BLD.shape[1] else _token_losses
    return {**per_token(model_cfg, x_BLD, w_head, batch["targets"]),
            "weights": (batch["segment_ids"] > 0).astype(jnp.float32)}


def loss_fn(model_cfg, params, batch: Batch) -> tuple[jax.Array, dict]:
    """The training objective averaged over real (non-padding) tokens, and
    {"num_tokens", "cross_entropy"} (the plain next-token loss, what `loss` reports), with an MoE
    model's "router" statistics (`aux_loss`, `z_loss`, `dropped` averaged over its MoE layers,
    `load_max`: the busiest expert's tokens over the mean, in any layer; `layers`: `forward`'s
    per-layer ones, [MoE layers, ...], for the per-layer metrics and the balancing bias) and with
    `model.mtp_depth` "mtp": each depth's mean cross-entropy [D] (maxlm/model/mtp.py)."""
    if n := zigzag.shards(model_cfg):  # a sum over tokens: computed in zig-zag order, never put back
        batch = zigzag.reorder(batch, n)
    x_BLD, sown = forward_intermediates(model_cfg, params, batch, with_mtp=True)
    router_stats = sown.get("router_stats")
    per_token = token_losses(model_cfg, params, batch, x_BLD)
    weights_BL = per_token["weights"]
    num_tokens = weights_BL.sum()
    mean = lambda v_BL: (v_BL * weights_BL).sum() / jnp.maximum(num_tokens, 1.0)
    objective = mean(per_token["objective"])
    aux = {"num_tokens": num_tokens, "cross_entropy": mean(per_token["cross_entropy"])}
    if router_stats is not None:  # the load-balancing and router z-losses, averaged over the MoE layers
        layers_mean = jax.tree.map(lambda a: a.mean(axis=0), router_stats)
        objective = objective + moe.router_loss(model_cfg, layers_mean)
        # the busiest expert of any layer over the mean, the rest averaged over the layers
        aux["router"] = {name: router_stats["load_E"].max() if name == "load_max" else layers_mean[name]
                         for name in moe.ROUTER_METRICS}
        aux["router"]["layers"] = router_stats
    if "mtp" in sown:  # multi-token prediction: each depth's plain cross-entropy over the tokens it counts
        aux["mtp"] = jnp.stack([
            mtp.mean_cross_entropy(token_losses(model_cfg, params, mtp.depth_batch(batch, k), x_kBLD))
            for k, x_kBLD in enumerate(sown["mtp"], start=1)])
        objective = objective + mtp.mtp_loss(model_cfg, aux["mtp"])
    return objective, aux


def stack_layers(params):
    """Unrolled params (`layer_0`, `layer_1`, ...) → the scanned layout: `layers`, a leading layer
    axis; an MoE model's dense layers (below its MoE ones) as `dense_layers`."""
    names = sorted((k for k in params if k.startswith("layer_")), key=lambda k: int(k[6:]))
    experts = [k for k in names if "router" in params[k]["mlp"]]
    dense = [k for k in names if k not in experts]
    stack = lambda keys: jax.tree.map(lambda *xs: jnp.stack(xs), *(params[k] for k in keys))
    groups = {"layers": stack(experts), **({"dense_layers": stack(dense)} if dense else {})} if experts \
        else {"layers": stack(names)}
    return {**{k: v for k, v in params.items() if k not in names}, **groups}


def unstack_layers(params, num_layers: int | None = None, stacked: bool = True, num_dense: int = 0):
    """The scanned layout (`dense_layers` then `layers`, each with a leading axis) → unrolled
    params (`layer_0`, `layer_1`, ...).

    With `stacked=False`, each group is one layer's tree (for trees without a layer axis, such as
    PartitionSpecs): `num_dense` times the `dense_layers` one, then the `layers` one up to
    `num_layers` in all."""
    per_layer = []
    for group in ("dense_layers", "layers"):
        if group not in params:
            continue
        layers = params[group]
        if stacked:
            count = jax.tree.leaves(layers)[0].shape[0]
            per_layer += [jax.tree.map(lambda x, i=i: x[i], layers) for i in range(count)]
        else:
            per_layer += [layers] * (num_dense if group == "dense_layers" else num_layers - num_dense)
    rest = {k: v for k, v in params.items() if k not in ("dense_layers", "layers")}
    return {**rest, **{f"layer_{i}": layer for i, layer in enumerate(per_layer)}}


def is_spec(x) -> bool:
    return isinstance(x, PartitionSpec)
