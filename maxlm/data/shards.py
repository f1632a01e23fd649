"""Packed rows as self-contained records in ArrayRecord shards.

A shard holds the packed rows of some documents, one ArrayRecord record per row. A record carries
everything its row's four arrays are derived from, so reading row r touches one record and nothing
else (no document table in memory, whatever the corpus size):

    int32 header [num_tokens, num_starts, prev_token]
    int32 starts[num_starts]     the columns where a document starts (bos in `inputs` there)
    tokens[num_tokens]           the row's targets, in the shard's token dtype (uint16 or uint32)

`prev_token` is the target just before the row: its first input when column 0 continues a
document (-1 when a document starts there). As in `packing`, positions restart at 0 in every
row's first segment. A row shorter than `seq_len` (the last of a shard) is padded on read. Decoded rows are
bitwise `packing.PackedStream.rows` of the same documents packed as one stream
(tests/test_data_shards.py).

`grain.sources.ArrayRecordDataSource` over the shard files in order numbers the rows of all
shards globally and reads any of them at random, from a local or shared filesystem or `gs://`
(array_record reads Cloud Storage itself), opening each shard's index only.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from maxlm.data.packing import KEYS, PackedStream

HEADER = 3


def encode_rows(stream: PackedStream, first: int = 0, stop: int | None = None) -> list[bytes]:
    """The records of rows [first, stop) of `stream` (default: all)."""
    stop = stream.num_rows if stop is None else stop
    seq_len, targets_T, starts_D = stream.seq_len, stream.targets_T, np.asarray(stream.doc_starts_D)
    records = []
    for r in range(first, stop):
        lo, hi = r * seq_len, min((r + 1) * seq_len, stream.num_tokens)
        d_lo, d_hi = np.searchsorted(starts_D, [lo, hi], side="left")
        starts = (starts_D[d_lo:d_hi] - lo).astype(np.int32)
        continues = not (len(starts) and starts[0] == 0)
        header = np.array([hi - lo, len(starts), int(targets_T[lo - 1]) if continues else -1], np.int32)
        records.append(header.tobytes() + starts.tobytes() + np.asarray(targets_T[lo:hi]).tobytes())
    return records


class RowDecoder:
    """Rows of `seq_len` from records: the four int32 arrays of `PackedStream.rows`."""

    def __init__(self, seq_len: int, token_dtype, bos_id: int, pad_id: int):
        self.seq_len, self.dtype = seq_len, np.dtype(token_dtype)
        self.bos_id, self.pad_id = bos_id, pad_id
        self._cols = np.arange(seq_len, dtype=np.int32)

    def decode(self, records: Sequence[bytes]) -> dict[str, np.ndarray]:
        out = {k: np.zeros((len(records), self.seq_len), np.int32) for k in KEYS}
        for i, record in enumerate(records):
            num_tokens, num_starts, prev = np.frombuffer(record, np.int32, HEADER)
            starts = np.frombuffer(record, np.int32, num_starts, offset=4 * HEADER)
            tokens = np.frombuffer(record, self.dtype, num_tokens, offset=4 * (HEADER + num_starts))
            targets, inputs = out["targets"][i], out["inputs"][i]
            targets[:num_tokens] = tokens
            inputs[1:num_tokens] = tokens[:-1]
            inputs[0] = prev if prev >= 0 else self.bos_id
            inputs[starts] = self.bos_id
            # segment k (1-based) runs from its start column to the next one; a row that begins
            # inside a document begins with segment 1 too
            is_start = np.zeros(num_tokens, np.int32)
            is_start[starts] = 1
            is_start[0] = 1
            segment = np.cumsum(is_start, dtype=np.int32)
            segment_start = np.maximum.accumulate(np.where(is_start == 1, self._cols[:num_tokens], 0))
            out["segment_ids"][i, :num_tokens] = segment
            out["positions"][i, :num_tokens] = self._cols[:num_tokens] - segment_start
            if num_tokens < self.seq_len:
                targets[num_tokens:] = inputs[num_tokens:] = self.pad_id
        return out


def write_shard(path: str, records: Sequence[bytes]) -> None:
    """One shard file of `records` (array_record; `group_size:1` so each row is read alone)."""
    from array_record.python.array_record_module import ArrayRecordWriter

    writer = ArrayRecordWriter(str(path), "group_size:1")
    try:
        for record in records:
            writer.write(record)
    finally:
        writer.close()


class ShardedRows:
    """The rows of shard files in order, numbered globally: the `PackedStream` read interface
    (`num_rows`, `seq_len`, `rows(ids)`) over `grain.sources.ArrayRecordDataSource`."""

    def __init__(self, paths: Sequence[str], seq_len: int, token_dtype, bos_id: int, pad_id: int):
        import grain

        self.source = grain.sources.ArrayRecordDataSource([str(p) for p in paths])
        self.num_rows, self.seq_len = len(self.source), seq_len
        self.decoder = RowDecoder(seq_len, token_dtype, bos_id, pad_id)

    def rows(self, ids) -> dict[str, np.ndarray]:
        ids = [int(i) for i in np.asarray(ids).reshape(-1)]
        return self.decoder.decode(self.source.__getitems__(ids))
