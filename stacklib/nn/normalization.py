"""Per-example normalization: `LayerNorm` and `RMSNorm`.

Mirrors `flax.nnx.LayerNorm` and `nnx.RMSNorm` (flax/nnx/nn/normalization.py,
flax 0.12.8): same arguments, defaults (`epsilon=1e-6`, note: not PyTorch's 1e-5) and
weight names (`scale`, initialised to ones; `bias`, zeros).

    LayerNorm:  y = (x - mean(x)) / sqrt(var(x) + eps) * scale + bias
    RMSNorm:    y = x / sqrt(mean(x^2) + eps) * scale

over the last axis. Statistics are computed in at least float32 even for bfloat16
inputs, and the variance uses flax's fast form `E[x^2] - E[x]^2` (clipped at 0), so our
outputs match flax's to float32 rounding.

Differences from flax.nnx:
- Only the last axis is normalized (no `reduction_axes`, `feature_axes`, `axis_name`,
  `mask`, or `use_fast_variance=False`); a wrong feature size raises a ValueError
  naming expected and actual sizes.
- No `BatchNorm`, `GroupNorm` or `InstanceNorm`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from stacklib.nn import initializers
from stacklib.nn.linear import promote_dtype
from stacklib.nn.module import Module
from stacklib.nn.rngs import Rngs
from stacklib.nn.variables import Param


def _check_features(layer: Module, x: jax.Array) -> None:
    if jnp.ndim(x) < 1 or jnp.shape(x)[-1] != layer.num_features:
        raise ValueError(
            f"{type(layer).__name__}(num_features={layer.num_features}) expects inputs of shape "
            f"(..., {layer.num_features}), got shape {jnp.shape(x)}."
        )


def _normalize(x, mean, var, scale, bias, epsilon, dtype):
    """(x - mean) * rsqrt(var + eps) * scale + bias, in flax's order of operations."""
    y = x - mean[..., None]
    mul = jax.lax.rsqrt(var[..., None] + epsilon)
    args = [x]
    if scale is not None:
        mul = mul * scale
        args.append(scale)
    y = y * mul
    if bias is not None:
        y = y + bias
        args.append(bias)
    return jnp.asarray(y, dtype or jnp.result_type(*args))


def _statistics(x: jax.Array, dtype: Any, use_mean: bool) -> tuple[jax.Array, jax.Array]:
    """Mean and variance over the last axis, in at least float32."""
    x = jnp.asarray(x, jnp.promote_types(dtype or jnp.result_type(x), jnp.float32))
    if not use_mean:
        var = jnp.mean(jax.lax.square(x), axis=-1)
        return jnp.zeros_like(var), var
    mu, mu2 = jnp.mean(x, axis=-1), jnp.mean(jax.lax.square(x), axis=-1)
    # E[x^2] - E[x]^2 can come out slightly negative from rounding; clip so rsqrt stays finite.
    return mu, jnp.maximum(0.0, mu2 - jax.lax.square(mu))


class LayerNorm(Module):
    """Layer normalization over the last axis (Ba et al., 2016, arXiv:1607.06450).

    Args:
      num_features: size of the last axis.
      epsilon: added to the variance before the square root.
      dtype: dtype of the result (None: inferred from inputs and params).
      param_dtype: dtype of `scale` and `bias`.
      use_bias, use_scale: learn `bias` / `scale`.
      bias_init, scale_init: their initializers.
      rngs: keys for the initializers (drawn even for constant ones, as in flax).
    """

    def __init__(
        self,
        num_features: int,
        *,
        epsilon: float = 1e-6,
        dtype: Any | None = None,
        param_dtype: Any = jnp.float32,
        use_bias: bool = True,
        use_scale: bool = True,
        bias_init: initializers.Initializer = initializers.zeros,
        scale_init: initializers.Initializer = initializers.ones,
        rngs: Rngs,
    ):
        shape = (num_features,)
        self.scale = Param(scale_init(rngs.params(), shape, param_dtype)) if use_scale else None
        self.bias = Param(bias_init(rngs.params(), shape, param_dtype)) if use_bias else None
        self.num_features = num_features
        self.epsilon = epsilon
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.use_bias = use_bias
        self.use_scale = use_scale

    def __call__(self, x: jax.Array) -> jax.Array:
        _check_features(self, x)
        scale = self.scale[...] if self.scale is not None else None
        bias = self.bias[...] if self.bias is not None else None
        x, scale, bias = promote_dtype((x, scale, bias), self.dtype)
        mean, var = _statistics(x, self.dtype, use_mean=True)
        return _normalize(x, mean, var, scale, bias, self.epsilon, self.dtype)


class RMSNorm(Module):
    """Root-mean-square normalization over the last axis (Zhang & Sennrich, 2019).

    Like LayerNorm without re-centering and without a bias: cheaper, and what most recent
    language models use.

    Args: as `LayerNorm`, without `use_bias`/`bias_init`.
    """

    def __init__(
        self,
        num_features: int,
        *,
        epsilon: float = 1e-6,
        dtype: Any | None = None,
        param_dtype: Any = jnp.float32,
        use_scale: bool = True,
        scale_init: initializers.Initializer = initializers.ones,
        rngs: Rngs,
    ):
        self.scale = Param(scale_init(rngs.params(), (num_features,), param_dtype)) if use_scale else None
        self.num_features = num_features
        self.epsilon = epsilon
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.use_scale = use_scale

    def __call__(self, x: jax.Array) -> jax.Array:
        _check_features(self, x)
        scale = self.scale[...] if self.scale is not None else None
        x, scale = promote_dtype((x, scale), self.dtype)
        mean, var = _statistics(x, self.dtype, use_mean=False)
        return _normalize(x, mean, var, scale, None, self.epsilon, self.dtype)
