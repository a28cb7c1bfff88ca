"""The roofline model: what a machine can do, what an op can reach, and MFU.

A processor does at most `peak_flops` operations per second and moves at most
`peak_bandwidth` bytes per second to and from memory. An op that does F FLOPs and moves
B bytes therefore takes at least

    t ≥ max(F / peak_flops, B / peak_bandwidth),

and reaches at most `min(peak_flops, I · peak_bandwidth)` FLOP/s, where I = F / B is its
arithmetic intensity. Plotted against I on log-log axes, that bound is a slanted line
(memory-bound) meeting a flat one (compute-bound) at the ridge, I = peak_flops /
peak_bandwidth. Placing each op of a profile at (I, achieved FLOP/s) shows which bound
holds it back and how far from it the op is.

`measure_matmul_peak` and `measure_bandwidth` measure the two peaks on this machine (a
datasheet does not know how many cores a shared CPU gives us); `mfu` is model FLOPs
utilization, the share of the peak a step achieves.

Mirrors: XProf's roofline tool (which reads peaks from the device's datasheet) and the
MFU of MaxText's training logs.

Differences from XProf:
  * Peaks are measured, with one matmul and one in-place elementwise kernel, not read
    from a spec; they are what this program can reach, usually below the datasheet's.
  * One memory level (the one a large array streams from); XProf draws a roof per level
    (HBM, VMEM/caches).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterable

import jax
import jax.numpy as jnp

from stacklib.profile.capture import time_fn


@dataclasses.dataclass(frozen=True)
class Roofline:
    """A machine's two ceilings.

    Attributes:
      peak_flops: FLOP/s the fastest kernel reaches (e.g. a large matmul).
      peak_bandwidth: bytes/s memory delivers to a streaming kernel.
    """

    peak_flops: float
    peak_bandwidth: float

    def __post_init__(self):
        if not (self.peak_flops > 0 and self.peak_bandwidth > 0):
            raise ValueError(f"Roofline peaks must be positive, got peak_flops={self.peak_flops}, "
                             f"peak_bandwidth={self.peak_bandwidth}.")

    @property
    def ridge(self) -> float:
        """The intensity (FLOPs per byte) above which an op is compute-bound."""
        return self.peak_flops / self.peak_bandwidth

    def attainable(self, intensity: float) -> float:
        """The most FLOP/s an op of this arithmetic intensity can reach: min(peak, I · bandwidth)."""
        return min(self.peak_flops, intensity * self.peak_bandwidth)

    def min_time(self, flops: float, nbytes: float) -> float:
        """Seconds an op needs at least: max(flops / peak_flops, bytes / peak_bandwidth)."""
        return max(flops / self.peak_flops, nbytes / self.peak_bandwidth)

    def bound(self, flops: float, nbytes: float) -> str:
        """'compute' or 'memory': which ceiling limits an op with these counts."""
        return "compute" if flops / self.peak_flops >= nbytes / self.peak_bandwidth else "memory"


def mfu(flops_per_step: float, step_seconds: float, peak_flops: float) -> float:
    """Model FLOPs utilization: the share of `peak_flops` a step achieves.

    MFU = flops_per_step / (step_seconds · peak_flops). Count the model's FLOPs (e.g. from
    `stacklib.compile.cost_analysis`, or 6 · parameters · tokens for a transformer's
    training step), not what the compiled program happened to execute.
    """
    if step_seconds <= 0 or peak_flops <= 0:
        raise ValueError(f"mfu needs positive step_seconds and peak_flops, "
                         f"got {step_seconds} and {peak_flops}.")
    return flops_per_step / (step_seconds * peak_flops)


def measure_matmul_peak(n: int, *, dtype=jnp.float32, repeats: int = 5) -> float:
    """FLOP/s of this machine's fastest kernel: an n×n matmul, best of `repeats` runs.

    The best run, not the median: a peak is what the hardware can do, and on a shared
    machine the slower runs measure the neighbours.
    """
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), dtype)
    timing = time_fn(jax.jit(jnp.matmul), a, b, repeats=repeats)
    return 2 * n**3 / timing.best


def measure_bandwidth(nbytes: int, *, repeats: int = 5) -> float:
    """Bytes/s memory streams: an in-place `x * 2` over `nbytes` of float32, best of `repeats`.

    The kernel reads `nbytes` and writes `nbytes`. It donates its input, so the result
    reuses the same buffer: a fresh output buffer would be touched for the first time by
    the kernel, and on a CPU the operating system's page faults would dominate the time.
    The bandwidth depends on where `nbytes` fit: a few MB stream from the caches, tens of
    MB or more from main memory.
    """
    scale = jax.jit(lambda v: v * 2.0, donate_argnums=0)
    x = scale(jnp.ones((max(nbytes // 4, 1),), jnp.float32))  # compile, and own the buffer
    x.block_until_ready()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        x = scale(x)
        x.block_until_ready()
        seconds.append(time.perf_counter() - start)
    return 2 * x.nbytes / min(seconds)


def plot_roofline(roofline: Roofline, points: Iterable[tuple[str, float, float]] = (), *, ax=None,
                  title: str = "Roofline"):
    """Draw the two ceilings and place each (label, intensity, achieved FLOP/s) point.

    Returns the matplotlib Axes.
    """
    import matplotlib.pyplot as plt

    points = list(points)
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4.5))
    intensities = [p[1] for p in points if p[1] > 0] + [roofline.ridge]
    low = 10 ** math.floor(math.log10(min(intensities) / 4))
    high = 10 ** math.ceil(math.log10(max(intensities) * 4))
    grid = [low * (high / low) ** (i / 200) for i in range(201)]
    ax.loglog(grid, [roofline.attainable(i) for i in grid], color="black", lw=2, label="roofline")
    ax.axvline(roofline.ridge, color="grey", ls=":", lw=1)
    ax.annotate(f"ridge {roofline.ridge:.1f} FLOP/B", (roofline.ridge, roofline.peak_flops),
                textcoords="offset points", xytext=(5, -14), fontsize=8, color="grey")
    for label, intensity, achieved in points:
        if intensity > 0 and achieved > 0:
            ax.scatter(intensity, achieved, s=30, zorder=3)
            ax.annotate(label, (intensity, achieved), textcoords="offset points", xytext=(4, 3), fontsize=7)
    ax.set_xlabel("arithmetic intensity (FLOPs per byte)")
    ax.set_ylabel("FLOP/s")
    ax.set_title(title)
    return ax
