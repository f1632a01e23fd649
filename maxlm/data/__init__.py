"""Data: sources (TFDS, local files), cleaning, tokenizers, packing and the step-indexed pipeline."""

from maxlm.data.corpus import ensure_corpus, load_split
from maxlm.data.errors import DataError
from maxlm.data.packing import pack_documents, packing_efficiency
from maxlm.data.pipeline import SOURCES, TokenDataset, make_dataset, prepare
from maxlm.data.tokenizer import ByteTokenizer, SentencePieceTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "SOURCES",
    "ByteTokenizer",
    "DataError",
    "SentencePieceTokenizer",
    "TokenDataset",
    "Tokenizer",
    "ensure_corpus",
    "load_split",
    "load_tokenizer",
    "make_dataset",
    "pack_documents",
    "packing_efficiency",
    "prepare",
]
