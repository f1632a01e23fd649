"""RoPE scaling for context extension (`model.rope_scaling`, maxlm/model/positions.py): the
frequencies and the rotation are transformers' (`ROPE_INIT_FUNCTIONS`, `LlamaRotaryEmbedding`)."""

import jax.numpy as jnp
import numpy as np
import pytest

from maxlm.model import positions
from tests.helpers import load_config, with_overrides

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

# (rope type, theta, head dim, factor, original length, the type's own parameters in transformers' names)
CASES = [
    ("llama3", 500000.0, 128, 8.0, 8192, {"low_freq_factor": 1.0, "high_freq_factor": 4.0}),  # Llama 3.1 8B
    ("llama3", 500000.0, 64, 32.0, 8192, {"low_freq_factor": 1.0, "high_freq_factor": 4.0}),  # Llama 3.2 1B
    ("llama3", 10000.0, 16, 2.0, 64, {"low_freq_factor": 2.0, "high_freq_factor": 8.0}),
    ("yarn", 1000000.0, 128, 4.0, 32768, {}),  # Qwen3's recommended YaRN
    ("yarn", 10000.0, 16, 2.0, 64, {}),
    ("yarn", 10000.0, 64, 8.0, 4096, {"beta_fast": 16.0, "beta_slow": 2.0}),
]
MAXLM_NAMES = {"low_freq_factor": "rope_low_freq_factor", "high_freq_factor": "rope_high_freq_factor",
               "beta_fast": "rope_beta_fast", "beta_slow": "rope_beta_slow"}


def _configs(kind, theta, head_dim, factor, original, extra):
    """(maxlm's model config, transformers' LlamaConfig) of one case."""
    overrides = {"model.rope_scaling": kind, "model.rope_theta": theta, "model.rope_scaling_factor": factor,
                 "model.rope_original_max_len": original, "model.head_dim": head_dim,
                 **{f"model.{MAXLM_NAMES[k]}": v for k, v in extra.items()}}
    ours = with_overrides(load_config("tiny"), overrides).model
    theirs = transformers.LlamaConfig(
        hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim, max_position_embeddings=int(original * factor),
        rope_parameters={"rope_type": kind, "rope_theta": theta, "factor": factor,
                         "original_max_position_embeddings": original, **extra})
    return ours, theirs


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[2]}-x{c[3]:g}" for c in CASES])
def test_frequencies_are_transformers(case):
    """Ours are computed in float64 and rounded once; transformers' in float32, step by step, so
    they agree to 3 float32 ulps (2.8e-7 at most over these cases), and the attention factor
    exactly."""
    ours, theirs = _configs(*case)
    want, want_factor = ROPE_INIT_FUNCTIONS[case[0]](theirs, "cpu")
    got, got_factor = positions.rope_frequencies(ours, case[2])
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want.numpy(), rtol=4e-7, atol=0)
    assert got_factor == want_factor


@pytest.mark.parametrize("case", [CASES[2], CASES[4]], ids=["llama3", "yarn"])
def test_rotated_queries_are_transformers(case):
    """Queries rotated at positions past the original length equal transformers' rotary
    embedding with its cos/sin (YaRN's attention factor on both)."""
    from transformers.models.llama import modeling_llama

    ours, theirs = _configs(*case)
    rng = np.random.default_rng(0)
    q_BLHDh = rng.standard_normal((2, 200, 4, case[2])).astype(np.float32)
    positions_BL = np.stack([np.arange(200), np.arange(200) + 37]).astype(np.int32)
    got = positions.rotary(ours, jnp.asarray(q_BLHDh), jnp.asarray(positions_BL))
    cos, sin = modeling_llama.LlamaRotaryEmbedding(theirs)(torch.zeros(1), torch.from_numpy(positions_BL).long())
    q_BHLDh = torch.from_numpy(q_BLHDh).transpose(1, 2)
    want, _ = modeling_llama.apply_rotary_pos_emb(q_BHLDh, q_BHLDh, cos, sin)
    np.testing.assert_allclose(np.asarray(got), want.transpose(1, 2).numpy(), atol=2e-5, rtol=0)


def test_no_scaling_keeps_the_unscaled_frequencies():
    """rope_scaling='none' rotates by theta's frequencies, and a scaling changes only the low ones
    (long wavelengths): the highest frequency is kept by both rules."""
    cfg = load_config("tiny").model
    x_BLHDh = jnp.ones((1, 8, 1, 16))
    pos_BL = jnp.arange(8)[None]
    plain = positions.rope(x_BLHDh, pos_BL, cfg.rope_theta)
    np.testing.assert_array_equal(positions.rotary(cfg, x_BLHDh, pos_BL), plain)
    for case in (CASES[2], CASES[4]):
        ours, _ = _configs(*case)
        freq_F, _ = positions.rope_frequencies(ours, 16)
        unscaled_F = 1.0 / ours.rope_theta ** (np.arange(0, 16, 2) / 16)
        assert freq_F[0] == np.float32(unscaled_F[0])
        np.testing.assert_allclose(freq_F[-1], unscaled_F[-1] / ours.rope_scaling_factor, rtol=1e-6)
