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


def _encode(targets, starts, seq_len: int, prev: int, rows: range) -> list[bytes]:
    """Records of `rows` of the token stream `targets` whose documents start at `starts`
    (ascending offsets into it); `prev`: the token before the stream (-1: none)."""
    records = []
    for r in rows:
        lo, hi = r * seq_len, min((r + 1) * seq_len, len(targets))
        d_lo, d_hi = np.searchsorted(starts, [lo, hi], side="left")
        row_starts = (starts[d_lo:d_hi] - lo).astype(np.int32)
        continues = not (len(row_starts) and row_starts[0] == 0)
        before = (int(targets[lo - 1]) if lo else prev) if continues else -1
        header = np.array([hi - lo, len(row_starts), before], np.int32)
        records.append(header.tobytes() + row_starts.tobytes() + np.asarray(targets[lo:hi]).tobytes())
    return records


def encode_rows(stream: PackedStream, first: int = 0, stop: int | None = None) -> list[bytes]:
    """The records of rows [first, stop) of `stream` (default: all)."""
    stop = stream.num_rows if stop is None else stop
    return _encode(stream.targets_T, np.asarray(stream.doc_starts_D), stream.seq_len, -1, range(first, stop))


class ShardWriter:
    """Packs documents into one shard file as they come, holding less than a row between calls:
    `add` a chunk of documents' ids, `close` at the end (the last row is padded on read). The
    records are those `encode_rows` gives for the same documents packed as one stream."""

    def __init__(self, path: str, seq_len: int, token_dtype, eos_id: int):
        from array_record.python.array_record_module import ArrayRecordWriter

        self.seq_len, self.dtype, self.eos_id = seq_len, np.dtype(token_dtype), eos_id
        self.rows = self.tokens = self.documents = 0
        self._pending = np.zeros(0, self.dtype)  # the tokens of a row not yet full
        self._pending_starts = np.zeros(0, np.int64)
        self._prev = -1
        self._writer = ArrayRecordWriter(str(path), "group_size:1")  # each row readable alone

    def add(self, ids: Sequence[np.ndarray]) -> None:
        if not len(ids):
            return
        lengths = np.fromiter((len(x) + 1 for x in ids), np.int64, len(ids))
        eos = np.array([self.eos_id], self.dtype)
        targets = np.concatenate([self._pending, *(a for x in ids for a in (x, eos))], dtype=self.dtype,
                                 casting="unsafe")
        starts = np.concatenate([self._pending_starts, len(self._pending) + np.cumsum(lengths) - lengths])
        full = len(targets) // self.seq_len
        self._write(_encode(targets, starts, self.seq_len, self._prev, range(full)))
        cut = full * self.seq_len
        if full:
            self._prev = int(targets[cut - 1])
        self._pending, self._pending_starts = targets[cut:].copy(), starts[starts >= cut] - cut
        self.tokens += int(lengths.sum())
        self.documents += len(ids)

    def close(self) -> None:
        if len(self._pending):
            self._write(_encode(self._pending, self._pending_starts, self.seq_len, self._prev, range(1)))
        self._writer.close()

    def _write(self, records: list[bytes]) -> None:
        for record in records:
            self._writer.write(record)
        self.rows += len(records)


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
