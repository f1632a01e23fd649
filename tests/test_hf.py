"""Hugging Face export and import (maxlm/hf/files.py, `python -m maxlm.export`,
`checkpoint.init_from_hf`): transformers' LlamaForCausalLM gives maxlm's logits on an export
(tied and untied embeddings, grouped-query attention, a head_dim other than d_model/heads, a
non-default RoPE base and norm eps); export → import is bitwise exact, onto sharded meshes with
each device receiving only its shard, from single or sharded files, scanned or unrolled; a
training run starts from an export with the export's loss; mismatches are one clear error (exit 2);
the tokenizer files load in transformers; models without RoPE are refused."""

import functools
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxlm import config as config_lib, model
from maxlm.checkpoint import saved_run
from maxlm.data import make_dataset
from maxlm.data.tokenizers import ByteTokenizer, SentencePieceTokenizer
from maxlm.hf import config_json as hf_config_json, files as hf
from maxlm.sharding import mesh as mesh_lib, state as state_lib
from maxlm.train import loop
from tests.helpers import ROOT, command_env, load_config, random_params, with_overrides

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _cfg(overrides=None):
    """configs/tiny.py (4 heads, 2 kv heads, d_model 64, 2 layers, vocab 264) on 8 devices."""
    base = {"metrics.tensorboard": False, "eval.every_steps": 0}
    return config_lib.resolve(with_overrides(load_config("tiny"), {**base, **(overrides or {})}),
                              jax.device_count())


def _sequence(length, vocab, seed=0):
    """One unpacked sequence: positions 0..L-1, one segment."""
    tokens_1L = np.random.default_rng(seed).integers(3, vocab, size=(1, length)).astype(np.int32)
    return {"inputs": tokens_1L, "segment_ids": np.ones_like(tokens_1L),
            "positions": np.arange(length, dtype=np.int32)[None]}


def _hf_logits(directory, tokens_1L):
    hf_model = transformers.LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32)
    with torch.no_grad():
        return hf_model(torch.from_numpy(tokens_1L.astype(np.int64))).logits.numpy()


def _bits(x):
    return np.asarray(x, np.float32).view(np.uint32)


def _assert_bitwise_equal(got, want):
    flat_got, flat_want = jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)
    assert len(flat_got) == len(flat_want)
    for (path, a), b in zip(flat_got, flat_want):
        assert a.dtype == jnp.float32 and a.shape == b.shape, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=jax.tree_util.keystr(path))


def _abstract(cfg):
    rules, mesh = mesh_lib.rules_of(cfg.mesh), mesh_lib.make_mesh(cfg.mesh)
    return state_lib.abstract_params(cfg.model, state_lib.param_shardings(cfg.model, mesh, rules))


# ----------------------------------------------------------------------------- export


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_export_logits_equal_transformers(tmp_path, tied):
    overrides = {"model.tie_embeddings": tied}
    if not tied:  # also: head_dim != d_model / num_heads, RoPE base and norm eps not the defaults
        overrides.update({"model.head_dim": 24, "model.rope_theta": 5e5, "model.norm_eps": 1e-6})
    cfg = _cfg(overrides)
    params = random_params(cfg.model)
    files = hf.export(params, cfg, str(tmp_path))
    assert set(files) >= {"model.safetensors", "config.json", "generation_config.json",
                          "tokenizer_config.json"}
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["max_position_embeddings"] == cfg.seq_len == 64
    assert (written["bos_token_id"], written["eos_token_id"], written["tie_word_embeddings"]) == (1, 2, tied)
    batch = _sequence(48, 259)
    ours = np.asarray(jax.jit(functools.partial(model.apply, cfg.model))(params, batch))
    theirs = _hf_logits(str(tmp_path), batch["inputs"])
    assert theirs.shape == ours.shape == (1, 48, 264)
    np.testing.assert_allclose(theirs, ours, atol=1e-4, rtol=0)
    assert np.abs(ours).max() > 0.5  # logits far from zero: the comparison means something


def test_export_leaves_out_the_mtp_modules_with_one_line_and_import_refuses_them(tmp_path, capsys):
    """The multi-token prediction modules have no place in transformers' Llama: the export is the
    main model's, said once; starting an MTP run from a Llama checkpoint is refused (exit 2)."""
    cfg, plain = _cfg({"model.mtp_depth": 2}), _cfg()
    params = random_params(cfg.model)
    hf.export(params, cfg, str(tmp_path))
    assert capsys.readouterr().err.count("leaves out the 2 multi-token prediction module(s)") == 1
    main = {k: v for k, v in params.items() if not k.startswith("mtp_")}
    _assert_bitwise_equal(hf.load_params(str(tmp_path), plain.model, _abstract(plain)), main)
    with pytest.raises(config_lib.ConfigError, match=r"init_from_hf=.* with model.mtp_depth=2: .* model.mtp_depth=0"):
        hf.check_init_from_hf(with_overrides(cfg, {"checkpoint.init_from_hf": str(tmp_path)}))


# ----------------------------------------------------------------------------- import


@pytest.mark.parametrize("mesh", [(1, 8, 1), (2, 2, 2), (1, 4, 2)], ids=lambda m: "x".join(map(str, m)))
def test_import_round_trip_is_exact_and_sharded(tmp_path, monkeypatch, mesh):
    """Export → import gives the parameters back bit for bit on a sharded mesh; each device gets
    only its shard and every read is one layer's shard of a tensor, never the whole tensor."""
    data, fsdp, tensor = mesh
    cfg = _cfg({"mesh.data": data, "mesh.fsdp": fsdp, "mesh.tensor": tensor})
    params = random_params(cfg.model, seed=3)
    hf.export(params, cfg, str(tmp_path))
    reads = []
    read_block = hf.read_block

    def recording(hf_slice, t, index):
        block = read_block(hf_slice, t, index)
        reads.append((t.hf_shape, block.size))
        return block

    monkeypatch.setattr(hf, "read_block", recording)
    loaded = hf.load_params(str(tmp_path), cfg.model, _abstract(cfg))
    _assert_bitwise_equal(loaded, params)
    for leaf, want in zip(jax.tree.leaves(loaded), jax.tree.leaves(params)):
        shard_shape = leaf.sharding.shard_shape(leaf.shape)
        for shard in leaf.addressable_shards:
            assert shard.data.shape == shard_shape
            np.testing.assert_array_equal(_bits(shard.data), _bits(np.asarray(want)[shard.index]))
    # Matrices are split over fsdp (embed) and tensor (heads/mlp/vocab), norm scales over fsdp.
    for hf_shape, size in reads:
        split = fsdp * tensor if len(hf_shape) == 2 else fsdp
        assert size * split == np.prod(hf_shape), (hf_shape, size)


def test_import_from_sharded_files_bfloat16_and_unrolled(tmp_path):
    cfg = _cfg()
    unrolled_cfg = _cfg({"model.scan_layers": False})
    unrolled = random_params(unrolled_cfg.model, seed=5)
    stacked = model.stack_layers(unrolled)
    # unrolled params, written in several files: read back into the scanned layout
    files = hf.export(unrolled, unrolled_cfg, str(tmp_path / "split"), max_shard_bytes=40_000)
    shards = sorted(f for f in os.listdir(tmp_path / "split") if f.endswith(".safetensors"))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert hf.INDEX in files and "model.safetensors" not in files
    _assert_bitwise_equal(hf.load_params(str(tmp_path / "split"), cfg.model, _abstract(cfg)), stacked)
    # scanned → unrolled
    hf.export(stacked, cfg, str(tmp_path / "one"))
    _assert_bitwise_equal(
        hf.load_params(str(tmp_path / "one"), unrolled_cfg.model, _abstract(unrolled_cfg)), unrolled)
    # bfloat16 weights: the parameters rounded to bfloat16 (and float32 again on import)
    hf.export(stacked, cfg, str(tmp_path / "bf16"), dtype="bfloat16")
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    rounded = jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), stacked)
    _assert_bitwise_equal(hf.load_params(str(tmp_path / "bf16"), cfg.model, _abstract(cfg)), rounded)
    with pytest.raises(config_lib.ConfigError, match="already holds an export"):
        hf.export(stacked, cfg, str(tmp_path / "one"))


def test_mismatches_are_one_clear_error(tmp_path):
    cfg = _cfg()
    hf.export(random_params(cfg.model), cfg, str(tmp_path))
    other = _cfg({"model.num_kv_heads": 4, "model.mlp_dim": 256, "model.tie_embeddings": True})
    with pytest.raises(config_lib.ConfigError) as e:
        hf.load_params(str(tmp_path), other.model, _abstract(other))
    message = str(e.value)
    for part in ("model.num_kv_heads=4 but the checkpoint has 2",
                 "model.mlp_dim=256 but the checkpoint has 128",
                 "model.tie_embeddings=True but the checkpoint has False",
                 "--config.model.num_kv_heads=2 --config.model.mlp_dim=128"):
        assert part in message
    # features maxlm's model has no counterpart for
    hf_cfg = json.loads((tmp_path / "config.json").read_text())
    scaled = dict(hf_cfg, rope_parameters={"rope_type": "dynamic", "rope_theta": 5e5, "factor": 32.0},
                  attention_bias=True, model_type="mistral")
    with pytest.raises(config_lib.ConfigError, match="rope type 'dynamic'.*attention_bias=true") as e:
        hf_config_json.check_config(scaled, cfg.model, "X")
    assert "mistral" in str(e.value)
    with pytest.raises(config_lib.ConfigError, match="config.json lacks num_hidden_layers"):
        hf_config_json.check_config({"model_type": "llama"}, cfg.model, "X")
    # weights that do not fit the config they came with
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps(hf_cfg))
    from safetensors.numpy import save_file

    save_file({"model.embed_tokens.weight": np.zeros((264, 32), np.float32)}, str(bad / hf.WEIGHTS))
    with pytest.raises(config_lib.ConfigError, match=r"embed_tokens.weight has shape \[264, 32\], "
                       r"expected \[264, 64\]; model.layers.0.input_layernorm.weight missing"):
        hf.load_params(str(bad), cfg.model, _abstract(cfg))
    with pytest.raises(config_lib.ConfigError, match="no config.json"):
        hf.read_dir(str(tmp_path / "nowhere"))
    both = _cfg({"checkpoint.init_from_hf": str(tmp_path), "checkpoint.restore_from": str(tmp_path)})
    with pytest.raises(config_lib.ConfigError, match="both set"):
        hf.check_init_from_hf(both)


NO_CLASS = {  # a Llama-shaped run with another position encoding: why no transformers class holds it
    "sinusoidal": "has no class for model.positions='sinusoidal': the transformers classes maxlm maps have RoPE "
                  "(Llama, Mistral, Qwen3, Olmo2, Olmo3, Gemma2, Gemma3, Mixtral, Qwen3Moe, DeepseekV3) or a learned table "
                  "(GPT2)",
    "learned": "maps model.positions='learned', model.norm='rmsnorm', model.mlp_activation='swiglu' and "
               "model.use_bias=False to GPT2LMHeadModel alone (the other classes have RoPE, RMSNorm, a gated MLP, "
               "no biases), which needs model.norm='layernorm' (not 'rmsnorm'); model.mlp_activation='gelu' (not "
               "'swiglu'); model.use_bias=True; model.num_kv_heads=model.num_heads=4 (not 2)",
}


@pytest.mark.parametrize("positions", ["sinusoidal", "learned"])
def test_non_rope_models_without_a_class_are_refused(tmp_path, positions):
    """Only RoPE classes, and GPT-2 with its learned table, hold position encodings: export and
    import refuse others with one line, before writing or reading anything."""
    cfg = _cfg({"model.positions": positions, "checkpoint.init_from_hf": str(tmp_path / "hf")})
    why = re.escape(NO_CLASS[positions])
    with pytest.raises(config_lib.ConfigError, match=f"^the Hugging Face export {why}"):
        hf.export(random_params(cfg.model), cfg, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
    with pytest.raises(config_lib.ConfigError, match=re.escape(f"checkpoint.init_from_hf={tmp_path / 'hf'} ") + why):
        hf.check_init_from_hf(cfg)  # before reading the folder (there is none)
    with pytest.raises(config_lib.ConfigError, match=why):
        hf.load_params(str(tmp_path / "hf"), cfg.model, _abstract(cfg))


def test_export_cli_refuses_a_non_rope_run(tmp_path):
    """Refused from the run's config.json alone, before its checkpoint is restored."""
    cfg = _cfg({"model.positions": "learned"})
    (tmp_path / "config.json").write_text(config_lib.to_json(cfg))
    result = _cli("maxlm.export", f"--workdir={tmp_path}", f"--out={tmp_path / 'hf'}")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"maxlm: config error: the Hugging Face export {NO_CLASS['learned']}"]
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("model_type", [None, "mixtral"])
def test_sentencepiece_tokenizer_files_load_in_transformers(tmp_path, model_type):
    """Alone, and beside a Mixtral config.json (AutoTokenizer then takes another path: its fast
    backend, converted from tokenizer.model)."""
    import sentencepiece as spm

    words = "the quick brown fox jumps over lazy dog def class return import 2024 naïve café".split()
    rng = np.random.default_rng(0)
    (tmp_path / "corpus.txt").write_text("\n".join(" ".join(rng.choice(words, 12)) for _ in range(300)))
    spm.SentencePieceTrainer.train(  # the options of `python -m maxlm.data tokenizer`
        input=str(tmp_path / "corpus.txt"), model_prefix=str(tmp_path / "tok"), vocab_size=320,
        model_type="bpe", byte_fallback=True, pad_id=0, unk_id=1, bos_id=2, eos_id=3,
        normalization_rule_name="identity", remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True, split_digits=True, hard_vocab_limit=False, minloglevel=2)
    ours = SentencePieceTokenizer(tmp_path / "tok.model")
    out = tmp_path / "hf"
    out.mkdir()
    hf.write_tokenizer(ours, str(out), seq_len=64)
    if model_type:
        (out / "config.json").write_text(json.dumps({"model_type": model_type}))
    theirs = transformers.AutoTokenizer.from_pretrained(str(out))
    assert (theirs.pad_token_id, theirs.bos_token_id, theirs.eos_token_id) == (0, 2, 3)
    for text in ["the quick brown fox 12345", "naïve café ünïcödé 42\n\n", "def f(x):\n    return x  "]:
        ids = ours.encode(text).tolist()
        assert theirs(text, add_special_tokens=False).input_ids == ids
        assert theirs(text).input_ids == [ours.bos_id, *ids]  # bos first, as maxlm frames a document
        assert theirs.decode(ids) == ours.decode(ids) == text


# ----------------------------------------------------------------------------- a real run, the CLIs


def _cli(*args, devices=8):
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=command_env(os.environ.get("HOME", "/tmp"), devices))


@pytest.fixture(scope="module")
def exported(tmp_path_factory, data_dirs):
    """A 6-step tiny run (fsdp=8), exported with `python -m maxlm.export`."""
    workdir = tmp_path_factory.mktemp("run")
    cfg = _cfg({**data_dirs, "steps": 6, "checkpoint.every_steps": 6})
    loop.train_and_evaluate(cfg, str(workdir))
    out = tmp_path_factory.mktemp("export") / "hf"
    result = _cli("maxlm.export", f"--workdir={workdir}", f"--out={out}")
    assert result.returncode == 0, result.stderr
    return workdir, out, json.loads(result.stdout.splitlines()[-1])


def test_export_cli(exported):
    workdir, out, printed = exported
    assert printed["step"] == 6 and printed["dtype"] == "float32"
    assert sorted(os.listdir(out)) == sorted(printed["files"])
    run = saved_run.load_run(str(workdir))
    batch = _sequence(64, 259, seed=1)
    ours = np.asarray(jax.jit(functools.partial(model.apply, run["config"].model))(run["params"], batch))
    np.testing.assert_allclose(_hf_logits(str(out), batch["inputs"]), ours, atol=1e-4, rtol=0)
    # byte tokens: ByT5Tokenizer has maxlm's byte ids and special ids
    tok, ours_tok = transformers.AutoTokenizer.from_pretrained(str(out)), ByteTokenizer()
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    text = "naïve café: x = 1\n"
    ids = ours_tok.encode(text).tolist()
    assert tok(text, add_special_tokens=False).input_ids == ids
    assert tok.decode([1, *ids, 2], skip_special_tokens=True) == text
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["suppress_tokens"] == [259, 260, 261, 262, 263]  # vocab padded past the bytes
    bad = _cli("maxlm.export", f"--workdir={workdir}", f"--out={out}", "--dtype=float16")
    assert bad.returncode == 2 and "--dtype='float16'" in bad.stderr


def test_training_starts_from_the_export(exported, tmp_path, data_dirs):
    """init_from_hf: step 0's loss is the exported parameters' loss on batch 0; once the workdir
    has a checkpoint, resuming wins over init_from_hf (here a folder that no longer exists)."""
    source, out, _ = exported
    overrides = {**data_dirs, "steps": 2, "optim.warmup_steps": 1, "checkpoint.every_steps": 2,
                 "seed": 7, "checkpoint.init_from_hf": str(out)}
    cfg = _cfg(overrides)
    run = saved_run.load_run(str(source))
    rules, mesh = mesh_lib.rules_of(cfg.mesh), mesh_lib.make_mesh(cfg.mesh)
    dataset = make_dataset(cfg, "train")
    initial = model.init_params(cfg.model, jax.random.key(cfg.seed))
    with mesh_lib.activate(mesh, rules):
        batch = mesh_lib.read_batch(dataset, 0, mesh, rules)
        loss_of = jax.jit(lambda p: model.loss_fn(cfg.model, p, batch)[1]["cross_entropy"])
        expected, fresh = float(loss_of(run["params"])), float(loss_of(initial))
    assert abs(expected - fresh) > 0.05  # the run learned something: the check can tell them apart
    last = loop.train_and_evaluate(cfg, str(tmp_path))
    assert last["first_loss"] == pytest.approx(expected, rel=1e-5)
    gone = _cfg({**overrides, "checkpoint.init_from_hf": str(tmp_path / "deleted")})
    loop.check_start(gone, str(tmp_path))  # init_from_hf not read: the workdir has its own checkpoint
    assert loop.train_and_evaluate(gone, str(tmp_path)) == {}  # resumed at step 2: nothing to do


def test_train_cli_rejects_a_mismatched_checkpoint(exported, tmp_path, data_dirs):
    _, out, _ = exported
    workdir = tmp_path / "run"
    flags = [f"--config.{k}={v}" for k, v in data_dirs.items()]
    result = _cli("maxlm.train", "--config=configs/tiny.py", f"--workdir={workdir}", *flags,
                  f"--config.checkpoint.init_from_hf={out}", "--config.model.num_kv_heads=4",
                  "--config.model.num_layers=3")
    assert result.returncode == 2, result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("maxlm: config error: checkpoint.init_from_hf=")
    assert "model.num_layers=3 but the checkpoint has 2" in line and "model.num_kv_heads=4" in line
    assert not (workdir / "checkpoints").exists()


def test_model_from_hf_takes_the_folders_model_keys_through_the_cli(exported, tmp_path, data_dirs):
    """Issue 54: starting from a published model took a dozen flags; `model.from_hf=True` takes the
    model keys from the folder's config.json (here tiny's export on a config of another shape) and
    says which it set; without a folder it is exit 2."""
    _, out, _ = exported
    flags = [f"--config.{k}={v}" for k, v in data_dirs.items()]
    base = ["maxlm.train", "--config=configs/tiny.py", "--config.model.num_layers=3", "--config.model.d_model=96",
            "--config.steps=2", "--config.optim.warmup_steps=1", "--config.model.from_hf=True", *flags]
    done = _cli(*base, f"--workdir={tmp_path / 'run'}", f"--config.checkpoint.init_from_hf={out}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "model.num_layers=2" in done.stderr and "model.d_model=64" in done.stderr
    recorded = json.loads((tmp_path / "run" / "config.json").read_text())["model"]
    assert (recorded["num_layers"], recorded["d_model"]) == (2, 64)
    refused = _cli(*base, f"--workdir={tmp_path / 'none'}")
    assert refused.returncode == 2 and "set checkpoint.init_from_hf=PATH as well" in refused.stderr
