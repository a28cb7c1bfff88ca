"""Worker processes: `IterDataset.mp_prefetch(MultiprocessingOptions(num_workers=n))`.

Mirrors grain's `mp_prefetch` (`grain/_src/python/dataset/transformations/process_prefetch.py`
and `interleave.py`), in the same shape:

* worker w of n runs the whole pipeline on its shard: the `MapDataset` under
  `to_iter_dataset()` is sliced `[w::n]`, and everything above it runs unchanged
  (one worker runs the pipeline as it is, unsliced, so any `IterDataset` can be moved
  to a worker process, even one with no `MapDataset` beneath);
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
again: nothing is skipped or repeated. `set_state` keeps the worker processes, as grain
does: it sends each worker its new position on a control queue and bumps a generation
number that every message carries, so the consumer drops what the workers had computed
from the old position. Starting a worker costs a second or two; moving one is free.

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
_SENT, _INTERRUPTED, _STOPPED = "sent", "interrupted", "stopped"
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
            "does not sit on one. Build the pipeline as MapDataset...to_iter_dataset()...mp_prefetch(), "
            "or use one worker, which runs any pipeline whole."
        )
    clone = copy.copy(dataset)
    clone._parents = (slice_pipeline(dataset._parent, sl),)
    return clone


class MultiprocessPrefetchIterDataset(IterDataset):
    """The parent pipeline run by `options.num_workers` worker processes, interleaved in turn."""

    def __init__(self, parent: IterDataset, options: MultiprocessingOptions):
        super().__init__(parent)
        if options.num_workers > 1:
            slice_pipeline(parent, slice(0, None, 1))  # fail now, not in a worker, if it cannot be split
        self._options = options

    def __iter__(self) -> MultiprocessPrefetchDatasetIterator:
        return MultiprocessPrefetchDatasetIterator(self._parent, self._options)

    def __str__(self) -> str:
        return f"MultiprocessPrefetchIterDataset(num_workers={self._options.num_workers})"


def _put(channel, message, stop, control, parent_pid: int) -> str:
    """Put `message` on the channel, waiting while it is full.

    Returns _SENT; _INTERRUPTED if a new position arrived meanwhile (the message is then
    stale and dropped); _STOPPED if the consumer closed or died.
    """
    while True:
        try:
            channel.put(message, timeout=_POLL_S)
            return _SENT
        except queue.Full:
            if stop.is_set() or os.getppid() != parent_pid:
                return _STOPPED
            if not control.empty():
                return _INTERRUPTED


def _take_request(control, *, wait: bool):
    """The newest (generation, state) sent by `set_state`, or None; waits up to _POLL_S if `wait`."""
    request = None
    with contextlib.suppress(queue.Empty):
        request = control.get(timeout=_POLL_S) if wait else control.get_nowait()
        while True:  # several set_state calls in a row: only the last one matters
            request = control.get_nowait()
    return request


def _portable(error: BaseException) -> BaseException:
    """`error` if it survives pickling to the consumer, else a RuntimeError with its text."""
    try:
        cloudpickle.loads(cloudpickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")


def _worker_main(pickled_pipeline: bytes, state, generation: int, channel, control, stop,
                 parent_pid: int) -> None:
    """A worker's whole life: send (generation, kind, element, state) until told to stop.

    After its shard ends (or raises) the worker waits for a new position from
    `set_state` instead of exiting, so a restored iterator reuses the process.
    """
    pipeline, iterator, finished = None, None, False
    while not stop.is_set():
        request = _take_request(control, wait=finished)
        if request is not None:
            (generation, state), finished = request, False
            if iterator is not None:
                iterator.close()
            iterator = None
        elif finished:
            if os.getppid() != parent_pid:
                return
            continue
        try:
            if iterator is None:
                if pipeline is None:
                    pipeline = cloudpickle.loads(pickled_pipeline)
                iterator = iter(pipeline)
                if state is not None:
                    iterator.set_state(state)
            element = next(iterator)
            message = (generation, _ELEMENT, element, iterator.get_state())
        except StopIteration:
            message, finished = (generation, _END, None, None), True
        except Exception as error:  # handed to the consumer, which raises it
            message, finished = (generation, _ERROR, _portable(error), traceback.format_exc()), True
        if _put(channel, message, stop, control, parent_pid) == _STOPPED:
            return


class MultiprocessPrefetchDatasetIterator(DatasetIterator):
    """Round robin over worker processes; the state is per-worker states plus whose turn it is."""

    def __init__(self, parent: IterDataset, options: MultiprocessingOptions):
        self._workers: list = []  # first, so that __del__ works even if the rest fails
        super().__init__()
        n = options.num_workers
        self._options = options
        self._shards = [parent] if n == 1 else [slice_pipeline(parent, slice(w, None, n)) for w in range(n)]
        self._states: list[dict | None] = [None] * n  # None: from the shard's beginning
        self._exhausted = [False] * n
        self._next_worker = 0
        self._generation = 0  # bumped by set_state; messages from older generations are stale

    def _start_workers(self) -> None:
        context = multiprocessing.get_context("spawn")
        for w, shard in enumerate(self._shards):
            channel = context.Queue(maxsize=self._options.per_worker_buffer_size)
            control, stop = context.Queue(), context.Event()
            process = context.Process(
                target=_worker_main, name=f"stacklib-data-worker-{w}", daemon=True,
                args=(cloudpickle.dumps(shard), self._states[w], self._generation, channel, control, stop,
                      os.getpid()),
            )
            process.start()
            self._workers.append((process, channel, control, stop))

    def _get(self, w: int):
        process, channel, _, _ = self._workers[w]
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

    def _receive(self, w: int):
        while True:
            generation, *message = self._get(w)
            if generation == self._generation:  # else computed before the last set_state
                return message

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
        self._states = copy.deepcopy(state["workers"])
        self._exhausted = list(state["exhausted"])
        self._next_worker = state["next_worker"]
        self._generation += 1
        for w, (_, _, control, _) in enumerate(self._workers):  # running workers move; none restart
            control.put((self._generation, self._states[w]))

    def close(self) -> None:
        for _, _, _, stop in self._workers:
            stop.set()
        for process, _, _, _ in self._workers:
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
