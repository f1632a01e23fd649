"""The model: a decoder-only Transformer as pure functions of a config and a plain param pytree.

    from maxlm import model
    params = model.init_params(cfg.model, rng)
    loss, aux = model.loss_fn(cfg.model, params, batch)

`transformer.py` is the network (blocks, the pipelined forward, the losses), `pipeline.py` its
GPipe and circular schedules over the mesh's `stage` axis; `moe.py` the mixture-of-experts MLP, `balance.py`
its selection biases across the layers; `mtp.py` the multi-token prediction modules;
`norms.py` RMSNorm and where blocks put it; `attention.py` the attention backends and packed mask,
`cudnn.py` cuDNN's calls batched under vmap, `ring_attention.py`, `ring_blocks.py`,
`zigzag.py` and `ulysses.py` the context-parallel strategies, `attention_plan.py` which kernels
run, `positions.py` the position encodings,
`counts.py` the parameter counts, `head.py` the output projection, `fp8.py` float8 matmuls, `backward_order.py` the unrolled
layers' backward order.
Nothing here knows about meshes, optimizers or data files.
"""

from maxlm.model.moe import MoE
from maxlm.model.norms import LayerNorm, RMSNorm, block_norm, norms_around, placed_norms, qk_norm, residual
from maxlm.model.parallel.pipeline import bubble_fraction, pipeline_stages
from maxlm.model.param_counts import active_params, count_params
from maxlm.model.transformer import (
    MLP,
    REMAT_POLICIES,
    Attention,
    Batch,
    Block,
    Transformer,
    apply,
    compute_dtype,
    embed,
    forward,
    head_weights,
    hidden_states,
    init_params,
    is_spec,
    layer_groups,
    loss_fn,
    microbatches,
    output_logits,
    param_logical_specs,
    pipelined_forward,
    stack_layers,
    token_losses,
    unstack_layers,
    weight_matmul,
)

__all__ = [
    "REMAT_POLICIES",
    "Attention",
    "Batch",
    "Block",
    "MoE",
    "LayerNorm",
    "RMSNorm",
    "MLP",
    "Transformer",
    "active_params",
    "apply",
    "block_norm",
    "bubble_fraction",
    "compute_dtype",
    "count_params",
    "embed",
    "forward",
    "head_weights",
    "hidden_states",
    "init_params",
    "is_spec",
    "layer_groups",
    "loss_fn",
    "microbatches",
    "norms_around",
    "output_logits",
    "placed_norms",
    "param_logical_specs",
    "pipeline_stages",
    "pipelined_forward",
    "qk_norm",
    "residual",
    "stack_layers",
    "token_losses",
    "unstack_layers",
    "weight_matmul",
]
