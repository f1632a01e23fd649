"""Data: config → source(s) → cleaned, tokenized, packed shards → step-indexed batches.

`make_dataset(config, split)` (`dataset.py`) is the entry point; it reads down through the
steps' modules in that order.
"""

from maxlm.data.batches import TokenDataset
from maxlm.data.corpus import ensure_corpus, load_split
from maxlm.data.dataset import STREAM_KEYS, make_dataset, source_fingerprints
from maxlm.data.errors import DataError
from maxlm.data.packing import pack_documents, packing_efficiency
from maxlm.data.tokenizers import ByteTokenizer, SentencePieceTokenizer, Tokenizer, load_tokenizer
from maxlm.data.tokenizers.bpe import HFTokenizer, TiktokenTokenizer

__all__ = [
    "ByteTokenizer",
    "DataError",
    "HFTokenizer",
    "SentencePieceTokenizer",
    "TiktokenTokenizer",
    "TokenDataset",
    "Tokenizer",
    "ensure_corpus",
    "load_split",
    "load_tokenizer",
    "STREAM_KEYS",
    "make_dataset",
    "source_fingerprints",
    "pack_documents",
    "packing_efficiency",
]
