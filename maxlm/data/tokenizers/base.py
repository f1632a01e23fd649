"""The interface every tokenizer shares (`maxlm/data/tokenizers/` loads them; the byte-level BPE
ones are in `maxlm/data/tokenizers/bpe.py`)."""

from __future__ import annotations

import abc
from collections.abc import Iterable, Sequence

import numpy as np


class Tokenizer(abc.ABC):
    """Text <-> int32 ids. Special ids are part of `range(vocab_size)`."""

    vocab_size: int
    pad_id: int
    bos_id: int
    eos_id: int
    _options: dict[str, str] | tuple = ()

    @property
    def options(self) -> dict[str, str]:
        """The tokenizer keys (`maxlm.data.tokenizers.OPTION_KEYS`) it was loaded with, those set:
        with `spec`, what `load_tokenizer(spec, **options)` rebuilds it from."""
        return dict(self._options)

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


class FileTokenizer(Tokenizer):
    """A tokenizer read from a file: its spec is the file's path, its fingerprint set at load."""

    _path: str
    _fingerprint: str

    @property
    def spec(self) -> str:
        return self._path

    @property
    def fingerprint(self) -> str:
        return self._fingerprint
