"""The one packer: how tokenized documents become fixed-length rows with no wasted space.

Each document is framed as `[bos] + ids + [eos]` and contributes the next-token pairs
`(tokens[:-1], tokens[1:])`. The pairs of all documents are laid end to end and cut into rows of
`seq_len`; a document cut by a row boundary continues in the next row as a new segment, so every
row but the last is full. Segment ids (1, 2, ... per row; 0 = padding) let attention stay inside
a segment, and positions restart at 0 in each segment so RoPE sees each piece from its start.

`Packer` writes each row as a self-contained record, the unit a shard stores (`shards.py`), and
`RowDecoder` derives the row's four int32 arrays from its record alone. A record is

    int32 header [num_tokens, num_starts, prev_token]
    int32 starts[num_starts]     the columns where a document starts (bos in `inputs` there)
    tokens[num_tokens]           the row's targets, in `token_dtype(vocab)` (uint16 or uint32)

`prev_token` is the target just before the row: its first input when column 0 continues a
document (-1 when a document starts there). A row shorter than `seq_len` (the last one) is
padded on read. Reading row r thus touches one record and nothing else, and a row costs about 2
bytes per token stored instead of 16. `pack_documents` is the same two steps in memory.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

KEYS = ("inputs", "targets", "segment_ids", "positions")
HEADER = 3  # int32 words


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every id: uint16 below 65536, else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


class Packer:
    """Packs documents into row records as they come: `add` a chunk of documents' ids and get
    the records of the rows it filled, `finish` for the last, partial row's. Between calls it
    holds less than a row, so any chunking of the same documents gives the same records.
    `rows`, `tokens` (next-token pairs) and `documents` count what it packed."""

    def __init__(self, seq_len: int, token_dtype, eos_id: int):
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.seq_len, self.dtype, self.eos_id = seq_len, np.dtype(token_dtype), eos_id
        self.rows = self.tokens = self.documents = 0
        self._pending = np.zeros(0, self.dtype)  # the targets of a row not yet full
        self._pending_starts = np.zeros(0, np.int64)  # where documents start in it
        self._prev = -1  # the target before `_pending`

    def add(self, ids: Sequence[np.ndarray]) -> list[bytes]:
        """The records of the rows filled by these documents (each a 1-D array of token ids)."""
        if not len(ids):
            return []
        lengths = np.fromiter((len(x) + 1 for x in ids), np.int64, len(ids))
        eos = np.array([self.eos_id], self.dtype)
        targets = np.concatenate([self._pending, *(a for x in ids for a in (np.ravel(x), eos))], dtype=self.dtype,
                                 casting="unsafe")
        starts = np.concatenate([self._pending_starts, len(self._pending) + np.cumsum(lengths) - lengths])
        full = len(targets) // self.seq_len
        records = self._records(targets, starts, full)
        cut = full * self.seq_len
        if full:
            self._prev = int(targets[cut - 1])
        self._pending, self._pending_starts = targets[cut:].copy(), starts[starts >= cut] - cut
        self.tokens += int(lengths.sum())
        self.documents += len(ids)
        return records

    def finish(self) -> list[bytes]:
        """The record of the last row, shorter than `seq_len` (none when the rows came out even)."""
        records = self._records(self._pending, self._pending_starts, 1) if len(self._pending) else []
        self._pending, self._pending_starts = self._pending[:0], self._pending_starts[:0]
        return records

    def _records(self, targets: np.ndarray, starts: np.ndarray, num_rows: int) -> list[bytes]:
        """The records of the first `num_rows` rows of the stream `targets` whose documents start
        at `starts` (ascending offsets into it), `self._prev` the target before it."""
        seq_len = self.seq_len
        lo_R = np.arange(num_rows, dtype=np.int64) * seq_len
        hi_R = np.minimum(lo_R + seq_len, len(targets))
        first_R, stop_R = np.searchsorted(starts, lo_R), np.searchsorted(starts, hi_R)
        begins_R = stop_R > first_R  # a document starts at the row's column 0
        begins_R[begins_R] = starts[first_R[begins_R]] == lo_R[begins_R]
        before_R = np.where(lo_R > 0, targets[np.maximum(lo_R - 1, 0)].astype(np.int64), self._prev)
        header_R3 = np.stack([hi_R - lo_R, stop_R - first_R, np.where(begins_R, -1, before_R)], axis=1)
        # each record is three byte ranges of these, sliced without copying
        header = _bytes(header_R3.astype(np.int32))
        columns = _bytes((starts % seq_len).astype(np.int32))
        tokens, size = _bytes(targets), self.dtype.itemsize
        h = 4 * HEADER
        records = [b"".join((header[h * r:h * (r + 1)], columns[4 * a:4 * b], tokens[size * lo:size * hi]))
                   for r, (a, b, lo, hi) in enumerate(zip(first_R.tolist(), stop_R.tolist(), lo_R.tolist(),
                                                          hi_R.tolist()))]
        self.rows += len(records)
        return records


def _bytes(array: np.ndarray) -> memoryview:
    return memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))


class RowDecoder:
    """Rows of `seq_len` from records: int32 arrays `inputs, targets, segment_ids, positions`,
    each `[len(records), seq_len]`. Padding has inputs = targets = `pad_id`, segment_ids = 0 and
    positions = 0; the loss must mask it with `segment_ids > 0`."""

    def __init__(self, seq_len: int, token_dtype, bos_id: int, pad_id: int):
        self.seq_len, self.dtype = seq_len, np.dtype(token_dtype)
        self.bos_id, self.pad_id = bos_id, pad_id
        self._cols = np.arange(seq_len, dtype=np.int32)

    def decode(self, records: Sequence[bytes]) -> dict[str, np.ndarray]:
        h = 4 * HEADER
        header_N3 = np.frombuffer(b"".join(r[:h] for r in records), np.int32).reshape(-1, HEADER)
        num_tokens_N, num_starts_N, prev_N = header_N3.T
        ends = (h + 4 * num_starts_N).tolist()
        starts = np.frombuffer(b"".join(r[h:e] for r, e in zip(records, ends)), np.int32)
        tokens = np.frombuffer(b"".join(r[e:] for r, e in zip(records, ends)), self.dtype)
        real_NL = self._cols < num_tokens_N[:, None]
        start_rows = np.repeat(np.arange(len(records)), num_starts_N)

        targets = np.full(real_NL.shape, self.pad_id, np.int32)
        targets[real_NL] = tokens
        inputs = np.empty_like(targets)
        inputs[:, 1:] = targets[:, :-1]
        inputs[:, 0] = np.where(prev_N >= 0, prev_N, self.bos_id)
        inputs[start_rows, starts] = self.bos_id
        # segment k (1-based) runs from its start column to the next one; a row that begins
        # inside a document begins with segment 1 too
        is_start_NL = np.zeros(real_NL.shape, bool)
        is_start_NL[start_rows, starts] = True
        is_start_NL[:, 0] = True
        segment_ids = np.cumsum(is_start_NL, axis=1, dtype=np.int32)
        positions = self._cols - np.maximum.accumulate(np.where(is_start_NL, self._cols, 0), axis=1)
        pad_NL = ~real_NL
        inputs[pad_NL] = self.pad_id
        segment_ids[pad_NL] = positions[pad_NL] = 0
        return {"inputs": inputs, "targets": targets, "segment_ids": segment_ids, "positions": positions}


def pack_documents(docs: Iterable[np.ndarray], seq_len: int, bos_id: int, eos_id: int, pad_id: int = 0,
                   token_dtype=np.int32) -> dict[str, np.ndarray]:
    """All rows of `docs` packed as one stream, in memory: `Packer`'s records decoded by
    `RowDecoder`, bitwise what a shard of the same documents reads back as."""
    packer = Packer(seq_len, token_dtype, eos_id)
    records = packer.add(list(docs)) + packer.finish()
    return RowDecoder(seq_len, token_dtype, bos_id, pad_id).decode(records)


def packing_efficiency(segment_ids: np.ndarray) -> float:
    """Fraction of slots holding a real token (segment id > 0)."""
    segment_ids = np.asarray(segment_ids)
    if segment_ids.size == 0:
        return 0.0
    return float(np.count_nonzero(segment_ids) / segment_ids.size)
