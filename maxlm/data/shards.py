"""Packed rows in ArrayRecord shard files, one record per row (the records of `packing.Packer`).

A shard is written as its documents come (`ShardWriter`) and read a row at a time
(`ShardedRows`): `grain.sources.ArrayRecordDataSource` over the shard files in order numbers the
rows of all shards globally and reads any of them at random, from a local or shared filesystem or
`gs://` (array_record reads Cloud Storage itself), opening each shard's index only.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from maxlm.data.packing import Packer, RowDecoder


class ShardWriter:
    """Packs documents into one shard file as they come: `add` a chunk of documents' ids, `close`
    at the end. `packer` counts the rows, tokens and documents written."""

    def __init__(self, path: str, seq_len: int, token_dtype, eos_id: int):
        from array_record.python.array_record_module import ArrayRecordWriter

        self.packer = Packer(seq_len, token_dtype, eos_id)
        self._writer = ArrayRecordWriter(str(path), "group_size:1")  # each row readable alone

    def add(self, ids: Sequence[np.ndarray]) -> None:
        self._write(self.packer.add(ids))

    def close(self) -> None:
        self._write(self.packer.finish())
        self._writer.close()

    def _write(self, records: list[bytes]) -> None:
        for record in records:
            self._writer.write(record)


class ShardedRows:
    """The rows of shard files in order, numbered globally: `num_rows`, `seq_len` and `rows(ids)`,
    the four int32 arrays of those rows (`packing.RowDecoder`)."""

    def __init__(self, paths: Sequence[str], seq_len: int, token_dtype, bos_id: int, pad_id: int):
        import grain

        self.source = grain.sources.ArrayRecordDataSource([str(p) for p in paths])
        self.num_rows, self.seq_len = len(self.source), seq_len
        self.decoder = RowDecoder(seq_len, token_dtype, bos_id, pad_id)

    def rows(self, ids) -> dict[str, np.ndarray]:
        ids = [int(i) for i in np.asarray(ids).reshape(-1)]
        return self.decoder.decode(self.source.__getitems__(ids))
