"""stacklib.transforms vs jax: the gradient of an MLP loss, eager, interpreted and compiled.

Our `jit` lowers the staged jaxpr to StableHLO with our own emitter and compiles it with
XLA, as `jax.jit` does (target: ≥ 0.9× `jax.jit`'s speed). `jit(f, interpret=True)`
runs the same jaxpr with NumPy, one call per equation, and our eager `grad` re-traces on
every call: they show what compiling buys.

On a busy machine with few cores, NumPy's multithreaded BLAS (OpenBLAS) can be many times
slower than single-threaded, because its spinning threads fight the other processes for
the cores: for stable numbers there, run with OPENBLAS_NUM_THREADS=1.
"""

import jax
import jax.numpy as jnp
import numpy as np

import stacklib.transforms as st
import stacklib.transforms.numpy as tnp
from benchmarks.timing import median_seconds, print_ratio


def _loss(m):
    def loss(params, x, y):
        w1, b1, w2 = params
        return m.mean((m.tanh(x @ w1 + b1) @ w2 - y) ** 2)
    return loss


def main(scale: float = 1.0) -> None:
    jax.config.update("jax_enable_x64", True)  # both sides in float64, as in the chapter
    width, batch = max(4, int(256 * scale)), max(4, int(256 * scale))
    rng = np.random.default_rng(0)
    params = (rng.normal(size=(width, width)) / np.sqrt(width), np.zeros(width), rng.normal(size=(width, 1)))
    x, y = rng.normal(size=(batch, width)), rng.normal(size=(batch, 1))
    print(f"MLP loss gradient, batch {batch}, width {width}, float64")

    ours_eager = st.grad(_loss(tnp))
    ours_interpreted = st.jit(st.grad(_loss(tnp)), interpret=True)
    ours_jit = st.jit(st.grad(_loss(tnp)))
    theirs_jit = jax.jit(jax.grad(_loss(jnp)))
    for a, b, c in zip(ours_jit(params, x, y), ours_interpreted(params, x, y), theirs_jit(params, x, y),
                       strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(a, c, rtol=1e-9, atol=1e-12)
    eager_s = median_seconds(lambda: ours_eager(params, x, y))
    interpreted_s = median_seconds(lambda: ours_interpreted(params, x, y))
    # Alternate the two compiled ones so that a burst of load on the machine hits both alike.
    jit_s, xla_s = [], []
    for _ in range(5):
        jit_s.append(median_seconds(lambda: ours_jit(params, x, y), repeats=9))
        xla_s.append(median_seconds(lambda: jax.block_until_ready(theirs_jit(params, x, y)), repeats=9))
    jit_s, xla_s = min(jit_s), min(xla_s)
    print_ratio("our eager grad vs jax.jit", eager_s, xla_s, "jax.jit")
    print_ratio("our jit(interpret=True) vs jax.jit", interpreted_s, xla_s, "jax.jit")
    print_ratio("our jit (StableHLO -> XLA) vs jax.jit", jit_s, xla_s, "jax.jit", target=0.9)
