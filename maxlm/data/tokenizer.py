"""Tokenizers: a byte-level one (no files needed) and a SentencePiece wrapper.

Both share one small interface so the pipeline never cares which is in use; `checked_tokenizer`
loads the config's and checks it against the model's vocabulary. A SentencePiece model file may
be local or at a URL (`gs://bucket/tok.model`), read through etils.epath; on a job of several
processes, process 0 alone reads it and every process gets its bytes (`maxlm.processes`).
`encode` never adds special tokens: packing adds BOS/EOS itself, so documents
are framed the same way whatever the tokenizer.
"""

from __future__ import annotations

import abc
import hashlib
import os
from collections.abc import Iterable, Sequence

import numpy as np

from maxlm import processes


class Tokenizer(abc.ABC):
    """Text <-> int32 ids. Special ids are part of `range(vocab_size)`."""

    vocab_size: int
    pad_id: int
    bos_id: int
    eos_id: int

    @property
    @abc.abstractmethod
    def spec(self) -> str:
        """The string `load_tokenizer` accepts to rebuild this tokenizer."""

    @property
    @abc.abstractmethod
    def fingerprint(self) -> str:
        """Changes whenever encoding could change (keys the packed-data cache)."""

    @abc.abstractmethod
    def encode(self, text: str) -> np.ndarray:
        """Returns int32 ids of `text`, without BOS/EOS."""

    @abc.abstractmethod
    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Inverse of `encode`; special ids are dropped."""

    def encode_batch(self, texts: Iterable[str], num_threads: int | None = None) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]


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


class SentencePieceTokenizer(Tokenizer):
    """A trained SentencePiece model; it must define bos, eos and pad pieces. `proto`: the model
    file's bytes, when already read (else they are read from `model_path`)."""

    def __init__(self, model_path: str | os.PathLike, proto: bytes | None = None):
        import sentencepiece as spm  # Only needed when such a model is used.

        self._path = os.fspath(model_path)
        self.proto = model_bytes(self._path) if proto is None else proto
        self._sp = spm.SentencePieceProcessor(model_proto=self.proto)
        self._fingerprint = "sp-" + hashlib.sha256(self.proto).hexdigest()[:16]
        self.vocab_size = int(self._sp.get_piece_size())
        self.pad_id = int(self._sp.pad_id())
        self.bos_id = int(self._sp.bos_id())
        self.eos_id = int(self._sp.eos_id())
        specials = {"bos": self.bos_id, "eos": self.eos_id, "pad": self.pad_id}
        missing = [name for name, i in specials.items() if i < 0]
        if missing:
            raise ValueError(
                f"SentencePiece model {self._path!r} does not define {'/'.join(missing)}; "
                "train it with distinct non-negative bos_id, eos_id and pad_id "
                "(e.g. pad_id=0 unk_id=1 bos_id=2 eos_id=3)"
            )

    @property
    def spec(self) -> str:
        return self._path

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

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
    """The bytes of the SentencePiece model file at `path` (local or a URL); ValueError if there is
    none."""
    from etils import epath

    file = epath.Path(path)
    if not file.is_file():
        raise ValueError(
            f"tokenizer model file not found: {path!r} (data.tokenizer must be 'byte' or the "
            "path to a SentencePiece .model file)"
        )
    return file.read_bytes()


def load_tokenizer(spec: str, job: bool = False) -> Tokenizer:
    """`"byte"` or the path (`~` expanded) or URL of a SentencePiece `.model` file.

    `job`: every process of the job calls this at the same point, and process 0 alone reads the
    file: every process gets its bytes, or raises its error (a file one host lacks stops all the
    processes, not that one alone while the others wait for it). Else this process reads it."""
    if spec == "byte":
        return ByteTokenizer()
    path = os.path.expanduser(spec)
    proto = processes.from_process_0(lambda: model_bytes(path)) if job else model_bytes(path)
    return SentencePieceTokenizer(path, proto)


def checked_tokenizer(config) -> Tokenizer:
    """`data.tokenizer`, loaded for the job (`load_tokenizer(..., job=True)`: every process calls
    this) and checked against `model.vocab_size`."""
    tokenizer = load_tokenizer(config.data.tokenizer, job=True)
    if tokenizer.vocab_size > config.model.vocab_size:
        raise ValueError(
            f"tokenizer {tokenizer.spec!r} has vocab_size={tokenizer.vocab_size}, more than "
            f"model.vocab_size={config.model.vocab_size}; set model.vocab_size >= "
            f"{tokenizer.vocab_size}"
        )
    return tokenizer
