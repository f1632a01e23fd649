"""Data: the built-in TFDS corpus, tokenizers, packing and the step-indexed batch pipeline."""

from maxlm.data.corpus import ensure_corpus, load_split
from maxlm.data.packing import pack_documents, packing_efficiency
from maxlm.data.pipeline import SOURCES, TokenDataset, make_dataset
from maxlm.data.tokenizer import ByteTokenizer, SentencePieceTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "SOURCES",
    "ByteTokenizer",
    "SentencePieceTokenizer",
    "TokenDataset",
    "Tokenizer",
    "ensure_corpus",
    "load_split",
    "load_tokenizer",
    "make_dataset",
    "pack_documents",
    "packing_efficiency",
]
