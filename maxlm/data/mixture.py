"""Several sources in fixed proportions (`data.mixture`): the rows of step s drawn from the
sources by their weights, as a pure function of (config, s).

Row slot g = s * batch_size + j (the j-th row of global batch s) falls in block g // BLOCK. A
block holds each source's share of its BLOCK slots exactly (the weights times BLOCK, rounded by
largest remainders), in an order drawn from (seed, block). The k-th slot that goes to source i
reads source i's k-th row in its own order: the source's rows shuffled with a seed of its own and
repeated, epoch after epoch (unshuffled for validation). So each source runs through its epochs
at its own pace, and a process reads only the slots of its rows, on any process count.
"""

from __future__ import annotations

import functools

import grain
import numpy as np

from maxlm.data.prefetch import Prefetcher, batch_parts_key

BLOCK = 4096


def block_counts(weights, block: int = BLOCK) -> np.ndarray:
    """Each source's slots in a block: `weights / sum * block`, rounded down, the slots left
    given to the largest remainders (ties to the earlier source)."""
    weights = np.asarray(weights, np.float64)
    quotas = weights / weights.sum() * block
    counts = np.floor(quotas).astype(np.int64)
    left = block - int(counts.sum())
    order = sorted(range(len(weights)), key=lambda i: (-(quotas[i] - counts[i]), i))
    counts[order[:left]] += 1
    return counts


class MixtureDataset:
    """The `TokenDataset` interface (`batch`, `prefetch`) over several sources' packed rows.

    `parts`: (name, rows) per source, `rows` with `num_rows` and `rows(ids)` (`shards.ShardedRows`).
    """

    def __init__(self, parts, weights, *, tokenizer, batch_size: int, seq_len: int, seed: int | None,
                 split: str, stats: dict):
        self.names = [name for name, _ in parts]
        self._rows = [rows for _, rows in parts]
        self.counts = block_counts(weights)
        if (self.counts == 0).any():
            raise ValueError(f"data.mixture: source(s) {[n for n, c in zip(self.names, self.counts) if not c]} "
                             f"weigh less than 1/{BLOCK} of the whole")
        self.tokenizer, self.batch_size, self.seq_len, self.split = tokenizer, batch_size, seq_len, split
        self.seed, self.stats = seed, stats
        self.orders = []
        for i, rows in enumerate(self._rows):
            order = grain.MapDataset.range(rows.num_rows)
            if seed is not None:  # each source its own shuffle, epochs independent of the others'
                order = order.shuffle(seed=int(np.random.SeedSequence([seed, i]).generate_state(1)[0]))
            self.orders.append(order.repeat(None))
        # steps of whole blocks before some source's rows come round again (an eval pass's length)
        self.steps_per_epoch = min(rows.num_rows // count for rows, count in zip(self._rows, self.counts)) \
            * BLOCK // batch_size
        tokens = sum(s["tokens"] for s in stats.values())
        self.packing_efficiency = tokens / (sum(s["sequences"] for s in stats.values()) * seq_len)

    @functools.lru_cache(maxsize=4)  # noqa: B019 - a handful of blocks, alive as long as the dataset
    def _block(self, block: int) -> tuple[np.ndarray, np.ndarray]:
        """(source of each slot, its rank among that source's slots) in `block`."""
        rng = np.random.default_rng([self.seed or 0, block])
        source = rng.permutation(np.repeat(np.arange(len(self.counts)), self.counts))
        order = np.argsort(source, kind="stable")
        starts = np.concatenate([[0], np.cumsum(self.counts)[:-1]])
        rank = np.empty(BLOCK, np.int64)
        rank[order] = np.arange(BLOCK) - starts[source[order]]
        return source, rank

    def slot_sources(self, slots) -> tuple[np.ndarray, np.ndarray]:
        """(source, that source's sample index) of each global row slot."""
        slots = np.asarray(slots, np.int64)
        source, sample = np.empty_like(slots), np.empty_like(slots)
        for block in np.unique(slots // BLOCK):
            here = slots // BLOCK == block
            src, rank = self._block(int(block))
            source[here] = src[slots[here] % BLOCK]
            sample[here] = block * self.counts[source[here]] + rank[slots[here] % BLOCK]
        return source, sample

    def first_row(self, position: int) -> int:
        """The row slot of batch `position`'s first row (as `TokenDataset.first_row`)."""
        return int(position) * self.batch_size

    def position_at_row(self, row: int) -> int:
        """The first batch position at or after row slot `row` (as `TokenDataset.position_at_row`)."""
        return -(-int(row) // self.batch_size)

    def batch(self, step: int, parts=0, num_parts: int = 1) -> dict[str, np.ndarray]:
        """This process's rows of global batch `step` (as `TokenDataset.batch`)."""
        step, parts, num_parts = int(step), batch_parts_key(parts), int(num_parts)
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if num_parts < 1 or self.batch_size % num_parts:
            raise ValueError(f"batch_size={self.batch_size} must be divisible by the number of batch parts {num_parts}")
        per_part = self.batch_size // num_parts
        slots = np.concatenate([np.arange(per_part) + step * self.batch_size + part * per_part
                                for part in parts])
        source, sample = self.slot_sources(slots)
        out = None
        for i in np.unique(source):
            mine = np.flatnonzero(source == i)
            rows = self._rows[i].rows([self.orders[i][int(k)] for k in sample[mine]])
            if out is None:
                out = {k: np.empty((len(slots), self.seq_len), v.dtype) for k, v in rows.items()}
            for k, v in rows.items():
                out[k][mine] = v
        return out

    def prefetch(self, depth: int = 2) -> Prefetcher:
        cache = self.__dict__.setdefault("_prefetchers", {})
        if depth not in cache:
            cache[depth] = Prefetcher(self, depth)
        return cache[depth]

    def __repr__(self) -> str:
        shares = ", ".join(f"{n}={c / BLOCK:.3f}" for n, c in zip(self.names, self.counts))
        return f"MixtureDataset(split={self.split!r}, {shares}, batch_size={self.batch_size})"
