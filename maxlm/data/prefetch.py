"""Background reading of a dataset's batches: `TokenDataset.prefetch()`.

The training loop reads batch `step` on its own thread between dispatching steps; on a fast
accelerator that read would be a visible share of the step (docs/performance.md#data-and-checkpoints).
A `Prefetcher` computes the next steps' batches on one background thread instead, each exactly
`dataset.batch(step, ...)`, so the stream is unchanged.
"""

from __future__ import annotations

import queue
import sys
import threading
import weakref

import numpy as np


class Prefetcher:
    """`TokenDataset.batch` served from a bounded queue filled by one background thread.

    The thread computes `batch(s), batch(s+1), ...` from the last step asked for, at most
    `depth` ahead; `batch(step)` returns the queued batch when `step` is the next one and
    otherwise restarts the thread at `step`. numpy releases the GIL while gathering rows, so the
    reading overlaps the training loop's own host work as well as the device's step.
    """

    def __init__(self, dataset, depth: int = 2):
        if depth < 1:
            raise ValueError(f"prefetch depth must be >= 1, got {depth}")
        self.dataset, self.depth = weakref.proxy(dataset), depth
        self._ref = weakref.ref(dataset)
        self._next = None  # (step, parts, num_parts) the queue's head is for
        self._queue = self._stop = self._thread = None

    def __getattr__(self, name):  # steps_per_epoch, row_ids, ... of the dataset
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def batch(self, step: int, parts=0, num_parts: int = 1) -> dict[str, np.ndarray]:
        key = (int(step), batch_parts_key(parts), int(num_parts))
        if key != self._next or self._thread is None:
            self._start(key)
        item = self._queue.get()
        if isinstance(item, BaseException):
            self.close()
            raise item
        self._next = (key[0] + 1, *key[1:])
        return item

    def _start(self, key) -> None:
        self.close()
        self._queue, self._stop = queue.Queue(self.depth), threading.Event()
        self._thread = threading.Thread(
            target=_fill_queue, args=(self._ref, key, self._queue, self._stop),
            name=f"maxlm-prefetch-{key[0]}", daemon=True,
        )  # fmt: skip
        self._thread.start()
        self._next = key

    def close(self) -> None:
        """Stops the thread (it restarts on the next `batch`)."""
        thread, self._thread = getattr(self, "_thread", None), None
        if thread is not None:
            self._stop.set()
            # Not joined when the thread may drop the last reference itself, nor at interpreter
            # exit: from Python 3.12 a daemon thread that wants the GIL then is parked forever, so
            # a join from __del__ at exit hung the process after its last step.
            if thread is not threading.current_thread() and not sys.is_finalizing():
                thread.join()

    __del__ = close


def _fill_queue(ref, key, out: queue.Queue, stop: threading.Event) -> None:
    step, parts, num_parts = key
    while not stop.is_set():
        dataset = ref()  # no strong reference while waiting: the thread ends with the dataset
        if dataset is None:
            return
        try:
            item = dataset.batch(step, parts, num_parts)
        except BaseException as e:  # raised in the caller's thread by `batch`
            item = e
        del dataset
        while not stop.is_set():
            try:
                out.put(item, timeout=0.05)
                break
            except queue.Full:
                continue
        if isinstance(item, BaseException):
            return
        step += 1



def batch_parts_key(parts) -> tuple[int, ...]:
    """`batch`'s parts: one part p, or a tuple of parts."""
    if isinstance(parts, (int, np.integer)):
        return (int(parts),)
    return tuple(int(p) for p in parts)
