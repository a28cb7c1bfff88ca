"""From a captured trace to a table of where the time went, op by op.

A trace is a list of timed events on threads. The ones we want are the XLA ops: each
kernel the compiled program ran, with the HLO instruction's name (`hlo_op`), its module
(`hlo_module`, e.g. 'jit_train_step'), and the run it belongs to (`run_id`, one per
call). On the CPU they are on the runtime's worker threads; on a GPU or TPU on the
device's op line. `load_trace` reads them from the JSON trace, `load_xplane` from the
XSpace protobuf through `jax.profiler.ProfileData`, and both give the same `OpEvent`s.
`op_table` sums them per op (or per any key, such as a named scope) into rows of
count, total time and share.

Mirrors: the trace formats `jax.profiler.trace` writes, and the "framework op stats" /
"HLO op profile" tables of XProf, which stay empty for CPU profiles in this JAX version.

Differences from XProf:
  * Times are wall-clock durations of events; when two ops overlap on different threads
    both count in full, so shares can add to more than the step time (XProf reports
    "self time" per device instead).
  * Only XLA ops are tabulated; Python and runtime events are skipped.
"""

from __future__ import annotations

import collections
import dataclasses
import gzip
import json
import os
import pathlib
import re
from collections.abc import Callable, Iterable
from typing import Any

# Names of thread/line that carry device ops on accelerators (no `hlo_op` argument there).
_DEVICE_OP_LINES = ("XLA Ops", "TensorFlow Ops")


@dataclasses.dataclass(frozen=True)
class OpEvent:
    """One execution of one XLA op.

    Attributes:
      name: the HLO instruction, e.g. 'ynn_fusion.1' or 'broadcast_maximum_fusion'.
      module: the HLO module, e.g. 'jit_train_step'.
      start_us, duration_us: when it started (relative to the trace) and how long it ran.
      thread: the thread or device line it ran on.
      run_id: which execution of the module (one per call) it belongs to.
    """

    name: str
    module: str
    start_us: float
    duration_us: float
    thread: str
    run_id: str


@dataclasses.dataclass(frozen=True)
class OpStat:
    """One row of an op table."""

    key: str
    count: int
    total_us: float
    fraction: float  # of the table's total time

    @property
    def mean_us(self) -> float:
        return self.total_us / self.count


def _resolve(path: str | os.PathLike, patterns: tuple[str, ...]) -> pathlib.Path:
    """A trace file, given the file itself or a folder to search (newest capture first)."""
    path = pathlib.Path(path)
    if path.is_file():
        return path
    if path.is_dir():
        for pattern in patterns:
            found = sorted(path.rglob(pattern), key=lambda p: p.stat().st_mtime)
            if found:
                return found[-1]
    raise FileNotFoundError(
        f"No trace found at {str(path)!r} (looked for {', '.join(patterns)}). Pass the folder "
        "given to jax.profiler.trace, or the file itself; capture with create_perfetto_trace=True "
        "to get perfetto_trace.json.gz."
    )


def _thread_names(events: list[dict]) -> dict[tuple[Any, Any], str]:
    return {(e.get("pid"), e.get("tid")): e.get("args", {}).get("name", "")
            for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}


def load_trace(path: str | os.PathLike) -> list[OpEvent]:
    """Read the XLA op events of a Chrome/Perfetto JSON trace (`.json` or `.json.gz`).

    Args:
      path: a `*.trace.json.gz` / `perfetto_trace.json.gz` file, or a folder holding one
        (such as the `log_dir` given to `jax.profiler.trace`; the newest capture is used).

    Returns:
      The op events sorted by start time.

    Raises:
      FileNotFoundError: no trace file at `path`.
    """
    file = _resolve(path, ("perfetto_trace.json.gz", "*.trace.json.gz", "*.json.gz", "*.json"))
    opener = gzip.open if file.suffix == ".gz" else open
    with opener(file, "rt") as handle:
        document = json.load(handle)
    events = document["traceEvents"] if isinstance(document, dict) else document
    threads = _thread_names(events)
    ops = []
    for event in events:
        if event.get("ph") != "X":
            continue
        args = event.get("args", {})
        thread = threads.get((event.get("pid"), event.get("tid")), str(event.get("tid")))
        if "hlo_op" not in args and thread not in _DEVICE_OP_LINES:
            continue
        ops.append(OpEvent(
            name=args.get("hlo_op", event["name"]),
            module=args.get("hlo_module", ""),
            start_us=float(event["ts"]),
            duration_us=float(event.get("dur", 0.0)),
            thread=thread,
            run_id=str(args.get("run_id", "")),
        ))
    return sorted(ops, key=lambda op: op.start_us)


def load_xplane(path: str | os.PathLike) -> list[OpEvent]:
    """Read the XLA op events of an XSpace protobuf (`*.xplane.pb`) with `jax.profiler.ProfileData`.

    The same events as `load_trace` gives for the JSON of the same capture; times are
    converted from nanoseconds to microseconds.
    """
    from jax.profiler import ProfileData

    profile = ProfileData.from_file(str(_resolve(path, ("*.xplane.pb",))))
    ops = []
    for plane in profile.planes:
        for line in plane.lines:
            for event in line.events:
                stats = dict(event.stats)
                if "hlo_op" not in stats and line.name not in _DEVICE_OP_LINES:
                    continue
                ops.append(OpEvent(
                    name=str(stats.get("hlo_op", event.name)),
                    module=str(stats.get("hlo_module", "")),
                    start_us=event.start_ns / 1e3,
                    duration_us=event.duration_ns / 1e3,
                    thread=line.name,
                    run_id=str(stats.get("run_id", "")),
                ))
    return sorted(ops, key=lambda op: op.start_us)


def op_table(events: Iterable[OpEvent], *, key: Callable[[OpEvent], str] | None = None,
             module: str | None = None) -> list[OpStat]:
    """Total time per op (or per `key(event)`), largest first.

    Args:
      events: op events from `load_trace` or `load_xplane`.
      key: what to group by; default the op's name. E.g. `lambda e: scopes[e.name]`.
      module: keep only events of this HLO module (e.g. 'jit_train_step').

    Returns:
      `OpStat` rows sorted by total time, descending; fractions sum to 1.
    """
    key = key or (lambda event: event.name)
    totals: dict[str, float] = collections.defaultdict(float)
    counts: collections.Counter = collections.Counter()
    for event in events:
        if module is not None and event.module != module:
            continue
        group = key(event)
        totals[group] += event.duration_us
        counts[group] += 1
    grand_total = sum(totals.values()) or 1.0
    rows = [OpStat(group, counts[group], total, total / grand_total) for group, total in totals.items()]
    return sorted(rows, key=lambda row: (-row.total_us, row.key))


def runs(events: Iterable[OpEvent], module: str | None = None) -> int:
    """How many executions (calls) of `module` the events cover: distinct run ids."""
    return len({(e.module, e.run_id) for e in events if module is None or e.module == module})


_WRAPPER = re.compile(r"^[\w\-]+\((.*)\)$")


def named_scope(op_name: str, depth: int = 1, default: str = "(no scope)") -> str:
    """The `jax.named_scope` an HLO op came from, from its metadata `op_name`.

    XLA keeps JAX's name stack in each instruction's metadata, e.g.
    'jit(step)/transpose(jvp(attention))/dot_general': the outer function, then scopes
    wrapped by the transformations that produced the op, then the primitive. We drop the
    first and last parts, unwrap 'jvp(...)', 'transpose(...)', 'vmap(...)', 'jit(...)', and
    keep the first `depth` scopes.

    Example:
      named_scope('jit(step)/transpose(jvp(attention))/dot_general') == 'attention'
    """
    first = op_name.split(";")[0]  # fused ops list several names; the first is the root's
    parts = first.split("/")[1:-1]
    scopes = []
    for part in parts:
        while (match := _WRAPPER.match(part)) is not None:
            part = match.group(1)
        if part:
            scopes.append(part)
    return "/".join(scopes[:depth]) if scopes else default


def is_backward(op_name: str) -> bool:
    """Whether the op belongs to a backward pass: JAX marks those 'transpose(...)'."""
    return "transpose(" in op_name.split(";")[0]
