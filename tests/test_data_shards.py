"""maxlm/data/shards.py: packed rows as ArrayRecord records, bitwise the packed stream's rows."""

import numpy as np
import pytest
from array_record.python.array_record_module import ArrayRecordWriter

from maxlm.data.packing import PackedStream
from maxlm.data.shards import RowDecoder, ShardedRows, ShardWriter, encode_rows

BOS, EOS, PAD = 2, 3, 0


def documents(seed: int, count: int, vocab: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    # lengths from 0 (bos + eos only) to several rows long, so rows start inside documents
    return [rng.integers(4, vocab, rng.integers(0, 40)) for _ in range(count)]


@pytest.mark.parametrize("seq_len, vocab, dtype", [(8, 1000, np.uint16), (16, 100_000, np.uint32), (1, 50, np.uint16)])
def test_records_decode_to_the_packed_streams_rows(seq_len, vocab, dtype):
    stream = PackedStream.from_documents(documents(seq_len, 60, vocab), seq_len, BOS, EOS, PAD, dtype)
    records = encode_rows(stream)
    assert len(records) == stream.num_rows
    got = RowDecoder(seq_len, dtype, BOS, PAD).decode(records)
    want = stream.rows(np.arange(stream.num_rows))
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
        assert got[key].dtype == np.int32


def test_shards_read_back_in_any_order_across_files(tmp_path):
    """Rows split over three shard files read back by global id, in a shuffled order."""
    seq_len = 8
    stream = PackedStream.from_documents(documents(0, 80, 1000), seq_len, BOS, EOS, PAD, np.uint16)
    bounds = [0, 7, 20, stream.num_rows]
    paths = []
    for k, (first, stop) in enumerate(zip(bounds, bounds[1:])):
        paths.append(str(tmp_path / f"rows-{k:05d}.array_record"))
        writer = ArrayRecordWriter(paths[-1], "group_size:1")
        for record in encode_rows(stream, first, stop):
            writer.write(record)
        writer.close()
    rows = ShardedRows(paths, seq_len, np.uint16, BOS, PAD)
    assert rows.num_rows == stream.num_rows
    ids = np.random.default_rng(1).permutation(stream.num_rows)
    got, want = rows.rows(ids), stream.rows(ids)
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


@pytest.mark.parametrize("seq_len", [1, 8, 64])
def test_the_streaming_writer_writes_the_records_of_the_whole_stream(tmp_path, seq_len):
    """Documents added in uneven chunks (some empty, some shorter than a row) give the records of
    the same documents packed as one stream."""
    docs = documents(seq_len + 5, 70, 1000)
    stream = PackedStream.from_documents(docs, seq_len, BOS, EOS, PAD, np.uint16)
    path = str(tmp_path / "shard.array_record")
    writer = ShardWriter(path, seq_len, np.uint16, EOS)
    cuts = [0, 1, 1, 4, 30, 31, 70]
    for a, b in zip(cuts, cuts[1:]):
        writer.add(docs[a:b])
    writer.close()
    assert (writer.rows, writer.tokens, writer.documents) == (stream.num_rows, stream.num_tokens, len(docs))
    rows = ShardedRows([path], seq_len, np.uint16, BOS, PAD)
    assert [rows.source[i] for i in range(rows.num_rows)] == encode_rows(stream)
