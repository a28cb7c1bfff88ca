"""Worker processes: `IterDataset.mp_prefetch(MultiprocessingOptions(num_workers=n))`.

Mirrors grain's `mp_prefetch` (`grain/_src/python/dataset/transformations/process_prefetch.py`
and `interleave.py`), in the same shape:

* worker w of n runs the whole pipeline on its shard: the `MapDataset` under
  `to_iter_dataset()` is sliced `[w::n]`, and everything above it runs unchanged;
* the consumer takes one element from each worker in turn (round robin), skipping
  workers that have finished.

For a pipeline whose steps are one-to-one (shuffle, map, random_map, batching on the
`MapDataset`), worker w's k-th element is global element w + k*n, so the round robin
restores the exact single-process order, whatever n is. Steps that drop or combine
elements after the split (a filter, a batch on the iterator) act on each shard
separately, so their output depends on n; put them after `mp_prefetch` if it must not.
Grain behaves the same way.

Why processes: CPython runs one thread's Python code at a time, so a CPU-heavy map only
scales with separate interpreters. Workers are started with "spawn" (a fresh
interpreter), not "fork", because forking a process that runs JAX's threads can
deadlock; the pipeline travels to them pickled with cloudpickle, which also pickles
lambdas and functions defined in a notebook.

The state is one entry per worker (that worker's iterator state after the last element
the consumer took from it) plus whose turn it is. Elements a worker computed ahead but
that were never consumed are not in the state, so after a restore they are computed
again: nothing is skipped or repeated.

Differences from grain: the state format is ours (grain's records its interleave's
internals); a state restores only into the same number of workers; no shared-memory
transport (elements are pickled through a pipe); no `worker_init_fn`.
"""

from __future__ import annotations

import contextlib
import copy
import multiprocessing
import os
import queue
import traceback
from typing import Any

import cloudpickle

from stacklib.data.dataset import DatasetIterator, IterDataset
from stacklib.data.options import MultiprocessingOptions
from stacklib.data.prefetch import PrefetchIterDataset

_ELEMENT, _END, _ERROR = "element", "end", "error"
_POLL_S = 0.2  # how often a blocked worker or consumer checks whether the other side is gone


def slice_pipeline(dataset: IterDataset, sl: slice) -> IterDataset:
    """A copy of the pipeline in which the `MapDataset` under `to_iter_dataset()` is sliced `sl`.

    Raises:
      ValueError: the pipeline does not start with `MapDataset.to_iter_dataset()`, or
        already contains an `mp_prefetch`.
    """
    if isinstance(dataset, PrefetchIterDataset):
        return PrefetchIterDataset(dataset._parent.slice(sl), read_options=dataset._read_options,
                                   allow_nones=dataset._allow_nones)
    if isinstance(dataset, MultiprocessPrefetchIterDataset):
        raise ValueError("mp_prefetch cannot follow another mp_prefetch: use one, with more workers.")
    if len(dataset.parents) != 1 or not isinstance(dataset._parent, IterDataset):
        raise ValueError(
            f"mp_prefetch splits the work by slicing the MapDataset under to_iter_dataset(), but {dataset} "
            "does not sit on one. Build the pipeline as MapDataset...to_iter_dataset()...mp_prefetch()."
        )
    clone = copy.copy(dataset)
    clone._parents = (slice_pipeline(dataset._parent, sl),)
    return clone


class MultiprocessPrefetchIterDataset(IterDataset):
    """The parent pipeline run by `options.num_workers` worker processes, interleaved in turn."""

    def __init__(self, parent: IterDataset, options: MultiprocessingOptions):
        super().__init__(parent)
        slice_pipeline(parent, slice(0, None, 1))  # fail now, not in a worker, if it cannot be split
        self._options = options

    def __iter__(self) -> MultiprocessPrefetchDatasetIterator:
        return MultiprocessPrefetchDatasetIterator(self._parent, self._options)

    def __str__(self) -> str:
        return f"MultiprocessPrefetchIterDataset(num_workers={self._options.num_workers})"


def _put(channel, message, stop, parent_pid: int) -> bool:
    """Put `message` on the channel, waiting while it is full; False if we should stop instead."""
    while True:
        try:
            channel.put(message, timeout=_POLL_S)
            return True
        except queue.Full:
            if stop.is_set() or os.getppid() != parent_pid:  # consumer closed, or died
                return False


def _portable(error: BaseException) -> BaseException:
    """`error` if it survives pickling to the consumer, else a RuntimeError with its text."""
    try:
        cloudpickle.loads(cloudpickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")


def _worker_main(pickled_pipeline: bytes, state, channel, stop, parent_pid: int) -> None:
    """A worker's whole life: build its shard's iterator, then send (element, state) pairs."""
    try:
        iterator = iter(cloudpickle.loads(pickled_pipeline))
        if state is not None:
            iterator.set_state(state)
        while not stop.is_set():
            try:
                element = next(iterator)
            except StopIteration:
                _put(channel, (_END, None, None), stop, parent_pid)
                return
            if not _put(channel, (_ELEMENT, element, iterator.get_state()), stop, parent_pid):
                return
    except Exception as error:  # handed to the consumer, which raises it
        _put(channel, (_ERROR, _portable(error), traceback.format_exc()), stop, parent_pid)


class MultiprocessPrefetchDatasetIterator(DatasetIterator):
    """Round robin over worker processes; the state is per-worker states plus whose turn it is."""

    def __init__(self, parent: IterDataset, options: MultiprocessingOptions):
        self._workers: list = []  # first, so that __del__ works even if the rest fails
        n = options.num_workers
        self._options = options
        self._shards = [slice_pipeline(parent, slice(w, None, n)) for w in range(n)]
        self._states: list[dict | None] = [None] * n  # None: from the shard's beginning
        self._exhausted = [False] * n
        self._next_worker = 0

    def _start_workers(self) -> None:
        context = multiprocessing.get_context("spawn")
        n = len(self._shards)
        for w in range(n):
            channel = context.Queue(maxsize=self._options.per_worker_buffer_size)
            stop = context.Event()
            process = context.Process(
                target=_worker_main, name=f"stacklib-data-worker-{w}", daemon=True,
                args=(cloudpickle.dumps(self._shards[w]), self._states[w], channel, stop, os.getpid()),
            )
            process.start()
            self._workers.append((process, channel, stop))

    def _receive(self, w: int):
        process, channel, _ = self._workers[w]
        while True:
            try:
                return channel.get(timeout=_POLL_S)
            except queue.Empty:
                if process.is_alive():
                    continue
                try:  # it may have sent its last message just before exiting
                    return channel.get(timeout=1.0)
                except queue.Empty:
                    self.close()
                    raise RuntimeError(
                        f"data worker {w} of {len(self._shards)} exited with code {process.exitcode} "
                        "before finishing its shard (killed, or out of memory?)."
                    ) from None

    def __next__(self) -> Any:
        n = len(self._shards)
        while not all(self._exhausted):
            if not self._workers:
                self._start_workers()
            w = self._next_worker
            self._next_worker = (w + 1) % n
            if self._exhausted[w]:
                continue
            kind, payload, state = self._receive(w)
            if kind == _END:
                self._exhausted[w] = True
            elif kind == _ERROR:
                self.close()
                payload.add_note(f"stacklib.data: raised in data worker {w} of {n}; its traceback:\n{state}")
                raise payload
            else:
                self._states[w] = state
                return payload
        self.close()  # every worker has finished its shard
        raise StopIteration

    def get_state(self) -> dict[str, Any]:
        return {"workers": copy.deepcopy(self._states), "exhausted": list(self._exhausted),
                "next_worker": self._next_worker}

    def set_state(self, state: dict[str, Any]) -> None:
        n = len(self._shards)
        if len(state["workers"]) != n:
            raise ValueError(
                f"set_state: this state was saved from {len(state['workers'])} data workers, but the "
                f"pipeline has {n}. Restore with MultiprocessingOptions(num_workers={len(state['workers'])})."
            )
        self.close()  # workers computed ahead from the old position
        self._states = copy.deepcopy(state["workers"])
        self._exhausted = list(state["exhausted"])
        self._next_worker = state["next_worker"]

    def close(self) -> None:
        for _, _, stop in self._workers:
            stop.set()
        for process, _, _ in self._workers:
            process.join(timeout=2.0)
            if process.is_alive():
                process.terminate()
                process.join()
        self._workers = []

    def __del__(self):
        # Best effort: at interpreter exit multiprocessing may be half torn down already,
        # and the daemon workers die with the interpreter anyway.
        with contextlib.suppress(Exception):
            self.close()
