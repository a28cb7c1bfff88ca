"""stacklib.transforms vs jax: the gradient of an MLP loss, eager and staged.

Our `jit` interprets the staged jaxpr with NumPy, one call per equation; `jax.jit`
compiles it with XLA. The ratios say what interpretation costs against compilation,
and what staging saves against re-tracing on every call (our eager `grad`).

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
    ours_jit = st.jit(st.grad(_loss(tnp)))
    eager_s = median_seconds(lambda: ours_eager(params, x, y))
    jit_s = median_seconds(lambda: ours_jit(params, x, y))
    theirs_jit = jax.jit(jax.grad(_loss(jnp)))
    xla_s = median_seconds(lambda: jax.block_until_ready(theirs_jit(params, x, y)))
    for a, b in zip(ours_jit(params, x, y), theirs_jit(params, x, y), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)
    print_ratio("our jit vs our eager grad", jit_s, eager_s, "our eager grad")
    print_ratio("our jit vs jax.jit", jit_s, xla_s, "jax.jit")
