"""Hugging Face export and import of the classes past Llama (maxlm/hf/architectures.py): an MoE
run exports as transformers' MixtralForCausalLM, or Qwen3MoeForCausalLM with model.qk_norm=per_head
(dense first layers, unrenormalised gates), a dense qk-norm run as Qwen3ForCausalLM; each gives
maxlm's logits and greedy tokens in transformers. A model of each class built and saved by
transformers imports with its logits, and exports back to the same tensors, scanned or unrolled,
on a sharded mesh. What a class cannot hold is refused with one line naming the key (exit 2
through the CLI)."""

import functools
import json

import jax
import numpy as np
import pytest

from maxlm import config as config_lib, model
from maxlm.hf import architectures, config_json, files as hf
from tests.helpers import random_params
from tests.test_hf import _abstract, _assert_bitwise_equal, _bits, _cfg, _cli, _sequence

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# 4 experts, top-2, an expert hidden size unlike mlp_dim's 128 (a mix-up shows as a shape error)
MOE = {"model.num_experts": 4, "model.experts_per_token": 2, "model.expert_mlp_dim": 48}
# configs/tiny.py's shape in transformers' words, RoPE base 1e6 (Mixtral's and Qwen3's default)
SHAPE = dict(vocab_size=264, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
OLMO = {"model.qk_norm": "full", "model.norm_placement": "post"}
GEMMA = {"model.norm_placement": "sandwich", "model.mlp_activation": "geglu", "model.norm_plus_one": True,
         "model.scale_embeddings": True}
# class → (maxlm overrides, the transformers config of the same model)
FAMILIES = {
    "MixtralForCausalLM": ({**MOE, "model.sliding_window": 16},  # a window shorter than the test rows
                           dict(num_hidden_layers=2, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
                                sliding_window=16)),
    "MistralForCausalLM": ({"model.sliding_window": 9}, dict(num_hidden_layers=2, intermediate_size=128,
                                                             sliding_window=9)),
    "Qwen3MoeForCausalLM": (  # a dense first layer, gates not renormalised
        {**MOE, "model.qk_norm": "per_head", "model.num_layers": 3, "model.first_dense_layers": 1,
         "model.router_renormalize": False},
        dict(num_hidden_layers=3, intermediate_size=128, moe_intermediate_size=48, num_experts=4,
             num_experts_per_tok=2, mlp_only_layers=[0], norm_topk_prob=False)),
    "Qwen3ForCausalLM": ({"model.qk_norm": "per_head"}, dict(num_hidden_layers=2, intermediate_size=128)),
    "Olmo2ForCausalLM": ({"model.qk_norm": "full", "model.norm_placement": "post"},
                         dict(num_hidden_layers=2, intermediate_size=128)),
    "GPT2LMHeadModel": ({"model.positions": "learned", "model.norm": "layernorm", "model.mlp_activation": "gelu",
                         "model.use_bias": True, "model.num_kv_heads": 4},
                        dict(num_hidden_layers=2, n_inner=128, n_positions=64)),
    # OLMo 3: local, local, global (a window shorter than the test rows), its local layers' own base
    "Olmo3ForCausalLM": ({**OLMO, "model.num_layers": 3, "model.layer_pattern": "LLG", "model.sliding_window": 9,
                          "model.rope_theta_local": 1e4},
                         dict(num_hidden_layers=3, intermediate_size=128, sliding_window=9,
                              layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                              rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
    # Gemma 2: local and global layers, both soft caps (below the largest scores and logits)
    "Gemma2ForCausalLM": ({**GEMMA, "model.num_layers": 3, "model.layer_pattern": "LG", "model.sliding_window": 9,
                           "model.attn_logit_softcap": 1.5, "model.final_logit_softcap": 3.0},
                          dict(num_hidden_layers=3, intermediate_size=128, sliding_window=9, query_pre_attn_scalar=16,
                               attn_logit_softcapping=1.5, final_logit_softcapping=3.0)),
    # Gemma 3: 5 local to 1 global on 7 layers (one scanned group and a layer after it), the local base
    "Gemma3ForCausalLM": ({**GEMMA, "model.qk_norm": "per_head", "model.num_layers": 7, "model.layer_pattern": "LLLLLG",
                           "model.sliding_window": 9, "model.rope_theta_local": 1e4},
                          dict(num_hidden_layers=7, intermediate_size=128, sliding_window=9, query_pre_attn_scalar=16,
                               rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
    # DeepSeek-V3: latent attention, a dense first layer, then MoE layers of 4 experts (top-2, 2
    # groups of which 1 eligible, sigmoid scores with the selection bias, 1 shared expert, gates x 2.5)
    "DeepseekV3ForCausalLM": (
        {"model.attention_kind": "mla", "model.q_lora_rank": 24, "model.kv_lora_rank": 32, "model.qk_nope_head_dim": 16,
         "model.qk_rope_head_dim": 8, "model.v_head_dim": 12, "model.num_kv_heads": 4, "model.num_layers": 3,
         **MOE, "model.first_dense_layers": 1, "model.shared_experts": 1, "model.router": "sigmoid",
         "model.load_balance": "bias", "model.router_scale": 2.5, "model.router_groups": 2, "model.router_topk_groups": 1},
        dict(num_hidden_layers=3, intermediate_size=128, num_key_value_heads=4, head_dim=8, q_lora_rank=24, kv_lora_rank=32,
             qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, first_k_dense_replace=1, n_routed_experts=4,
             num_experts_per_tok=2, moe_intermediate_size=48, n_shared_experts=1, n_group=2, topk_group=1,
             routed_scaling_factor=2.5, norm_topk_prob=True)),
}


def _family_cfg(hf_class, overrides=None):
    return _cfg({**FAMILIES[hf_class][0], "model.rope_theta": 1e6, **(overrides or {})})


def _moe_cfg(overrides=None):
    return _family_cfg("MixtralForCausalLM", overrides)


def _hf_model(directory):
    """The exported folder as transformers loads it: the class from its config.json."""
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def _logits(hf_model, tokens_1L):
    with torch.no_grad():
        return hf_model(torch.from_numpy(tokens_1L.astype(np.int64))).logits.numpy()


def _greedy(logits_of, prompt, new_tokens: int, allowed: int, length: int = 48) -> list[int]:
    """maxlm's greedy continuation (argmax over the first `allowed` ids) with `logits_of(batch)`,
    the whole prefix recomputed at each step in one `length`-token buffer (causal: the padding
    after it is unseen; the export test's batch shape, so nothing compiles again)."""
    batch = {"inputs": np.zeros((1, length), np.int32), "segment_ids": np.ones((1, length), np.int32),
             "positions": np.arange(length, dtype=np.int32)[None]}
    batch["inputs"][0, :len(prompt)] = prompt
    for t in range(len(prompt), len(prompt) + new_tokens):
        batch["inputs"][0, t] = int(np.argmax(np.asarray(logits_of(batch))[0, t - 1, :allowed]))
    return batch["inputs"][0, :len(prompt) + new_tokens].tolist()


def _hf_greedy(hf_model, prompt, new_tokens: int) -> list[int]:
    """transformers' greedy `generate` (its KV cache; the export's generation_config suppresses the
    ids past the byte tokenizer's 259)."""
    with torch.no_grad():
        return hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 max_new_tokens=new_tokens, do_sample=False)[0].tolist()


# ----------------------------------------------------------------------------- export


@pytest.mark.parametrize("hf_class, scanned", [("MixtralForCausalLM", True), ("Qwen3MoeForCausalLM", False),
                                               ("Qwen3ForCausalLM", True), ("Olmo2ForCausalLM", False),
                                               ("MistralForCausalLM", True), ("GPT2LMHeadModel", True),
                                               ("Olmo3ForCausalLM", False), ("Gemma2ForCausalLM", True),
                                               ("Gemma3ForCausalLM", True), ("DeepseekV3ForCausalLM", True)])
def test_export_is_the_class_with_maxlm_logits_and_greedy_tokens(tmp_path, hf_class, scanned):
    cfg = _family_cfg(hf_class, {"model.scan_layers": scanned})
    params = random_params(cfg.model, seed=1)
    hf.export(params, cfg, str(tmp_path))
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["architectures"] == [hf_class]
    hf_model = _hf_model(str(tmp_path))
    assert type(hf_model).__name__ == hf_class
    logits_of = functools.partial(jax.jit(functools.partial(model.apply, cfg.model)), params)
    batch = _sequence(48, 259, seed=2)
    np.testing.assert_allclose(_logits(hf_model, batch["inputs"]), logits_of(batch), atol=1e-4, rtol=0)
    prompt = _sequence(6, 259, seed=3)["inputs"][0].tolist()
    assert _hf_greedy(hf_model, prompt, 10) == _greedy(logits_of, prompt, 10, allowed=259)


# ----------------------------------------------------------------------------- import


def _random_hf(directory, hf_class: str, tied: bool):
    """A tiny model of transformers' own class `hf_class`, random weights (norm scales 1 + noise,
    so a swapped norm shows), saved as transformers saves it."""
    config_class = getattr(transformers, {"Gemma3ForCausalLM": "Gemma3TextConfig"}.get(
        hf_class, hf_class.replace("ForCausalLM", "Config").replace("LMHeadModel", "Config")))
    config = config_class(**{**SHAPE, **FAMILIES[hf_class][1]}, tie_word_embeddings=tied)
    torch.manual_seed(0)
    hf_model = getattr(transformers, hf_class)(config).eval()
    norm_offset = 0.0 if hf_class.startswith("Gemma") else 1.0  # Gemma's norms scale by 1 + the weight
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            is_norm = "norm" in name or ".ln_" in name
            p.copy_(norm_offset + 0.2 * torch.randn_like(p) if is_norm else 0.05 * torch.randn_like(p))
    hf_model.save_pretrained(directory)
    return hf_model


@pytest.mark.parametrize("hf_class, tied", [("MixtralForCausalLM", False), ("Qwen3MoeForCausalLM", True),
                                            ("Qwen3ForCausalLM", False), ("Olmo2ForCausalLM", True),
                                            ("MistralForCausalLM", False), ("GPT2LMHeadModel", True),
                                            ("Olmo3ForCausalLM", False), ("Gemma2ForCausalLM", True),
                                            ("Gemma3ForCausalLM", False), ("DeepseekV3ForCausalLM", False)])
def test_import_gives_transformers_logits_and_exports_back_the_same(tmp_path, hf_class, tied):
    theirs = _random_hf(tmp_path / "hf", hf_class, tied)
    cfg = _family_cfg(hf_class, {"model.tie_embeddings": tied, "mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2})
    params = hf.load_params(str(tmp_path / "hf"), cfg.model, _abstract(cfg))
    batch = _sequence(48, 264, seed=4)
    ours = np.asarray(jax.jit(functools.partial(model.apply, cfg.model))(params, batch))
    np.testing.assert_allclose(ours, _logits(theirs, batch["inputs"]), atol=1e-5, rtol=0)
    # unrolled: the same parameters
    unrolled = _family_cfg(hf_class, {"model.tie_embeddings": tied, "model.scan_layers": False})
    _assert_bitwise_equal(hf.load_params(str(tmp_path / "hf"), unrolled.model, _abstract(unrolled)),
                          model.unstack_layers(jax.device_get(params)))
    # maxlm → HF again: transformers' tensors, bit for bit
    hf.export(params, cfg, str(tmp_path / "back"))
    from safetensors.numpy import load_file

    saved, back = load_file(str(tmp_path / "hf" / hf.WEIGHTS)), load_file(str(tmp_path / "back" / hf.WEIGHTS))
    assert sorted(back) == sorted(saved)
    for name in saved:
        np.testing.assert_array_equal(_bits(back[name]), _bits(saved[name]), err_msg=name)


@pytest.mark.parametrize("hf_class", ["Qwen3ForCausalLM", "Olmo2ForCausalLM", "MistralForCausalLM",
                                      "GPT2LMHeadModel", "MixtralForCausalLM", "Qwen3MoeForCausalLM",
                                      "Olmo3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "DeepseekV3ForCausalLM"])
def test_a_packed_row_gives_transformers_logits_of_each_document_alone(tmp_path, hf_class):
    """Two documents and padding in one row (positions restarting, segment ids): each document's
    logits are transformers' forward pass of that document alone, within 1e-5."""
    theirs = _random_hf(tmp_path / "hf", hf_class, tied=False)
    cfg = _family_cfg(hf_class)
    params = hf.load_params(str(tmp_path / "hf"), cfg.model, _abstract(cfg))
    first, second = _sequence(29, 264, seed=5)["inputs"][0], _sequence(15, 264, seed=6)["inputs"][0]
    row = np.concatenate([first, second, np.zeros(4, np.int32)])[None]
    batch = {"inputs": row, "segment_ids": np.repeat([[1, 2, 0]], [29, 15, 4], axis=1).astype(np.int32),
             "positions": np.concatenate([np.arange(29), np.arange(15), np.arange(4)])[None].astype(np.int32)}
    ours = np.asarray(jax.jit(functools.partial(model.apply, cfg.model))(params, batch))[0]
    np.testing.assert_allclose(ours[:29], _logits(theirs, first[None])[0], atol=1e-5, rtol=0)
    np.testing.assert_allclose(ours[29:44], _logits(theirs, second[None])[0], atol=1e-5, rtol=0)


def test_a_window_as_long_as_the_rows_imports_as_no_window(tmp_path):
    """Mistral 7B v0.1's 4096-token window at seq_len 4096, here a window of 64 over rows of 64: it
    hides no key there, and the run, which may not set such a window (exit 2), imports the
    checkpoint with none and transformers' logits."""
    _random_hf(tmp_path / "hf", "MistralForCausalLM", tied=False)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(
        {**json.loads((tmp_path / "hf" / "config.json").read_text()), "sliding_window": 64}))
    theirs = _hf_model(str(tmp_path / "hf"))
    cfg = _family_cfg("MistralForCausalLM", {"model.sliding_window": 0})
    assert cfg.seq_len == 64
    with pytest.raises(config_lib.ConfigError, match=r"model.sliding_window=0 but the checkpoint has 64"):
        hf.load_params(str(tmp_path / "hf"), cfg.model, _abstract(cfg))  # no seq_len: the window counts
    params = hf.load_params(str(tmp_path / "hf"), cfg.model, _abstract(cfg), cfg.seq_len)
    batch = _sequence(64, 264, seed=4)
    ours = np.asarray(jax.jit(functools.partial(model.apply, cfg.model))(params, batch))
    np.testing.assert_allclose(ours, _logits(theirs, batch["inputs"]), atol=1e-5, rtol=0)


def test_import_mismatches_name_the_keys(tmp_path):
    _random_hf(tmp_path, "MixtralForCausalLM", tied=False)
    dense = _cfg({"model.rope_theta": 1e6})
    with pytest.raises(config_lib.ConfigError) as e:
        hf.load_params(str(tmp_path), dense.model, _abstract(dense))
    assert str(e.value).endswith(
        "does not match the run: model.sliding_window=0 but the checkpoint has 16; model.num_experts=0 but the "
        "checkpoint has 4; model.expert_mlp_dim=0 but the checkpoint has 48 (set --config.model.sliding_window=16 "
        "--config.model.num_experts=4 --config.model.expert_mlp_dim=48)")
    other = _moe_cfg({"model.num_experts": 8, "model.mlp_dim": 96})
    with pytest.raises(config_lib.ConfigError) as e:  # mlp_dim: Mixtral has no dense MLP to compare
        hf.load_params(str(tmp_path), other.model, _abstract(other))
    assert "model.num_experts=8 but the checkpoint has 4 (set --config.model.num_experts=4)" in str(e.value)
    hf_cfg = json.loads((tmp_path / "config.json").read_text())
    with pytest.raises(config_lib.ConfigError, match=r"model.sliding_window=16 but the checkpoint has 4096"):
        config_json.check_config(dict(hf_cfg, sliding_window=4096), _moe_cfg().model, "X")
    qwen3 = {**hf_cfg, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "sliding_window": 4096}
    with pytest.raises(config_lib.ConfigError,
                       match=r"unsupported: sliding_window=4096 \(maxlm maps a window on every layer only"):
        config_json.check_config({**qwen3, "use_sliding_window": True}, _cfg().model, "X")
    with pytest.raises(config_lib.ConfigError) as e:  # a window Qwen3 does not use is no window
        config_json.check_config({**qwen3, "use_sliding_window": False}, _cfg().model, "X")
    assert "sliding_window" not in str(e.value)
    # a Mixtral is no Qwen3-MoE: the qk-norm differs
    with pytest.raises(config_lib.ConfigError, match=r"model.qk_norm='per_head' but the checkpoint has 'none'"):
        config_json.check_config(hf_cfg, _moe_cfg({"model.qk_norm": "per_head"}).model, "X")


def test_qwen3_moe_dense_layers_are_read_from_mlp_only_layers_and_the_sparse_step():
    qwen = dict(SHAPE, model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], num_hidden_layers=4,
                intermediate_size=96, moe_intermediate_size=48, num_experts=4, num_experts_per_tok=2)
    mapped, unsupported = config_json.model_config_from_hf(dict(qwen, mlp_only_layers=[0, 1]))
    assert unsupported == [] and (mapped["first_dense_layers"], mapped["mlp_dim"]) == (2, 96)
    assert mapped["router_renormalize"] is False and mapped["qk_norm"] == "per_head"
    mapped, _ = config_json.model_config_from_hf(qwen)  # every layer MoE: no dense MLP to compare
    assert mapped["first_dense_layers"] == 0 and "mlp_dim" not in mapped
    for odd in (dict(mlp_only_layers=[1]), dict(decoder_sparse_step=2)):
        assert config_json.model_config_from_hf(dict(qwen, **odd))[1][0].startswith("dense layers [")


# ----------------------------------------------------------------------------- refused


REFUSED = [  # (the class the rest of the config picks, key, value, why)
    ("MixtralForCausalLM", "model.shared_experts", 1, "model.shared_experts=1 (Mixtral has no shared experts)"),
    ("MixtralForCausalLM", "model.router", "sigmoid",
     "model.router='sigmoid' (Mixtral's router is a softmax over all experts)"),
    ("MixtralForCausalLM", "model.first_dense_layers", 1,
     "model.first_dense_layers=1 (every Mixtral layer is an MoE layer)"),
    ("MixtralForCausalLM", "model.router_renormalize", False,
     "model.router_renormalize=False (Mixtral renormalises the top-k gates"),
    ("MixtralForCausalLM", "model.router_scale", 2.5, "model.router_scale=2.5 (Mixtral does not scale the gates)"),
    ("MixtralForCausalLM", "model.load_balance", "bias",
     "model.load_balance='bias' (the selection bias has no place in Mixtral's router)"),
    ("Qwen3MoeForCausalLM", "model.shared_experts", 1, "model.shared_experts=1 (Qwen3Moe has no shared experts)"),
    ("Qwen3MoeForCausalLM", "model.router_scale", 2.5, "model.router_scale=2.5 (Qwen3Moe does not scale the gates)"),
]


@pytest.mark.parametrize("hf_class, key, value, why", REFUSED, ids=[f"{c[:5]}-{k[6:]}" for c, k, _, _ in REFUSED])
def test_what_a_class_cannot_hold_is_refused_naming_the_key(tmp_path, hf_class, key, value, why):
    cfg = _family_cfg(hf_class, {"checkpoint.init_from_hf": str(tmp_path / "hf")})
    params = random_params(cfg.model)  # refused before they are read
    cfg.model[key.split(".")[1]] = value  # after resolve: load_balance='bias' may not be in this tree's domain yet
    prefix = f"maps a mixture-of-experts model to transformers' {hf_class}, which cannot hold "
    with pytest.raises(config_lib.ConfigError) as e:
        hf.export(params, cfg, str(tmp_path / "out"))
    assert str(e.value).startswith(f"the Hugging Face export {prefix}{why}")
    assert not (tmp_path / "out").exists()
    with pytest.raises(config_lib.ConfigError, match=f"^checkpoint.init_from_hf=.* {prefix}"):
        hf.check_init_from_hf(cfg)  # before reading the folder (there is none)


def test_norm_placements_and_qk_norms_without_a_class_are_refused():
    """Each dense class is one (norm placement, qk-norm) pair; an MoE class is pre-norm; Gemma's
    block comes with all of Gemma's pieces."""
    for placement, qk_norm in (("pre", "full"), ("post", "none"), ("post", "per_head"), ("sandwich", "full")):
        with pytest.raises(config_lib.ConfigError, match=f"^X has no class for model.norm_placement='{placement}' "
                                                         f"with model.qk_norm='{qk_norm}'; it maps 'pre' with 'none' "
                                                         r"\(Llama\), 'pre' with 'per_head' \(Qwen3\), 'post' with "
                                                         r"'full' \(Olmo2\), 'sandwich' with 'none' \(Gemma2\), "
                                                         r"'sandwich' with 'per_head' \(Gemma3\)$"):
            architectures.architecture(_cfg({"model.norm_placement": placement, "model.qk_norm": qk_norm}).model, "X")
    with pytest.raises(config_lib.ConfigError, match="^X maps a mixture-of-experts model with "
                                                     "model.norm_placement='pre' .* not norm_placement='post'"):
        architectures.architecture(_cfg({**MOE, "model.norm_placement": "post", "model.qk_norm": "full"}).model, "X")
    with pytest.raises(config_lib.ConfigError, match=r"^X maps .* to transformers' Olmo2ForCausalLM, which cannot "
                                                     r"hold model.head_dim=24 \(Olmo2's heads are d_model / num_heads "
                                                     r"= 16 wide\)$"):
        architectures.architecture(_family_cfg("Olmo2ForCausalLM", {"model.head_dim": 24}).model, "X")
    with pytest.raises(config_lib.ConfigError, match=r"^X maps model.norm_placement='sandwich' with model.qk_norm="
                                                     r"'none' to transformers' Gemma2ForCausalLM, which cannot hold "
                                                     r"model.mlp_activation='swiglu' \(Gemma2 has GeGLU MLP\); "
                                                     r"model.norm_plus_one=False .*; model.scale_embeddings=False"):
        architectures.architecture(_cfg({"model.norm_placement": "sandwich"}).model, "X")
    gemma3 = _family_cfg("Gemma3ForCausalLM", {"model.attn_logit_softcap": 50.0}).model
    with pytest.raises(config_lib.ConfigError, match=r"which cannot hold model.attn_logit_softcap=50 \(Gemma3's "
                                                     r"attention does not cap its scores\)$"):
        architectures.architecture(gemma3, "X")
    olmo = _cfg({**OLMO, "model.sliding_window": 9, "model.layer_pattern": "LLG", "model.rope_theta_local": 1e4,
                 "model.num_layers": 3})
    assert architectures.architecture(olmo.model, "X") is architectures.OLMO3
    with pytest.raises(config_lib.ConfigError, match=r"Llama.* model.sliding_window=9 with model.layer_pattern='LLG' "
                                                     r"\(Llama holds no sliding window\); model.rope_theta_local=10000 "
                                                     r"\(Llama's layers share one RoPE\)$"):
        architectures.architecture(_cfg({"model.sliding_window": 9, "model.layer_pattern": "LLG",
                                         "model.rope_theta_local": 1e4, "model.num_layers": 3}).model, "X")


def test_gpt_style_keys_go_to_gpt2_alone_and_qkv_biases_to_no_class():
    with pytest.raises(config_lib.ConfigError, match=r"^X maps model.positions='rope', model.norm='layernorm', "
                                                     r"model.mlp_activation='gelu' and model.use_bias=True to "
                                                     r"GPT2LMHeadModel alone .* which needs model.positions='learned' "
                                                     r"\(not 'rope'\); model.num_kv_heads=model.num_heads=4 \(not 2\)$"):
        architectures.architecture(_cfg({"model.norm": "layernorm", "model.mlp_activation": "gelu",
                                         "model.use_bias": True}).model, "X")
    with pytest.raises(config_lib.ConfigError, match=r"^X has no class for model.qkv_bias=True"):
        architectures.architecture(_cfg({"model.qkv_bias": True}).model, "X")
    with pytest.raises(config_lib.ConfigError, match=r"^X maps .* to transformers' LlamaForCausalLM, which cannot hold "
                                                     r"model.final_logit_softcap=30 \(Llama does not cap its logits\)$"):
        architectures.architecture(_cfg({"model.final_logit_softcap": 30.0}).model, "X")


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
    assert "model.capacity_factor=1.25: transformers' MoE classes run every token's experts" in capsys.readouterr().err
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
    from maxlm.checkpoint import saved_run
    from maxlm.train import loop

    cfg = _moe_cfg({**data_dirs, "steps": 2, "optim.warmup_steps": 1, "checkpoint.every_steps": 2})
    loop.train_and_evaluate(cfg, str(tmp_path / "run"))
    result = _cli("maxlm.export", f"--workdir={tmp_path / 'run'}", f"--out={tmp_path / 'hf'}")
    assert result.returncode == 0, result.stderr
    hf_model = _hf_model(str(tmp_path / "hf"))
    assert type(hf_model).__name__ == "MixtralForCausalLM"
    run = saved_run.load_run(str(tmp_path / "run"))
    tokenizer = transformers.ByT5Tokenizer.from_pretrained(str(tmp_path / "hf"))
    prompt = [tokenizer.bos_token_id, *tokenizer("The quick", add_special_tokens=False).input_ids]
    logits_of = functools.partial(jax.jit(functools.partial(model.apply, run["config"].model)), run["params"])
    assert _hf_greedy(hf_model, prompt, 8) == _greedy(logits_of, prompt, 8, allowed=259)
