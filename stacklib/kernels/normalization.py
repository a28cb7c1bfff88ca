"""Layer normalization and RMS normalization in XLA operations (tokamax's 'xla' `layer_norm`).

    y = (x - mean(x)) / sqrt(var(x) + epsilon) · (scale + scale_offset) + offset

along `axis`; with `subtract_mean=False` the mean is taken as zero, which is RMSNorm.
As in tokamax (`tokamax/_src/ops/normalization/base.py`), float16/bfloat16 inputs are
computed in float32 and the result is cast back to the input's dtype.

Differences from tokamax: no fused-input callables and no Triton kernel; the gradient is
JAX's autodiff of these lines (tokamax writes the VJP by hand; the results agree).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def xla_layer_norm(x: jax.Array, scale: jax.Array | None, offset: jax.Array | None, *, axis: int = -1,
                   epsilon: float = 1e-6, scale_offset: float = 0.0, subtract_mean: bool = True,
                   config: None = None) -> jax.Array:
    """Normalize `x` along `axis` (LayerNorm, or RMSNorm with `subtract_mean=False`)."""
    del config
    axis = axis % x.ndim
    y = x.astype(jnp.promote_types(x.dtype, jnp.float32))  # statistics in at least float32
    if subtract_mean:
        y = y - jnp.mean(y, axis, keepdims=True)
    y = y * jax.lax.rsqrt(jnp.mean(jnp.square(y), axis, keepdims=True) + epsilon)
    others = [a for a in range(x.ndim) if a != axis]  # scale and offset broadcast along these
    if scale is not None:
        y = y * jnp.expand_dims(scale.astype(y.dtype) + scale_offset, others)
    if offset is not None:
        y = y + jnp.expand_dims(offset.astype(y.dtype), others)
    return y.astype(x.dtype)
