"""Kernels written in Pallas, proved equal to XLA's reference ops (chapters 09 and 10).

Chapter 09 builds TPU-style Pallas kernels, one concept per file:

* `flash_attention` — attention with an online softmax, causal block skipping and
  grouped-query heads; differentiable through a `custom_vjp` whose backward is Pallas too
  (`flash_attention.py`); `reference_attention` is the einsum it must equal;
* `backend.py` — the one switch that decides native vs interpreted (`resolve_interpret`),
  and `record_calls`, which lists the kernels traced (grid and blocks) for tests.

Mirrors `jax.experimental.pallas` and its reference kernels in
`jax.experimental.pallas.ops.tpu`; each file's docstring lists its differences.
"""

from stacklib.kernels.backend import KernelCall, record_calls, resolve_interpret
from stacklib.kernels.flash_attention import flash_attention, reference_attention

__all__ = [
    "KernelCall",
    "flash_attention",
    "record_calls",
    "reference_attention",
    "resolve_interpret",
]
