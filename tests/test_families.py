"""The model families beyond Llama's block, as users run them: through the CLI on 8 CPU devices
(fsdp 4 x tensor 2) with eval, checkpoints and TensorBoard on, resumed bitwise, then exported to
their transformers class. Their logits against transformers: tests/test_hf_architectures.py."""

import json
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from tests.helpers import ROOT, command_env, metrics_rows, saved_state, train_rows

# family → (its keys on configs/tiny.py's shape, the transformers class it exports as)
FAMILIES = {
    "olmo2": ({"model.norm_placement": "post", "model.qk_norm": "full"}, "Olmo2ForCausalLM"),
    "qwen3": ({"model.qk_norm": "per_head"}, "Qwen3ForCausalLM"),
    "mistral": ({"model.sliding_window": 16}, "MistralForCausalLM"),
    "gemma3": ({"model.norm_placement": "sandwich", "model.qk_norm": "per_head", "model.mlp_activation": "geglu",
                "model.norm_plus_one": True, "model.scale_embeddings": True, "model.sliding_window": 16,
                "model.layer_pattern": "LG", "model.rope_theta_local": 1e4, "model.tie_embeddings": True},
               "Gemma3ForCausalLM"),
    "deepseek_v3": ({"model.attention_kind": "mla", "model.q_lora_rank": 32, "model.kv_lora_rank": 32,
                     "model.qk_nope_head_dim": 16, "model.qk_rope_head_dim": 8, "model.v_head_dim": 16,
                     "model.num_kv_heads": 4, "model.num_experts": 4, "model.experts_per_token": 2,
                     "model.expert_mlp_dim": 64, "model.shared_experts": 1, "model.first_dense_layers": 1,
                     "model.router": "sigmoid", "model.load_balance": "bias", "model.router_groups": 2,
                     "model.router_topk_groups": 1, "model.mtp_depth": 1}, "DeepseekV3ForCausalLM"),
    "gpt2": ({"model.positions": "learned", "model.norm": "layernorm", "model.mlp_activation": "gelu",
              "model.use_bias": True, "model.num_kv_heads": 4, "model.tie_embeddings": True}, "GPT2LMHeadModel"),
}


@pytest.mark.ci  # three CLI runs each
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_cli_trains_the_family_resumes_bitwise_and_exports_it(tmp_path, data_dirs, family):
    keys, hf_class = FAMILIES[family]
    flags = ["--config=configs/tiny.py", "--config.mesh.data=1", "--config.mesh.fsdp=4", "--config.mesh.tensor=2",
             "--config.steps=6", "--config.checkpoint.every_steps=3", "--config.eval.every_steps=3",
             "--config.log_every_steps=1", "--config.optim.warmup_steps=2",
             *(f"--config.{k}={v}" for k, v in {**keys, **data_dirs}.items())]

    def run(module, *args):
        result = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                                timeout=300, env=command_env(tmp_path))
        assert result.returncode == 0, result.stderr[-3000:]

    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    run("maxlm.train", f"--workdir={whole}", *flags)
    assert list(whole.glob("events.out.tfevents.*"))  # TensorBoard
    assert [row["step"] for row in metrics_rows(whole) if "eval_loss" in row] == [3, 6]
    shutil.copytree(whole, resumed)
    shutil.rmtree(resumed / "checkpoints" / "6")
    run("maxlm.train", f"--workdir={resumed}", *flags)
    want, got = train_rows(whole), train_rows(resumed)
    assert [got[s]["loss"] for s in (4, 5, 6)] == [want[s]["loss"] for s in (4, 5, 6)]
    assert jax.tree.all(jax.tree.map(np.array_equal, saved_state(whole, 6), saved_state(resumed, 6)))
    assert want[6]["loss"] < want[1]["loss"]
    run("maxlm.export", f"--workdir={whole}", f"--out={tmp_path / 'hf'}")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == [hf_class]
