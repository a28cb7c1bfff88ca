"""Weight initializers: functions `(key, shape, dtype) -> array`.

Mirrors `flax.nnx.initializers` (flax/nnx/nn/initializers.py, flax 0.12.8), which itself
re-exports `jax.nn.initializers` and adds `zeros_init()` / `ones_init()`. We do the
same: the initializers are JAX's, so a layer initialised here from the same key as
flax's gets bit-identical weights.

The default for `Linear.kernel` is `lecun_normal()`: a truncated normal with variance
`1 / fan_in`, which keeps the variance of activations roughly constant from layer to
layer at initialisation (LeCun et al., "Efficient BackProp", 1998).

Differences from flax.nnx: only the initializers imported below (no `delta_orthogonal`,
`kaiming_*` or `orthogonal`).
"""

from __future__ import annotations

from collections.abc import Callable

from jax.nn.initializers import (
    constant,
    glorot_normal,
    glorot_uniform,
    he_normal,
    he_uniform,
    lecun_normal,
    lecun_uniform,
    normal,
    ones,
    truncated_normal,
    uniform,
    variance_scaling,
    xavier_normal,
    xavier_uniform,
    zeros,
)

Initializer = Callable  # (key, shape, dtype) -> jax.Array


def zeros_init() -> Initializer:
    """An initializer that returns zeros (the default for biases)."""
    return zeros


def ones_init() -> Initializer:
    """An initializer that returns ones (the default for normalization scales)."""
    return ones


__all__ = [
    "Initializer", "constant", "glorot_normal", "glorot_uniform", "he_normal", "he_uniform",
    "lecun_normal", "lecun_uniform", "normal", "ones", "ones_init", "truncated_normal", "uniform",
    "variance_scaling", "xavier_normal", "xavier_uniform", "zeros", "zeros_init",
]
