"""Mixtral 8x7B's shape (Mistral AI, 2024) on a v5p-64 (32 chips on 8 hosts): seq 4096, batch 128
(0.5M tokens a step), bfloat16, splash attention, megablox grouped matmuls.

The model is the published one (HF `MixtralForCausalLM` defaults, mistralai/Mixtral-8x7B-v0.1's
config.json): 32 layers, d_model 4096, 32 query heads and 8 kv heads of 128, 8 SwiGLU experts of
14336 per layer, 2 per token (top-2 of a softmax, renormalised), vocabulary 32,000, untied
embeddings, RoPE theta 1e6, RMSNorm eps 1e-5, router auxiliary loss 0.001; 46.7B parameters,
12.9B active per token. Dropless; `model.grouped_matmul` "auto" is the Pallas megablox kernel on
the TPU.

FSDP over every chip (the experts' weights too, as a dense layer's: every device computes its own
tokens with all eight experts' weights gathered layer by layer), full rematerialisation. Not the
expert axis (MaxText's v5p Mixtral layout): planned with 2 of the 32 layers, `mesh.expert=8`
x `fsdp=4` peaks higher (33.2 GB against 26.0) and estimates 2.7x slower (0.85 s against 0.32
s), `expert=2 x fsdp=16` peaks lower (15.9 GB) but estimates 1.35x slower (0.43 s), because
maxlm's expert-parallel dispatch all-gathers the group's tokens and sizes each device's buffers
for every slot of the group (docs/moe.md#presets; planned before each device sorted its own
slots, which cut the fsdp=32 step's bytes by half). The whole preset plans 39.4 GB a chip.
CI compiles it for the slice with libtpu and checks it fits (tests/test_tpu_plan.py):

    python -m maxlm.bench plan --config=configs/mixtral_8x7b_v5p64.py --target=v5p-64

docs/tpus.md records the planned memory and the estimated step time.
"""

from maxlm.config import defaults


def get_config():
    c = defaults()
    c.name = "mixtral_8x7b_v5p64"
    c.platform = "tpu"
    c.num_devices = 32
    c.steps = 100000
    c.batch_size = 128
    c.seq_len = 4096
    c.model.num_layers = 32
    c.model.d_model = 4096
    c.model.num_heads = 32
    c.model.num_kv_heads = 8
    c.model.mlp_dim = 14336
    c.model.vocab_size = 32000
    c.model.rope_theta = 1e6
    c.model.dtype = "bfloat16"
    c.model.num_experts = 8
    c.model.experts_per_token = 2
    c.model.load_balance_weight = 0.001
    c.model.attention = "splash"
    c.model.remat = "full"
    c.mesh.data = 1
    c.mesh.fsdp = 32
    c.optim.lr = 3e-4
    c.optim.warmup_steps = 2000
    c.checkpoint.every_steps = 1000
    c.eval.every_steps = 1000
    return c
