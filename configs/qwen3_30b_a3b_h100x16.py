"""Qwen3-30B-A3B's shape (Qwen, 2025) laid out for two hosts of 8 H100 80GB GPUs: seq 4096, batch
64 (0.26M tokens a step), bfloat16, cuDNN attention, ragged_dot grouped matmuls. It does NOT fit
yet: see below.

Qwen/Qwen3-30B-A3B's config.json gives 48 layers, d_model 2048,
32 query heads and 4 kv heads of 128 (attention wider than d_model), 128 SwiGLU experts of 768 per
layer, 8 per token (top-8 of a softmax, renormalised: norm_topk_prob), vocabulary 151,936, untied
embeddings, RoPE theta 1e6, RMSNorm eps 1e-6, router auxiliary loss 0.001 and an RMSNorm of each
head's q and k before RoPE (qk-norm); maxlm builds all of that: 30,532,122,624 parameters, the
published count, 3.35B active per token, and it exports as Qwen3MoeForCausalLM (docs/huggingface.md).

The layout: expert parallelism, `mesh.expert=8` (each GPU holds 16 of the 128 experts and runs
them on the slots its host's 8 GPUs route to them: the group's exchange stays on NVLink) times
`fsdp=2` over the two hosts (the rest of the weights, and the experts' d_model, split in two;
each host a process), 4 microbatches of 16 sequences, full
rematerialisation, the loss's logits 512 positions at a time (the vocabulary is 152K).
Parameters and Adam state take 31.0 GB per GPU. Dropless, it does NOT fit: on GPUs
XLA compiles ragged_dot into copies of its rows for each local expert ([16 experts, 262,144
slots, 2048] bf16, 17.2 GB each), so the step plans 120 GB per GPU (FSDP over the 16 GPUs:
1.4 TB); with `model.capacity_factor=1.25` (GShard's dispatch, no ragged_dot) and no
microbatches it plans 62 GB and fits (docs/moe.md#presets has the figures). CI compiles a
2-layer cut of it for the two hosts (tests/test_gpu_plan.py); the whole of it, deviceless (the
flag: docs/moe.md#presets):

    XLA_FLAGS=--xla_gpu_enable_cub_radix_sort=false \
        python -m maxlm.bench plan --config=configs/qwen3_30b_a3b_h100x16.py --target=h100x16
"""

from maxlm.config import defaults


def get_config():
    c = defaults()
    c.name = "qwen3_30b_a3b_h100x16"
    c.platform = "gpu"
    c.num_devices = 16
    c.steps = 100000
    c.batch_size = 64
    c.seq_len = 4096
    c.model.num_layers = 48
    c.model.d_model = 2048
    c.model.num_heads = 32
    c.model.num_kv_heads = 4
    c.model.head_dim = 128
    c.model.mlp_dim = 6144  # unused: every layer is an MoE layer
    c.model.vocab_size = 151936
    c.model.rope_theta = 1e6
    c.model.norm_eps = 1e-6
    c.model.qk_norm = "per_head"
    c.model.dtype = "bfloat16"
    c.model.num_experts = 128
    c.model.experts_per_token = 8
    c.model.expert_mlp_dim = 768
    c.model.router_renormalize = True
    c.model.load_balance_weight = 0.001
    c.model.remat = "full"
    c.model.logits_chunk_size = 512
    c.mesh.data = 1
    c.mesh.fsdp = 2
    c.mesh.expert = 8
    c.optim.grad_accum_steps = 4
    c.optim.lr = 3e-4
    c.optim.warmup_steps = 2000
    c.checkpoint.every_steps = 1000
    c.eval.every_steps = 1000
    return c
