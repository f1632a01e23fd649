"""Optional document cleaning (`data.filters.*`); each filter is off at its default of 0/False.

Applied in this order, each document counted under the first filter that drops it:
  * `min_words`: drop documents with fewer whitespace-separated words.
  * `max_symbol_ratio`: drop documents whose share of characters that are neither alphanumeric
    nor whitespace exceeds this (0 < x <= 1).
  * `max_repeated_word_share`: drop documents in which the most frequent word makes up more than
    this share of all words (0 < x <= 1).
  * `dedup`: drop exact duplicates (same SHA-256 of the UTF-8 text) after the first, within a split.
  * `near_dedup`: drop near duplicates after the first: documents that share a MinHash-LSH key
    with an earlier one (`minhash.py`; `near_dedup_ngram`, `near_dedup_bands`, `near_dedup_rows`).
The two dedups are global over the split; `build.py` runs them across its units in parallel, with
the result of this serial pass.
"""

from __future__ import annotations

import collections
import hashlib
import re

FILTER_KEYS = ("min_words", "max_symbol_ratio", "max_repeated_word_share", "dedup", "near_dedup")
NEAR_DEDUP_KEYS = ("near_dedup_ngram", "near_dedup_bands", "near_dedup_rows")
_SYMBOL = re.compile(r"[^\w\s]")


def settings(data_cfg) -> dict:
    """`data.filters` as a plain dict (it keys the packed cache)."""
    f = data_cfg.filters
    return {**{k: f[k] for k in FILTER_KEYS}, **({k: f[k] for k in NEAR_DEDUP_KEYS} if f.near_dedup else {})}


def exact_key(text: str) -> bytes:
    """`dedup`'s key: 16 bytes of the text's SHA-256."""
    return hashlib.sha256(text.encode("utf-8")).digest()[:16]


def near_keys(text: str, cfg: dict) -> list[bytes]:
    """`near_dedup`'s keys: the text's MinHash-LSH band keys."""
    from maxlm.data import minhash

    return minhash.band_keys(text, cfg["near_dedup_ngram"], cfg["near_dedup_bands"], cfg["near_dedup_rows"])


def passes(text: str, cfg: dict, counts: collections.Counter) -> bool:
    """The per-document filters (all but the dedups); a drop is counted under its filter."""
    words = text.split() if (cfg["min_words"] or cfg["max_repeated_word_share"]) else ()
    if cfg["min_words"] and len(words) < cfg["min_words"]:
        counts["filtered_min_words"] += 1
        return False
    if cfg["max_symbol_ratio"] and len(_SYMBOL.findall(text)) > cfg["max_symbol_ratio"] * len(text):
        counts["filtered_max_symbol_ratio"] += 1
        return False
    if cfg["max_repeated_word_share"] and words:
        top = collections.Counter(words).most_common(1)[0][1]
        if top > cfg["max_repeated_word_share"] * len(words):
            counts["filtered_max_repeated_word_share"] += 1
            return False
    return True


def iter_filtered(texts, cfg: dict, counts: collections.Counter):
    """Yields the kept texts of the iterable `texts`, in order, one at a time (the dedups keep
    their keys of every document they see); `counts["filtered_<name>"]` += dropped per filter."""
    if not any(cfg[k] for k in FILTER_KEYS):
        yield from texts
        return
    seen, seen_near = set(), set()
    for text in texts:
        if not passes(text, cfg, counts):
            continue
        if cfg["dedup"]:
            key = exact_key(text)
            if key in seen:
                counts["filtered_dedup"] += 1
                continue
            seen.add(key)
        if cfg["near_dedup"]:
            keys = near_keys(text, cfg)
            repeat = any(k in seen_near for k in keys)
            seen_near.update(keys)  # a dropped document's keys too, as build.py's pass does
            if repeat:
                counts["filtered_near_dedup"] += 1
                continue
        yield text
