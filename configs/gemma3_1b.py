"""Gemma 3 1B (Google, gemma-3-1b-pt): 999,885,952 parameters (301,989,888 of them the tied embedding).

26 layers, d_model 1152, 4 query heads and 1 kv head of 256, GeGLU 6912, vocabulary 262,144,
RMSNorm eps 1e-6. Gemma 3's block: RMSNorms before and after each sublayer
(`model.norm_placement=sandwich`), each scaling by 1 + w (`model.norm_plus_one`), queries and keys
RMS-normed per head (`model.qk_norm=per_head`), embeddings times √1152 (`model.scale_embeddings`);
five local layers to one global (`model.layer_pattern=LLLLLG`: 512-token sliding window, RoPE base
10,000) and the global layers' base 1,000,000. It exports as transformers' Gemma3ForCausalLM,
and `checkpoint.init_from_hf` starts from the published weights (docs/huggingface.md;
docs/models.md lists the families).

Gemma 3 1B was pretrained at 32K tokens; this preset's rows are 4096 (256 of them: 1M tokens a
step), with full rematerialisation and the loss's logits 512 positions at a time (a 262K
vocabulary), as the other presets of this size.
"""

from maxlm.config import defaults


def get_config():
    c = defaults()
    c.name = "gemma3_1b"
    c.steps = 100000
    c.batch_size = 256
    c.seq_len = 4096
    c.model.num_layers = 26
    c.model.d_model = 1152
    c.model.num_heads = 4
    c.model.num_kv_heads = 1
    c.model.head_dim = 256
    c.model.mlp_dim = 6912
    c.model.vocab_size = 262144
    c.model.tie_embeddings = True
    c.model.norm_eps = 1e-6
    c.model.norm_placement = "sandwich"
    c.model.norm_plus_one = True
    c.model.qk_norm = "per_head"
    c.model.mlp_activation = "geglu"
    c.model.scale_embeddings = True
    c.model.sliding_window = 512
    c.model.layer_pattern = "LLLLLG"
    c.model.rope_theta = 1000000.0
    c.model.rope_theta_local = 10000.0
    c.model.dtype = "bfloat16"
    c.model.remat = "full"
    c.model.logits_chunk_size = 512
    c.optim.lr = 3e-4
    c.optim.warmup_steps = 2000
    c.checkpoint.every_steps = 1000
    c.eval.every_steps = 1000
    return c
