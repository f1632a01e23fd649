"""Packs tokenized documents into fixed-length rows with no wasted space.

Each document is framed as `[bos] + ids + [eos]` and contributes the next-token pairs
`(tokens[:-1], tokens[1:])`. The pairs of all documents are laid end to end and cut into rows of
`seq_len`; a document cut by a row boundary continues in the next row as a new segment, so every
row but the last is full. Segment ids (1, 2, ... per row; 0 = padding) let attention stay inside
a segment, and positions restart at 0 in each segment so RoPE sees each piece from its start.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

KEYS = ("inputs", "targets", "segment_ids", "positions")


def pack_documents(
    docs: Iterable[np.ndarray], seq_len: int, bos_id: int, eos_id: int, pad_id: int = 0
) -> dict[str, np.ndarray]:
    """Returns int32 arrays `inputs, targets, segment_ids, positions`, each `[num_rows, seq_len]`.

    Padding (only in the last row) has inputs = targets = `pad_id`, segment_ids = 0 and
    positions = 0; the loss must mask it with `segment_ids > 0`.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    docs = [np.asarray(d, dtype=np.int32).reshape(-1) for d in docs]
    if not docs:
        return {k: np.zeros((0, seq_len), np.int32) for k in KEYS}
    num_docs = len(docs)
    # Document d contributes len_d + 1 pairs: (bos, ids...) -> (ids..., eos).
    pairs_D = np.fromiter((len(d) + 1 for d in docs), dtype=np.int64, count=num_docs)
    pair_end_D = np.cumsum(pairs_D)  # one past each document's last pair
    pair_start_D = pair_end_D - pairs_D
    num_pairs = int(pair_end_D[-1])
    num_rows = -(-num_pairs // seq_len)
    size = num_rows * seq_len
    num_pad = size - num_pairs
    # Large temporaries dominate the run time (page faults), so: int32 where it fits, in place.
    index_dtype = np.int32 if size < 2**31 else np.int64

    # targets: each document's ids followed by eos; inputs: the same stream shifted right by one,
    # with bos at each document start (where the shift would bring in the previous eos).
    targets_S = np.full(size, pad_id, np.int32)
    is_id_P = np.ones(num_pairs, bool)
    is_id_P[pair_end_D - 1] = False
    targets_S[:num_pairs][is_id_P] = np.concatenate(docs)
    targets_S[pair_end_D - 1] = eos_id
    del is_id_P
    inputs_S = np.full(size, pad_id, np.int32)
    inputs_S[1:num_pairs] = targets_S[: num_pairs - 1]
    inputs_S[pair_start_D] = bos_id

    # A segment is the part of a document inside one row, so in row r its id is the document id
    # minus that of the row's first slot, plus one. Padding counts as one extra document.
    with_pad_D = np.append(pairs_D, num_pad)
    segment_ids_RL = np.repeat(np.arange(num_docs + 1, dtype=np.int32), with_pad_D)
    segment_ids_RL = segment_ids_RL.reshape(num_rows, seq_len)
    segment_ids_RL -= segment_ids_RL[:, :1].copy()
    segment_ids_RL += 1
    # A segment starts at its document's start or its row's start, whichever is later, so its
    # positions are min(position in document, column).
    starts_D = np.append(pair_start_D, num_pairs).astype(index_dtype)
    positions_RL = np.arange(size, dtype=index_dtype)
    positions_RL -= np.repeat(starts_D, with_pad_D)
    positions_RL = positions_RL.reshape(num_rows, seq_len)
    np.minimum(positions_RL, np.arange(seq_len, dtype=index_dtype), out=positions_RL)
    positions_RL = positions_RL.astype(np.int32, copy=False)

    if num_pad:  # only the tail of the last row: segment 0, position 0
        segment_ids_RL[-1, seq_len - num_pad :] = 0
        positions_RL[-1, seq_len - num_pad :] = 0
    return {
        "inputs": inputs_S.reshape(num_rows, seq_len),
        "targets": targets_S.reshape(num_rows, seq_len),
        "segment_ids": segment_ids_RL,
        "positions": positions_RL,
    }


def packing_efficiency(segment_ids: np.ndarray) -> float:
    """Fraction of slots holding a real token (segment id > 0)."""
    segment_ids = np.asarray(segment_ids)
    if segment_ids.size == 0:
        return 0.0
    return float(np.count_nonzero(segment_ids) / segment_ids.size)


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every id: uint16 below 65536, else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


class PackedStream:
    """The compact form of `pack_documents`' output: the token stream stored once.

    `targets_T` is every document's ids followed by eos, end to end (`T` = number of next-token
    pairs), in `token_dtype(vocab)`; `doc_starts_D` is where each document starts in it. Row r
    covers slots [r*L, (r+1)*L); `rows(ids)` derives the four int32 arrays of those rows —
    bitwise what `pack_documents` gives — so the cache holds ~2 bytes per token instead of 16.
    """

    def __init__(self, targets_T, doc_starts_D, seq_len: int, bos_id: int, eos_id: int, pad_id: int):
        self.targets_T, self.doc_starts_D = targets_T, doc_starts_D
        self.seq_len, self.bos_id, self.eos_id, self.pad_id = seq_len, bos_id, eos_id, pad_id
        self.num_tokens = int(len(targets_T))
        self.num_rows = -(-self.num_tokens // seq_len)
        self._cols = np.arange(seq_len, dtype=np.int64)

    @classmethod
    def from_documents(cls, docs, seq_len, bos_id, eos_id, pad_id=0, dtype=np.int32):
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        docs = [np.asarray(d).reshape(-1) for d in docs]
        lengths = np.fromiter((len(d) + 1 for d in docs), np.int64, len(docs))
        ends = np.cumsum(lengths)
        targets = np.full(int(ends[-1]) if len(docs) else 0, eos_id, dtype)
        is_id = np.ones(len(targets), bool)
        is_id[ends - 1] = False
        if len(docs):
            targets[is_id] = np.concatenate(docs)
        return cls(targets, ends - lengths, seq_len, bos_id, eos_id, pad_id)

    @property
    def packing_efficiency(self) -> float:
        return self.num_tokens / (self.num_rows * self.seq_len) if self.num_rows else 0.0

    def rows(self, ids) -> dict[str, np.ndarray]:
        ids = np.asarray(ids, np.int64).reshape(-1)
        slots_RL = ids[:, None] * self.seq_len + self._cols  # absolute slot index
        real_RL = slots_RL < self.num_tokens
        clipped_RL = np.minimum(slots_RL, self.num_tokens - 1)
        doc_RL = np.searchsorted(self.doc_starts_D, clipped_RL, side="right") - 1
        start_RL = self.doc_starts_D[doc_RL]
        targets = self.targets_T[clipped_RL].astype(np.int32)
        inputs = self.targets_T[np.maximum(clipped_RL - 1, 0)].astype(np.int32)
        inputs[clipped_RL == start_RL] = self.bos_id
        segment_ids = (doc_RL - doc_RL[:, :1] + 1).astype(np.int32)
        positions = np.minimum(clipped_RL - start_RL, self._cols).astype(np.int32)
        if not real_RL.all():
            pad = ~real_RL
            targets[pad] = inputs[pad] = self.pad_id
            segment_ids[pad] = positions[pad] = 0
        return {"inputs": inputs, "targets": targets, "segment_ids": segment_ids, "positions": positions}
