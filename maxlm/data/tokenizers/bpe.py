"""Byte-level BPE tokenizers from users' files: a Hugging Face `tokenizer.json` (through the
`tokenizers` library) and a tiktoken BPE file (Llama 3's `tokenizer.model`: lines of `base64
token` and rank, through `tiktoken`). `maxlm.data.tokenizers.load_tokenizer` reads the file and
tells them apart by content.

Their ids are those of `transformers.AutoTokenizer` on the same tokenizer (for tiktoken, the
tokenizer transformers converts it to: `maxlm/hf/tokenizer_files.py` writes the same one on
export), with one choice of maxlm's: text that spells a special token (`<|endoftext|>` in a
document about tokenizers) is encoded as text, never as the special id, as SentencePiece and
Llama 3's own tokenizer do (AutoTokenizer's `split_special_tokens=True`). Packing adds bos and eos
itself.

bos, eos and pad are found by name among the special tokens (`BOS_NAMES`, ...): `<s>`, `</s>`,
`<pad>`, `<|begin_of_text|>`, `<|end_of_text|>`, `<|endoftext|>` (bos and eos both, as GPT-2's),
...; pad falls back to eos (padding is masked out of the loss). The keys `data.bos_token`,
`data.eos_token` and `data.pad_token` name other tokens. A tiktoken file holds no special tokens:
Llama 3's 256 follow its ranks unless `data.tokenizer_special_tokens` lists others, and Llama 3's
pre-tokenizer regex splits text unless `data.tokenizer_pattern` gives another.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from maxlm.data.tokenizers.base import FileTokenizer

# Llama 3's pre-tokenizer (its tokenizer.py; transformers' TikTokenConverter default).
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# Llama 3.1's 256 special tokens after the 128,000 ranks (3.2 and 3.3 keep them; 3's own differ
# only in reserved names): bos 128000, eos 128001, pad 128004.
LLAMA3_SPECIAL_TOKENS = (
    "<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>", "<|start_header_id|>", "<|end_header_id|>",
    "<|eom_id|>", "<|eot_id|>", "<|python_tag|>", *(f"<|reserved_special_token_{i}|>" for i in range(3, 248)))
# Searched in order among a tokenizer's special tokens when no key names the token.
BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|bos|>", "<BOS>", "[BOS]", "<｜begin▁of▁sentence｜>",
             "<|startoftext|>", "<|endoftext|>")
EOS_NAMES = ("<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "<EOS>", "[EOS]", "<｜end▁of▁sentence｜>",
             "<|endoftext|>")
PAD_NAMES = ("<pad>", "<|pad|>", "<PAD>", "[PAD]", "<|padding|>", "<｜▁pad▁｜>", "<|finetune_right_pad_id|>")
KEYS = {"bos": "data.bos_token", "eos": "data.eos_token", "pad": "data.pad_token"}


def special_ids(where: str, specials: dict[str, int], token_id: Callable[[str], int | None],
                bos_token: str = "", eos_token: str = "", pad_token: str = "") -> tuple[int, int, int]:
    """(bos, eos, pad) ids of the tokenizer `where`: the token each key names (`token_id`: its id,
    None if it has none), else the first of the names found among `specials` ({text: id}); pad
    falls back to eos. ValueError naming the keys to set when bos or eos is not found."""
    found = {}
    for kind, named, names in (("bos", bos_token, BOS_NAMES), ("eos", eos_token, EOS_NAMES),
                               ("pad", pad_token, PAD_NAMES)):
        if named:
            found[kind] = token_id(named)
            if found[kind] is None:
                raise ValueError(f"{KEYS[kind]}={named!r} is not a token of {where}")
        else:
            found[kind] = next((specials[n] for n in names if n in specials), None)
    missing = [kind for kind in ("bos", "eos") if found[kind] is None]
    if missing:
        listed = ", ".join(sorted(specials, key=specials.get)[:8]) or "none"
        raise ValueError(
            f"{where} has no {' or '.join(missing)} token among its special tokens ({listed}); set "
            f"{' and '.join(KEYS[k] for k in missing)} to the token that "
            f"{'begins and ends' if len(missing) == 2 else 'begins' if missing == ['bos'] else 'ends'} a document")
    return found["bos"], found["eos"], found["eos"] if found["pad"] is None else found["pad"]


def _digest(data: bytes, *settings) -> str:
    return hashlib.sha256(data + json.dumps(settings).encode()).hexdigest()[:16]


class HFTokenizer(FileTokenizer):
    """A Hugging Face `tokenizer.json` (`data`: its bytes), through the `tokenizers` library."""

    def __init__(self, path: str | os.PathLike, data: bytes, bos_token: str = "", eos_token: str = "",
                 pad_token: str = ""):
        from tokenizers import Tokenizer as HFTokenizerObject

        self._path = os.fspath(path)
        self.data = data
        try:
            self._tok = HFTokenizerObject.from_str(data.decode("utf-8"))
        except Exception as e:  # noqa: BLE001  (the library raises plain Exceptions)
            raise ValueError(f"{self._path!r} is not a tokenizer.json the tokenizers library reads: "
                             f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
        self._tok.encode_special_tokens = True  # a special token's text in a document is text
        self._tok.no_truncation()
        self._tok.no_padding()
        added = self._tok.get_added_tokens_decoder()
        self.vocab_size = max([*self._tok.get_vocab(with_added_tokens=True).values(), *added]) + 1
        specials = {t.content: i for i, t in sorted(added.items()) if t.special}
        self.special_ids = frozenset(specials.values())
        self._options = {k: v for k, v in (("bos_token", bos_token), ("eos_token", eos_token),
                                           ("pad_token", pad_token)) if v}
        self.bos_id, self.eos_id, self.pad_id = special_ids(
            f"the tokenizer.json {self._path!r}", specials, self._tok.token_to_id, bos_token, eos_token, pad_token)
        self._fingerprint = "hf-" + _digest(data, self.bos_id, self.eos_id, self.pad_id)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode_batch_fast([text], add_special_tokens=False)[0].ids, np.int32)

    def encode_batch(self, texts: Iterable[str], num_threads: int | None = None) -> list[np.ndarray]:
        if num_threads == 1:  # one core: one text at a time (a batch takes the library's whole pool)
            return [self.encode(t) for t in texts]
        return [np.asarray(e.ids, np.int32) for e in self._tok.encode_batch_fast(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        ids_N = np.asarray(ids, dtype=np.int64).reshape(-1)
        ids_N = ids_N[(ids_N >= 0) & (ids_N < self.vocab_size)]
        return self._tok.decode(ids_N.tolist(), skip_special_tokens=True)

    def __repr__(self) -> str:
        return f"HFTokenizer({self._path!r}, vocab_size={self.vocab_size})"


def is_tiktoken(data: bytes) -> bool:
    """Whether `data` starts as a tiktoken BPE file does: a first line `BASE64 RANK`."""
    first = data[:data.find(b"\n")] if b"\n" in data[:1024] else data[:1024]
    parts = first.split()
    return len(parts) == 2 and parts[1].isdigit() and _b64(parts[0]) is not None


def _b64(token: bytes) -> bytes | None:
    try:
        return base64.b64decode(token, validate=True)
    except (binascii.Error, ValueError):
        return None


def parse_tiktoken(data: bytes, where: str) -> dict[bytes, int]:
    """{token bytes: rank} of a tiktoken BPE file, as `tiktoken.load.load_tiktoken_bpe` reads it
    (which caches a file by its path, not its content, in a temporary directory: not used).
    ValueError naming the line when one is not `BASE64 RANK`, or when the ranks are not 0..N-1."""
    ranks = {}
    for n, line in enumerate(data.splitlines(), 1):
        if not line:
            continue
        parts = line.split()
        token = _b64(parts[0]) if len(parts) == 2 and parts[1].isdigit() else None
        if token is None:
            raise ValueError(f"{where}:{n}: not a tiktoken line `BASE64 RANK`: {line[:80]!r}")
        ranks[token] = int(parts[1])
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{where}: the ranks are not 0..{len(ranks) - 1}, each once (a token listed "
                         "twice, or a rank skipped)")
    return ranks


class TiktokenTokenizer(FileTokenizer):
    """A tiktoken BPE file (`data`: its bytes), through `tiktoken`, with `special_tokens` (default
    Llama 3's) after its ranks and `pattern` (default Llama 3's) splitting text before the merges."""

    def __init__(self, path: str | os.PathLike, data: bytes, bos_token: str = "", eos_token: str = "",
                 pad_token: str = "", tokenizer_pattern: str = "", tokenizer_special_tokens: str = ""):
        import tiktoken

        self._path = os.fspath(path)
        where = f"the tiktoken file {self._path!r}"
        self.ranks = parse_tiktoken(data, self._path)
        self.pattern = tokenizer_pattern or LLAMA3_PATTERN
        names = ([s.strip() for s in tokenizer_special_tokens.split(",") if s.strip()]
                 if tokenizer_special_tokens else list(LLAMA3_SPECIAL_TOKENS))
        if len(set(names)) != len(names):
            raise ValueError(f"data.tokenizer_special_tokens={tokenizer_special_tokens!r} lists a token twice")
        self.special_tokens = {name: len(self.ranks) + i for i, name in enumerate(names)}
        self.vocab_size = len(self.ranks) + len(names)
        try:
            self._enc = tiktoken.Encoding(os.path.basename(self._path) or "tiktoken", pat_str=self.pattern,
                                          mergeable_ranks=self.ranks, special_tokens=self.special_tokens)
        except Exception as e:  # noqa: BLE001  (a bad regex: the Rust side's error)
            raise ValueError(f"{where} with data.tokenizer_pattern={self.pattern!r}: {e}") from None
        self._options = {k: v for k, v in (
            ("bos_token", bos_token), ("eos_token", eos_token), ("pad_token", pad_token),
            ("tokenizer_pattern", tokenizer_pattern), ("tokenizer_special_tokens", tokenizer_special_tokens)) if v}

        def token_id(name: str) -> int | None:
            return self.special_tokens.get(name, self.ranks.get(name.encode("utf-8")))

        self.bos_id, self.eos_id, self.pad_id = special_ids(where, self.special_tokens, token_id,
                                                            bos_token, eos_token, pad_token)
        self._fingerprint = "tiktoken-" + _digest(data, self.pattern, names, self.bos_id, self.eos_id, self.pad_id)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._enc.encode_ordinary(text), np.int32)

    def encode_batch(self, texts: Iterable[str], num_threads: int | None = None) -> list[np.ndarray]:
        texts = list(texts)
        if num_threads == 1 or len(texts) <= 1:
            return [self.encode(t) for t in texts]
        ids = self._enc.encode_ordinary_batch(texts, num_threads=num_threads or os.cpu_count() or 1)
        return [np.asarray(x, np.int32) for x in ids]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        ids_N = np.asarray(ids, dtype=np.int64).reshape(-1)
        ids_N = ids_N[(ids_N >= 0) & (ids_N < len(self.ranks))]  # special ids dropped
        return self._enc.decode_bytes(ids_N.tolist()).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return f"TiktokenTokenizer({self._path!r}, vocab_size={self.vocab_size})"
