"""GPT-2 small (OpenAI, 2019): 124,439,808 parameters, the seeds' classic GPT-style model.

12 layers, d_model 768, 12 heads of 64, an ungated tanh-GeLU MLP of 3072, vocabulary 50,257,
a learned table of 1,024 positions, LayerNorm (eps 1e-5) before each sublayer, biases in every
projection, tied embeddings. It exports as transformers' GPT2LMHeadModel, and
`checkpoint.init_from_hf` starts from the published weights (docs/huggingface.md; docs/models.md
lists the families).

Batch 512 × 1024 (0.5M tokens a step), peak lr 6e-4 with weight decay 0.1, as nanoGPT's
reproduction of the 124M model trains it.
"""

from maxlm.config import defaults


def get_config():
    c = defaults()
    c.name = "gpt2_124m"
    c.steps = 20000
    c.batch_size = 512
    c.seq_len = 1024
    c.model.num_layers = 12
    c.model.d_model = 768
    c.model.num_heads = 12
    c.model.num_kv_heads = 12
    c.model.mlp_dim = 3072
    c.model.vocab_size = 50257
    c.model.tie_embeddings = True
    c.model.positions = "learned"
    c.model.max_positions = 1024
    c.model.norm = "layernorm"
    c.model.mlp_activation = "gelu"
    c.model.use_bias = True
    c.model.dtype = "bfloat16"
    c.optim.lr = 6e-4
    c.optim.weight_decay = 0.1
    c.optim.warmup_steps = 700
    c.checkpoint.every_steps = 1000
    c.eval.every_steps = 1000
    return c
