"""Near-duplicate keys by MinHash-LSH (`data.filters.near_dedup`), the RefinedWeb/FineWeb recipe.

A document's shingles are its word n-grams (`near_dedup_ngram` words, lower-cased). Each shingle
is hashed to 64 bits; `bands × rows` hash functions `(a·h + b) mod 2^61-1` give the MinHash
signature (the minimum of each over the shingles). The signature is cut into `bands` bands of
`rows` values, and each band is one 16-byte key. Two documents with Jaccard similarity s share
at least one key with probability 1 - (1 - s^rows)^bands: with 14 bands of 8 (FineWeb's 112
hashes) about 0.2 at s = 0.6, 0.8 at s = 0.75 and > 0.99 at s = 0.85.

`build.py` drops every document that shares a key with an earlier one in the split's order, in
the same hash-partitioned pass as exact dedup. Everything here is a pure function of the text
and the settings: the same keys on any machine, in any worker.
"""

from __future__ import annotations

import hashlib
import re

import numpy as np

_PRIME = np.uint64((1 << 61) - 1)
_WORD = re.compile(r"\w+")


def _coefficients(count: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0x5EED)  # fixed: keys must not depend on the run's seed
    return (rng.integers(1, int(_PRIME), count, dtype=np.uint64),
            rng.integers(0, int(_PRIME), count, dtype=np.uint64))


def mulmod(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(a · b) mod 2^61-1 of uint64 arrays (broadcast), exactly, in 64-bit pieces: each operand is
    first reduced below 2^61-1, so that none of the products below overflows 64 bits."""
    a, b = np.asarray(a, np.uint64) % _PRIME, np.asarray(b, np.uint64) % _PRIME
    a_hi, a_lo = a >> np.uint64(31), a & np.uint64((1 << 31) - 1)
    b_hi, b_lo = b >> np.uint64(31), b & np.uint64((1 << 31) - 1)
    # a·b = a_hi·b_hi·2^62 + (a_hi·b_lo + a_lo·b_hi)·2^31 + a_lo·b_lo, and 2^61 ≡ 1
    high = (a_hi * b_hi) % _PRIME * np.uint64(2) % _PRIME
    mid = (a_hi * b_lo + a_lo * b_hi) % _PRIME
    mid = ((mid >> np.uint64(30)) + ((mid & np.uint64((1 << 30) - 1)) << np.uint64(31))) % _PRIME
    return (high + mid + (a_lo * b_lo) % _PRIME) % _PRIME


def shingle_hashes(text: str, ngram: int) -> np.ndarray:
    """The distinct 61-bit hashes of the text's word n-grams (one for a shorter text)."""
    words = _WORD.findall(text.lower())
    grams = {" ".join(words[i:i + ngram]) for i in range(max(1, len(words) - ngram + 1))}
    digests = b"".join(hashlib.blake2b(g.encode(), digest_size=8).digest() for g in sorted(grams))
    return np.frombuffer(digests, np.uint64) % _PRIME


def band_keys(text: str, ngram: int, bands: int, rows: int) -> list[bytes]:
    """The document's `bands` LSH keys (16 bytes each; the band's index is part of the key)."""
    a, b = _coefficients(bands * rows)
    shingles = shingle_hashes(text, ngram)
    signature = ((mulmod(shingles[:, None], a[None, :]) + b[None, :]) % _PRIME).min(axis=0)
    return [hashlib.blake2b(signature[i * rows:(i + 1) * rows].tobytes(), digest_size=16,
                            salt=i.to_bytes(8, "little")).digest() for i in range(bands)]
