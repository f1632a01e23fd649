"""125M class: GPT-3 Small's shape (Brown et al. 2020, Table 2.1) built from Llama blocks.

12 layers, d_model 768, 12 heads of 64, i.e. 12·L·d² = 84,934,656 non-embedding parameters as in
the GPT-3 table. The SwiGLU hidden size 2048 keeps the MLP at GPT-3's 2·768·3072 weights
(3·768·2048); RoPE replaces learned positions. With the GPT-2 vocabulary padded to 50,304 and tied
embeddings the total is 123,587,328 (GPT-3 Small: 125M, of which 1.6M positional embeddings).
"""

from maxlm.config import defaults


def get_config():
    c = defaults()
    c.name = "llama_125m"
    c.steps = 20000
    c.batch_size = 256
    c.seq_len = 2048
    c.model.num_layers = 12
    c.model.d_model = 768
    c.model.num_heads = 12
    c.model.num_kv_heads = 12
    c.model.mlp_dim = 2048
    c.model.vocab_size = 50304
    c.model.tie_embeddings = True
    c.model.dtype = "bfloat16"
    c.optim.lr = 6e-4
    c.optim.warmup_steps = 2000
    c.checkpoint.every_steps = 1000
    c.eval.every_steps = 1000
    return c
