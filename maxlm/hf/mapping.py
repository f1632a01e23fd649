"""Hugging Face ↔ maxlm: the weight mapping (the class and config.json are chosen in
`maxlm/hf/architectures.py`, the files read and written in `maxlm/hf/files.py`).

maxlm's layers are Llama's (pre-norm RMSNorm, RoPE, SwiGLU, grouped-query attention, no biases),
OLMo 2's and 3's (the norms after each sublayer, the whole projections' qk-norm), Gemma's (norms
before and after each sublayer, GeGLU) or GPT-2's, so a run converts to the transformers class
`architectures.architecture` picks without custom code:

    maxlm parameter                      HF tensor (`model.layers.{i}.` prefix for a layer's)
    embed            [V, D]              model.embed_tokens.weight        [V, D]
    head             [D, V]              lm_head.weight                   [V, D]  (absent when tied)
    final_norm.scale [D]                 model.norm.weight                [D]
    attn_norm.scale  [D]                 input_layernorm.weight           [D]
    attn.wq          [D, H, Dh]          self_attn.q_proj.weight          [H·Dh, D]
    attn.wk, wv      [D, K, Dh]          self_attn.{k,v}_proj.weight      [K·Dh, D]
    attn.wo          [H, Dh, D]          self_attn.o_proj.weight          [D, H·Dh]
    attn.q_norm.scale, k_norm.scale [Dh] self_attn.{q,k}_norm.weight      [Dh]  (Qwen3: qk_norm=per_head)
                         [H, Dh], [K, Dh]                                 [H·Dh], [K·Dh]  (OLMo 2: full)
    mlp_norm.scale   [D]                 post_attention_layernorm.weight  [D]
  OLMo 2's block (norm_placement=post) has instead, after each sublayer (`BLOCK_NORMS`):
    attn_out_norm.scale [D]              post_attention_layernorm.weight  [D]
    mlp_out_norm.scale  [D]              post_feedforward_layernorm.weight [D]
  and Gemma's (sandwich) both, its norm before the MLP being pre_feedforward_layernorm.weight
    mlp.w_gate, w_up [D, F]              mlp.{gate,up}_proj.weight        [F, D]
    mlp.w_down       [F, D]              mlp.down_proj.weight             [D, F]
  an MoE layer (Mixtral: B = block_sparse_moe, gate/up/down = w1/w3/w2; Qwen3-MoE: B = mlp,
  gate/up/down = gate_proj/up_proj/down_proj; its dense layers, mlp_only_layers, are as above):
    mlp.router       [D, E]              B.gate.weight                    [E, D]
    mlp.w_gate, w_up [E, D, F]           B.experts.{e}.{gate,up}.weight   [F, D]  (one per expert)
    mlp.w_down       [E, F, D]           B.experts.{e}.down.weight        [D, F]

The experts are written one tensor each, the layout of published Mixtral and Qwen3-MoE checkpoints
and of transformers 4.x; transformers 5 fuses them into `experts.gate_up_proj` as it loads (and splits
them again when it saves). A layer's parameters are `layers` (scanned: a leading layer axis; an
MoE model's dense layers below it are `dense_layers`) or `layer_{i}` (unrolled). RoPE needs no
permutation: maxlm rotates the pairs (i, i + Dh/2), which is what HF's `rotate_half` does (HF
checkpoints are stored in that layout; the tests compare logits with transformers').

Each HF tensor is described as its maxlm array seen through a reshape: the HF tensor's axes are
groups of maxlm dims (`q_proj`: [(H, Dh), (D,)]) and `perm` orders those dims as maxlm stores
them. A `Source` adds the leading axes of the maxlm array that index tensors (a scanned group's
layers, an MoE layer's experts). `to_hf` converts one tensor's array for export; `read_block`
reads only the rows and columns of an HF tensor that one device's shard needs, for import.
"""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import numpy as np

from maxlm.hf.architectures import DEEPSEEK_V3, GPT2, Arch, architecture
from maxlm.model import layer_groups, moe


class Tensor(NamedTuple):
    """How one HF tensor relates to a maxlm array (of one layer and one expert, for those)."""

    groups: tuple[tuple[int, ...], ...]  # the HF tensor's axes, each a group of maxlm-sized dims
    perm: tuple[int, ...]  # maxlm's array = the grouped dims (flattened) transposed by `perm`
    part: tuple[int, int] = (0, 1)  # (k, n): the array is the k-th of n equal slices of the last axis
    #                                 (GPT-2's fused query, key and value projection)
    # HF holds the last `interleaved` entries of maxlm's last axis (whole in every sharding) as
    # interleaved pairs (x0, x1), (x2, x3), ... where maxlm holds them as halves: DeepSeek's RoPE
    # dims, which transformers de-interleaves as it rotates (`rope_interleave`) and maxlm at import
    interleaved: int = 0

    @property
    def part_shape(self) -> tuple[int, ...]:
        """The array's share of the HF tensor (`to_hf`'s result)."""
        return tuple(math.prod(g) for g in self.groups)

    @property
    def hf_shape(self) -> tuple[int, ...]:
        *rest, last = self.part_shape
        return (*rest, last * self.part[1])


class Source(NamedTuple):
    """One maxlm parameter and the HF tensors it holds."""

    keys: tuple[str, ...]  # its path in the params tree
    name: str  # the HF name; `{e}` for the expert axis
    tensor: Tensor
    layers: range | None = None  # a scanned group's layers (its leading axis; `{i}` in `name`)
    experts: int = 0  # the experts of an `{e}` axis (after the layer axis)

    @property
    def leading(self) -> tuple[int, ...]:
        """The sizes of the array's axes that index HF tensors."""
        layers = () if self.layers is None else (len(self.layers),)
        return layers + ((self.experts,) if self.experts else ())

    def hf_name(self, index: tuple[int, ...]) -> str:
        """The HF tensor at `index` along `leading`."""
        layer = (self.layers[index[0]],) if self.layers is not None else ()
        expert = index[-1:] if self.experts else ()
        return self.name.format(i=layer[0] if layer else None, e=expert[0] if expert else None)


def _mlp_tensors(m, arch: Arch, experts: bool) -> dict[tuple[str, ...], tuple[str, Tensor]]:
    """A layer's MLP: the dense SwiGLU, or the MoE layer's router and experts (DeepSeek-V3's with
    its selection bias and shared experts)."""
    D, F = m.d_model, m.mlp_dim
    if not experts:
        return {("mlp", "w_gate"): ("mlp.gate_proj.weight", Tensor(((F,), (D,)), (1, 0))),
                ("mlp", "w_up"): ("mlp.up_proj.weight", Tensor(((F,), (D,)), (1, 0))),
                ("mlp", "w_down"): ("mlp.down_proj.weight", Tensor(((D,), (F,)), (1, 0)))}
    E, F = m.num_experts, m.expert_mlp_dim
    gate, up, down = (f"{arch.moe_block}.experts.{{e}}.{w}.weight" for w in arch.expert_weights)
    out = {("mlp", "router"): (f"{arch.moe_block}.gate.weight", Tensor(((E,), (D,)), (1, 0))),
           ("mlp", "w_gate"): (gate, Tensor(((F,), (D,)), (1, 0))),
           ("mlp", "w_up"): (up, Tensor(((F,), (D,)), (1, 0))),
           ("mlp", "w_down"): (down, Tensor(((D,), (F,)), (1, 0)))}
    if arch is DEEPSEEK_V3:  # shared experts: one SwiGLU of shared_experts x expert_mlp_dim
        S = m.shared_experts * F
        out.update({("mlp", "router_bias"): ("mlp.gate.e_score_correction_bias", Tensor(((E,),), (0,))),
                    ("mlp", "shared_gate"): ("mlp.shared_experts.gate_proj.weight", Tensor(((S,), (D,)), (1, 0))),
                    ("mlp", "shared_up"): ("mlp.shared_experts.up_proj.weight", Tensor(((S,), (D,)), (1, 0))),
                    ("mlp", "shared_down"): ("mlp.shared_experts.down_proj.weight", Tensor(((D,), (S,)), (1, 0)))})
    return out


def _latent_attention_tensors(m) -> dict[tuple[str, ...], tuple[str, Tensor]]:
    """DeepSeek-V3's multi-head latent attention (maxlm/model/mla.py), its RoPE dims interleaved in
    HF's query and latent projections."""
    D, H, N, R, V, C, Q = (m.d_model, m.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim,
                           m.kv_lora_rank, m.q_lora_rank)
    if Q:
        queries = {("attn", "wq_a"): ("self_attn.q_a_proj.weight", Tensor(((Q,), (D,)), (1, 0))),
                   ("attn", "q_a_norm", "scale"): ("self_attn.q_a_layernorm.weight", Tensor(((Q,),), (0,))),
                   ("attn", "wq_b"): ("self_attn.q_b_proj.weight", Tensor(((H, N + R), (Q,)), (2, 0, 1), interleaved=R))}
    else:
        queries = {("attn", "wq"): ("self_attn.q_proj.weight", Tensor(((H, N + R), (D,)), (2, 0, 1), interleaved=R))}
    return {**queries,
            ("attn", "wkv_a"): ("self_attn.kv_a_proj_with_mqa.weight", Tensor(((C + R,), (D,)), (1, 0), interleaved=R)),
            ("attn", "kv_a_norm", "scale"): ("self_attn.kv_a_layernorm.weight", Tensor(((C,),), (0,))),
            ("attn", "wkv_b"): ("self_attn.kv_b_proj.weight", Tensor(((H, N + V), (C,)), (2, 0, 1))),
            ("attn", "wo"): ("self_attn.o_proj.weight", Tensor(((D,), (H, V)), (1, 2, 0)))}


def _gpt2_layer_tensors(m) -> dict[tuple[str, ...], tuple[str, Tensor]]:
    """GPT-2's block: Conv1D weights stored [in, out], the query, key and value projections fused
    into `c_attn` as its three slices of the output axis, LayerNorms with biases."""
    D, H, Dh, F = m.d_model, m.num_heads, m.head_dim, m.mlp_dim
    out = {}
    for k, name in enumerate("qkv"):
        out[("attn", f"w{name}")] = ("attn.c_attn.weight", Tensor(((D,), (H, Dh)), (0, 1, 2), (k, 3)))
        out[("attn", f"b{name}")] = ("attn.c_attn.bias", Tensor(((H, Dh),), (0, 1), (k, 3)))
    for norm, hf in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
        out[(norm, "scale")], out[(norm, "bias")] = (f"{hf}.weight", Tensor(((D,),), (0,))), (f"{hf}.bias", Tensor(((D,),), (0,)))
    return {**out,
            ("attn", "wo"): ("attn.c_proj.weight", Tensor(((H, Dh), (D,)), (0, 1, 2))),
            ("attn", "bo"): ("attn.c_proj.bias", Tensor(((D,),), (0,))),
            ("mlp", "w_up"): ("mlp.c_fc.weight", Tensor(((D,), (F,)), (0, 1))),
            ("mlp", "b_up"): ("mlp.c_fc.bias", Tensor(((F,),), (0,))),
            ("mlp", "w_down"): ("mlp.c_proj.weight", Tensor(((F,), (D,)), (0, 1))),
            ("mlp", "b_down"): ("mlp.c_proj.bias", Tensor(((D,),), (0,)))}


def _layer_tensors(m, experts: bool) -> dict[tuple[str, ...], tuple[str, Tensor]]:
    """A block's parameters (path within the block) → (HF name within the layer, Tensor);
    `experts`: an MoE layer's."""
    D, H, K, Dh = m.d_model, m.num_heads, m.num_kv_heads, m.head_dim
    arch = architecture(m, "the Hugging Face mapping")
    if arch is GPT2:
        return _gpt2_layer_tensors(m)
    if arch is DEEPSEEK_V3:
        norm = Tensor(((D,),), (0,))
        return {**{(name, "scale"): (hf_name, norm) for name, hf_name in BLOCK_NORMS["pre"].items()},
                **_latent_attention_tensors(m), **_mlp_tensors(m, arch, experts)}
    # per_head: one [Dh] scale for all heads; full: the whole projection's, [H·Dh] and [K·Dh]
    q_dims, k_dims = ((Dh,), (Dh,)) if arch.qk_norm == "per_head" else ((H, Dh), (K, Dh))
    qk_norms = {("attn", "q_norm", "scale"): ("self_attn.q_norm.weight", Tensor((q_dims,), tuple(range(len(q_dims))))),
                ("attn", "k_norm", "scale"): ("self_attn.k_norm.weight", Tensor((k_dims,), tuple(range(len(k_dims)))))}
    norm = Tensor(((D,),), (0,))
    return {
        **{(name, "scale"): (hf_name, norm) for name, hf_name in BLOCK_NORMS[arch.norm_placement].items()},
        ("attn", "wq"): ("self_attn.q_proj.weight", Tensor(((H, Dh), (D,)), (2, 0, 1))),
        ("attn", "wk"): ("self_attn.k_proj.weight", Tensor(((K, Dh), (D,)), (2, 0, 1))),
        ("attn", "wv"): ("self_attn.v_proj.weight", Tensor(((K, Dh), (D,)), (2, 0, 1))),
        ("attn", "wo"): ("self_attn.o_proj.weight", Tensor(((D,), (H, Dh)), (1, 2, 0))),
        **(qk_norms if arch.qk_norm != "none" else {}),
        **_mlp_tensors(m, arch, experts),
    }


# A block's norms (maxlm/model/norms.py `norms_around`) by model.norm_placement → their HF
# names: `post_attention_layernorm` is Llama's norm before the MLP, OLMo 2's and Gemma's after
# attention. Gemma's norm weights are w of its 1 + w, as maxlm's with model.norm_plus_one.
BLOCK_NORMS = {
    "pre": {"attn_norm": "input_layernorm.weight", "mlp_norm": "post_attention_layernorm.weight"},
    "post": {"attn_out_norm": "post_attention_layernorm.weight", "mlp_out_norm": "post_feedforward_layernorm.weight"},
    "sandwich": {"attn_norm": "input_layernorm.weight", "attn_out_norm": "post_attention_layernorm.weight",
                 "mlp_norm": "pre_feedforward_layernorm.weight", "mlp_out_norm": "post_feedforward_layernorm.weight"},
}


def _top_tensors(m) -> dict[tuple[str, ...], tuple[str, Tensor]]:
    """maxlm's parameters outside the blocks → (HF name, Tensor)."""
    D, V = m.d_model, m.vocab_size
    if architecture(m, "the Hugging Face mapping") is GPT2:
        out = {("embed",): ("transformer.wte.weight", Tensor(((V,), (D,)), (0, 1))),
               ("pos_embed",): ("transformer.wpe.weight", Tensor(((m.max_positions,), (D,)), (0, 1))),
               ("final_norm", "scale"): ("transformer.ln_f.weight", Tensor(((D,),), (0,))),
               ("final_norm", "bias"): ("transformer.ln_f.bias", Tensor(((D,),), (0,)))}
    else:
        out = {("embed",): ("model.embed_tokens.weight", Tensor(((V,), (D,)), (0, 1))),
               ("final_norm", "scale"): ("model.norm.weight", Tensor(((D,),), (0,)))}
    if not m.tie_embeddings:
        out[("head",)] = ("lm_head.weight", Tensor(((V,), (D,)), (1, 0)))
    return out


def _is_moe_layer(m, i: int) -> bool:
    return bool(m.num_experts) and i >= moe.dense_layers(m)


def _layer_prefix(m) -> str:
    """Layer i's tensors' prefix, `{i}` for i."""
    return "transformer.h.{i}." if architecture(m, "the Hugging Face mapping") is GPT2 else "model.layers.{i}."


def hf_tensors(m) -> dict[str, Tensor]:
    """Every HF tensor name of a model config, in file order, with its Tensor."""
    top = _top_tensors(m)
    out = {top[("embed",)][0]: top[("embed",)][1]}
    for i in range(m.num_layers):
        for name, tensor in _layer_tensors(m, _is_moe_layer(m, i)).values():
            for e in range(m.num_experts) if "{e}" in name else [None]:
                out[_layer_prefix(m).format(i=i) + name.format(e=e)] = tensor
    for key, (name, tensor) in top.items():
        if key != ("embed",):
            out[name] = tensor
    return out


def sources(m, params) -> list[Source]:
    """The `Source` of each leaf of a params tree (scanned or unrolled) that goes to HF."""
    out = [Source(path, name, tensor) for path, (name, tensor) in _top_tensors(m).items()]

    def layer_sources(group: str, layers: range | None, experts: bool, prefix: str):
        for path, (name, tensor) in _layer_tensors(m, experts).items():
            per_expert = m.num_experts if "{e}" in name else 0
            out.append(Source((group, *path), prefix + name, tensor, layers, per_expert))

    if any(group in params for group, _, _ in layer_groups(m)):  # scanned
        first = 0
        for group, count, experts in layer_groups(m):
            layer_sources(group, range(first, first + count), experts, _layer_prefix(m))
            first += count
    else:
        for i in range(m.num_layers):
            layer_sources(f"layer_{i}", None, _is_moe_layer(m, i), _layer_prefix(m).format(i=i))
    return out


def hf_index(source: Source) -> list[tuple[tuple[int, ...], str]]:
    """[(index along `source.leading`, HF name)] of every HF tensor a source holds."""
    return [(index, source.hf_name(index)) for index in itertools.product(*map(range, source.leading))]


def _interleave(array, tail: int):
    """maxlm's last axis with its last `tail` entries as HF holds them: halves → pairs."""
    rest, halves = array[..., :-tail], array[..., -tail:]
    pairs = np.stack([halves[..., :tail // 2], halves[..., tail // 2:]], axis=-1).reshape(*halves.shape[:-1], tail)
    return np.concatenate([rest, pairs], axis=-1)


def _deinterleave(array, tail: int):
    """`_interleave`'s inverse: HF's pairs → maxlm's halves."""
    rest, pairs = array[..., :-tail], array[..., -tail:]
    return np.concatenate([rest, pairs[..., 0::2], pairs[..., 1::2]], axis=-1)


def to_hf(array, tensor: Tensor) -> np.ndarray:
    """One maxlm array (one layer's) → the HF tensor (numpy, C-contiguous)."""
    array = np.asarray(array)
    if tensor.interleaved:
        array = _interleave(array, tensor.interleaved)
    nd = array.transpose(np.argsort(tensor.perm))
    return np.ascontiguousarray(nd.reshape(tensor.part_shape))


def read_block(hf_slice, tensor: Tensor, index: tuple[slice, ...]) -> np.ndarray:
    """The block `index` (slices of maxlm's array, as jax.make_array_from_callback asks for them)
    of the HF tensor `hf_slice` (a safetensors slice, or any array), read without reading more
    than the block's rows × columns: each HF axis is read over the range its group's leading dim
    needs (the trailing dims of a group are whole in maxlm's shardings, e.g. head_dim)."""
    nd_shape = [n for group in tensor.groups for n in group]
    nd_index = [slice(None)] * len(nd_shape)
    for maxlm_axis, nd_axis in enumerate(tensor.perm):
        nd_index[nd_axis] = index[maxlm_axis]
    ranges = []
    for s, n in zip(nd_index, nd_shape):
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError(f"strided shard index {s} is not supported")
        ranges.append((start, stop))
    hf_index, block_shape, within = [], [], []
    k = 0
    for group in tensor.groups:
        inner = math.prod(group[1:])
        (start, stop), rest = ranges[k], ranges[k + 1:k + len(group)]
        hf_index.append(slice(start * inner, stop * inner))
        block_shape += [stop - start, *group[1:]]
        within += [slice(None), *(slice(a, b) for a, b in rest)]
        k += len(group)
    offset = tensor.part[0] * tensor.part_shape[-1]  # this part's place along a fused last axis
    hf_index[-1] = slice(hf_index[-1].start + offset, hf_index[-1].stop + offset)
    block = np.asarray(hf_slice[tuple(hf_index)]).reshape(block_shape)[tuple(within)].transpose(tensor.perm)
    if tensor.interleaved:
        n = nd_shape[tensor.perm[-1]]  # maxlm's last axis
        if index[-1].indices(n)[:2] != (0, n):
            raise ValueError(f"the interleaved RoPE dims need maxlm's last axis whole, got {index[-1]} of {n}")
        block = _deinterleave(block, tensor.interleaved)
    return block
