"""Linear layers and embeddings: `Linear`, `LinearGeneral`, `Embed`.

Mirrors `flax.nnx.Linear`, `nnx.LinearGeneral` and `nnx.Embed` (flax/nnx/nn/linear.py,
flax 0.12.8), with flax's argument names, defaults and weight names, so a parity test
can copy weights key by key:

    Linear.kernel     (in_features, out_features)     lecun_normal()
    Linear.bias       (out_features,)                 zeros
    Embed.embedding   (num_embeddings, features)      variance_scaling(1, fan_in, normal, out_axis=0)

The kernel is stored `(in, out)`, so `y = x @ kernel + bias` needs no transpose. Keys are
drawn in flax's order (kernel, then bias, even though zeros need no randomness), which
is what makes `Linear(3, 4, rngs=nnx.Rngs(0))` bit-identical in both libraries.

Differences from flax.nnx:
- A wrong input size raises a ValueError that names the layer, the expected and the
  actual shape (flax lets `dot_general` fail with a TypeError).
- No `dot_general`, `promote_dtype`, `preferred_element_type` or `*_metadata` arguments
  (metadata comes with the initializer, e.g. `with_partitioning`, which flax accepts
  too); `LinearGeneral` has no `batch_axis`; no `Conv`, `Einsum` or `LoRA`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from stacklib.nn import initializers
from stacklib.nn.module import Module
from stacklib.nn.rngs import Rngs
from stacklib.nn.variables import Param, VariableMetadata

default_kernel_init = initializers.lecun_normal()
default_bias_init = initializers.zeros_init()
default_embed_init = initializers.variance_scaling(1.0, "fan_in", "normal", out_axis=0)


def promote_dtype(arrays: tuple, dtype: Any | None = None) -> tuple:
    """Cast arrays (Nones pass through) to `dtype`, or to their common floating type."""
    if dtype is None:
        dtype = jnp.result_type(*[a for a in arrays if a is not None])
        if not jnp.issubdtype(dtype, jnp.inexact):
            dtype = jnp.promote_types(dtype, jnp.float32)
    return tuple(None if a is None else jnp.asarray(a, dtype) for a in arrays)


class Linear(Module):
    """A dense layer: `y = x @ kernel + bias`, over the last axis of `x`.

    Args:
      in_features: size of the input's last axis.
      out_features: size of the output's last axis.
      use_bias: add a bias.
      dtype: dtype of the computation (None: promote inputs and params together).
      param_dtype: dtype the parameters are created in.
      precision: `jax.lax.Precision` of the matrix product.
      kernel_init, bias_init: initializers `(key, shape, dtype) -> array`.
      rngs: where the initializers' keys come from (`rngs.params()`).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        use_bias: bool = True,
        dtype: Any | None = None,
        param_dtype: Any = jnp.float32,
        precision: Any = None,
        kernel_init: initializers.Initializer = default_kernel_init,
        bias_init: initializers.Initializer = default_bias_init,
        rngs: Rngs,
    ):
        self.kernel = Param(kernel_init(rngs.params(), (in_features, out_features), param_dtype))
        self.bias = Param(bias_init(rngs.params(), (out_features,), param_dtype)) if use_bias else None
        self.in_features = in_features
        self.out_features = out_features
        self.use_bias = use_bias
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.precision = precision

    def __call__(self, inputs: jax.Array) -> jax.Array:
        """`inputs @ kernel + bias` for `inputs` of shape `(..., in_features)`.

        Raises:
          ValueError: the last axis of `inputs` is not `in_features` long.
        """
        if jnp.ndim(inputs) < 1 or jnp.shape(inputs)[-1] != self.in_features:
            raise ValueError(
                f"Linear(in_features={self.in_features}, out_features={self.out_features}) expects "
                f"inputs of shape (..., {self.in_features}), got shape {jnp.shape(inputs)}. "
                "Check the previous layer's output size, or reshape the input."
            )
        bias = self.bias[...] if self.bias is not None else None
        inputs, kernel, bias = promote_dtype((inputs, self.kernel[...], bias), self.dtype)
        # Contract the last axis of the inputs with the first axis of the (in, out) kernel.
        dimension_numbers = (((inputs.ndim - 1,), (0,)), ((), ()))
        y = jax.lax.dot_general(inputs, kernel, dimension_numbers, precision=self.precision)
        if bias is not None:
            y += jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
        return y


def _as_tuple(x: int | Sequence[int]) -> tuple[int, ...]:
    return tuple(x) if isinstance(x, Sequence) else (x,)


def _reshaped(value: Any, shape: tuple[int, ...]) -> Any:
    # An initializer wrapped by `with_partitioning` returns its array inside a
    # VariableMetadata; reshape the array and keep the metadata (its names describe `shape`).
    if isinstance(value, VariableMetadata):
        return dataclasses.replace(value, raw_value=jnp.reshape(value.raw_value, shape))
    return jnp.reshape(value, shape)


class LinearGeneral(Module):
    """A dense layer over several input axes and/or producing several output axes.

    `kernel` has shape `(*in_features, *out_features)`. Attention uses it to project
    `(batch, length, features)` to `(batch, length, heads, head_dim)` and back.

    The kernel is initialised as a `(prod(in), prod(out))` matrix and reshaped, so fan-in
    based initializers see the true fan-in (as in flax). Logical names given with
    `with_partitioning` describe the reshaped kernel: one per axis of
    `(*in_features, *out_features)`.

    Args:
      in_features: size(s) of the contracted input axes.
      out_features: size(s) of the output axes.
      axis: which input axes to contract (default: the last).
      (the others as in `Linear`)
    """

    def __init__(
        self,
        in_features: int | Sequence[int],
        out_features: int | Sequence[int],
        *,
        axis: int | Sequence[int] = -1,
        use_bias: bool = True,
        dtype: Any | None = None,
        param_dtype: Any = jnp.float32,
        kernel_init: initializers.Initializer = default_kernel_init,
        bias_init: initializers.Initializer = default_bias_init,
        precision: Any = None,
        rngs: Rngs,
    ):
        self.in_features = _as_tuple(in_features)
        self.out_features = _as_tuple(out_features)
        self.axis = _as_tuple(axis)
        if len(self.in_features) != len(self.axis):
            raise ValueError(
                f"LinearGeneral: in_features {self.in_features} and axis {self.axis} must have "
                "the same length (one size per contracted axis)."
            )
        flat_shape = (int(np.prod(self.in_features)), int(np.prod(self.out_features)))
        kernel = kernel_init(rngs.params(), flat_shape, param_dtype)
        self.kernel = Param(_reshaped(kernel, self.in_features + self.out_features))
        if use_bias:
            bias = bias_init(rngs.params(), (flat_shape[1],), param_dtype)
            self.bias = Param(_reshaped(bias, self.out_features))
        else:
            self.bias = None
        self.use_bias = use_bias
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.precision = precision

    def __call__(self, inputs: jax.Array) -> jax.Array:
        """Contract `inputs` over `axis` with the kernel; output `(..., *out_features)`.

        Raises:
          ValueError: the contracted axes of `inputs` do not have sizes `in_features`.
        """
        axis = tuple(a % inputs.ndim for a in self.axis)
        got = tuple(inputs.shape[a] for a in axis)
        if got != self.in_features:
            raise ValueError(
                f"LinearGeneral expects axes {self.axis} of the input to have sizes "
                f"{self.in_features}, got {got} (input shape {inputs.shape})."
            )
        bias = self.bias[...] if self.bias is not None else None
        inputs, kernel, bias = promote_dtype((inputs, self.kernel[...], bias), self.dtype)
        contract = tuple(range(len(axis)))  # the kernel's leading axes are the input axes
        out = jax.lax.dot_general(inputs, kernel, ((axis, contract), ((), ())), precision=self.precision)
        return out + bias if bias is not None else out


class Embed(Module):
    """A lookup table from integer ids to `features`-dimensional vectors.

    Args:
      num_embeddings: number of ids (vocabulary size).
      features: size of each vector.
      dtype: dtype of the output (None: the embedding's).
      param_dtype: dtype the table is created in.
      embedding_init: initializer of the `(num_embeddings, features)` table.
      rngs: where the initializer's key comes from.
    """

    def __init__(
        self,
        num_embeddings: int,
        features: int,
        *,
        dtype: Any | None = None,
        param_dtype: Any = jnp.float32,
        embedding_init: initializers.Initializer = default_embed_init,
        rngs: Rngs,
    ):
        self.embedding = Param(embedding_init(rngs.params(), (num_embeddings, features), param_dtype))
        self.num_embeddings = num_embeddings
        self.features = features
        self.dtype = dtype or self.embedding.dtype
        self.param_dtype = param_dtype

    def __call__(self, inputs: jax.Array) -> jax.Array:
        """The rows of the table at `inputs`: shape `inputs.shape + (features,)`.

        Ids outside `[0, num_embeddings)` are clamped by `jnp.take`, as in flax.

        Raises:
          ValueError: `inputs` is not an integer array.
        """
        if not jnp.issubdtype(jnp.asarray(inputs).dtype, jnp.integer):
            raise ValueError(
                f"Embed expects integer ids, got dtype {jnp.asarray(inputs).dtype}. "
                "Convert with inputs.astype(jnp.int32)."
            )
        embedding = jnp.asarray(self.embedding[...], self.dtype)
        if self.num_embeddings == 1:
            return jnp.broadcast_to(embedding, inputs.shape + (self.features,))
        return jnp.take(embedding, inputs, axis=0)

    def attend(self, query: jax.Array) -> jax.Array:
        """`query @ embedding.T`: logits over the vocabulary, for tied input/output embeddings."""
        query, embedding = promote_dtype((query, self.embedding[...]), self.dtype)
        return jnp.dot(query, embedding.T)
