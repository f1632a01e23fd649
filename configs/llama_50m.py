"""A ~50M-parameter Llama for CPU benchmarks and small real runs: 49,947,136 parameters.

8 layers, d_model 512, 8 heads of 64, SwiGLU 2048, a 32,000-token vocabulary
(Llama 2's size) with tied embeddings.
"""

from maxlm.config import defaults


def get_config():
    c = defaults()
    c.name = "llama_50m"
    c.steps = 10000
    c.batch_size = 16
    c.seq_len = 512
    c.model.num_layers = 8
    c.model.d_model = 512
    c.model.num_heads = 8
    c.model.num_kv_heads = 8
    c.model.mlp_dim = 2048
    c.model.vocab_size = 32000
    c.model.tie_embeddings = True
    c.optim.warmup_steps = 500
    c.checkpoint.every_steps = 500
    c.eval.every_steps = 500
    return c
