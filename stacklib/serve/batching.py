"""Dynamic batching: requests from many clients, padded into one call of the model.

A model call on a small batch costs about as much as on a large one (the time goes to
dispatch and to reading the weights), so a server that calls the model once per
request wastes most of the machine. `DynamicBatcher` runs one worker thread that:

1. waits for the first pending request;
2. keeps collecting requests until it holds `max_batch_size` rows or `batch_timeout`
   seconds have passed since that first request (the window: latency traded for
   throughput);
3. concatenates them and pads the batch up to the next of `allowed_batch_sizes` (TF
   Serving's name), by default `max_batch_size` alone, so that one shape is compiled;
4. calls the model once and hands each request its own rows back.

Why one padded shape by default: XLA compiles a different program for each batch size,
and on CPU a row's logits differ in the last bit between a batch of 1 and a batch of 16
(the matmul blocks its sums differently). With a single shape, a request's answer never
depends on who else was calling: the server is bitwise batch-invariant. Padding costs
compute at light load; a large model would allow a few sizes (`bucket_sizes(32)`) instead.

Requests are futures (`concurrent.futures.Future`), so threads wait on `.result()` and
asyncio endpoints `await asyncio.wrap_future(...)`.

Differences from TF Serving's batcher: one queue per model version, no per-queue
limits on outstanding batches, no priority; padding repeats the last row.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import numpy as np


def bucket_sizes(max_batch_size: int) -> list[int]:
    """Powers of two below `max_batch_size`, then `max_batch_size` itself: [1, 2, 4, ..., max]."""
    sizes, size = [], 1
    while size < max_batch_size:
        sizes.append(size)
        size *= 2
    return [*sizes, max_batch_size]


class DynamicBatcher:
    """Batch `submit(rows)` calls from many threads into calls of `model(batch)`.

    Args:
      model: a function of one array (B, ...) returning an array (B, ...).
      max_batch_size: the most rows in one call.
      batch_timeout: seconds to wait for more requests after the first one arrives.
      allowed_batch_sizes: the padded sizes the model is called with, increasing, the last
        equal to `max_batch_size` (default: only `max_batch_size`).
    """

    def __init__(self, model: Callable, *, max_batch_size: int = 32, batch_timeout: float = 0.002,
                 allowed_batch_sizes: list[int] | None = None):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}.")
        sizes = list(allowed_batch_sizes or [max_batch_size])
        if sizes != sorted(set(sizes)) or sizes[-1] != max_batch_size:
            raise ValueError(f"allowed_batch_sizes must increase and end with max_batch_size="
                             f"{max_batch_size}, got {allowed_batch_sizes}.")
        self.allowed_batch_sizes = sizes
        self.model, self.max_batch_size, self.batch_timeout = model, max_batch_size, batch_timeout
        self.batch_sizes: collections.Counter[int] = collections.Counter()  # rows per call -> calls
        self._queue: queue.Queue = queue.Queue()
        self._closed = False
        self._carried = None  # a request that did not fit in the previous call: it goes first
        self._worker = threading.Thread(target=self._run, daemon=True, name="DynamicBatcher")
        self._worker.start()

    def warm_up(self, example_row: np.ndarray) -> None:
        """Compile every allowed size now, so the first clients do not wait for the compiler."""
        for size in self.allowed_batch_sizes:
            np.asarray(self.model(np.repeat(example_row[None], size, axis=0)))

    def submit(self, rows: np.ndarray) -> Future:
        """Queue `rows` (n, ...) with 1 <= n <= max_batch_size; the future gets their outputs."""
        if self._closed:
            raise RuntimeError("this batcher is closed.")
        if not 1 <= len(rows) <= self.max_batch_size:
            raise ValueError(f"a request must have between 1 and {self.max_batch_size} rows, got "
                             f"{len(rows)}.")
        future: Future = Future()
        self._queue.put((rows, future))
        return future

    def close(self) -> None:
        """Finish the requests already queued, then stop the worker."""
        self._closed = True
        self._queue.put(None)
        self._worker.join()

    def _collect(self) -> list | None:
        first, self._carried = self._carried or self._queue.get(), None
        if first is None:
            return None
        pending, rows = [first], len(first[0])
        deadline = time.monotonic() + self.batch_timeout
        while rows < self.max_batch_size:
            try:
                item = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if item is None:
                self._queue.put(None)  # close after this batch
                break
            if rows + len(item[0]) > self.max_batch_size:
                self._carried = item  # too big for this call: first in line for the next
                break
            pending.append(item)
            rows += len(item[0])
        return pending

    def _run(self) -> None:
        while (pending := self._collect()) is not None:
            pending = [(rows, future) for rows, future in pending if future.set_running_or_notify_cancel()]
            if not pending:
                continue
            batch = np.concatenate([rows for rows, _ in pending])
            n = len(batch)
            size = next(b for b in self.allowed_batch_sizes if b >= n)
            padded = np.concatenate([batch, np.repeat(batch[-1:], size - n, axis=0)]) if size > n else batch
            try:
                outputs = np.asarray(self.model(padded))[:n]
            except Exception as error:  # the model failed: every request in the batch learns why
                for _, future in pending:
                    future.set_exception(error)
                continue
            self.batch_sizes[n] += 1
            start = 0
            for rows, future in pending:
                future.set_result(outputs[start:start + len(rows)])
                start += len(rows)
