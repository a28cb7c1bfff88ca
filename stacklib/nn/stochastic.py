"""Dropout: zero a random fraction of activations while training.

Mirrors `flax.nnx.Dropout` (flax/nnx/nn/stochastic.py, flax 0.12.8).

    y = where(mask, x / (1 - rate), 0),   mask ~ Bernoulli(1 - rate), elementwise

Dividing by the keep probability keeps `E[y] = x`, so nothing changes at evaluation
time except that the mask is switched off (`deterministic=True`, or `model.eval()`).

Where the randomness comes from is the NNX part: given `rngs` at construction, the
layer forks its own stream from `rngs.dropout` and keeps it as state (an `RngKey` and
an `RngCount`), so every call draws a new mask, the same sequence of masks on every run,
and the stream is saved and restored with the weights.

Differences from flax.nnx: no `set_view` (use `deterministic=` or `model.eval()`).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from stacklib.nn.module import Module
from stacklib.nn.rngs import Rngs, RngStream


class Dropout(Module):
    """Randomly zero a fraction `rate` of the inputs, scaling the rest by `1 / (1 - rate)`.

    Args:
      rate: probability of dropping each element (not the keep rate).
      broadcast_dims: axes along which the same mask is shared (e.g. the time axis);
        negative axes count from the end.
      deterministic: if True, return inputs unchanged; can be overridden per call.
      rng_collection: the stream to fork the layer's stream from.
      rngs: an `Rngs` or `RngStream`; None means pass `rngs=` on every call instead.
    """

    def __init__(
        self,
        rate: float,
        *,
        broadcast_dims: Sequence[int] = (),
        deterministic: bool | None = False,
        rng_collection: str = "dropout",
        rngs: Rngs | RngStream | None = None,
    ):
        self.rate = rate
        self.broadcast_dims = tuple(broadcast_dims)
        self.deterministic = deterministic
        self.rng_collection = rng_collection
        if isinstance(rngs, Rngs):
            self.rngs = rngs[rng_collection].fork()
        elif isinstance(rngs, RngStream):
            self.rngs = rngs.fork()
        elif rngs is None:
            self.rngs = None
        else:
            raise TypeError(
                f"Dropout(rngs=...) must be an Rngs, an RngStream or None, got {type(rngs).__name__}."
            )

    def __call__(
        self,
        inputs: jax.Array,
        *,
        deterministic: bool | None = None,
        rngs: Rngs | RngStream | jax.Array | None = None,
    ) -> jax.Array:
        """Apply dropout (unless deterministic).

        Raises:
          ValueError: neither the call nor the constructor says whether to be deterministic,
            or dropout is on but there is no random stream to draw the mask from.
        """
        deterministic = deterministic if deterministic is not None else self.deterministic
        if deterministic is None:
            raise ValueError(
                "Dropout does not know whether it is training: pass deterministic=True/False "
                "to the constructor or the call, or call model.train() / model.eval()."
            )
        if self.rate == 0.0 or deterministic:
            return inputs
        if self.rate == 1.0:
            return jnp.zeros_like(inputs)  # avoids 0 / 0 in the rescaling
        rngs = rngs if rngs is not None else self.rngs
        if isinstance(rngs, Rngs):
            key = rngs[self.rng_collection]()
        elif isinstance(rngs, RngStream):
            key = rngs()
        elif isinstance(rngs, jax.Array):
            key = rngs
        else:
            raise ValueError(
                "Dropout is on (deterministic=False) but has no random stream: construct it with "
                "Dropout(rate, rngs=rngs) or call it with rngs=..."
            )
        keep_prob = 1.0 - self.rate
        mask_shape = list(inputs.shape)
        for axis in self.broadcast_dims:  # indexing, so -1 means the last axis, as in flax
            mask_shape[axis] = 1
        mask = jax.random.bernoulli(key, p=keep_prob, shape=mask_shape)
        mask = jnp.broadcast_to(mask, inputs.shape)
        return jax.lax.select(mask, inputs / keep_prob, jnp.zeros_like(inputs))
