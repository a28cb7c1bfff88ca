"""stacklib.transforms vs jax: the gradient of an MLP loss, eager, interpreted and compiled.

Our `jit` lowers the staged jaxpr to StableHLO with our own emitter and compiles it with
XLA, as `jax.jit` does (target: ≥ 0.9× `jax.jit`'s speed). `jit(f, interpret=True)`
runs the same jaxpr with NumPy, one call per equation, and our eager `grad` re-traces on
every call: they show what compiling buys.

The compiled comparison runs in alternating rounds (ours, theirs, theirs, ours, ...) and
reports the median of the rounds' ratios, with their range, because on a shared machine
the load changes from one second to the next. A second comparison on a tiny MLP (width
4), where XLA's own work is a few microseconds, gives each side's per-call overhead: the
Python (ours) or C++ (JAX) that a call crosses before and after XLA runs.

On a busy machine with few cores, NumPy's multithreaded BLAS (OpenBLAS) can be many times
slower than single-threaded, because its spinning threads fight the other processes for
the cores: for stable numbers there, run with OPENBLAS_NUM_THREADS=1.
"""

import os
import statistics

import jax
import jax.numpy as jnp
import numpy as np

import stacklib.transforms as st
import stacklib.transforms.numpy as tnp
from benchmarks.timing import alternating_ratios, median_seconds, print_ratio


def _loss(m):
    def loss(params, x, y):
        w1, b1, w2 = params
        return m.mean((m.tanh(x @ w1 + b1) @ w2 - y) ** 2)
    return loss


def _problem(width: int, batch: int):
    rng = np.random.default_rng(0)
    params = (rng.normal(size=(width, width)) / np.sqrt(width), np.zeros(width), rng.normal(size=(width, 1)))
    return params, rng.normal(size=(batch, width)), rng.normal(size=(batch, 1))


def _compiled_pair(width: int, batch: int):
    """Our jit and jax.jit on the same problem, checked to agree; each returns when its result is ready."""
    params, x, y = _problem(width, batch)
    ours, theirs = st.jit(st.grad(_loss(tnp))), jax.jit(jax.grad(_loss(jnp)))
    for a, b in zip(ours(params, x, y), theirs(params, x, y), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)
    return (lambda: ours(params, x, y)), (lambda: jax.block_until_ready(theirs(params, x, y)))


def main(scale: float = 1.0) -> None:
    jax.config.update("jax_enable_x64", True)  # both sides in float64, as in the chapter
    width, batch = max(4, int(256 * scale)), max(4, int(256 * scale))
    params, x, y = _problem(width, batch)
    print(f"MLP loss gradient, batch {batch}, width {width}, float64; load average {os.getloadavg()[0]:.1f}")

    ours_eager = st.grad(_loss(tnp))
    ours_interpreted = st.jit(st.grad(_loss(tnp)), interpret=True)
    theirs_jit = jax.jit(jax.grad(_loss(jnp)))
    for a, b in zip(ours_interpreted(params, x, y), theirs_jit(params, x, y), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)
    xla_s = median_seconds(lambda: jax.block_until_ready(theirs_jit(params, x, y)))
    eager_s = median_seconds(lambda: ours_eager(params, x, y))
    interpreted_s = median_seconds(lambda: ours_interpreted(params, x, y))
    print_ratio("our eager grad vs jax.jit", eager_s, xla_s, "jax.jit")
    print_ratio("our jit(interpret=True) vs jax.jit", interpreted_s, xla_s, "jax.jit")

    rounds = 15 if scale >= 1 else 3
    ours_s, theirs_s = alternating_ratios(*_compiled_pair(width, batch), rounds=rounds)
    ratios = [t / o for o, t in zip(ours_s, theirs_s, strict=True)]
    speed = statistics.median(ratios)
    print(f"our jit (StableHLO -> XLA) vs jax.jit: stacklib {statistics.median(ours_s) * 1e3:.2f} ms, "
          f"jax.jit {statistics.median(theirs_s) * 1e3:.2f} ms -> {speed:.2f}× jax.jit's speed, the median "
          f"of {rounds} alternating rounds ({min(ratios):.2f} to {max(ratios):.2f}) "
          f"({'meets' if speed >= 0.9 else 'misses'} the target of ≥ 0.9×)")

    tiny_ours, tiny_theirs = alternating_ratios(*_compiled_pair(4, 4), rounds=rounds, calls=201)
    tiny_ours_us, tiny_theirs_us = statistics.median(tiny_ours) * 1e6, statistics.median(tiny_theirs) * 1e6
    print(f"per-call overhead (width 4, where XLA's own work is negligible): "
          f"stacklib {tiny_ours_us:.0f} µs, jax.jit {tiny_theirs_us:.0f} µs")
