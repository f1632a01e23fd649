"""Optional document cleaning (`data.filters.*`); each filter is off at its default of 0/False.

Applied in this order, each document counted under the first filter that drops it:
  * `min_words`: drop documents with fewer whitespace-separated words.
  * `max_symbol_ratio`: drop documents whose share of characters that are neither alphanumeric
    nor whitespace exceeds this (0 < x <= 1).
  * `max_repeated_word_share`: drop documents in which the most frequent word makes up more than
    this share of all words (0 < x <= 1).
  * `dedup`: drop exact duplicates (same SHA-256 of the UTF-8 text) after the first, within a split.
"""

from __future__ import annotations

import collections
import hashlib
import re

FILTER_KEYS = ("min_words", "max_symbol_ratio", "max_repeated_word_share", "dedup")
_SYMBOL = re.compile(r"[^\w\s]")


def settings(data_cfg) -> dict:
    """`data.filters` as a plain dict (it keys the packed cache)."""
    return {k: data_cfg.filters[k] for k in FILTER_KEYS}


def iter_filtered(texts, cfg: dict, counts: collections.Counter):
    """Yields the kept texts of the iterable `texts`, in order, one at a time (dedup keeps one
    32-byte hash per kept document); `counts["filtered_<name>"]` += dropped per filter."""
    if not any(cfg.values()):
        yield from texts
        return
    seen = set()
    for text in texts:
        words = text.split() if (cfg["min_words"] or cfg["max_repeated_word_share"]) else ()
        if cfg["min_words"] and len(words) < cfg["min_words"]:
            counts["filtered_min_words"] += 1
            continue
        if cfg["max_symbol_ratio"] and len(_SYMBOL.findall(text)) > cfg["max_symbol_ratio"] * len(text):
            counts["filtered_max_symbol_ratio"] += 1
            continue
        if cfg["max_repeated_word_share"] and words:
            top = collections.Counter(words).most_common(1)[0][1]
            if top > cfg["max_repeated_word_share"] * len(words):
                counts["filtered_max_repeated_word_share"] += 1
                continue
        if cfg["dedup"]:
            digest = hashlib.sha256(text.encode("utf-8")).digest()
            if digest in seen:
                counts["filtered_dedup"] += 1
                continue
            seen.add(digest)
        yield text
