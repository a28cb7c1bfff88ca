"""Timing helpers shared by the benchmarks."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_seconds(run: Callable[[], object], *, repeats: int = 5, warmup: int = 1) -> float:
    """Median wall time of `run()` over `repeats` calls, after `warmup` untimed calls.

    `run` must wait for its own results (e.g. `jax.block_until_ready`), since JAX
    dispatches asynchronously. The median resists the odd slow call on a busy machine.
    """
    for _ in range(warmup):
        run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def print_ratio(what: str, ours_s: float, theirs_s: float, library: str, target: float | None = None):
    """Print one line: both times and our speed as a fraction of the real library's."""
    speed = theirs_s / ours_s
    verdict = ""
    if target is not None:
        verdict = f" ({'meets' if speed >= target else 'misses'} the target of ≥ {target}×)"
    print(f"{what}: stacklib {ours_s * 1e3:.2f} ms, {library} {theirs_s * 1e3:.2f} ms "
          f"-> {speed:.2f}× {library}'s speed{verdict}")
    return speed


def alternating_ratios(ours: Callable[[], object], theirs: Callable[[], object], *, rounds: int = 9,
                       calls: int = 21) -> tuple[list[float], list[float]]:
    """Per-call seconds of `ours` and `theirs`, measured in alternating rounds.

    Each round times `calls` calls of one, then of the other (the order swaps every round),
    and keeps each side's median: a burst of load on a shared machine then hits both
    sides of a round alike. Returns the two lists of per-round medians; the ratio of a
    round is `theirs[i] / ours[i]`, and the figure to report is the median of those.
    """
    ours(), theirs()  # warm up both
    ours_s, theirs_s = [], []
    for i in range(rounds):
        order = [(ours, ours_s), (theirs, theirs_s)]
        for run, into in order if i % 2 == 0 else reversed(order):
            into.append(median_seconds(run, repeats=calls, warmup=0))
    return ours_s, theirs_s
