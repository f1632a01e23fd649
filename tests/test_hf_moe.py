"""Hugging Face export and import of mixture-of-experts models (maxlm/hf/): an MoE run exports as
transformers' MixtralForCausalLM, which gives maxlm's logits and greedy tokens; a Mixtral built
and saved by transformers imports with transformers' logits, and exports back to the same
tensors, scanned or unrolled, on a sharded mesh; what Mixtral cannot hold is refused with one
line naming the key (exit 2 through the CLI)."""

import functools
import json

import jax
import numpy as np
import pytest

from maxlm import config as config_lib, model
from maxlm.hf import architectures, files as hf
from tests.helpers import random_params
from tests.test_hf import _abstract, _assert_bitwise_equal, _bits, _cfg, _cli, _sequence

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# 4 experts, top-2, an expert hidden size unlike mlp_dim's 128 (a mix-up shows as a shape error)
MOE = {"model.num_experts": 4, "model.experts_per_token": 2, "model.expert_mlp_dim": 48}


def _moe_cfg(overrides=None):
    return _cfg({**MOE, **(overrides or {})})


def _hf_model(directory):
    """The exported folder as transformers loads it: the class from its config.json."""
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def _logits(hf_model, tokens_1L):
    with torch.no_grad():
        return hf_model(torch.from_numpy(tokens_1L.astype(np.int64))).logits.numpy()


def _greedy(model_cfg, params, prompt, new_tokens: int, allowed: int) -> list[int]:
    """maxlm's greedy continuation (argmax over the first `allowed` ids), the whole prefix
    recomputed at each step in one fixed-length buffer (causal: the padding after it is unseen)."""
    length = len(prompt) + new_tokens
    batch = {"inputs": np.zeros((1, length), np.int32), "segment_ids": np.ones((1, length), np.int32),
             "positions": np.arange(length, dtype=np.int32)[None]}
    batch["inputs"][0, :len(prompt)] = prompt
    logits_of = jax.jit(functools.partial(model.apply, model_cfg))
    for t in range(len(prompt), length):
        batch["inputs"][0, t] = int(np.argmax(np.asarray(logits_of(params, batch))[0, t - 1, :allowed]))
    return batch["inputs"][0].tolist()


# ----------------------------------------------------------------------------- export


@pytest.mark.parametrize("scanned", [True, False], ids=["scanned", "unrolled"])
def test_moe_export_is_mixtral_with_maxlm_logits_and_greedy_tokens(tmp_path, scanned):
    cfg = _moe_cfg({"model.scan_layers": scanned, "model.rope_theta": 1e6})
    params = random_params(cfg.model, seed=1)
    hf.export(params, cfg, str(tmp_path))
    written = json.loads((tmp_path / "config.json").read_text())
    assert (written["architectures"], written["num_local_experts"], written["num_experts_per_tok"],
            written["intermediate_size"]) == (["MixtralForCausalLM"], 4, 2, 48)
    hf_model = _hf_model(str(tmp_path))
    assert type(hf_model).__name__ == "MixtralForCausalLM"
    batch = _sequence(48, 259, seed=2)
    ours = np.asarray(jax.jit(functools.partial(model.apply, cfg.model))(params, batch))
    np.testing.assert_allclose(_logits(hf_model, batch["inputs"]), ours, atol=1e-4, rtol=0)
    # the experts matter: the same weights with other top-k choices give other logits
    top1 = np.asarray(jax.jit(functools.partial(model.apply, _moe_cfg({"model.experts_per_token": 1}).model))(
        params if scanned else model.stack_layers(params), batch))
    assert np.abs(top1 - ours).max() > 1e-2
    # greedy decoding through transformers' KV cache (generation_config suppresses ids past 259)
    prompt = _sequence(6, 259, seed=3)["inputs"][0].tolist()
    with torch.no_grad():
        theirs = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 6, dtype=torch.long),
                                   max_new_tokens=10, do_sample=False)[0].tolist()
    assert theirs == _greedy(cfg.model, params, prompt, 10, allowed=259)


# ----------------------------------------------------------------------------- import


def _random_mixtral(directory, tied: bool):
    """A tiny MixtralForCausalLM of transformers' own, random weights (norm scales 1 + noise, so a
    swapped norm shows), saved as transformers saves it."""
    config = transformers.MixtralConfig(
        vocab_size=264, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, rms_norm_eps=1e-5,
        tie_word_embeddings=tied, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    torch.manual_seed(0)
    hf_model = transformers.MixtralForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.05 * torch.randn_like(p))
    hf_model.save_pretrained(directory)
    return hf_model


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_mixtral_import_gives_transformers_logits_and_exports_back_the_same(tmp_path, tied):
    theirs = _random_mixtral(tmp_path / "mixtral", tied)
    cfg = _moe_cfg({"model.rope_theta": 1e6, "model.tie_embeddings": tied,
                    "mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2})
    params = hf.load_params(str(tmp_path / "mixtral"), cfg.model, _abstract(cfg))
    batch = _sequence(48, 264, seed=4)
    ours = np.asarray(jax.jit(functools.partial(model.apply, cfg.model))(params, batch))
    np.testing.assert_allclose(ours, _logits(theirs, batch["inputs"]), atol=1e-5, rtol=0)
    # unrolled: the same parameters
    unrolled = _moe_cfg({"model.rope_theta": 1e6, "model.tie_embeddings": tied, "model.scan_layers": False})
    _assert_bitwise_equal(hf.load_params(str(tmp_path / "mixtral"), unrolled.model, _abstract(unrolled)),
                          model.unstack_layers(jax.device_get(params)))
    # maxlm → HF again: transformers' tensors, bit for bit
    hf.export(params, cfg, str(tmp_path / "back"))
    from safetensors.numpy import load_file

    saved, back = load_file(str(tmp_path / "mixtral" / hf.WEIGHTS)), load_file(str(tmp_path / "back" / hf.WEIGHTS))
    assert sorted(back) == sorted(saved)
    for name in saved:
        np.testing.assert_array_equal(_bits(back[name]), _bits(saved[name]), err_msg=name)


def test_mixtral_import_mismatches_name_the_keys(tmp_path):
    _random_mixtral(tmp_path, tied=False)
    dense = _cfg({"model.rope_theta": 1e6})
    with pytest.raises(config_lib.ConfigError) as e:
        hf.load_params(str(tmp_path), dense.model, _abstract(dense))
    assert str(e.value).endswith(
        "does not match the run: model.num_experts=0 but the checkpoint has 4; model.expert_mlp_dim=0 but the "
        "checkpoint has 48 (set --config.model.num_experts=4 --config.model.expert_mlp_dim=48)")
    other = _moe_cfg({"model.rope_theta": 1e6, "model.num_experts": 8, "model.mlp_dim": 96})
    with pytest.raises(config_lib.ConfigError) as e:  # mlp_dim: Mixtral has no dense MLP to compare
        hf.load_params(str(tmp_path), other.model, _abstract(other))
    assert "model.num_experts=8 but the checkpoint has 4 (set --config.model.num_experts=4)" in str(e.value)
    hf_cfg = json.loads((tmp_path / "config.json").read_text())
    with pytest.raises(config_lib.ConfigError, match=r"unsupported: sliding_window=4096"):
        architectures.check_config(dict(hf_cfg, sliding_window=4096), _moe_cfg({"model.rope_theta": 1e6}).model, "X")


# ----------------------------------------------------------------------------- refused


REFUSED = {
    "model.shared_experts": (1, "model.shared_experts=1 (Mixtral has no shared experts)"),
    "model.router": ("sigmoid", "model.router='sigmoid' (Mixtral's router is a softmax over all experts)"),
    "model.first_dense_layers": (1, "model.first_dense_layers=1 (every Mixtral layer is an MoE layer)"),
    "model.router_renormalize": (False, "model.router_renormalize=False (Mixtral renormalises the top-k gates"),
    "model.router_scale": (2.5, "model.router_scale=2.5 (Mixtral does not scale the gates)"),
    "model.load_balance": ("bias", "model.load_balance='bias' (the selection bias has no place in Mixtral's router)"),
}


@pytest.mark.parametrize("key", sorted(REFUSED))
def test_what_mixtral_cannot_hold_is_refused_naming_the_key(tmp_path, key):
    value, why = REFUSED[key]
    cfg = _moe_cfg({"checkpoint.init_from_hf": str(tmp_path / "hf")})
    params = random_params(cfg.model)  # refused before they are read
    cfg.model[key.split(".")[1]] = value  # after resolve: load_balance='bias' may not be in this tree's domain yet
    prefix = "maps a mixture-of-experts model to transformers' MixtralForCausalLM, which cannot hold "
    with pytest.raises(config_lib.ConfigError) as e:
        hf.export(params, cfg, str(tmp_path / "out"))
    assert str(e.value).startswith(f"the Hugging Face export {prefix}{why}")
    assert not (tmp_path / "out").exists()
    with pytest.raises(config_lib.ConfigError, match=f"^checkpoint.init_from_hf=.* {prefix}"):
        hf.check_init_from_hf(cfg)  # before reading the folder (there is none)


def test_group_limited_routing_is_refused_and_every_refusal_is_listed():
    cfg = _moe_cfg({"model.router": "sigmoid", "model.router_groups": 2, "model.router_topk_groups": 1,
                    "model.shared_experts": 1})
    with pytest.raises(config_lib.ConfigError) as e:
        architectures.architecture(cfg.model, "X")
    assert str(e.value).count("model.") == 3 and "model.router_groups=2 (Mixtral has no group-limited" in str(e.value)


def test_capacity_is_exported_with_a_warning(tmp_path, capsys):
    """Capacity is how maxlm computes, not a weight: the export is the dropless model of the same
    weights, said so in one warning."""
    cfg = _moe_cfg({"model.capacity_factor": 1.25})
    hf.export(random_params(cfg.model), cfg, str(tmp_path))
    assert "model.capacity_factor=1.25: transformers' Mixtral runs every token's experts" in capsys.readouterr().err
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["MixtralForCausalLM"]


def test_export_cli_refuses_a_shared_expert_run_in_one_line(tmp_path):
    cfg = _moe_cfg({"model.shared_experts": 2})
    (tmp_path / "config.json").write_text(config_lib.to_json(cfg))
    result = _cli("maxlm.export", f"--workdir={tmp_path}", f"--out={tmp_path / 'hf'}")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "maxlm: config error: the Hugging Face export maps a mixture-of-experts model to transformers' "
        "MixtralForCausalLM, which cannot hold model.shared_experts=2 (Mixtral has no shared experts)"]
    assert not (tmp_path / "hf").exists()


# ----------------------------------------------------------------------------- through the CLI


@pytest.mark.ci
def test_a_trained_moe_run_exports_through_the_cli(tmp_path, data_dirs):
    """As a user would: train a tiny MoE run, `python -m maxlm.export`, load it in transformers
    by its config.json alone, decode greedily: maxlm's tokens."""
    from maxlm.train import loop, runs

    cfg = _moe_cfg({**data_dirs, "steps": 2, "optim.warmup_steps": 1, "checkpoint.every_steps": 2})
    loop.train_and_evaluate(cfg, str(tmp_path / "run"))
    result = _cli("maxlm.export", f"--workdir={tmp_path / 'run'}", f"--out={tmp_path / 'hf'}")
    assert result.returncode == 0, result.stderr
    hf_model = _hf_model(str(tmp_path / "hf"))
    assert type(hf_model).__name__ == "MixtralForCausalLM"
    run = runs.load_run(str(tmp_path / "run"))
    tokenizer = transformers.ByT5Tokenizer.from_pretrained(str(tmp_path / "hf"))
    prompt = [tokenizer.bos_token_id, *tokenizer("The quick", add_special_tokens=False).input_ids]
    with torch.no_grad():
        theirs = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                   max_new_tokens=8, do_sample=False)[0].tolist()
    assert theirs == _greedy(run["config"].model, run["params"], prompt, 8, allowed=259)
