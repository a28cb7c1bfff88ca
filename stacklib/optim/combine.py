"""Combinators: build one gradient transformation out of others.

Mirrors `optax.chain` (optax/transforms/_combining.py) and `optax.masked`
(optax/transforms/_masking.py), optax 0.2.8.

`chain(a, b, c)` runs `a`, then `b` on a's output, then `c`; its state is the tuple of
their states. `masked(inner, mask)` runs `inner` on the leaves where `mask` is True and
passes the others through, which is how weight decay skips biases and norm scales.

Differences from optax:
- No `named_chain`, `partition` or `mask_compatible_extra_args`.
- `masked` raises a ValueError naming the paths when the mask does not fit the params.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from stacklib.optim.base import (
    GradientTransformation,
    GradientTransformationExtraArgs,
    Params,
    PyTree,
    with_extra_args_support,
)


def chain(*transforms: GradientTransformation) -> GradientTransformationExtraArgs:
    """Apply transformations one after the other.

    The update rule is function composition, `u -> t_n(...t_2(t_1(u)))`, each `t_i`
    with its own state; the chain's state is the tuple `(s_1, ..., s_n)`.

    Args:
      *transforms: the transformations, in the order they act on the updates.

    Returns:
      A `GradientTransformationExtraArgs`; extra keyword arguments given to its `update`
      are passed to every transformation.

    Raises:
      ValueError (from `update`): the state does not have one entry per transformation,
        e.g. a state made by a different optimizer.
    """
    transforms = tuple(with_extra_args_support(t) for t in transforms)

    def init_fn(params):
        return tuple(t.init(params) for t in transforms)

    def update_fn(updates, state, params=None, **extra_args):
        if len(state) != len(transforms):
            raise ValueError(
                f"chain of {len(transforms)} transformations got a state with {len(state)} "
                "entries. Pass the state that this optimizer's own `init` returned."
            )
        new_state = []
        for t, s in zip(transforms, state, strict=True):
            updates, s = t.update(updates, s, params, **extra_args)
            new_state.append(s)
        return updates, tuple(new_state)

    return GradientTransformationExtraArgs(init_fn, update_fn)


class MaskedState(NamedTuple):
    """The inner transformation's state, kept only for the unmasked leaves."""

    inner_state: Any


class MaskedNode(NamedTuple):
    """Stands in for a masked-out leaf: a container with no children, so tree maps skip it."""


def _is_mask_function(mask: Any) -> bool:
    leaves = jax.tree.leaves(jax.tree.map(callable, mask))
    return bool(leaves) and all(leaves)


def masked(
    inner: GradientTransformation,
    mask: PyTree | Callable[[Params], PyTree],
) -> GradientTransformationExtraArgs:
    """Apply `inner` only where `mask` is True; pass the other updates through unchanged.

    Masked-out leaves are replaced by `MaskedNode()` before `inner` sees the tree, so
    `inner` keeps state only for the leaves it transforms.

    Args:
      inner: the transformation to apply to the selected leaves.
      mask: a tree of booleans with the structure of the params (or a prefix of it), or
        a function from params to such a tree, e.g.
        `lambda p: jax.tree.map(lambda x: x.ndim > 1, p)` to skip biases and scales.

    Returns:
      A `GradientTransformationExtraArgs`.
    """
    inner = with_extra_args_support(inner)

    def mask_tree_for(tree):
        mask_tree = mask(tree) if _is_mask_function(mask) else mask
        try:
            jax.tree.map(lambda m, t: None, mask_tree, tree)
        except ValueError as error:
            raise ValueError(
                "The mask given to masked() does not fit the tree it masks: it must have "
                f"the params' structure (or a prefix of it). {error}"
            ) from None
        return mask_tree

    def mask_out(tree, mask_tree):
        return jax.tree.map(lambda m, t: t if m else MaskedNode(), mask_tree, tree)

    def init_fn(params):
        return MaskedState(inner_state=inner.init(mask_out(params, mask_tree_for(params))))

    def update_fn(updates, state, params=None, **extra_args):
        mask_tree = mask_tree_for(updates)
        masked_params = None if params is None else mask_out(params, mask_tree)
        new_masked, inner_state = inner.update(
            mask_out(updates, mask_tree), state.inner_state, masked_params, **extra_args
        )
        new_updates = jax.tree.map(
            lambda m, new, old: new if m else old, mask_tree, new_masked, updates
        )
        return new_updates, MaskedState(inner_state=inner_state)

    return GradientTransformationExtraArgs(init_fn, update_fn)
