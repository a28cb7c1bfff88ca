"""Capture a profile with `jax.profiler`, and time a step honestly.

`trace(log_dir)` wraps `jax.profiler.trace`: everything JAX runs inside the `with` block
is recorded by the profiler in the runtime (host threads, and device streams on a GPU or
TPU) and written to `log_dir/plugins/profile/<run>/` as an XSpace protobuf
(`*.xplane.pb`, what XProf/TensorBoard read) and a Chrome-trace JSON (`*.trace.json.gz`),
plus `perfetto_trace.json.gz` when `create_perfetto_trace=True`. Ours checks first that
it can write there, and hands back the paths of what was written.

`time_fn(fn, *args)` measures a step the way a profile would: after a warm-up call that
compiles, waiting for the result each time (JAX dispatches asynchronously), and reports
the median and the fastest of several calls.

Mirrors: `jax.profiler.trace(log_dir, create_perfetto_link=False, create_perfetto_trace=False)`.

Differences from `jax.profiler.trace`:
  * An unusable `log_dir` fails before the traced code runs, with an error that names the
    directory, the reason and a fix; JAX reports it (if at all) when the trace is saved.
  * The context manager yields a `TraceFiles` whose paths are filled in on exit, instead
    of None, so the caller need not search the directory.
  * No `create_perfetto_link` (it waits for a browser) and no `profiler_options`.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import jax


class ProfileDirectoryError(OSError):
    """The profile cannot be written where it was asked to go."""


@dataclasses.dataclass
class TraceFiles:
    """Where one capture was written (filled in when the `with` block ends).

    Attributes:
      run_dir: `log_dir/plugins/profile/<timestamp>`, the folder of this capture.
      xplane: the XSpace protobuf, readable with `jax.profiler.ProfileData.from_file`.
      trace_json: the Chrome-trace JSON (gzip), the format of chrome://tracing.
      perfetto_json: the Perfetto JSON (gzip), if `create_perfetto_trace=True`.
    """

    log_dir: pathlib.Path
    run_dir: pathlib.Path | None = None
    xplane: pathlib.Path | None = None
    trace_json: pathlib.Path | None = None
    perfetto_json: pathlib.Path | None = None


def _check_writable(log_dir: pathlib.Path) -> None:
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=log_dir, prefix=".write-test-"):
            pass
    except OSError as error:
        reason = error.strerror or str(error)
        raise ProfileDirectoryError(
            f"Cannot write a profile to {str(log_dir)!r}: {reason}. Pass a directory you can "
            f"write to, e.g. trace(tempfile.mkdtemp()) or a folder under your home directory."
        ) from error


def _runs(log_dir: pathlib.Path) -> set[pathlib.Path]:
    return set((log_dir / "plugins" / "profile").glob("*"))


def _single(run_dir: pathlib.Path, pattern: str) -> pathlib.Path | None:
    found = sorted(run_dir.glob(pattern))
    return found[0] if found else None


@contextmanager
def trace(log_dir: str | os.PathLike, *, create_perfetto_trace: bool = True) -> Iterator[TraceFiles]:
    """Profile what JAX runs inside the `with` block and write it under `log_dir`.

    Args:
      log_dir: the folder for the profile (created if missing), as in `jax.profiler.trace`.
      create_perfetto_trace: also write `perfetto_trace.json.gz` (default True here,
        since the op tables of this package read it).

    Yields:
      A `TraceFiles`, whose paths are set when the block ends.

    Raises:
      ProfileDirectoryError: `log_dir` cannot be created or written, before anything runs.
    """
    log_dir = pathlib.Path(log_dir)
    _check_writable(log_dir)
    before = _runs(log_dir)
    files = TraceFiles(log_dir)
    with jax.profiler.trace(str(log_dir), create_perfetto_trace=create_perfetto_trace):
        yield files
    new_runs = sorted(_runs(log_dir) - before, key=lambda path: path.stat().st_mtime)
    if not new_runs:  # a capture within the same second reuses the timestamped folder
        new_runs = sorted(_runs(log_dir), key=lambda path: path.stat().st_mtime)
    files.run_dir = new_runs[-1]
    files.xplane = _single(files.run_dir, "*.xplane.pb")
    files.trace_json = _single(files.run_dir, "*.trace.json.gz")
    files.perfetto_json = _single(files.run_dir, "perfetto_trace.json.gz")


@dataclasses.dataclass(frozen=True)
class Timing:
    """Wall-clock seconds of repeated calls: all of them, the median and the fastest."""

    seconds: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def best(self) -> float:
        return min(self.seconds)


def time_fn(fn: Callable, *args, repeats: int = 10, warmup: int = 1, **kwargs) -> Timing:
    """Time `fn(*args, **kwargs)`: `warmup` untimed calls, then `repeats` timed ones.

    Each timed call waits for its result (`jax.block_until_ready`), so the time is the
    work, not the dispatch. The warm-up call pays for tracing and compilation.

    Raises:
      ValueError: `repeats` < 1 or `warmup` < 0.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"time_fn needs repeats >= 1 and warmup >= 0, got repeats={repeats}, "
                         f"warmup={warmup}.")
    for _ in range(warmup):
        jax.block_until_ready(fn(*args, **kwargs))
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args, **kwargs))
        seconds.append(time.perf_counter() - start)
    return Timing(tuple(seconds))
