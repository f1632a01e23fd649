"""Packed rows served as fixed global batches: the batch of step s a pure function of (config, s).

A grain `MapDataset` of row ids fixes which rows form each batch, by index alone, with no
iterator state: `batch(step)` is the same on every run, after any resume and for any number of
processes, and each process reads only its own rows. Nothing here imports TensorFlow.
"""

from __future__ import annotations

import grain
import numpy as np

from maxlm.data.prefetch import Prefetcher, batch_parts_key
from maxlm.data.shards import ShardedRows
from maxlm.data.tokenizers import Tokenizer


class TokenDataset:
    """Packed rows of one split, served as fixed global batches.

    Row order. Let N = num_rows, B = the global batch size and E = N // B steps per epoch.
    Step s belongs to epoch e = s // E and takes rows `order[e*N + (s % E)*B + k]` for k < B,
    where `order` is `grain.MapDataset.range(N)[.shuffle(seed)].repeat(None)`:
      * train: grain's shuffle draws epoch e's order as the permutation
        `index_shuffle(i, max_index=N-1, seed=(shuffle_seed + e) mod 2**32, rounds=4)` of
        [0, N), with `shuffle_seed` derived from `config.seed` (see `_shuffle_seed`). So each
        epoch is a fresh, seed-determined permutation, computed per index in O(1) memory.
      * validation: no shuffle; epoch e repeats rows 0..N-1 in order.
    The last N - E*B rows of each epoch's order are dropped (drop_remainder); when training
    they are different rows each epoch.
    """

    def __init__(self, rows: ShardedRows, *, tokenizer: Tokenizer, batch_size: int, seed: int | None,
                 split: str, packing_efficiency: float):
        self.split = split
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self._rows = rows  # read on demand, a row at a time
        self.num_rows, self.seq_len = rows.num_rows, rows.seq_len
        self.packing_efficiency = packing_efficiency  # fraction of non-padding tokens over the split
        self.steps_per_epoch = self.num_rows // batch_size
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"the {split!r} split has {self.num_rows} packed rows of seq_len={self.seq_len}, "
                f"fewer than one batch of batch_size={batch_size}; lower batch_size or seq_len"
            )
        order = grain.MapDataset.range(self.num_rows)
        if seed is not None:
            order = order.shuffle(seed=_shuffle_seed(seed))
        self.order = order.repeat(None)  # index e*N + i: row i of epoch e's order

    def epoch_of(self, step: int) -> int:
        return step // self.steps_per_epoch

    def first_row(self, position: int) -> int:
        """The index in the row stream (`order`) of batch `position`'s first row: the rows read
        before it, each epoch's dropped remainder counted."""
        epoch, in_epoch = divmod(int(position), self.steps_per_epoch)
        return epoch * self.num_rows + in_epoch * self.batch_size

    def position_at_row(self, row: int) -> int:
        """The first batch position whose rows all come at or after stream index `row` (the
        inverse of `first_row`, rounding up: no row before `row` is read again)."""
        epoch, in_epoch = divmod(int(row), self.num_rows)
        step = -(-in_epoch // self.batch_size)
        if step >= self.steps_per_epoch:
            epoch, step = epoch + 1, 0
        return epoch * self.steps_per_epoch + step

    def row_ids(self, step: int, parts=0, num_parts: int = 1) -> np.ndarray:
        """Ids of the rows `batch(step, ...)` returns, in order."""
        step, parts, num_parts = int(step), batch_parts_key(parts), int(num_parts)
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if num_parts < 1 or self.batch_size % num_parts:
            raise ValueError(
                f"batch_size={self.batch_size} must be divisible by the number of batch parts "
                f"{num_parts}"
            )
        for part in parts:
            if not 0 <= part < num_parts:
                raise ValueError(f"batch part {part} not in [0, {num_parts})")
        per_part = self.batch_size // num_parts
        epoch, step_in_epoch = divmod(step, self.steps_per_epoch)
        start = epoch * self.num_rows + step_in_epoch * self.batch_size
        firsts = [start + part * per_part for part in parts]
        return np.fromiter(
            (self.order[i] for first in firsts for i in range(first, first + per_part)),
            np.int64, per_part * len(parts),
        )

    def batch(self, step: int, parts=0, num_parts: int = 1) -> dict[str, np.ndarray]:
        """Part `parts` of global batch `step` cut into `num_parts` equal parts.

        Rows [p*B/P, (p+1)*B/P) of the global batch (P = num_parts), as int32 arrays `[B/P, seq_len]`
        under `inputs, targets, segment_ids, positions`. `parts` may also be a tuple of parts p
        (ascending): a process whose devices hold several separate slices of the batch (see
        `mesh.batch_parts`) gets them concatenated, `[len(parts)*B/P, seq_len]`. The parts are the
        batch's, not the processes': one process may read several.
        """
        return self._rows.rows(self.row_ids(step, parts, num_parts))

    def prefetch(self, depth: int = 2) -> Prefetcher:
        """This dataset, its `batch` served from a background thread reading `depth` steps ahead.

        Same calls, same arrays (each is `batch(step, ...)` itself, keyed by step): asking for a
        step other than the next one (a resume, a rollback) restarts reading there. Cached, so
        `ds.prefetch()` in a loop returns the same object; its thread ends with the dataset.
        """
        cache = self.__dict__.setdefault("_prefetchers", {})
        if depth not in cache:
            cache[depth] = Prefetcher(self, depth)
        return cache[depth]

    def __repr__(self) -> str:
        return (
            f"TokenDataset(split={self.split!r}, num_rows={self.num_rows}, "
            f"seq_len={self.seq_len}, batch_size={self.batch_size}, tokenizer={self.tokenizer!r})"
        )


def _shuffle_seed(seed: int) -> int:
    # grain reshuffles epoch e with seed + e, so raw seeds s and s+1 would share all but one
    # epoch order. Hashing the seed first keeps runs with nearby seeds unrelated.
    return int(np.random.SeedSequence(seed).generate_state(1, np.uint32)[0])
