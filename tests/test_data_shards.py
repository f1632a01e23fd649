"""maxlm/data/packing.py's records and maxlm/data/shards.py's files: the record of a row is the
documented bytes, any chunking of the documents writes the same records, and shard files read
back by global row id."""

import numpy as np
import pytest
from array_record.python.array_record_module import ArrayRecordWriter

from maxlm.data.packing import Packer, RowDecoder, pack_documents
from maxlm.data.shards import ShardedRows, ShardWriter

BOS, EOS, PAD = 2, 3, 0


def documents(seed: int, count: int, vocab: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    # lengths from 0 (bos + eos only) to several rows long, so rows start inside documents
    return [rng.integers(4, vocab, rng.integers(0, 40)) for _ in range(count)]


def records_of(docs, seq_len: int, dtype) -> list[bytes]:
    packer = Packer(seq_len, dtype, EOS)
    return packer.add(docs) + packer.finish()


def test_a_rows_record_is_the_documented_bytes():
    """[10 11] and [20 .. 26] in rows of 4: the shard format, byte for byte (a change here is a
    change of the cache format: bump build.PACKED_FORMAT)."""
    records = records_of([np.array([10, 11]), np.arange(20, 27)], 4, np.uint16)

    def record(num_tokens, starts, prev, tokens):
        header = np.array([num_tokens, len(starts), prev], np.int32)
        return header.tobytes() + np.array(starts, np.int32).tobytes() + np.array(tokens, np.uint16).tobytes()

    assert records == [record(4, [0, 3], -1, [10, 11, EOS, 20]),  # two documents start in row 0
                       record(4, [], 20, [21, 22, 23, 24]),  # row 1 continues the second
                       record(3, [], 24, [25, 26, EOS])]  # the last row, padded on read
    rows = RowDecoder(4, np.uint16, BOS, PAD).decode(records)
    assert rows["inputs"].tolist() == [[BOS, 10, 11, BOS], [20, 21, 22, 23], [24, 25, 26, PAD]]
    assert rows["segment_ids"].tolist() == [[1, 1, 1, 2], [1, 1, 1, 1], [1, 1, 1, 0]]


@pytest.mark.parametrize("seq_len", [1, 8, 64])
def test_the_streaming_writer_writes_the_records_of_the_whole_stream(tmp_path, seq_len):
    """Documents added in uneven chunks (some empty, some shorter than a row) give the records of
    the same documents packed in one go."""
    docs = documents(seq_len + 5, 70, 1000)
    path = str(tmp_path / "shard.array_record")
    writer = ShardWriter(path, seq_len, np.uint16, EOS)
    cuts = [0, 1, 1, 4, 30, 31, 70]
    for a, b in zip(cuts, cuts[1:]):
        writer.add(docs[a:b])
    writer.close()
    whole = records_of(docs, seq_len, np.uint16)
    tokens = sum(len(d) + 1 for d in docs)
    packed = writer.packer
    assert (packed.rows, packed.tokens, packed.documents) == (len(whole), tokens, len(docs))
    rows = ShardedRows([path], seq_len, np.uint16, BOS, PAD)
    assert [rows.source[i] for i in range(rows.num_rows)] == whole


def test_shards_read_back_in_any_order_across_files(tmp_path):
    """Rows split over three shard files read back by global id, in a shuffled order."""
    seq_len = 8
    docs = documents(0, 80, 1000)
    records = records_of(docs, seq_len, np.uint16)
    bounds = [0, 7, 20, len(records)]
    paths = []
    for k, (first, stop) in enumerate(zip(bounds, bounds[1:])):
        paths.append(str(tmp_path / f"rows-{k:05d}.array_record"))
        writer = ArrayRecordWriter(paths[-1], "group_size:1")
        for record in records[first:stop]:
            writer.write(record)
        writer.close()
    rows = ShardedRows(paths, seq_len, np.uint16, BOS, PAD)
    assert rows.num_rows == len(records)
    ids = np.random.default_rng(1).permutation(len(records))
    got, want = rows.rows(ids), pack_documents(docs, seq_len, BOS, EOS, PAD)
    for key in want:
        np.testing.assert_array_equal(got[key], want[key][ids], err_msg=key)
