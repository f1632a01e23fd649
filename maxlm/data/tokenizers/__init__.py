"""Tokenizers: a byte-level one (no files needed), and a tokenizer file: a SentencePiece model,
a Hugging Face `tokenizer.json` or a tiktoken BPE file (Llama 3's `tokenizer.model`; these two in
`maxlm/data/tokenizers/bpe.py`), told apart by content.

All share one small interface so the pipeline never cares which is in use; `checked_tokenizer`
loads the config's (`data.tokenizer` with the keys of `OPTION_KEYS`) and checks it against the
model's vocabulary. A tokenizer file may be local or at a URL (`gs://bucket/tok.model`), read
through etils.epath; on a job of several processes, process 0 alone reads it and every process
gets its bytes (`maxlm.runtime.processes`). `encode` never adds special tokens: packing adds BOS/EOS
itself, so documents are framed the same way whatever the tokenizer.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence

import numpy as np

from maxlm.data.tokenizers.base import FileTokenizer, Tokenizer
from maxlm.runtime import processes


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes shifted past three specials: pad=0, bos=1, eos=2, byte b -> b+3."""

    pad_id = 0
    bos_id = 1
    eos_id = 2
    _OFFSET = 3
    vocab_size = 256 + _OFFSET

    @property
    def spec(self) -> str:
        return "byte"

    @property
    def fingerprint(self) -> str:
        return "byte-v1"

    def encode(self, text: str) -> np.ndarray:
        bytes_N = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
        return bytes_N.astype(np.int32) + self._OFFSET

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        ids_N = np.asarray(ids, dtype=np.int64).reshape(-1)
        ids_N = ids_N[ids_N >= self._OFFSET]  # drop pad/bos/eos
        # A model whose vocab is padded past 259 can sample ids that are no byte:
        # map them to 0xFF, which is never valid UTF-8 and so decodes to U+FFFD.
        bytes_N = np.where(ids_N < self.vocab_size, ids_N - self._OFFSET, 0xFF)
        return bytes_N.astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class SentencePieceTokenizer(FileTokenizer):
    """A trained SentencePiece model; it must define bos, eos and pad pieces, or the keys
    `data.bos_token`, ... name its pieces for them. `proto`: the model file's bytes, when already
    read (else they are read from `model_path`)."""

    def __init__(self, model_path: str | os.PathLike, proto: bytes | None = None, bos_token: str = "",
                 eos_token: str = "", pad_token: str = ""):
        import sentencepiece as spm  # Only needed when such a model is used.

        self._path = os.fspath(model_path)
        self.proto = model_bytes(self._path) if proto is None else proto
        try:
            self._sp = spm.SentencePieceProcessor(model_proto=self.proto)
        except Exception as e:  # noqa: BLE001  (sentencepiece raises RuntimeError or others)
            raise ValueError(f"{self._path!r} is neither a SentencePiece model, a tokenizer.json nor a "
                             f"tiktoken BPE file ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
                             ) from None
        self._fingerprint = "sp-" + hashlib.sha256(self.proto).hexdigest()[:16]
        self.vocab_size = int(self._sp.get_piece_size())
        specials = {"bos": int(self._sp.bos_id()), "eos": int(self._sp.eos_id()), "pad": int(self._sp.pad_id())}
        named = {"bos": bos_token, "eos": eos_token, "pad": pad_token}
        for kind, piece in named.items():
            if piece:
                specials[kind] = int(self._sp.piece_to_id(piece))
                if self._sp.id_to_piece(specials[kind]) != piece:
                    raise ValueError(f"data.{kind}_token={piece!r} is not a piece of the SentencePiece model "
                                     f"{self._path!r}")
        self.bos_id, self.eos_id, self.pad_id = specials["bos"], specials["eos"], specials["pad"]
        missing = [name for name, i in specials.items() if i < 0]
        if missing:
            raise ValueError(
                f"SentencePiece model {self._path!r} does not define {'/'.join(missing)}; "
                "train it with distinct non-negative bos_id, eos_id and pad_id "
                "(e.g. pad_id=0 unk_id=1 bos_id=2 eos_id=3), or name its pieces with "
                + " and ".join(f"data.{name}_token" for name in missing)
            )
        self._options = {f"{k}_token": v for k, v in named.items() if v}
        if self._options:  # the default pieces keep the fingerprint (and the caches) they always had
            self._fingerprint += "-" + hashlib.sha256(json.dumps(specials, sort_keys=True).encode()).hexdigest()[:8]

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._sp.encode(text, out_type=int), dtype=np.int32)

    def encode_batch(self, texts: Iterable[str], num_threads: int | None = None) -> list[np.ndarray]:
        # One call so SentencePiece can use its own thread pool (default: every core).
        ids = self._sp.encode(list(texts), out_type=int, num_threads=num_threads or os.cpu_count())
        return [np.asarray(x, dtype=np.int32) for x in ids]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        ids_N = np.asarray(ids, dtype=np.int64).reshape(-1)
        # SentencePiece drops control pieces itself but rejects unknown ids.
        ids_N = ids_N[(ids_N >= 0) & (ids_N < self.vocab_size)]
        return self._sp.decode(ids_N.tolist())

    def __repr__(self) -> str:
        return f"SentencePieceTokenizer({self._path!r}, vocab_size={self.vocab_size})"


def model_bytes(path: str) -> bytes:
    """The bytes of the tokenizer file at `path` (local or a URL); ValueError if there is none."""
    from etils import epath

    file = epath.Path(path)
    if not file.is_file():
        raise ValueError(
            f"tokenizer model file not found: {path!r} (data.tokenizer must be 'byte' or the path of a "
            "SentencePiece .model, a Hugging Face tokenizer.json or a tiktoken BPE file)"
        )
    return file.read_bytes()


# The data.* keys a tokenizer file is loaded with: which tokens are bos, eos and pad (any file but
# "byte"), and a tiktoken file's pre-tokenizer regex and special tokens.
OPTION_KEYS = ("bos_token", "eos_token", "pad_token", "tokenizer_pattern", "tokenizer_special_tokens")
_TIKTOKEN_ONLY = ("tokenizer_pattern", "tokenizer_special_tokens")


def kind_of(data: bytes) -> str:
    """"tokenizer.json", "tiktoken" or "sentencepiece": what a tokenizer file's bytes are. A JSON
    object is a tokenizer.json, lines of `BASE64 RANK` a tiktoken file, anything else is given to
    SentencePiece (a binary protobuf, whose first bytes hold control characters)."""
    from maxlm.data.tokenizers import bpe

    head = data.lstrip()[:256]
    if head[:1] == b"{" and all(b >= 0x20 or b in b"\t\n\r" for b in head):
        return "tokenizer.json"
    return "tiktoken" if bpe.is_tiktoken(data) else "sentencepiece"


def load_tokenizer(spec: str, job: bool = False, **options: str) -> Tokenizer:
    """`"byte"` or the path (`~` expanded) or URL of a tokenizer file: a SentencePiece model, a
    Hugging Face tokenizer.json or a tiktoken BPE file (`kind_of`), whatever its name. `options`:
    the keys of `OPTION_KEYS` (those set; ValueError for one the file's kind does not take).

    `job`: every process of the job calls this at the same point, and process 0 alone reads the
    file: every process gets its bytes, or raises its error (a file one host lacks stops all the
    processes, not that one alone while the others wait for it). Else this process reads it."""
    options = {k: v for k, v in options.items() if v}
    if unknown := set(options) - set(OPTION_KEYS):
        raise TypeError(f"unknown tokenizer options {sorted(unknown)}")
    if spec == "byte":
        if options:
            raise ValueError(f"data.{next(iter(options))} applies to a tokenizer file, not to data.tokenizer=byte "
                             "(its ids are fixed: pad 0, bos 1, eos 2)")
        return ByteTokenizer()
    path = os.path.expanduser(spec)
    data = processes.from_process_0(lambda: model_bytes(path)) if job else model_bytes(path)
    kind = kind_of(data)
    if kind != "tiktoken" and (misplaced := [k for k in _TIKTOKEN_ONLY if k in options]):
        raise ValueError(f"data.{misplaced[0]} applies to a tiktoken BPE file only; data.tokenizer={spec!r} "
                         f"is a {'Hugging Face ' if kind == 'tokenizer.json' else ''}{kind} file")
    if kind == "sentencepiece":
        return SentencePieceTokenizer(path, data, **options)
    from maxlm.data.tokenizers import bpe

    return (bpe.HFTokenizer if kind == "tokenizer.json" else bpe.TiktokenTokenizer)(path, data, **options)


def options_of(data_cfg) -> dict[str, str]:
    """The tokenizer keys of `OPTION_KEYS` set in the config's `data` section."""
    return {k: data_cfg[k] for k in OPTION_KEYS if data_cfg[k]}


def config_tokenizer(data_cfg, job: bool = False) -> Tokenizer:
    """`data.tokenizer` with the config's tokenizer keys (`load_tokenizer`)."""
    return load_tokenizer(data_cfg.tokenizer, job, **options_of(data_cfg))


def checked_tokenizer(config) -> Tokenizer:
    """`data.tokenizer`, loaded for the job (`config_tokenizer(..., job=True)`: every process calls
    this) and checked against `model.vocab_size`."""
    tokenizer = config_tokenizer(config.data, job=True)
    if tokenizer.vocab_size > config.model.vocab_size:
        raise ValueError(
            f"tokenizer {tokenizer.spec!r} has vocab_size={tokenizer.vocab_size}, more than "
            f"model.vocab_size={config.model.vocab_size}; set model.vocab_size >= "
            f"{tokenizer.vocab_size}"
        )
    return tokenizer
