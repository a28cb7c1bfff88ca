"""Clipping: bound each update, or the norm of all of them together.

Mirrors `optax.clip` and `optax.clip_by_global_norm` (optax/transforms/_clipping.py,
optax 0.2.8), and `optax.tree.norm` as `global_norm`.

Clipping by the global norm rescales the whole update tree by one factor, so it keeps
the direction of the gradient and only shortens it. Clipping element by element changes
the direction, which is usually what you do not want for gradients, but is a cheap
guard against a single exploding coordinate.

Differences from optax: no `clip_by_block_rms`, per-example or adaptive clipping.
"""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp

from stacklib.optim.base import GradientTransformation, PyTree, init_empty_state


def global_norm(updates: PyTree) -> jax.Array:
    """The L2 norm of all leaves together: `sqrt(sum over leaves of sum(|x|**2))`.

    |x|^2 is computed as `re(x)^2 + im(x)^2`, optax's form, so complex leaves count their
    magnitude (for real leaves the imaginary part is zero).
    """
    squares = [jnp.sum(jnp.square(leaf.real) + jnp.square(leaf.imag)) for leaf in jax.tree.leaves(updates)]
    return jnp.sqrt(functools.reduce(operator.add, squares, 0))


def clip(max_delta: jax.typing.ArrayLike) -> GradientTransformation:
    """Clip every element of the updates to `[-max_delta, max_delta]`.

    Returns:
      A stateless `GradientTransformation`.
    """

    def update_fn(updates, state, params=None):
        del params
        return jax.tree.map(lambda g: jnp.clip(g, -max_delta, max_delta), updates), state

    return GradientTransformation(init_empty_state, update_fn)


def clip_by_global_norm(max_norm: jax.typing.ArrayLike) -> GradientTransformation:
    """Rescale the updates so that their global norm is at most `max_norm`.

        n = ||g||_2 over all leaves;   u = g if n < max_norm else g * max_norm / n

    Args:
      max_norm: the largest global norm let through unchanged.

    Returns:
      A stateless `GradientTransformation`.

    Reference: Pascanu et al., "On the difficulty of training recurrent neural networks", 2013.
    """

    def update_fn(updates, state, params=None):
        del params
        g_norm = global_norm(updates)
        # A select rather than `g * min(1, max_norm / n)`: the unclipped branch returns g
        # bit for bit, and the gradient of the select is what optax's is.
        trigger = jnp.squeeze(g_norm < max_norm)
        updates = jax.tree.map(
            lambda t: jax.lax.select(trigger, t, (t / g_norm.astype(t.dtype)) * max_norm), updates
        )
        return updates, state

    return GradientTransformation(init_empty_state, update_fn)
