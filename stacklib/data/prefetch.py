"""From random access to iteration: `to_iter_dataset`, with read-ahead threads.

Mirrors grain's `PrefetchIterDataset` and `PrefetchDatasetIterator`
(`grain/_src/python/dataset/transformations/prefetch.py`).

The iterator walks the indices 0, 1, 2, ... of a `MapDataset` and skips the Nones that
filters leave. Its whole state is one integer, the index of the next element to return,
`{"next_index": i}`, which is grain's state too. Restoring it is exact, because element i
of a `MapDataset` depends on nothing but i: the shuffle, the random maps and the batches
are all functions of the index.

With `ReadOptions(num_threads=k)`, k threads compute the next `prefetch_buffer_size`
elements ahead of the consumer. The state still counts only elements *returned*, so
work done ahead is simply redone after a restore, never skipped.

Differences from grain: no autotuning of the buffer, no statistics.
"""

from __future__ import annotations

import collections
import concurrent.futures
from typing import Any

from stacklib.data.dataset import DatasetIterator, IterDataset, MapDataset
from stacklib.data.options import ReadOptions


class PrefetchIterDataset(IterDataset):
    """The elements of a `MapDataset` in index order, Nones skipped unless `allow_nones`."""

    def __init__(self, parent: MapDataset, *, read_options: ReadOptions, allow_nones: bool = False):
        super().__init__(parent)
        if not isinstance(parent, MapDataset):
            raise TypeError(f"to_iter_dataset needs a MapDataset, got {type(parent).__name__}.")
        self._read_options = read_options
        self._allow_nones = allow_nones

    def __iter__(self) -> PrefetchDatasetIterator:
        return PrefetchDatasetIterator(self._parent, self._read_options, self._allow_nones)

    def __str__(self) -> str:
        options = self._read_options
        return (f"PrefetchIterDataset(num_threads={options.num_threads}, "
                f"prefetch_buffer_size={options.prefetch_buffer_size})")


class PrefetchDatasetIterator(DatasetIterator):
    """Iterates `parent[0], parent[1], ...`; the state is the next index to return."""

    def __init__(self, parent: MapDataset, read_options: ReadOptions, allow_nones: bool):
        self._executor = None  # first, so that __del__ works even if the rest fails
        super().__init__()
        self._dataset = parent
        self._length = len(parent)
        self._allow_nones = allow_nones
        self._next_index = 0
        self._buffer: collections.deque[concurrent.futures.Future] = collections.deque()
        self._next_buffered = 0  # the index the next submitted future computes
        self._buffer_size = read_options.prefetch_buffer_size
        if read_options.num_threads > 0 and read_options.prefetch_buffer_size > 0:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                read_options.num_threads, thread_name_prefix="stacklib-data-read"
            )

    def _fill_buffer(self) -> None:
        while len(self._buffer) < self._buffer_size and self._next_buffered < self._length:
            self._buffer.append(self._executor.submit(self._dataset.__getitem__, self._next_buffered))
            self._next_buffered += 1

    def _read_next(self) -> Any:
        if self._executor is None:
            return self._dataset[self._next_index]
        self._fill_buffer()
        element = self._buffer.popleft().result()  # re-raises the reader's exception here
        self._fill_buffer()
        return element

    def __next__(self) -> Any:
        while self._next_index < self._length:
            element = self._read_next()
            self._next_index += 1
            if element is not None or self._allow_nones:
                return element
        raise StopIteration

    def get_state(self) -> dict[str, Any]:
        return {"next_index": self._next_index}

    def set_state(self, state: dict[str, Any]) -> None:
        next_index = state["next_index"]
        if not 0 <= next_index <= self._length:
            raise IndexError(f"set_state: next_index {next_index} is outside [0, {self._length}], the "
                             f"length of {self._dataset}. Was the state saved from a different pipeline?")
        for future in self._buffer:
            future.cancel()
        self._buffer.clear()
        self._next_index = self._next_buffered = next_index

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
            self._buffer.clear()

    def __del__(self):
        self.close()
