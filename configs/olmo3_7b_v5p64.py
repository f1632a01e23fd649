"""OLMo 3 7B (Ai2, Olmo-3-1025-7B): 7,298,011,136 parameters, on a v5p-64 (32 chips on 8 hosts).

32 layers, d_model 4096, 32 heads of 128 (no grouping), SwiGLU 11008, vocabulary 100,278, untied
embeddings, RoPE theta 500,000, RMSNorm eps 1e-6. OLMo 2's block (norms on each sublayer's output,
qk-norm over the whole projection) with three local layers to one global
(`model.layer_pattern=LLLG`, a 4096-token window): at its pretraining length of 8192 tokens the
local layers' splash kernels skip the tiles outside the window.

Batch 512 × 8192 (4M tokens a step, OLMo 3's) accumulated in 4 microbatches (4 rows per chip at a
time), FSDP over every chip, activations rematerialised except each layer's two output
projections, the loss's logits 512 positions at a time. CI compiles it for the
slice with libtpu and checks it fits (tests/test_tpu_plan.py):

    python -m maxlm.bench plan --config=configs/olmo3_7b_v5p64.py --target=v5p-64

docs/models.md#presets records the planned memory and the estimated step time.
"""

from maxlm.config import defaults


def get_config():
    c = defaults()
    c.name = "olmo3_7b_v5p64"
    c.platform = "tpu"
    c.num_devices = 32
    c.steps = 100000
    c.batch_size = 512
    c.seq_len = 8192
    c.mesh.data = 1
    c.mesh.fsdp = 32
    c.model.num_layers = 32
    c.model.d_model = 4096
    c.model.num_heads = 32
    c.model.num_kv_heads = 32
    c.model.mlp_dim = 11008
    c.model.vocab_size = 100278
    c.model.rope_theta = 500000.0
    c.model.norm_eps = 1e-6
    c.model.norm_placement = "post"
    c.model.qk_norm = "full"
    c.model.sliding_window = 4096
    c.model.layer_pattern = "LLLG"
    c.model.dtype = "bfloat16"
    c.model.attention = "splash"
    c.model.remat = "save_out_proj"
    c.model.logits_chunk_size = 512
    c.optim.lr = 3e-4
    c.optim.warmup_steps = 2000
    c.optim.grad_accum_steps = 4
    c.checkpoint.every_steps = 1000
    c.eval.every_steps = 1000
    return c
