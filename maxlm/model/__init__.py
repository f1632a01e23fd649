"""The model: a decoder-only Transformer as pure functions of a config and a plain param pytree.

    from maxlm import model
    params = model.init_params(cfg.model, rng)
    loss, aux = model.loss_fn(cfg.model, params, batch)

`transformer.py` is the network (blocks, the pipelined forward, the losses); `weights.py` what
every layer module uses (parameters, weight matmuls); `attention.py` the attention backends and
packed mask, `attention_plan.py` which kernels run, `mla.py` latent attention, `positions.py` the
position encodings, `norms.py` the norms and where blocks put them, `layer_stack.py` local and
global layers, `mtp.py` multi-token prediction, `output_projection.py` the logits with their
backward, `param_counts.py` the parameter counts, `backward_order.py` the unrolled layers'
backward order. Concerns of their own: `moe/` (the mixture-of-experts MLP, its grouped matmuls,
expert parallelism, the router bias), `parallel/` (ring attention, Ulysses, the pipeline
schedules over `stage`) and `kernels/` (cuDNN, fp8, the tiled matmul). The model sees the mesh
only through the logical axis names it annotates and the context-parallel strategy it is given;
it knows nothing of optimizers or data files.
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
