"""The `data.*` keys: sources, tokenizers, preparing the packed cache, filters, resume."""

from __future__ import annotations

from maxlm.config.rules import (
    BOOL,
    NON_NEGATIVE_INT,
    POSITIVE,
    POSITIVE_INT,
    between,
    one_of,
)
from maxlm.config.schema import SAME, Section, key

# The `data` section.
DATA = Section()
DATA.source = key("tfds:python_stdlib", doc=(
               'the built-in corpus; `tfds:NAME[/CONFIG][:VERSION]` (prepared, ArrayRecord, in '
               '`data.tfds_dir`); or a file, directory or glob of `.txt`, `.jsonl`, `.parquet`, `.array_record`'
               ' files ([data](data.md))'))
DATA.mixture = key((), doc=(
                'several sources by weight instead of `data.source`: `((name, source, weight), ...)` '
                '([mixtures](data.md#mixtures-of-sources))'))
DATA.tfds_dir = key("~/.cache/maxlm/tensorflow_datasets", doc='where TFDS datasets live / are built')
DATA.cache_dir = key("~/.cache/maxlm/packed", doc=(
                  'the packed shards ([the cache](data.md#the-prepared-cache)): a local or shared directory, or'
                  ' a `gs://` URL; on a multi-host job it must be one every host reads (process 0 prepares it)'))
DATA.tokenizer = key("byte", doc=(
                  '`byte` (259 ids: pad 0, bos 1, eos 2, bytes 3–258) or the path or `gs://` URL of a tokenizer'
                  ' file, told apart by content: a sentencepiece model (it must define pad, bos and eos, or the'
                  ' keys below name its pieces), a Hugging Face `tokenizer.json` or a tiktoken BPE file such as'
                  " Llama 3's `tokenizer.model` ([tokenizers](data.md#tokenizers)); on a multi-host job process"
                  ' 0 reads it for every process'))
DATA.bos_token = key("", doc=(
                  'the text of a tokenizer file\'s bos token; `""` = the first of `<\\|begin_of_text\\|>`, `<s>`, '
                  '`<bos>`, ..., `<\\|endoftext\\|>` among its special tokens ([the names](data.md#tokenizers)); '
                  'none found: exit 2 naming this key. Not with `byte`'))
DATA.eos_token = key("", doc='the same for eos: `<\\|end_of_text\\|>`, `</s>`, `<eos>`, ..., `<\\|endoftext\\|>`')
DATA.pad_token = key("", doc=(
                  'the same for pad: `<pad>`, `<\\|pad\\|>`, `[PAD]`, ..., `<\\|finetune_right_pad_id\\|>`; none '
                  'found: eos (padding is masked out of the loss)'))
DATA.tokenizer_pattern = key("", doc=(
                          'a tiktoken file\'s pre-tokenizer regex; `""` = Llama 3\'s. Exit 2 with any other '
                          'tokenizer'))
DATA.tokenizer_special_tokens = key("", doc=(
                                 "a tiktoken file's special tokens after its ranks, comma-separated, in id "
                                 'order; `""` = Llama 3.1\'s 256 (`<\\|begin_of_text\\|>`, `<\\|end_of_text\\|>`, '
                                 '...). Exit 2 with any other tokenizer'))
DATA.text_key = key("text", doc='the text field of `.jsonl` lines, `.parquet` columns and TFDS features')
DATA.txt_documents = key("file", one_of(("file", "paragraph")),
                      '`.txt`: `file` = one document per file, `paragraph` = one per blank-line-separated block')
DATA.validation_percent = key(2.0, between("[0, 100]"),
                           'local files: share of documents (by a stable hash of `path:line`) in `validation`')
DATA.bad_records = key("error", one_of(("error", "skip")),
                    'a broken JSON line, a non-object line, a missing `text_key`: `error` = exit 2 naming '
                    'file:line; `skip` = skip and count')
DATA.tokenizer_vocab_size = key(0, NON_NEGATIVE_INT,
                             'vocabulary for `python -m maxlm.data tokenizer` (`0` = `model.vocab_size`; must '
                             'be ≤ it)')
DATA.tokenizer_sample_docs = key(20000, POSITIVE_INT, 'documents sampled (seeded) to train that tokenizer')
DATA.workers = key(0, NON_NEGATIVE_INT,
                'processes that prepare the packed cache, one unit each at a time (0: one per core); `python -m'
                ' maxlm.data prepare --workers=N` overrides it ([data.md](data.md#prepare-tokenize-and-pack))')
DATA.shard_mb = key(64.0, POSITIVE,
                 'local files: consecutive files of about this many MB form one unit, packed on its own into '
                 'one shard')
DATA.shard_examples = key(100_000, POSITIVE_INT, 'TFDS sources: examples per unit (shard)')
DATA.resume_position = key("same", one_of(("same", "tokens", "start")),
                        'a resume where a key the batches depend on changed (`batch_size`, `seq_len`, the '
                        "source, ...) or the source's files did: `same` exits 2, `tokens` continues after the "
                        'tokens read, `start` reads '
                        'the new data from its start '
                        '([checkpoints](checkpoints.md#changing-the-data-on-resume)); `seq_len` changes only '
                        'with a new RoPE setting ([extending the '
                        'context](checkpoints.md#extending-the-context))')
DATA.filters = Section()
DATA.filters.min_words = key(0, NON_NEGATIVE_INT,
                          'drop documents with fewer words (`0` = off): whitespace-separated, but each Chinese '
                          'or Japanese character counts as one ([counting by script](data.md#words-by-script))')
DATA.filters.max_symbol_ratio = key(0.0, between("[0, 1]"),
                                 'drop documents whose share of characters that are neither alphanumeric nor '
                                 'space exceeds this (`0` = off)')
DATA.filters.max_repeated_word_share = key(0.0, between("[0, 1]"),
                                        'drop documents whose most frequent word exceeds this share of words '
                                        '(`0` = off)')
DATA.filters.max_repeated_word_count = key(0, NON_NEGATIVE_INT,
                                        'drop documents whose most frequent word occurs more than this many '
                                        'times (`0` = off)')
DATA.filters.nfkc = key(False, BOOL,
                     'put each document in Unicode NFKC form before the other filters and the tokenizer, so the'
                     ' run trains on the normalised text (full-width `ＡＢＣ１２３` is `ABC123`, half-width `ｶﾞ` is '
                     '`ガ`)')
DATA.filters.html = key(False, BOOL,
                     "the documents are HTML: keep each one's main text (resiliparse), drop pages with none "
                     '([cleaning](data.md#cleaning))')
DATA.filters.languages = key((), doc=(
                          'keep only documents in these languages by fastText\'s lid.176, e.g. `("en",)` (`()` ='
                          ' all)'))
DATA.filters.min_language_score = key(0.65, between("[0, 1]"), '... with at least this probability')
DATA.filters.dedup = key(False, BOOL,
                      'drop exact duplicates (SHA-256 of the text) within a split, across all its shards; the '
                      'first copy is kept')
DATA.filters.near_dedup = key(False, BOOL,
                           'drop near duplicates within a split: documents that share a MinHash-LSH band with '
                           'an earlier one ([data.md](data.md#prepare-tokenize-and-pack))')
DATA.filters.near_dedup_ngram = key(5, POSITIVE_INT,
                                 "the shingles' words, and the LSH bands of that many hashes each (FineWeb's 14"
                                 ' × 8)')
DATA.filters.near_dedup_bands = key(14, POSITIVE_INT, SAME)
DATA.filters.near_dedup_rows = key(8, POSITIVE_INT, SAME)
