"""Seconds-scale config for tests: a 2-layer model on the built-in corpus, byte tokens."""

from maxlm.config import defaults


def get_config():
    c = defaults()
    c.name = "tiny"
    c.steps = 20
    c.batch_size = 8
    c.seq_len = 64
    c.log_every_steps = 5
    c.model.num_layers = 2
    c.model.d_model = 64
    c.model.num_heads = 4
    c.model.num_kv_heads = 2
    c.model.mlp_dim = 128
    c.model.vocab_size = 264  # byte tokenizer's 259 ids, rounded up to a multiple of 8
    c.optim.lr = 3e-3
    c.optim.warmup_steps = 5
    c.checkpoint.every_steps = 10
    c.eval.every_steps = 10
    c.eval.steps = 2
    return c
