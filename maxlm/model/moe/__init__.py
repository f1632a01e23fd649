"""A mixture-of-experts MLP: a router picks K of E SwiGLU experts per token (plus optional
always-on shared experts); it replaces the dense SwiGLU in MoE layers.

    out_BLD, stats = MoE(model_cfg).apply({"params": params}, x_BLD)

`route` turns router logits into each token's experts and gates (softmax: Mixtral/Qwen3;
sigmoid with a selection-only bias and group-limited routing: DeepSeek-V3). The experts then run
one of three ways, all the same numbers where nothing is dropped:
`dropless` (tokens sorted by expert, grouped matmuls: maxlm/model/moe/grouped_matmul.py), `with_capacity` (the
GShard/Switch dense dispatch, each expert takes at most C tokens of each sequence and drops the
rest) and `reference` (every expert on every token: the ground truth for the tests). With the
mesh's `expert` axis > 1 the first two run split over it (maxlm/model/moe/expert_parallel.py).

Shape suffixes: B batch, L length, D d_model, E experts, K experts per token (top-k),
F expert mlp hidden, S shared-expert hidden (shared_experts·F), T tokens (B·L), N token-slots (T·K),
C capacity (token-slots per expert and sequence), G router groups.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from maxlm.config.rules import LOAD_BALANCE, ROUTERS  # noqa: F401  (the choices, as moe.ROUTERS)

# submodules as modules: binding `grouped_matmul` the function here would hide the module of that name
from maxlm.model.moe import expert_parallel, grouped_matmul as gm, slot_order


def _dtype(model_cfg):
    # transformer.compute_dtype's value; this module cannot import transformer.py, which imports it
    return jnp.dtype(model_cfg.dtype)


def _param(module: nn.Module, name: str, std: float, shape, axes):
    init = nn.initializers.normal(stddev=std)
    return module.param(name, nn.with_logical_partitioning(init, axes), shape, jnp.float32)


# ----------------------------------------------------------------------------- routing


def _group_limited(cfg, select_TE):
    """`select_TE` with the experts outside each token's best `router_topk_groups` groups set to
    -inf (DeepSeek-V3: a group scores the sum of its two best experts)."""
    T, E = select_TE.shape
    G = cfg.router_groups
    per_group_TGX = select_TE.reshape(T, G, E // G)
    group_score_TG = jax.lax.top_k(per_group_TGX, min(2, E // G))[0].sum(axis=-1)
    best_groups_TX = jax.lax.top_k(group_score_TG, cfg.router_topk_groups)[1]
    eligible_TG = jax.nn.one_hot(best_groups_TX, G, dtype=jnp.bool_).any(axis=1)
    eligible_TE = jnp.repeat(eligible_TG, E // G, axis=1)
    return jnp.where(eligible_TE, select_TE, -jnp.inf)


def route(cfg, logits_TE, bias_E):
    """(experts_TK int32, gates_TK float32, stats) from router logits [T, E].

    softmax: probabilities over all E experts, the top K chosen; `router_renormalize` scales their
    gates to sum 1 (Qwen3; Mixtral's softmax over the top-K logits is the same thing).
    sigmoid: independent scores, the K chosen gates always normalised to sum 1 (DeepSeek-V3).
    Either way `bias_E` (load_balance=bias) and group-limited routing (`router_groups` > 0) only
    change which experts are chosen, never a gate's value; gates are then times `router_scale`.

    stats: `aux_loss` (Switch/GShard: E·Σ_e f_e·P_e, f_e the share of token-slots routed to e,
    P_e the mean probability of e, the normalised scores for sigmoid; 1.0 when balanced),
    `z_loss` (mean logsumexp(logits)²), `load_E` (slots per expert / their mean, E·f_e) and
    `probs_E` (P_e), the two means aux_loss multiplies (`whole_batch_stats`).
    """
    T, E = logits_TE.shape
    K = cfg.experts_per_token
    logits_TE = logits_TE.astype(jnp.float32)
    if cfg.router == "softmax":
        scores_TE = jax.nn.softmax(logits_TE, axis=-1)
        probs_TE = scores_TE
    else:
        scores_TE = jax.nn.sigmoid(logits_TE)
        probs_TE = scores_TE / scores_TE.sum(axis=-1, keepdims=True)
    select_TE = scores_TE + bias_E
    if cfg.router_groups:
        select_TE = _group_limited(cfg, select_TE)
    experts_TK = jax.lax.top_k(select_TE, K)[1].astype(jnp.int32)
    gates_TK = jnp.take_along_axis(scores_TE, experts_TK, axis=-1)
    if cfg.router == "sigmoid" or cfg.router_renormalize:
        gates_TK = gates_TK / gates_TK.sum(axis=-1, keepdims=True)
    gates_TK = gates_TK * cfg.router_scale

    slots_E = jnp.zeros((E,), jnp.float32).at[experts_TK.reshape(-1)].add(1.0)
    load_E, probs_E = slots_E * E / (T * K), probs_TE.mean(axis=0)
    z_loss = jnp.mean(jnp.square(jax.nn.logsumexp(logits_TE, axis=-1)))
    return experts_TK, gates_TK, {"aux_loss": _aux_loss(load_E, probs_E), "z_loss": z_loss, "load_E": load_E,
                                  "probs_E": probs_E}


def _aux_loss(load_E, probs_E):
    """E·Σ_e f_e·P_e, with load_E = E·f_e."""
    return jnp.sum(load_E * probs_E, axis=-1)


def whole_batch_stats(stats):
    """The router statistics of a batch from their averages over its equal-size microbatches (the
    pipeline's, [MoE layers, ...]). Each is a mean over the tokens (or token-slots), so the
    microbatches' average is the whole batch's, but for aux_loss, a product of two such means:
    it is recomputed from the whole batch's load_E and probs_E, so the loss and its gradients are
    the unsplit model's."""
    return {**stats, "aux_loss": _aux_loss(stats["load_E"], stats["probs_E"])}


def router_loss(cfg, stats):
    """What the router adds to the training objective: `load_balance_weight`·aux_loss (with
    load_balance=aux_loss) + `router_z_loss`·z_loss."""
    aux = cfg.load_balance_weight * stats["aux_loss"] if cfg.load_balance == "aux_loss" else 0.0
    return aux + cfg.router_z_loss * stats["z_loss"]


def updated_bias(bias_E, load_E, rate: float):
    """DeepSeek-V3's auxiliary-loss-free balancing: each expert's selection bias moves by `rate`
    towards the mean load, b_e += rate·sign(mean load − load_e). Run once per training step on the
    step's load (maxlm/model/moe/router_bias.py); gradients never reach the bias."""
    return bias_E + rate * jnp.sign(jnp.mean(load_E) - load_E)


# ----------------------------------------------------------------------------- the experts


def _swiglu(x, w_gate, w_up, w_down, spec_in: str, spec_out: str):
    hidden = nn.silu(jnp.einsum(spec_in, x, w_gate)) * jnp.einsum(spec_in, x, w_up)
    return jnp.einsum(spec_out, hidden, w_down)


def sorted_experts(x_ND, sizes_E, w_gate_EDF, w_up_EDF, w_down_EFD, dtype, backend: str = "auto"):
    """The experts' SwiGLU on rows sorted by expert, [N, D] in `dtype`: sizes_E[e] rows for expert
    e, in order (grouped matmuls on `backend`, model.grouped_matmul: no [E, N, ...] intermediate).
    Rows past sum(sizes_E) belong to no expert: their outputs are unspecified."""
    gate_NF = gm.grouped_matmul(x_ND, w_gate_EDF.astype(dtype), sizes_E, backend)
    up_NF = gm.grouped_matmul(x_ND, w_up_EDF.astype(dtype), sizes_E, backend)
    return gm.grouped_matmul(nn.silu(gate_NF) * up_NF, w_down_EFD.astype(dtype), sizes_E, backend)


def dropless(x_TD, experts_TK, gates_TK, w_gate_EDF, w_up_EDF, w_down_EFD, dtype, backend: str = "auto"):
    """Every token-slot computed, [T, D] in `dtype`: the T·K slots sorted by expert (a stable sort,
    so within an expert tokens keep their order), each expert's contiguous rows multiplied by its
    weights (`sorted_experts`), unsorted and summed with the gates (accumulated in float32)."""
    T, K = experts_TK.shape
    E = w_gate_EDF.shape[0]
    experts_N = experts_TK.reshape(-1)
    order_N = jnp.argsort(experts_N, stable=True)
    inverse_N = slot_order.inverse(order_N)
    sizes_E = jnp.bincount(experts_N, length=E).astype(jnp.int32)
    x_ND = slot_order.by_expert(x_TD.astype(dtype), order_N, inverse_N, K)
    y_ND = sorted_experts(x_ND, sizes_E, w_gate_EDF, w_up_EDF, w_down_EFD, dtype, backend)
    # unsort with the inverse permutation, then a plain weighted sum over the K slots
    y_TKD = slot_order.by_token(y_ND, order_N, inverse_N, K).reshape(T, K, -1)
    out_TD = jnp.einsum("tkd,tk->td", y_TKD, gates_TK.astype(dtype), preferred_element_type=jnp.float32)
    return out_TD.astype(dtype)


def capacity(cfg, seq_len: int) -> int:
    """C = ceil(capacity_factor·L·K/E): the most token-slots one expert takes from one sequence
    (capacity_factor > 0). Per sequence, as MaxText: which tokens drop depends on their own row
    alone, never on how the batch is split over devices or microbatches."""
    return math.ceil(cfg.capacity_factor * seq_len * cfg.experts_per_token / cfg.num_experts)


def dispatch_positions(experts_BLK, num_experts: int):
    """Each slot's place in its expert's queue for its sequence, [B, L, K] int32. Each row's queue
    is in priority order: every token's first choice (k=0) in token order, then every second
    choice, ... (GShard, MaxText), so a token loses its lower-ranked experts to capacity before
    anyone's top choice."""
    B, L, K = experts_BLK.shape
    experts_BN = experts_BLK.transpose(0, 2, 1).reshape(B, K * L)  # k-major within each row
    onehot_BNE = jax.nn.one_hot(experts_BN, num_experts, dtype=jnp.int32)
    position_BN = (jnp.cumsum(onehot_BNE, axis=1) * onehot_BNE).sum(axis=-1) - 1
    return position_BN.reshape(B, K, L).transpose(0, 2, 1)


def dropped_fraction(position_BLK, capacity: int):
    """The share of token-slots past their expert's capacity."""
    return (1.0 - (position_BLK < capacity).sum() / position_BLK.size).astype(jnp.float32)


def dispatch_masks(experts_BLK, gates_BLK, position_BLK, num_experts: int, capacity: int, dtype):
    """(dispatch_BLEC, combine_BLEC): the 0/1 mask putting each kept slot in its expert's buffer
    row, and the same times the slot's gate; a slot past `capacity` dispatches nowhere."""
    # one_hot of an out-of-range position is all zeros: a dropped slot dispatches nowhere
    slot_BLKC = jax.nn.one_hot(jnp.where(position_BLK < capacity, position_BLK, capacity), capacity, dtype=dtype)
    expert_BLKE = jax.nn.one_hot(experts_BLK, num_experts, dtype=dtype)
    # a token chooses an expert at most once, so summing its K slots keeps the mask 0/1
    dispatch_BLEC = jnp.einsum("blke,blkc->blec", expert_BLKE, slot_BLKC)
    combine_BLEC = jnp.einsum("blke,blkc,blk->blec", expert_BLKE, slot_BLKC, gates_BLK.astype(dtype))
    return dispatch_BLEC, combine_BLEC


def buffered_experts(x_BECD, w_gate_EDF, w_up_EDF, w_down_EFD, dtype):
    """Each expert's SwiGLU on its buffer rows: [B, E, C, D] → [B, E, C, D] in `dtype`."""
    return _swiglu(x_BECD, w_gate_EDF.astype(dtype), w_up_EDF.astype(dtype), w_down_EFD.astype(dtype),
                   "becd,edf->becf", "becf,efd->becd")


def with_capacity(x_BLD, experts_BLK, gates_BLK, w_gate_EDF, w_up_EDF, w_down_EFD, capacity: int, dtype):
    """([B, L, D] in `dtype`, dropped fraction): the dense dispatch/combine formulation (GShard).
    In each sequence, each expert takes its first `capacity` slots in queue order
    (`dispatch_positions`); a slot beyond that is dropped, its expert output 0 (the residual
    stream carries the token on)."""
    E = w_gate_EDF.shape[0]
    position_BLK = dispatch_positions(experts_BLK, E)
    dispatch_BLEC, combine_BLEC = dispatch_masks(experts_BLK, gates_BLK, position_BLK, E, capacity, dtype)
    x_BECD = jnp.einsum("blec,bld->becd", dispatch_BLEC, x_BLD.astype(dtype))
    y_BECD = buffered_experts(x_BECD, w_gate_EDF, w_up_EDF, w_down_EFD, dtype)
    out_BLD = jnp.einsum("blec,becd->bld", combine_BLEC, y_BECD, preferred_element_type=jnp.float32)
    return out_BLD.astype(dtype), dropped_fraction(position_BLK, capacity)


def _expert_parallel(x_BLD, experts_BLK, gates_BLK, weights, capacity: int, dtype, backend: str, dispatch: str):
    """`dropless` (capacity 0, on the grouped-matmul `backend`, the tokens exchanged by `dispatch`)
    or `with_capacity` with the experts split over the mesh's expert axis
    (maxlm/model/moe/expert_parallel.py), the same numbers: ([B, L, D] in `dtype`, dropped)."""
    # in the compute dtype before the exchange: the weights' FSDP gathers (and their gradients'
    # reduce-scatters) at the shard_map's edge then move bfloat16, not the float32 params
    weights = tuple(w.astype(dtype) for w in weights)
    if not capacity:
        out_BLD = expert_parallel.dropless(functools.partial(sorted_experts, backend=backend), x_BLD, experts_BLK,
                                           gates_BLK, *weights, dtype, dispatch)
        return out_BLD, jnp.zeros((), jnp.float32)
    position_BLK = dispatch_positions(experts_BLK, weights[0].shape[0])  # whole sequences' queues: GSPMD
    out_BLD = expert_parallel.with_capacity(dispatch_masks, buffered_experts, x_BLD, experts_BLK, gates_BLK,
                                            position_BLK, *weights, capacity, dtype)
    return out_BLD, dropped_fraction(position_BLK, capacity)


def reference(x_TD, experts_TK, gates_TK, w_gate_EDF, w_up_EDF, w_down_EFD, dtype):
    """Every expert on every token ([E, T, F]), weighted by the chosen experts' gates (0 for the
    others): E/K times the work, no sorting or dispatch to get wrong. The tests' ground truth."""
    E = w_gate_EDF.shape[0]
    gates_TE = jnp.einsum("tke,tk->te", jax.nn.one_hot(experts_TK, E, dtype=jnp.float32), gates_TK)
    y_ETD = _swiglu(x_TD.astype(dtype), w_gate_EDF.astype(dtype), w_up_EDF.astype(dtype),
                    w_down_EFD.astype(dtype), "td,edf->etf", "etf,efd->etd")
    return jnp.einsum("te,etd->td", gates_TE.astype(dtype), y_ETD, preferred_element_type=jnp.float32).astype(dtype)


# ----------------------------------------------------------------------------- the layer


class MoE(nn.Module):
    """The MoE MLP of one layer: x [B, L, D] → (out [B, L, D], stats).

    stats: `route`'s (aux_loss, z_loss, load_E, probs_E) and `dropped`, the share of token-slots over
    capacity (0.0 when dropless). With load_balance=bias the selection bias is the param
    `router_bias` [E] (Hugging Face DeepSeek-V3's `e_score_correction_bias`): a weight, so eval,
    generation and checkpoints carry it, but one the optimizer never moves (its gradient is
    stopped here); the training step sets it (`updated_bias`, maxlm/model/moe/router_bias.py).
    """

    cfg: Any

    @nn.compact
    def __call__(self, x_BLD):
        cfg = self.cfg
        dtype = _dtype(cfg)
        B, L, D = x_BLD.shape
        E, F, S = cfg.num_experts, cfg.expert_mlp_dim, cfg.shared_experts * cfg.expert_mlp_dim
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)  # as SwiGLU: residual writes shrink with depth
        router_DE = _param(self, "router", cfg.init_std, (D, E), ("embed", None))
        w_gate_EDF = _param(self, "w_gate", cfg.init_std, (E, D, F), ("experts", "embed", "mlp"))
        w_up_EDF = _param(self, "w_up", cfg.init_std, (E, D, F), ("experts", "embed", "mlp"))
        w_down_EFD = _param(self, "w_down", out_std, (E, F, D), ("experts", "mlp", "embed"))
        if cfg.load_balance == "bias":  # expert dim unsplit, as the router's: top-k sees every expert
            bias_E = jax.lax.stop_gradient(self.param(
                "router_bias", nn.with_logical_partitioning(nn.initializers.zeros, (None,)), (E,), jnp.float32))
        else:  # selection by the router alone
            bias_E = jnp.zeros((E,), jnp.float32)

        x_TD = x_BLD.reshape(B * L, D)
        # router in full float32 (not TF32/bf16 passes either; it is D·E a token): top-k between
        # near-equal logits must not flip with the compute dtype or the backend
        logits_TE = jnp.einsum("td,de->te", x_TD.astype(jnp.float32), router_DE, precision="highest")
        experts_TK, gates_TK, stats = route(cfg, logits_TE, bias_E)
        experts_BLK, gates_BLK = experts_TK.reshape(B, L, -1), gates_TK.reshape(B, L, -1)
        weights = (w_gate_EDF, w_up_EDF, w_down_EFD)
        C = capacity(cfg, L) if cfg.capacity_factor else 0
        # init only needs the parameters' shapes, and may run off the target (a plan from a CPU)
        backend = "ragged_dot" if self.is_initializing() else cfg.grouped_matmul
        dispatch = "all_gather" if self.is_initializing() else expert_parallel.dispatch_backend(cfg.expert_dispatch)
        if expert_parallel.active(x_BLD, dropless=not C):  # in shard_map: local sorts; tokens travel to split experts
            out_BLD, dropped = _expert_parallel(x_BLD, experts_BLK, gates_BLK, weights, C, dtype, backend, dispatch)
            out_TD = out_BLD.reshape(B * L, D)
        elif C:
            out_BLD, dropped = with_capacity(x_BLD, experts_BLK, gates_BLK, *weights, C, dtype)
            out_TD = out_BLD.reshape(B * L, D)
        else:
            out_TD, dropped = dropless(x_TD, experts_TK, gates_TK, *weights, dtype, backend), jnp.zeros((), jnp.float32)
        if S:
            w_gate_DS = _param(self, "shared_gate", cfg.init_std, (D, S), ("embed", "mlp"))
            w_up_DS = _param(self, "shared_up", cfg.init_std, (D, S), ("embed", "mlp"))
            w_down_SD = _param(self, "shared_down", out_std, (S, D), ("mlp", "embed"))
            out_TD = out_TD + _swiglu(x_TD.astype(dtype), w_gate_DS.astype(dtype), w_up_DS.astype(dtype),
                                      w_down_SD.astype(dtype), "td,ds->ts", "ts,sd->td")
        out_BLD = checkpoint_name(out_TD.reshape(B, L, D), "mlp_out")  # as SwiGLU's, for the remat policies
        return out_BLD, {**stats, "dropped": dropped}


def kernels(cfg, platform: str | None = None) -> dict:
    """What the dropless layer runs on `platform` (default: the target's): `grouped_matmul` and
    `expert_dispatch` resolved, for the run's log line and the plan's fields; {} for a dense model
    or one with a capacity."""
    if not cfg.num_experts or cfg.capacity_factor:
        return {}
    return {"grouped_matmul": gm.grouped_matmul_backend(cfg.grouped_matmul, _dtype(cfg), platform),
            "expert_dispatch": expert_parallel.dispatch_backend(cfg.expert_dispatch, platform)}


def dense_layers(cfg) -> int:
    """The layers whose MLP is the dense SwiGLU: the first `first_dense_layers` of an MoE model,
    every layer of a dense one; the layers above them are MoE layers."""
    return cfg.first_dense_layers if cfg.num_experts else cfg.num_layers


# the router statistics the objective's aux carries for the metrics (transformer.loss_fn)
ROUTER_METRICS = ("aux_loss", "z_loss", "dropped", "load_max")


def expert_params(cfg) -> int:
    """Every parameter of one MoE layer: router (and its bias), all E experts, shared experts."""
    D, E, F, S = cfg.d_model, cfg.num_experts, cfg.expert_mlp_dim, cfg.shared_experts * cfg.expert_mlp_dim
    return D * E + _router_bias(cfg) + E * 3 * D * F + 3 * D * S


def active_params(cfg) -> int:
    """The parameters one token uses in one MoE layer: router (and its bias), its K experts, shared
    experts (what its FLOPs scale with: 6 × this per token for a training step's matmuls)."""
    D, E, F, S = cfg.d_model, cfg.num_experts, cfg.expert_mlp_dim, cfg.shared_experts * cfg.expert_mlp_dim
    return D * E + _router_bias(cfg) + cfg.experts_per_token * 3 * D * F + 3 * D * S


def _router_bias(cfg) -> int:
    return cfg.num_experts if cfg.load_balance == "bias" else 0
