"""maxlm.data.prepare.filters on text without spaces: words counted by script (Chinese and Japanese
characters one each), the repeated-word share and count rules, NFKC, on a mixed zh/ja/en corpus;
the CLI's prepare with them; their place in the cache key and the stream keys."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from maxlm import config as config_lib
from maxlm.data import load_tokenizer
from maxlm.data.prepare import build, filters
from maxlm.resilience import data_position
from maxlm.runtime.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]

ZH = "北京的秋天非常美丽，天空很蓝，树叶变成了金黄色。很多人周末去公园散步。"  # 35 characters: 31 words and 4 marks
ZH2 = "机器学习是一门研究计算机如何从数据中学习的学科，它在语言模型中有广泛的应用。"
JA = "東京の秋はとても美しく、空は青くて、木の葉は黄色に変わりました。週末には多くの人が公園を散歩します。"  # kana + kanji
EN = ("The committee met on Tuesday to discuss the new budget of the city library, and everyone agreed "
      "that the plan made sense.")
SHORT = "Too short to keep."
SPAM_EN = "cheap " * 30 + "watches for sale today"
SPAM_ZH = "便宜" * 20 + "，快来买！"  # 便 and 宜 20 times each of 43 words
# NFKC: the full-width comma (and ！？：；（）) becomes ASCII's; 。、「」 have no compatibility form
ZH_NFKC, ZH2_NFKC = ZH.replace("，", ","), ZH2.replace("，", ",")
SPAM_ZH_NFKC = SPAM_ZH.replace("，", ",").replace("！", "!")
# Half-width Katakana: the voiced mark ﾞ is a character of its own, 7 times; NFKC joins it to its
# kana (データベースのガイドブックをダウンロード), whose most frequent word, ー, occurs 3 times.
HALF = "ﾃﾞｰﾀﾍﾞｰｽのｶﾞｲﾄﾞﾌﾞｯｸをﾀﾞｳﾝﾛｰﾄﾞ"
FULL = "ＡＩ　ｍｏｄｅｌｓ　ｒｅａｄ　ｔｅｘｔ　ｉｎ　ｍａｎｙ　ｓｃｒｉｐｔｓ　１２３"  # NFKC: FULL_NFKC
FULL_NFKC = "AI models read text in many scripts 123"
CORPUS = [ZH, ZH2, JA, EN, SHORT, SPAM_EN, SPAM_ZH, HALF, FULL, FULL_NFKC]


def test_words_are_counted_by_script():
    count = lambda text: filters.word_counts(text)  # noqa: E731
    assert count(EN) == (len(EN.split()), 3)  # whitespace, as before: "the" 3 times
    assert count("hello, world! - ok") == (4, 1)  # punctuation alone, "-", is a word there, as before
    assert count(ZH) == (31, 2) and count(JA) == (46, 4)  # every character but the marks ，。、
    assert len(ZH.split()) == len(JA.split()) == 1  # what min_words counted before
    assert count("「東京タワー」は、2026年に６０周年・記念です。") == (16, 2)  # ・ is no word; 2026 and ６０ are
    assert count("我爱Python编程，真的。") == (7, 1)  # 我 爱 Python 编 程 真 的
    assert count("x = 1  # 中文 = 2") == (8, 2)  # only the pieces with CJK characters change
    assert count("人々は𠀀𪚥を") == (6, 1)  # 々 and extension B characters are words
    assert count("안녕하세요 세계 안녕하세요") == (3, 2)  # Hangul: by whitespace (Korean puts spaces between words)
    assert count(SPAM_ZH) == (43, 20) and count(HALF) == (27, 7)
    assert count("") == (0, 0) and count("a\ud800b 中") == (2, 1)  # a lone surrogate (from a JSON \\ud800)
    assert filters.word_counts(ZH, top=False) == (31, 0)


def _cfg(**filter_keys) -> dict:
    c = config_lib.defaults()
    for key, value in filter_keys.items():
        c.data.filters[key] = value
    return filters.settings(c.data)


def _kept(cfg: dict, docs=CORPUS) -> tuple[list[str], dict]:
    counts = collections.Counter()
    kept = list(filters.iter_filtered(docs, cfg, counts))
    return kept, {k.removeprefix("filtered_"): v for k, v in counts.items() if v}


def test_mixed_chinese_japanese_english_corpus():
    # min_words: Chinese and Japanese are dozens of words, no longer one
    kept, dropped = _kept(_cfg(min_words=15))
    assert kept == [ZH, ZH2, JA, EN, SPAM_EN, SPAM_ZH, HALF] and dropped == {"min_words": 3}
    # the share rule: the spam in either script goes, the prose stays
    kept, dropped = _kept(_cfg(max_repeated_word_share=0.3))
    assert kept == [ZH, ZH2, JA, EN, SHORT, HALF, FULL, FULL_NFKC] and dropped == {"max_repeated_word_share": 2}
    # the count rule: no word more than 5 times; HALF's ﾞ is 7 of them
    kept, dropped = _kept(_cfg(max_repeated_word_count=5))
    assert kept == [ZH, ZH2, JA, EN, SHORT, FULL, FULL_NFKC] and dropped == {"max_repeated_word_count": 3}
    # NFKC before the filters: HALF's voiced marks join their kana, FULL is its ASCII twin (a duplicate)
    kept, dropped = _kept(_cfg(max_repeated_word_count=5, nfkc=True, dedup=True))
    assert kept == [ZH_NFKC, ZH2_NFKC, JA, EN, SHORT, "データベースのガイドブックをダウンロード", FULL_NFKC]
    assert dropped == {"max_repeated_word_count": 2, "dedup": 1}
    # all of them, in their order: each drop counted once, under the first rule that drops it
    kept, dropped = _kept(_cfg(min_words=15, max_repeated_word_share=0.3, max_repeated_word_count=5, nfkc=True))
    assert kept == [ZH_NFKC, ZH2_NFKC, JA, EN, "データベースのガイドブックをダウンロード"]
    assert dropped == {"min_words": 3, "max_repeated_word_share": 2}
    # nfkc alone keeps everything, normalised; the Japanese and English prose are NFKC already
    kept, dropped = _kept(_cfg(nfkc=True))
    assert kept == [ZH_NFKC, ZH2_NFKC, JA, EN, SHORT, SPAM_EN, SPAM_ZH_NFKC,
                    "データベースのガイドブックをダウンロード", FULL_NFKC, FULL_NFKC] and not dropped
    assert [filters.word_counts(t) for t in kept[:2]] == [filters.word_counts(t) for t in (ZH, ZH2)]


def test_new_keys_key_the_cache_and_the_stream_only_when_on():
    c = config_lib.defaults()
    before = {"html": False, "min_words": 0, "max_symbol_ratio": 0.0, "max_repeated_word_share": 0.0,
              "languages": [], "dedup": False, "near_dedup": False}
    assert filters.settings(c.data) == before  # the default cache key is what it was
    c.data.filters.min_words = 50  # caches counted by whitespace are not reused
    assert filters.settings(c.data) == {**before, "min_words": 50, "words": "by_script"}
    c = config_lib.defaults()
    recorded = data_position.stream_keys(c.to_dict())
    older = {k: v for k, v in recorded.items() if k not in ("data.filters.nfkc", "data.filters.max_repeated_word_count")}
    assert data_position.changes(recorded, c) == data_position.changes(older, c) == []
    c.data.filters.nfkc = True
    assert filters.settings(c.data)["nfkc"] is True
    assert data_position.changes(older, c) == ["data.filters.nfkc=True (checkpoint: False)"]
    with pytest.raises(ConfigError, match=r"data.filters.nfkc=True \(checkpoint: False\)"):
        data_position.check(recorded, c, "ckpt/100")
    c = config_lib.defaults()
    c.data.filters.max_repeated_word_count = -1
    with pytest.raises(ConfigError, match="max_repeated_word_count"):
        config_lib.resolve(c, 8)


@pytest.mark.slow
def test_prepare_cli_filters_and_normalises_a_mixed_jsonl_source(tmp_path):
    """`python -m maxlm.data prepare` on a .jsonl source: the drops are counted in the entry's
    meta, and the rows hold the NFKC text."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in CORPUS))
    cfg_file = tmp_path / "cfg.py"
    cfg_file.write_text(
        "from maxlm import config\n"
        "def get_config():\n"
        "    c = config.defaults()\n"
        "    c.seq_len, c.batch_size, c.eval.every_steps = 256, 2, 0\n"
        f"    c.data.source = {str(tmp_path / 'src')!r}\n"
        f"    c.data.cache_dir = {str(tmp_path / 'packed')!r}\n"
        "    c.data.validation_percent = 0.0\n"
        "    return c\n"
    )
    keys = {"min_words": 15, "max_repeated_word_share": 0.3, "max_repeated_word_count": 5, "nfkc": True,
            "dedup": True}
    cmd = [sys.executable, "-m", "maxlm.data", "prepare", f"--config={cfg_file}", "--workers=1",
           *(f"--config.data.filters.{k}={v}" for k, v in keys.items())]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""})
    assert r.returncode == 0, r.stderr
    entry = Path(json.loads(r.stdout)["train"]["cache"])
    meta = json.loads((entry / "meta.json").read_text())
    assert meta["filters"] == {**_cfg(**keys), "languages": []}
    assert meta["documents"] == 5 and {k: v for k, v in meta["filtered"].items() if v} == {
        "min_words": 3, "max_repeated_word_share": 2}
    c = config_lib.load_file(str(cfg_file))
    for key, value in keys.items():
        c.data.filters[key] = value
    rows, _ = build.prepare(c, "train")  # the entry the CLI wrote
    assert build.cache_path(c, "train")[0] == entry
    tok = load_tokenizer("byte")
    text = tok.decode(rows.rows(list(range(rows.num_rows)))["targets"].reshape(-1))  # the rows' stream
    for doc in (ZH_NFKC, JA, EN, "データベースのガイドブックをダウンロード"):
        assert doc in text
    assert "ﾃﾞｰ" not in text and "cheap" not in text and "便宜" not in text
