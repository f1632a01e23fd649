"""Users' tokenizers beside bytes and sentencepiece (maxlm/data/tokenizers/bpe.py): a Hugging Face
tokenizer.json and a tiktoken BPE file, told apart by content; their ids bitwise those of
transformers on Python's own source and Unicode text; bos/eos/pad by name or by key; the packed
cache keyed by the file's content; byte-level BPE training (`python -m maxlm.data tokenizer`); the
export's tokenizer files loading in `AutoTokenizer`. Every tokenizer here is trained in the test."""

from __future__ import annotations

import base64
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import jax
import numpy as np
import pytest

from maxlm import config as config_lib
from maxlm.data import HFTokenizer, SentencePieceTokenizer, TiktokenTokenizer, make_dataset
from maxlm.data.prepare import build
from maxlm.data.tokenizers import bpe, checked_tokenizer, kind_of, load_tokenizer
from maxlm.hf import files as hf
from maxlm.hf.tokenizer_files import bytes_to_unicode
from maxlm.resilience import data_position
from tests.helpers import ROOT, load_config, random_params, with_overrides

transformers = pytest.importorskip("transformers")

STDLIB = ("textwrap.py", "json/decoder.py", "heapq.py", "string.py", "shlex.py", "base64.py", "fractions.py")
UNICODE = ["你好，世界！这是一个用于测试分词器的中文句子，分词器应该学会常见的汉字组合。" * 3,
           "日本語のテキスト、カタカナとひらがな。", "한국어 문장입니다.", "emoji 🎉🚀👩‍💻 and a flag 🇫🇷!",
           "naïve café — “quotes” … ½ ∑ ∫ Ωμέγα Привет", "  leading spaces\n\n\ttabs\r\nCRLF   ",
           "12345678901234 3.14159 0xDEADBEEF", ""]
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<pad>"]


@pytest.fixture(scope="module")
def texts() -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return [(root / name).read_text(encoding="utf-8") for name in STDLIB] + UNICODE


def train_bpe(texts, vocab: int, specials=()):
    """A byte-level BPE (GPT-2's layout: specials first, then the 256 bytes, then the merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=list(specials), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def write_tiktoken(path: Path, texts, vocab: int) -> dict[bytes, int]:
    """A tiktoken BPE file: a byte-level BPE's tokens as bytes in base64, ranked by id (the order
    of its merges), one `BASE64 RANK` line each."""
    decode = {char: byte for byte, char in bytes_to_unicode().items()}
    ranks = {bytes(decode[c] for c in token): i for token, i in train_bpe(texts, vocab).get_vocab().items()}
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in sorted(ranks.items(), key=lambda x: x[1])))
    return ranks


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory, texts) -> Path:
    d = tmp_path_factory.mktemp("tokenizers")
    train_bpe(texts, 700, SPECIALS).save(str(d / "tokenizer.json"))
    write_tiktoken(d / "tokenizer.model", texts, 700)  # Llama 3's name for its tiktoken file
    return d


def _assert_same_ids(ours, theirs, texts, **kwargs):
    total = 0
    for text in texts:
        ids = ours.encode(text)
        assert ids.dtype == np.int32
        assert theirs(text, add_special_tokens=False, **kwargs).input_ids == ids.tolist(), text[:60]
        assert ours.decode(ids) == text
        total += len(ids)
    assert total > 50_000  # Python's source, not a toy
    batched, one_core = ours.encode_batch(texts), ours.encode_batch(texts, num_threads=1)
    assert all(a.tolist() == b.tolist() == ours.encode(t).tolist() for a, b, t in zip(batched, one_core, texts))


def test_tokenizer_json_ids_equal_transformers(tok_dir, texts):
    path = str(tok_dir / "tokenizer.json")
    ours = load_tokenizer(path)
    assert isinstance(ours, HFTokenizer) and kind_of((tok_dir / "tokenizer.json").read_bytes()) == "tokenizer.json"
    assert (ours.bos_id, ours.eos_id, ours.pad_id, ours.vocab_size) == (0, 1, 2, 700)  # by name, no key
    _assert_same_ids(ours, transformers.PreTrainedTokenizerFast(tokenizer_file=path), texts)
    # A document that spells a special token is text, as with AutoTokenizer's split_special_tokens
    spelled = "the end: <|end_of_text|> <pad>"
    split = transformers.PreTrainedTokenizerFast(tokenizer_file=path, split_special_tokens=True)
    assert split(spelled, add_special_tokens=False).input_ids == ours.encode(spelled).tolist()
    assert not {0, 1, 2} & set(ours.encode(spelled).tolist())
    assert ours.decode([0, *ours.encode("x y").tolist(), 1, 2, 10_000]) == "x y"  # specials, out of range dropped


def test_tiktoken_ids_equal_transformers_conversion(tok_dir, texts, monkeypatch):
    from transformers.convert_slow_tokenizer import TikTokenConverter

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")  # tiktoken's own loader caches files by path
    import tiktoken.load

    path = str(tok_dir / "tokenizer.model")
    ours = load_tokenizer(path)
    assert isinstance(ours, TiktokenTokenizer) and ours.ranks == tiktoken.load.load_tiktoken_bpe(path)
    n = len(ours.ranks)
    # Llama 3's layout: 256 special tokens after the ranks, bos/eos/pad found by name
    assert (ours.bos_id, ours.eos_id, ours.pad_id, ours.vocab_size) == (n, n + 1, n + 4, n + 256)
    assert inspect.signature(TikTokenConverter).parameters["pattern"].default == bpe.LLAMA3_PATTERN
    converted = TikTokenConverter(vocab_file=path, extra_special_tokens=list(bpe.LLAMA3_SPECIAL_TOKENS)).converted()
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_object=converted)
    assert theirs.convert_tokens_to_ids(["<|begin_of_text|>", "<|end_of_text|>", "<|finetune_right_pad_id|>",
                                         "<|reserved_special_token_247|>"]) == [n, n + 1, n + 4, n + 255]
    _assert_same_ids(ours, theirs, texts)


def test_the_kind_comes_from_the_content_not_the_name(tok_dir, sp_model, tmp_path):
    shutil.copy(tok_dir / "tokenizer.model", tmp_path / "vocab.txt")
    shutil.copy(tok_dir / "tokenizer.json", tmp_path / "tok.model")
    shutil.copy(sp_model, tmp_path / "sp.bin")
    assert isinstance(load_tokenizer(str(tmp_path / "vocab.txt")), TiktokenTokenizer)
    assert isinstance(load_tokenizer(str(tmp_path / "tok.model")), HFTokenizer)
    assert isinstance(load_tokenizer(str(tmp_path / "sp.bin")), SentencePieceTokenizer)
    lines = (tok_dir / "tokenizer.model").read_text().splitlines()
    (tmp_path / "bad.model").write_text("\n".join(lines[:2] + ["not base64!", *lines[2:]]))
    with pytest.raises(ValueError, match=r"bad.model:3: not a tiktoken line"):
        load_tokenizer(str(tmp_path / "bad.model"))
    (tmp_path / "junk.model").write_bytes(b"\x00\x01 neither of them")
    with pytest.raises(ValueError, match="neither a SentencePiece model, a tokenizer.json nor a tiktoken"):
        load_tokenizer(str(tmp_path / "junk.model"))


def test_special_tokens_by_name_by_key_and_the_errors(tmp_path, texts, tok_dir):
    def saved(name, specials):
        train_bpe(texts[:2], 400, specials).save(str(tmp_path / name))
        return str(tmp_path / name)

    gpt2 = load_tokenizer(saved("gpt2.json", ["<|endoftext|>"]))  # one token separates documents
    assert (gpt2.bos_id, gpt2.eos_id, gpt2.pad_id) == (0, 0, 0)
    llama2 = saved("llama2.json", ["<unk>", "<s>", "</s>"])
    assert (lambda t: (t.bos_id, t.eos_id, t.pad_id))(load_tokenizer(llama2)) == (1, 2, 2)  # pad: eos
    keyed = load_tokenizer(llama2, bos_token="</s>", eos_token="<s>", pad_token="<unk>")
    assert (keyed.bos_id, keyed.eos_id, keyed.pad_id) == (2, 1, 0)
    assert keyed.fingerprint != load_tokenizer(llama2).fingerprint and keyed.options["pad_token"] == "<unk>"
    with pytest.raises(ValueError, match=r"data.pad_token='<nope>' is not a token of the tokenizer.json"):
        load_tokenizer(llama2, pad_token="<nope>")
    bare = saved("bare.json", [])
    with pytest.raises(ValueError, match=r"no bos or eos token .*; set data.bos_token and data.eos_token to"):
        load_tokenizer(bare)
    named = load_tokenizer(bare, bos_token="a", eos_token="b")
    assert [*named.encode("a"), *named.encode("b")] == [named.bos_id, named.eos_id] == [64, 65]  # bytes' tokens
    assert named.pad_id == named.eos_id
    with pytest.raises(ValueError, match="data.tokenizer_pattern applies to a tiktoken BPE file only"):
        load_tokenizer(llama2, tokenizer_pattern=r"\S+")
    with pytest.raises(ValueError, match="data.bos_token applies to a tokenizer file, not to data.tokenizer=byte"):
        load_tokenizer("byte", bos_token="<s>")
    # tiktoken: its own special tokens and pre-tokenizer
    path = str(tok_dir / "tokenizer.model")
    llama3 = load_tokenizer(path)
    own = load_tokenizer(path, tokenizer_special_tokens="<|endoftext|>, <|pad|>")
    n = len(own.ranks)
    assert (own.bos_id, own.eos_id, own.pad_id, own.vocab_size) == (n, n, n + 1, n + 2)
    words = load_tokenizer(path, tokenizer_pattern=r"\s*\S+")
    text = "x = f(1234, 'it''s')  # naïve"
    assert words.encode(text).tolist() != llama3.encode(text).tolist() and words.decode(words.encode(text)) == text
    assert len({llama3.fingerprint, own.fingerprint, words.fingerprint}) == 3
    with pytest.raises(ValueError, match="data.tokenizer_pattern="):
        load_tokenizer(path, tokenizer_pattern="(unclosed")


def test_files_at_a_gs_url_read_as_local_ones(tok_dir):
    """Through etils.epath, as a SentencePiece model is: the job's process 0 reads the bytes."""
    from etils import epath

    from tests.gcs import BUCKET, fake_gcs

    with fake_gcs():
        for name in ("tokenizer.json", "tokenizer.model"):
            (epath.Path(f"gs://{BUCKET}") / name).write_bytes((tok_dir / name).read_bytes())
        cfg = config_lib.defaults()
        cfg.model.vocab_size = 1024
        cfg.data.tokenizer, cfg.data.pad_token = f"gs://{BUCKET}/tokenizer.json", "<|end_of_text|>"
        remote = checked_tokenizer(cfg)
        local = load_tokenizer(str(tok_dir / "tokenizer.json"), pad_token="<|end_of_text|>")
        assert (remote.fingerprint, remote.pad_id, remote.spec) == (local.fingerprint, 1, cfg.data.tokenizer)
        remote = load_tokenizer(f"gs://{BUCKET}/tokenizer.model", job=True)
        assert isinstance(remote, TiktokenTokenizer)
        assert remote.fingerprint == load_tokenizer(str(tok_dir / "tokenizer.model")).fingerprint


def test_sentencepiece_pieces_by_key(tmp_path, texts):
    """A model without a pad piece (Llama 2's) runs with data.pad_token naming one."""
    import sentencepiece as spm

    (tmp_path / "corpus.txt").write_text("\n".join(texts[:2]))
    spm.SentencePieceTrainer.train(input=str(tmp_path / "corpus.txt"), model_prefix=str(tmp_path / "llama2"),
                                   vocab_size=400, model_type="bpe", byte_fallback=True, unk_id=0, bos_id=1,
                                   eos_id=2, pad_id=-1, hard_vocab_limit=False, minloglevel=2)
    path = str(tmp_path / "llama2.model")
    with pytest.raises(ValueError, match="does not define pad; .* or name its pieces with data.pad_token"):
        load_tokenizer(path)
    tok = load_tokenizer(path, pad_token="<unk>")
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert (load_tokenizer(path, pad_token="<unk>", eos_token="<s>").eos_id, tok.options) == (1, {"pad_token": "<unk>"})
    with pytest.raises(ValueError, match=re.escape("data.bos_token='<|nope|>' is not a piece of the SentencePiece model")):
        load_tokenizer(path, pad_token="<unk>", bos_token="<|nope|>")


def _folder_config(tmp_path, texts, **overrides):
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    for i, text in enumerate(texts):
        (src / f"doc{i:02d}.txt").write_text(text or "-", encoding="utf-8")
    c = config_lib.defaults()
    c.seq_len, c.batch_size, c.model.vocab_size = 64, 4, 1024
    c.data.source, c.data.cache_dir, c.data.validation_percent = str(src), str(tmp_path / "packed"), 20.0
    return config_lib.apply_overrides(c, overrides)


def test_the_cache_key_follows_the_files_content_and_the_keys(tmp_path, texts):
    path = tmp_path / "tok" / "tokenizer.json"
    path.parent.mkdir()
    train_bpe(texts, 500, SPECIALS).save(str(path))
    cfg = _folder_config(tmp_path, texts[:3], **{"data.tokenizer": str(path)})
    first = build.cache_path(cfg, "train")[0]
    train_bpe(texts, 520, SPECIALS).save(str(path))  # the same path, other merges
    second = build.cache_path(cfg, "train")[0]
    keyed = build.cache_path(config_lib.apply_overrides(cfg, {"data.pad_token": "<|end_of_text|>"}), "train")[0]
    assert len({first, second, keyed}) == 3
    tiktoken_path = tmp_path / "tok" / "llama.model"
    write_tiktoken(tiktoken_path, texts, 400)
    cfg = config_lib.apply_overrides(cfg, {"data.tokenizer": str(tiktoken_path)})
    before = build.cache_path(cfg, "train")[0]
    with open(tiktoken_path, "a") as f:
        f.write(f"{base64.b64encode(b'zzzz').decode()} 400\n")
    assert build.cache_path(cfg, "train")[0] != before


def test_batches_of_a_tiktoken_file_with_its_keys(tmp_path, tok_dir):
    documents = [*UNICODE[1:7], "def f(x):\n    return x + 1\n", "import os\nprint(os.sep)\n"]
    cfg = _folder_config(tmp_path, documents, **{"data.tokenizer": str(tok_dir / "tokenizer.model"),
                                                 "data.tokenizer_special_tokens": "<|bos|>,<|eos|>,<|pad|>",
                                                 "data.validation_percent": 0.0})
    ds = make_dataset(cfg, "train")
    tok = ds.tokenizer
    n = len(tok.ranks)
    assert isinstance(tok, TiktokenTokenizer) and (tok.bos_id, tok.eos_id, tok.pad_id) == (n, n + 1, n + 2)
    rows, meta = build.prepare(cfg, "train")
    assert meta["tokenizer_fingerprint"] == tok.fingerprint and meta["vocab_size"] == n + 3
    batch = ds.batch(0)
    started = (batch["positions"][:, 1:] == 0) & (batch["segment_ids"][:, 1:] > 0)  # (a row's first continues)
    assert started.any() and (batch["inputs"][:, 1:][started] == n).all()  # bos opens each document
    assert (batch["inputs"][batch["segment_ids"] == 0] == n + 2).all()  # padding
    whole = []
    for inputs, targets, segments in zip(batch["inputs"], batch["targets"], batch["segment_ids"]):
        for s in range(1, segments.max() + 1):
            at = segments == s
            if inputs[at][0] == n and targets[at][-1] == n + 1:  # a whole document, from bos to eos
                whole.append(tok.decode(inputs[at][1:]))
    assert whole and set(whole) <= set(documents)


def test_a_checkpoint_before_the_tokenizer_keys_resumes_unchanged():
    cfg = config_lib.defaults()
    recorded = data_position.stream_keys(cfg.to_dict())
    older = {k: v for k, v in recorded.items() if not k.endswith(("_token", "tokenizer_pattern", "special_tokens"))}
    assert len(older) < len(recorded) and data_position.changes(older, cfg) == []
    cfg.data.eos_token = "</s>"
    assert data_position.changes(older, cfg) == ["data.eos_token='</s>' (checkpoint: '')"]


def _cli(tmp_path, command, *args):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    return subprocess.run([sys.executable, "-m", "maxlm.data", command, f"--config={tmp_path / 'cfg.py'}", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=180, env=env)


@pytest.mark.slow
def test_train_a_byte_level_bpe_and_use_it(tmp_path, texts):
    """`python -m maxlm.data tokenizer --out=X.json` with special tokens, read back by data.tokenizer;
    a tokenizer.json with no bos or eos stops the command with one line naming the keys."""
    from tokenizers import Tokenizer

    cfg = _folder_config(tmp_path, texts[:4] + [UNICODE[0] * 20, *UNICODE[1:]] * 3)
    (tmp_path / "cfg.py").write_text(f"import json\nfrom maxlm import config\n\n\ndef get_config():\n"
                                     f"    return config.from_recorded(json.loads({config_lib.to_json(cfg)!r}))\n")
    out = tmp_path / "tok" / "tokenizer.json"
    r = _cli(tmp_path, "tokenizer", f"--out={out}", "--special_tokens=<|im_start|>,<|im_end|>",
             "--config.data.tokenizer_vocab_size=600")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["special_tokens"] == ["<|pad|>", "<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"]
    assert (summary["pad_id"], summary["bos_id"], summary["eos_id"]) == (0, 1, 2) and summary["vocab_size"] == 600
    assert [Tokenizer.from_file(str(out)).token_to_id(t) for t in summary["special_tokens"]] == [0, 1, 2, 3, 4]
    tok = load_tokenizer(str(out))
    assert isinstance(tok, HFTokenizer) and (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    for text in [*texts, "<|im_start|>user 你好<|im_end|>", "🐍 é\x00\U0010ffff"]:
        assert tok.decode(tok.encode(text)) == text  # bytes: nothing is unknown
    chinese = UNICODE[0]
    assert len(tok.encode(chinese)) < len(chinese.encode("utf-8")) / 2  # it learned the CJK merges

    r = _cli(tmp_path, "stats", f"--config.data.tokenizer={out}")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["tokens"] > 0
    train_bpe(texts[:2], 300).save(str(tmp_path / "bare.json"))
    r = _cli(tmp_path, "stats", f"--config.data.tokenizer={tmp_path / 'bare.json'}")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "set data.bos_token and data.eos_token" in r.stderr


def test_train_sentencepiece_with_special_tokens(tmp_path, texts):
    from maxlm.data.__main__ import train_tokenizer

    cfg = _folder_config(tmp_path, texts[:3], **{"data.tokenizer_vocab_size": 400})
    summary = train_tokenizer(cfg, str(tmp_path / "sp.model"), ["<|im_start|>", "<|im_end|>"])
    tok = load_tokenizer(summary["model"])
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 2, 3) and tok._sp.piece_to_id("<|im_start|>") == 4
    text = "<|im_start|>def f(x): return x<|im_end|>"
    assert 4 not in tok.encode(text).tolist() and tok.decode(tok.encode(text)) == text  # specials: text


def _export_cfg(tokenizer: str):
    base = {"metrics.tensorboard": False, "eval.every_steps": 0, "data.tokenizer": tokenizer, "model.vocab_size": 1024}
    return config_lib.resolve(with_overrides(load_config("tiny"), base), jax.device_count())


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer.model"])
def test_the_export_writes_the_runs_tokenizer(tmp_path, tok_dir, texts, name):
    cfg = _export_cfg(str(tok_dir / name))
    ours = load_tokenizer(cfg.data.tokenizer)
    files = hf.export(random_params(cfg.model), cfg, str(tmp_path / "hf"))
    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"} <= set(files)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert (theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id) == (ours.bos_id, ours.eos_id, ours.pad_id)
    for text in texts:
        ids = ours.encode(text).tolist()
        assert theirs(text).input_ids == [ours.bos_id, *ids]  # bos first, as maxlm frames a document
        assert theirs.decode(ids) == text
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (written["bos_token_id"], written["eos_token_id"], written["vocab_size"]) == (ours.bos_id, ours.eos_id, 1024)
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert generation["suppress_tokens"] == list(range(ours.vocab_size, 1024))
    # transformers' default stays: there, text that spells a special token is that token
    assert theirs("<|end_of_text|>", add_special_tokens=False).input_ids == [ours.eos_id]
    for model_type in ("mixtral", "qwen3", "gpt2", "olmo2", "gemma3_text", "deepseek_v3"):  # other classes' configs
        other = tmp_path / model_type
        other.mkdir()
        for file in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            shutil.copy(tmp_path / "hf" / file, other / file)
        (other / "config.json").write_text(json.dumps({"model_type": model_type}))
        text = texts[-3]
        assert transformers.AutoTokenizer.from_pretrained(str(other))(text).input_ids == [ours.bos_id,
                                                                                          *ours.encode(text).tolist()]
