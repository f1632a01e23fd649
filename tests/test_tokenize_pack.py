"""maxlm.data's tokenizers (byte, sentencepiece) and document packing."""

from __future__ import annotations

import numpy as np
import pytest

from maxlm.data import ByteTokenizer, SentencePieceTokenizer, load_tokenizer, pack_documents, packing_efficiency

# ---------------------------------------------------------------------------------------------
# Tokenizers

TEXT = "def f(x):\n    return x  # héllo wörld — 你好 🐍\n\n  two  spaces\t"


def test_byte_tokenizer_round_trip():
    tok = load_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer)
    assert (tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id) == (259, 0, 1, 2)
    ids = tok.encode(TEXT)
    assert ids.dtype == np.int32
    assert len(ids) == len(TEXT.encode("utf-8"))
    assert ids.min() >= 3 and ids.max() < 259
    assert tok.decode(ids) == TEXT
    assert tok.decode(np.concatenate([[tok.bos_id], ids, [tok.eos_id, tok.pad_id]])) == TEXT
    assert tok.encode("").shape == (0,)
    # ids a padded model vocab could sample that are no byte decode to U+FFFD, not an error
    assert tok.decode([3 + ord("a"), 300, 3 + ord("b")]) == "a\ufffdb"


def test_sentencepiece_round_trip(sp_model):
    tok = load_tokenizer(str(sp_model))
    assert isinstance(tok, SentencePieceTokenizer)
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 2, 3)
    assert tok.vocab_size == 300
    ids = tok.encode(TEXT)
    assert ids.dtype == np.int32 and ids.max() < tok.vocab_size
    assert tok.decode(ids) == TEXT  # unseen characters go through byte fallback
    assert tok.decode(np.concatenate([[tok.bos_id], ids, [tok.eos_id, tok.pad_id]])) == TEXT
    batch = tok.encode_batch([TEXT, "x = 1"])
    np.testing.assert_array_equal(batch[0], ids)
    np.testing.assert_array_equal(batch[1], tok.encode("x = 1"))


def test_sentencepiece_without_pad_is_rejected(tmp_path):
    import sentencepiece as spm

    (tmp_path / "c.txt").write_text("\n".join(f"line {i} of text" for i in range(200)))
    spm.SentencePieceTrainer.train(
        input=str(tmp_path / "c.txt"), model_prefix=str(tmp_path / "nopad"), vocab_size=60,
        hard_vocab_limit=False, minloglevel=2,
    )  # fmt: skip
    with pytest.raises(ValueError, match="does not define pad"):
        SentencePieceTokenizer(tmp_path / "nopad.model")


def test_load_tokenizer_missing_file(tmp_path):
    missing = tmp_path / "nope.model"
    with pytest.raises(ValueError, match="nope.model"):
        load_tokenizer(str(missing))


# ---------------------------------------------------------------------------------------------
# Packing


def test_pack_small_example():
    docs = [np.array([10, 11]), np.array([20, 21, 22, 23, 24, 25, 26])]
    rows = pack_documents(docs, seq_len=4, bos_id=1, eos_id=2)
    assert rows["inputs"].tolist() == [[1, 10, 11, 1], [20, 21, 22, 23], [24, 25, 26, 0]]
    assert rows["targets"].tolist() == [[10, 11, 2, 20], [21, 22, 23, 24], [25, 26, 2, 0]]
    assert rows["segment_ids"].tolist() == [[1, 1, 1, 2], [1, 1, 1, 1], [1, 1, 1, 0]]
    assert rows["positions"].tolist() == [[0, 1, 2, 0], [0, 1, 2, 3], [0, 1, 2, 0]]
    assert packing_efficiency(rows["segment_ids"]) == pytest.approx(11 / 12)


def test_pack_empty_document_and_exact_fit():
    rows = pack_documents([np.array([5, 6]), np.array([], np.int32)], seq_len=5, bos_id=1, eos_id=2)
    assert rows["inputs"].tolist() == [[1, 5, 6, 1, 0]]
    assert rows["targets"].tolist() == [[5, 6, 2, 2, 0]]
    assert rows["segment_ids"].tolist() == [[1, 1, 1, 2, 0]]
    rows = pack_documents([np.array([5, 6, 7])], seq_len=4, bos_id=1, eos_id=2)
    assert packing_efficiency(rows["segment_ids"]) == 1.0
    assert pack_documents([], seq_len=4, bos_id=1, eos_id=2)["inputs"].shape == (0, 4)


@pytest.mark.parametrize("seq_len, vocab, dtype", [(16, 259, np.int32), (1, 259, np.uint16), (7, 100_000, np.uint32)])
def test_pack_random_documents_invariants(seq_len, vocab, dtype):
    rng = np.random.default_rng(seq_len)
    docs = [rng.integers(3, vocab, size=rng.integers(0, 50)).astype(np.int32) for _ in range(200)]
    bos, eos = 1, 2
    rows = pack_documents(docs, seq_len, bos, eos, token_dtype=dtype)
    inputs, targets, seg, pos = (rows[k] for k in ("inputs", "targets", "segment_ids", "positions"))
    num_pairs = sum(len(d) + 1 for d in docs)
    assert inputs.shape == (-(-num_pairs // seq_len), seq_len)
    assert all(a.dtype == np.int32 for a in rows.values())

    # Non-padding slots, read in order, are exactly the documents' next-token pairs.
    real = seg > 0
    np.testing.assert_array_equal(inputs[real], np.concatenate([np.r_[bos, d] for d in docs]))
    np.testing.assert_array_equal(targets[real], np.concatenate([np.r_[d, eos] for d in docs]))
    # Padding only at the tail of the last row; every other row is full.
    assert real[:-1].all()
    tail = real[-1]
    assert not (~tail[:-1] & tail[1:]).any()  # no real token after padding
    assert real.sum() == num_pairs
    assert packing_efficiency(seg) == pytest.approx(num_pairs / seg.size)
    assert (inputs[~real] == 0).all() and (targets[~real] == 0).all() and (pos[~real] == 0).all()

    for r in range(seg.shape[0]):
        s, p = seg[r][real[r]], pos[r][real[r]]
        assert s[0] == 1 and set(np.diff(s)) <= {0, 1}  # ids 1, 2, ... within the row
        new_segment = np.r_[True, np.diff(s) == 1]
        # Positions restart at 0 at each segment and count up by one inside it.
        assert (p[new_segment] == 0).all()
        assert (np.diff(p)[~new_segment[1:]] == 1).all()
        # Inside a segment, targets are the inputs shifted left by one.
        same = ~new_segment[1:]
        np.testing.assert_array_equal(targets[r][: len(s) - 1][same], inputs[r][1 : len(s)][same])
        # A new segment starts with bos unless it continues a document from the previous row.
        starts = np.flatnonzero(new_segment)
        assert (inputs[r][starts[1:]] == bos).all()
