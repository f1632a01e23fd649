"""OLMo 2 1B (Ai2, OLMo-2-0425-1B): 1,484,916,736 parameters.

16 layers, d_model 2048, 16 heads of 128 (no grouping), SwiGLU 8192, vocabulary 100,352,
untied embeddings, RoPE theta 500,000, RMSNorm eps 1e-6. OLMo 2's block: each RMSNorm on its
sublayer's output, before the residual add (`model.norm_placement=post`), and queries and keys
RMS-normed over the whole projection before RoPE (`model.qk_norm=full`). It exports as
transformers' Olmo2ForCausalLM, and `checkpoint.init_from_hf` starts from the published weights
(docs/huggingface.md; docs/models.md lists the families).

Its pretraining length, 4096 tokens, with 256 rows a step (1M tokens), full rematerialisation
and the loss's logits 512 positions at a time, as configs/llama_1b.py.
"""

from maxlm.config import defaults


def get_config():
    c = defaults()
    c.name = "olmo2_1b"
    c.steps = 100000
    c.batch_size = 256
    c.seq_len = 4096
    c.model.num_layers = 16
    c.model.d_model = 2048
    c.model.num_heads = 16
    c.model.num_kv_heads = 16
    c.model.mlp_dim = 8192
    c.model.vocab_size = 100352
    c.model.tie_embeddings = False
    c.model.rope_theta = 500000.0
    c.model.norm_eps = 1e-6
    c.model.norm_placement = "post"
    c.model.qk_norm = "full"
    c.model.dtype = "bfloat16"
    c.model.remat = "full"
    c.model.logits_chunk_size = 512
    c.optim.lr = 3e-4
    c.optim.warmup_steps = 2000
    c.checkpoint.every_steps = 1000
    c.eval.every_steps = 1000
    return c
