"""Qwen3-30B-A3B's shape (Qwen, 2025) laid out for two hosts of 8 H100 80GB GPUs: seq 4096, batch
64 (0.26M tokens a step), bfloat16, cuDNN attention, tiled grouped matmuls. It fits: see below.

Qwen/Qwen3-30B-A3B's config.json gives 48 layers, d_model 2048,
32 query heads and 4 kv heads of 128 (attention wider than d_model), 128 SwiGLU experts of 768 per
layer, 8 per token (top-8 of a softmax, renormalised: norm_topk_prob), vocabulary 151,936, untied
embeddings, RoPE theta 1e6, RMSNorm eps 1e-6, router auxiliary loss 0.001 and an RMSNorm of each
head's q and k before RoPE (qk-norm); maxlm builds all of that: 30,532,122,624 parameters, the
published count, 3.35B active per token, and it exports as Qwen3MoeForCausalLM (docs/huggingface.md).

The layout: the 16 GPUs form one FSDP mesh over both hosts (each host a process; the experts'
weights sharded like a dense layer's and gathered layer by layer), full rematerialisation, the
loss's logits 512 positions at a time (the vocabulary is 152K), and maxlm's tiled grouped matmul
(`model.grouped_matmul=tiled`): each GPU sorts its own 131,072 token-slots and runs them through
256-row tiles, 32 tiles a loop step, so its buffers grow with its rows, not with rows x experts
as XLA's GPU ragged_dot does. It fits: 55.1 GB planned per GPU of 76.4 GB usable
(docs/moe.md#presets has the figures, and why ragged_dot cannot fit). A 4-layer cut of it ran on
one H200 at 12.4% MFU (docs/moe.md#compute); the whole of it has not run on GPUs yet. CI compiles a 2-layer cut of it for the two hosts (tests/test_gpu_plan.py); the whole of
it, deviceless (the flag: docs/moe.md#presets):

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
    c.model.grouped_matmul = "tiled"  # ragged_dot's GPU buffers grow with the experts: docs/moe.md#presets
    c.mesh.data = 1
    c.mesh.fsdp = 16
    c.optim.lr = 3e-4
    c.optim.warmup_steps = 2000
    c.checkpoint.every_steps = 1000
    c.eval.every_steps = 1000
    return c
