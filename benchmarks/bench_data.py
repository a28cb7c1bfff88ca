"""stacklib.data against grain: records per second through a CPU-heavy map, by worker count.

The pipeline is the same for both libraries:

    MapDataset.range(n).shuffle(seed).map(cpu_heavy).to_iter_dataset(ReadOptions(num_threads=0))
        .mp_prefetch(MultiprocessingOptions(num_workers=w))      # for w > 0

`cpu_heavy` spends about a millisecond in a pure-Python loop, the kind of work (parsing,
tokenising) that only worker processes can parallelise. Throughput is measured after the
first element arrives, so worker start-up (printed separately) is not in it; each
configuration is run `repeats` times and the median taken. Both libraries must produce
the same elements in the same order, which is checked. Target: >= 0.9x grain's speed.
"""

from __future__ import annotations

import statistics
import time

import grain
from absl import flags

import stacklib.data as sd
from benchmarks.timing import print_ratio

WORKER_COUNTS = (0, 1, 2)


def cpu_heavy(x: int) -> int:
    """About a millisecond of pure-Python arithmetic (module level, so workers can import it)."""
    total = 0
    for i in range(20_000):
        total += (i * x) % 7
    return total


def _pipeline(library, records: int, workers: int):
    dataset = library.MapDataset.range(records).shuffle(seed=0).map(cpu_heavy)
    iterable = dataset.to_iter_dataset(library.ReadOptions(num_threads=0))
    if workers:
        iterable = iterable.mp_prefetch(library.MultiprocessingOptions(num_workers=workers))
    return iterable


def _run(library, records: int, workers: int) -> tuple[float, float, list[int]]:
    """(start-up seconds, seconds for the remaining records, all records) of one pass."""
    iterator = iter(_pipeline(library, records, workers))
    start = time.perf_counter()
    first = next(iterator)
    started = time.perf_counter()
    rest = list(iterator)
    finished = time.perf_counter()
    if hasattr(iterator, "close"):
        iterator.close()
    return started - start, finished - started, [first, *rest]


def main(scale: float = 1.0) -> None:
    flags.FLAGS.mark_as_parsed()  # grain's workers read absl flags (see PITFALLS.md)
    records = max(20, int(3000 * scale))
    repeats = 3 if scale >= 0.1 else 1
    print(f"{records} records, CPU-heavy map (~1 ms each), median of {repeats} passes")
    for workers in WORKER_COUNTS:
        runs = {"stacklib": [], "grain": []}
        for _ in range(repeats):
            for name, library in (("stacklib", sd), ("grain", grain)):
                runs[name].append(_run(library, records, workers))
        ours, theirs = runs["stacklib"], runs["grain"]
        assert ours[0][2] == theirs[0][2], "the two libraries produced different elements"
        ours_s = statistics.median(r[1] for r in ours) / (records - 1)
        theirs_s = statistics.median(r[1] for r in theirs) / (records - 1)
        startup = statistics.median(r[0] for r in ours), statistics.median(r[0] for r in theirs)
        print(f"  workers={workers}: start-up stacklib {startup[0]:.2f} s, grain {startup[1]:.2f} s; "
              f"{1 / ours_s:.0f} vs {1 / theirs_s:.0f} records/s")
        print_ratio(f"  time per record, {workers} worker(s)", ours_s, theirs_s, "grain", target=0.9)
