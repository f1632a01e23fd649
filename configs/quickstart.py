"""`make train`: a 0.9M-parameter Llama learns Python from the standard library, on a CPU, in minutes.

Byte-level tokens (no tokenizer to train), 128-token packed sequences, one CPU device. About
1.2M tokens in 300 steps: the loss falls from ln(264) = 5.6 to about 1.6 nats per byte
(1.7 on held-out files) in about 4 minutes on 2 CPU cores.
"""

from maxlm.config import defaults


def get_config():
    c = defaults()
    c.name = "quickstart"
    c.steps = 300
    c.batch_size = 32
    c.seq_len = 128
    c.log_every_steps = 20
    c.model.num_layers = 4
    c.model.d_model = 128
    c.model.num_heads = 4
    c.model.num_kv_heads = 2
    c.model.mlp_dim = 384
    c.model.vocab_size = 264  # byte tokenizer's 259 ids, rounded up to a multiple of 8
    c.optim.lr = 3e-3
    c.optim.warmup_steps = 30
    c.checkpoint.every_steps = 100
    c.eval.every_steps = 100
    c.eval.steps = 8
    return c
