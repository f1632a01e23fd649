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
    ("linear", 1000000.0, 256, 8.0, 4096, {}),  # Gemma 3's global layers (4B and up)
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


# ----------------------------------------------------------------------------- Hugging Face

# configs/tiny.py trained at 16 tokens, scaled 4x: the test's 48 positions are mostly past it
SCALED = {"llama3": {"model.rope_scaling": "llama3", "model.rope_scaling_factor": 4.0, "model.rope_original_max_len": 16,
                     "model.rope_low_freq_factor": 1.0, "model.rope_high_freq_factor": 2.0},
          "yarn": {"model.rope_scaling": "yarn", "model.rope_scaling_factor": 4.0, "model.rope_original_max_len": 16,
                   "model.rope_beta_fast": 8.0, "model.rope_beta_slow": 0.5}}


@pytest.mark.parametrize("kind, qk_norm", [("llama3", "none"), ("yarn", "none"), ("yarn", "per_head")],
                         ids=["llama3-Llama", "yarn-Llama", "yarn-Qwen3"])
def test_the_export_carries_the_scaling_to_transformers_and_imports_back(tmp_path, kind, qk_norm):
    """The export's config.json has the scaling in transformers' names; transformers' model gives
    maxlm's logits and greedy tokens; the folder imports back into the same run, and a run
    without the scaling is refused naming model.rope_scaling."""
    import functools

    import jax

    from maxlm import config as config_lib, model
    from maxlm.hf import files as hf
    from tests.helpers import random_params
    from tests.test_hf import _abstract, _assert_bitwise_equal, _cfg, _sequence
    from tests.test_hf_architectures import _greedy, _hf_greedy, _hf_model, _logits

    cfg = _cfg({**SCALED[kind], "model.qk_norm": qk_norm, "model.rope_theta": 1e4})
    params = random_params(cfg.model, seed=1)
    hf.export(params, cfg, str(tmp_path))
    hf_model = _hf_model(str(tmp_path))
    rope = hf_model.config.rope_parameters
    assert rope["rope_type"] == kind and rope["factor"] == 4.0 and rope["original_max_position_embeddings"] == 16
    logits_of = functools.partial(jax.jit(functools.partial(model.apply, cfg.model)), params)
    batch = _sequence(48, 259, seed=2)
    np.testing.assert_allclose(_logits(hf_model, batch["inputs"]), logits_of(batch), atol=1e-4, rtol=0)
    prompt = _sequence(20, 259, seed=3)["inputs"][0].tolist()
    assert _hf_greedy(hf_model, prompt, 24) == _greedy(logits_of, prompt, 24, allowed=259)
    _assert_bitwise_equal(hf.load_params(str(tmp_path), cfg.model, _abstract(cfg)), params)
    plain = _cfg({"model.qk_norm": qk_norm})
    with pytest.raises(config_lib.ConfigError, match=f"model.rope_scaling='none' but the checkpoint has '{kind}'"):
        hf.load_params(str(tmp_path), plain.model, _abstract(plain))
