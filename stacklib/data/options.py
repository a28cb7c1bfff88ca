"""How a pipeline reads in parallel: `ReadOptions` (threads) and `MultiprocessingOptions` (processes).

Mirrors `grain.ReadOptions` and `grain.MultiprocessingOptions`, with the same fields and
defaults.

Threads and processes solve different problems. Threads overlap *waiting*: while one
thread waits for a disk or a network read, the others run, so reading many small
records from slow storage gets faster with more threads. They do not overlap Python
*computation*: CPython runs one thread's bytecode at a time (the GIL), so a map written
in Python gets no faster with threads, and on two cores it gets slower from contention.
Processes each have their own interpreter, so a CPU-heavy map runs in parallel, at the
price of starting the workers and copying every element back to the trainer.

Differences from grain: no autotuning (`AutotuneParameter`), no profiling option.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ReadOptions:
    """Threads that read and transform the elements of a `MapDataset` ahead of time.

    Args:
      num_threads: threads computing `ds[i]` for upcoming indices; 0 reads in the
        iterating thread. Grain's default of 16 suits records on remote storage; for
        data already in memory use 0, because threads then only contend for the GIL.
      prefetch_buffer_size: how many elements may be computed ahead of the consumer.
    """

    num_threads: int = 16
    prefetch_buffer_size: int = 500

    def __post_init__(self):
        for name in ("num_threads", "prefetch_buffer_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"ReadOptions.{name} must be a non-negative int, got {value!r}.")


@dataclasses.dataclass(frozen=True)
class MultiprocessingOptions:
    """Worker processes for `IterDataset.mp_prefetch`.

    Args:
      num_workers: worker processes; 0 runs the pipeline in the calling process.
      per_worker_buffer_size: finished elements each worker may hold before it waits
        for the consumer (an element is a whole batch if the pipeline batches).
    """

    num_workers: int = 0
    per_worker_buffer_size: int = 1

    def __post_init__(self):
        if not isinstance(self.num_workers, int) or self.num_workers < 0:
            raise ValueError(
                f"MultiprocessingOptions.num_workers must be a non-negative int, got {self.num_workers!r}."
            )
        if not isinstance(self.per_worker_buffer_size, int) or self.per_worker_buffer_size < 1:
            raise ValueError(
                "MultiprocessingOptions.per_worker_buffer_size must be a positive int, "
                f"got {self.per_worker_buffer_size!r}."
            )
