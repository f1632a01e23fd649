"""The tokenizer files of a Hugging Face export (`maxlm/hf/files.py`): what
`transformers.AutoTokenizer.from_pretrained(DIR)` loads with the ids the run trained on.

- SentencePiece: the `.model` as `tokenizer.model` with a `LlamaTokenizer` config.
- tokenizer.json: the run's file, with a post-processor that puts bos first (as maxlm frames a
  document) in place of its own.
- tiktoken: the `tokenizers` BPE that transformers' `TikTokenConverter` makes of the file (the same
  vocabulary, merges, pre-tokenizer regex and special tokens), with the same bos post-processor.
- byte: a `ByT5Tokenizer` config.

The last three come with a `PreTrainedTokenizerFast` tokenizer_config.json naming bos, eos and pad.
"""

from __future__ import annotations

import json
import os


def write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=False)
        f.write("\n")


def _special(content: str) -> dict:
    return {"content": content, "special": True, "lstrip": False, "rstrip": False,
            "normalized": False, "single_word": False}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, which byte-level BPE vocabularies are written in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = (b for b in range(256) if b not in printable)
    return {b: chr(b) for b in printable} | {b: chr(256 + n) for n, b in enumerate(extra)}


def tiktoken_to_tokenizers(ranks: dict[bytes, int], pattern: str, special_tokens: dict[str, int]):
    """A `tokenizers.Tokenizer` that encodes as tiktoken does with these ranks, regex and special
    tokens: transformers' `TikTokenConverter` (convert_slow_tokenizer.py), without reading a file."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    byte_encoder = bytes_to_unicode()

    def text(token: bytes) -> str:
        return "".join(byte_encoder[b] for b in token)

    merges = []
    for token, rank in ranks.items():  # every split of a token into two tokens merges into it
        splits = [(token[:i], token[i:], rank) for i in range(1, len(token))]
        merges += sorted((m for m in splits if m[0] in ranks and m[1] in ranks), key=lambda m: (ranks[m[0]], ranks[m[1]]))
    merges.sort(key=lambda m: m[2])
    tok = Tokenizer(models.BPE({text(t): r for t, r in ranks.items()}, [(text(a), text(b)) for a, b, _ in merges],
                               fuse_unk=False))
    tok.model.ignore_merges = True  # a piece that is a token is that token, as in tiktoken
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    names = sorted(special_tokens, key=special_tokens.get)
    tok.add_special_tokens([AddedToken(name, normalized=False, special=True) for name in names])
    assert all(tok.token_to_id(name) == special_tokens[name] for name in names)
    return tok


def _bos_first(tok, bos: str, bos_id: int) -> None:
    """`tok`'s post-processor: bos before the text (before each of a pair's), after the byte-level
    one's offsets if it had one, in place of any other (one that added eos, say)."""
    from tokenizers import processors

    template = processors.TemplateProcessing(single=[bos, "$A"], pair=[bos, "$A", bos, "$B"],
                                             special_tokens=[(bos, bos_id)])
    byte_level = json.loads(tok.to_str()).get("post_processor") or {}
    kept = [p for p in byte_level.get("processors", [byte_level]) if p.get("type") == "ByteLevel"]
    tok.post_processor = (processors.Sequence([processors.ByteLevel(trim_offsets=False), template]) if kept
                          else template)


def _write_fast(tokenizer, out: str) -> tuple[list[str], dict, dict]:
    """tokenizer.json of a tokenizer.json or tiktoken run, and its config."""
    from tokenizers import Tokenizer

    from maxlm.data.tokenizers.bpe import HFTokenizer

    if isinstance(tokenizer, HFTokenizer):
        tok = Tokenizer.from_str(tokenizer.data.decode("utf-8"))
        tok.no_truncation()
        tok.no_padding()
    else:
        tok = tiktoken_to_tokenizers(tokenizer.ranks, tokenizer.pattern, tokenizer.special_tokens)
    pieces = {kind: tok.id_to_token(getattr(tokenizer, f"{kind}_id")) for kind in ("pad", "bos", "eos")}
    _bos_first(tok, pieces["bos"], tokenizer.bos_id)
    tok.save(os.path.join(out, "tokenizer.json"))
    return ["tokenizer.json"], pieces, {"tokenizer_class": "PreTrainedTokenizerFast"}


def write_tokenizer(tokenizer, out: str, seq_len: int) -> list[str]:
    """The tokenizer files transformers' `AutoTokenizer` loads.

    SentencePiece: the `.model` as `tokenizer.model` with a `LlamaTokenizer` config (bos added,
    eos not, as maxlm frames documents). tokenizer.json and tiktoken: a tokenizer.json (bos added
    by its post-processor). Byte tokens: a `ByT5Tokenizer` config, whose byte ids are maxlm's
    (byte b = id b + 3) and whose special tokens are renamed to maxlm's pad 0, bos 1, eos 2 (see
    docs/huggingface.md for what it does differently: it appends eos instead of prepending bos).
    """
    from maxlm.data.tokenizers import ByteTokenizer
    from maxlm.data.tokenizers.bpe import HFTokenizer, TiktokenTokenizer

    if isinstance(tokenizer, ByteTokenizer):
        pieces = {"pad": "<pad>", "bos": "<s>", "eos": "</s>", "unk": "<unk>"}
        config = {
            "tokenizer_class": "ByT5Tokenizer",
            "extra_ids": 0,
            "added_tokens_decoder": {str(tokenizer.pad_id): _special(pieces["pad"]),
                                     str(tokenizer.bos_id): _special(pieces["bos"]),
                                     str(tokenizer.eos_id): _special(pieces["eos"])},
        }
        files = []
    elif isinstance(tokenizer, (HFTokenizer, TiktokenTokenizer)):
        files, pieces, config = _write_fast(tokenizer, out)
    else:
        import sentencepiece as spm

        with open(os.path.join(out, "tokenizer.model"), "wb") as f:
            f.write(tokenizer.proto)
        sp = spm.SentencePieceProcessor(model_proto=tokenizer.proto)
        pieces = {"pad": sp.id_to_piece(tokenizer.pad_id), "bos": sp.id_to_piece(tokenizer.bos_id),
                  "eos": sp.id_to_piece(tokenizer.eos_id), "unk": sp.id_to_piece(sp.unk_id())}
        config = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": True,
                  "add_eos_token": False, "legacy": True}
        files = ["tokenizer.model"]
    tokens = {f"{kind}_token": piece for kind, piece in pieces.items()}
    config.update(tokens, model_max_length=seq_len, clean_up_tokenization_spaces=False)
    write_json(os.path.join(out, "tokenizer_config.json"), config)
    write_json(os.path.join(out, "special_tokens_map.json"), tokens)
    return files + ["tokenizer_config.json", "special_tokens_map.json"]
