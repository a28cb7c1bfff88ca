"""Gated linear units in XLA operations (tokamax's 'xla' `gated_linear_unit`).

    out = activation(x @ w_gate) * (x @ w_up)

SwiGLU with `activation=jax.nn.swish`, GEGLU with `jax.nn.gelu`, ReGLU with `jax.nn.relu`,
the original GLU with `jax.nn.sigmoid` (Dauphin et al. 2016; Shazeer 2020). The weights
are either one fused array `[K, 2, N]` (`[:, 0]` the gate, `[:, 1]` the up projection) or a
pair `(w_gate, w_up)` of `[K, N]` arrays. The product of the two halves is taken in at
least float32 and cast back to the input's dtype, as in tokamax
(`tokamax/_src/ops/gated_linear_unit/base.py`).

Differences from tokamax: no Pallas (Triton / Mosaic GPU) kernels; autodiff gradient.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp


def xla_gated_linear_unit(x: jax.Array, weights: jax.Array | tuple[jax.Array, jax.Array], *,
                          activation: Callable[[jax.Array], jax.Array] | None = None,
                          precision: jax.lax.PrecisionLike = None, config: None = None) -> jax.Array:
    """activation(x @ w_gate) * (x @ w_up): x [*B, M, K] -> [*B, M, N]."""
    del config
    if isinstance(weights, tuple):
        w_gate, w_up = weights
        gate = jnp.matmul(x, w_gate, precision=precision)
        up = jnp.matmul(x, w_up, precision=precision)
    else:
        both = jnp.einsum("...k,kjn->...jn", x, weights, precision=precision)  # [*B, M, 2, N]
        gate, up = both[..., 0, :], both[..., 1, :]
    dtype = jnp.promote_types(x.dtype, jnp.float32)
    gate, up = gate.astype(dtype), up.astype(dtype)
    if activation is not None:
        gate = activation(gate)
    return (gate * up).astype(x.dtype)
