"""A mixture-of-experts model small enough to train on a CPU in a few minutes.

configs/quickstart.py's Llama (4 layers, d_model 128, byte tokens, the built-in corpus) with the
SwiGLU of layers 2-4 turned into 8 experts, 2 per token (Mixtral's routing: top-2 of a softmax,
renormalised; Switch's auxiliary balancing loss at 0.01). Each expert is half the dense MLP
(192 = 384 / 2), so a token's active MLP matches quickstart's: 2.2M parameters, 0.86M active.
Dropless (grouped matmuls), 150 steps of 16 × 128 tokens. docs/moe.md#presets records its loss
curve (5.6 to 1.9) and time.
"""

import os

from maxlm.config import load_file


def get_config():
    c = load_file(os.path.join(os.path.dirname(__file__), "quickstart.py"))
    c.name = "moe_tiny"
    c.steps = 150
    c.batch_size = 16
    c.model.num_experts = 8
    c.model.experts_per_token = 2
    c.model.expert_mlp_dim = 192
    c.model.first_dense_layers = 1
    return c
