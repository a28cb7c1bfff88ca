"""Profiling without a GUI: capture a trace, tabulate its ops, place them on a roofline.

Chapter 08 profiles a training step and asks where its time goes and how far it is from
what the machine can do. This package holds the tools:

* `trace(log_dir)` — `jax.profiler.trace` that checks its folder first and returns the
  paths it wrote; `time_fn` — honest step timing (`capture.py`);
* `load_trace`, `load_xplane`, `op_table`, `runs`, `named_scope`, `is_backward` — read
  the op events of a capture and sum them per op or per named scope (`ops.py`);
* `Roofline`, `measure_matmul_peak`, `measure_bandwidth`, `mfu`, `plot_roofline` — the
  machine's ceilings, measured, and what each op reaches (`roofline.py`).

Mirrors `jax.profiler` (trace, ProfileData) and XProf's op profile and roofline tools;
the differences are listed in each file's docstring.
"""

from stacklib.profile.capture import ProfileDirectoryError, Timing, TraceFiles, time_fn, trace
from stacklib.profile.ops import (
    OpEvent,
    OpStat,
    is_backward,
    load_trace,
    load_xplane,
    named_scope,
    op_table,
    runs,
)
from stacklib.profile.roofline import (
    Roofline,
    measure_bandwidth,
    measure_matmul_peak,
    mfu,
    plot_roofline,
)

__all__ = [
    "OpEvent",
    "OpStat",
    "ProfileDirectoryError",
    "Roofline",
    "Timing",
    "TraceFiles",
    "is_backward",
    "load_trace",
    "load_xplane",
    "measure_bandwidth",
    "measure_matmul_peak",
    "mfu",
    "named_scope",
    "op_table",
    "plot_roofline",
    "runs",
    "time_fn",
    "trace",
]
