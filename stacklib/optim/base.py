"""The core protocol of `stacklib.optim`: a gradient transformation is two pure functions.

Mirrors `optax._src.base` and `optax._src.update` (optax 0.2.8). Everything else in this
package is built from the `GradientTransformation` pair defined here:

    init(params) -> state
    update(updates, state, params=None) -> (new_updates, new_state)

Both are pure: the state is an explicit pytree of arrays, never a hidden attribute, so an
optimizer can be jitted, checkpointed, and replayed exactly. An optimizer like Adam is
not a class with methods that mutate; it is a `GradientTransformation` whose state holds
the moment estimates, and whose `update` returns new ones.

Differences from optax:
- `GradientTransformationExtraArgs` is here for fidelity, but only `chain`, `masked`,
  `inject_hyperparams` and `MultiSteps` forward extra keyword arguments.
- `apply_updates` checks that `updates` has the structure of `params` and, if not, lists
  the leaf paths found on only one side (optax lets `jax.tree.map` raise its structure
  error, which names the first container whose keys differ).
- No `stateless`, `stateless_with_tree_map`, `StatefulSchedule` or `ScheduleState`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp

PyTree = Any
Params = PyTree  # nested containers of arrays: what a model is made of
Updates = Params  # same structure as the parameters
OptState = PyTree  # whatever a transformation keeps between steps
Schedule = Callable[[jax.typing.ArrayLike], jax.typing.ArrayLike]  # step count -> value
ScalarOrSchedule = float | jax.Array | Schedule

NO_PARAMS_MSG = (
    "This transformation needs the current parameters, but `update` was called without "
    "them. Call `tx.update(grads, opt_state, params)`."
)


class TransformInitFn(Protocol):
    def __call__(self, params: Params) -> OptState: ...


class TransformUpdateFn(Protocol):
    def __call__(
        self, updates: Updates, state: OptState, params: Params | None = None
    ) -> tuple[Updates, OptState]: ...


class GradientTransformation(NamedTuple):
    """A pair of pure functions, `init` and `update`, that transform gradients.

    `init(params)` returns the initial state (for example Adam's zeroed moments).
    `update(updates, state, params=None)` takes candidate updates (usually gradients),
    returns transformed updates and the next state. Being a `NamedTuple`, it can be
    unpacked (`init, update = tx`) and compared by value.

    Reference: optax's `GradientTransformation` (optax/_src/base.py).
    """

    init: TransformInitFn
    update: TransformUpdateFn


class GradientTransformationExtraArgs(GradientTransformation):
    """A `GradientTransformation` whose `update` also accepts `**extra_args`.

    Combinators (`chain`, `masked`) return this type so that a keyword argument given to
    the outer `update` reaches the inner transformations that want it.
    """


class EmptyState(NamedTuple):
    """The state of a transformation that keeps nothing between steps."""


def init_empty_state(params: Params) -> EmptyState:
    """`init` for stateless transformations."""
    del params
    return EmptyState()


def with_extra_args_support(tx: GradientTransformation) -> GradientTransformationExtraArgs:
    """Wrap `tx` so that its `update` accepts (and ignores) extra keyword arguments."""
    if isinstance(tx, GradientTransformationExtraArgs):
        return tx

    def update_fn(updates, state, params=None, **extra_args):
        del extra_args
        return tx.update(updates, state, params)

    return GradientTransformationExtraArgs(tx.init, update_fn)


def identity() -> GradientTransformation:
    """Pass updates through unchanged (and keep no state).

    Returns:
      A `GradientTransformation`.
    """

    def update_fn(updates, state, params=None):
        del params
        return updates, state

    return GradientTransformation(init_empty_state, update_fn)


def set_to_zero() -> GradientTransformation:
    """Map every update to zero, which freezes the parameters it is applied to.

    Returns:
      A `GradientTransformation`.
    """

    def update_fn(updates, state, params=None):
        del params
        return jax.tree.map(jnp.zeros_like, updates), state

    return GradientTransformation(init_empty_state, update_fn)


def safe_increment(count: jax.typing.ArrayLike) -> jax.Array:
    """`count + 1`, saturating at the dtype's maximum instead of wrapping around.

    An int32 step counter would overflow after 2**31 steps and make bias corrections
    divide by zero; saturating keeps it at the largest value instead.
    """
    count = jnp.asarray(count)
    info = jnp.iinfo if jnp.issubdtype(count.dtype, jnp.integer) else jnp.finfo
    max_value = jnp.array(info(count.dtype).max, count.dtype)
    return jnp.where(count < max_value, count + jnp.array(1, count.dtype), max_value)


def _paths(tree: PyTree) -> dict[str, Any]:
    """Map each leaf's path, as a readable string, to the leaf (None counts as a leaf)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is None)
    return {jax.tree_util.keystr(path) or "<root>": leaf for path, leaf in flat}


def check_same_structure(tree: PyTree, reference: PyTree, *, name: str, reference_name: str) -> None:
    """Raise if `tree` and `reference` are not the same pytree structure.

    The check runs in Python when a function is traced, so under `jax.jit` it costs nothing
    at run time.

    Raises:
      ValueError: naming the paths that only one of the two trees has, or the first path
        where their node types differ.
    """
    if jax.tree.structure(tree, is_leaf=lambda x: x is None) == jax.tree.structure(
        reference, is_leaf=lambda x: x is None
    ):
        return
    here, there = _paths(tree), _paths(reference)
    only_here = [path for path in here if path not in there]
    only_there = [path for path in there if path not in here]
    if only_here or only_there:
        raise ValueError(
            f"{name} and {reference_name} have different tree structures. "
            f"Paths only in {name}: {only_here[:5] or 'none'}; "
            f"paths only in {reference_name}: {only_there[:5] or 'none'}. "
            f"Compute {name} from the same tree as {reference_name} "
            "(e.g. jax.grad with respect to exactly the params you update)."
        )
    raise ValueError(
        f"{name} and {reference_name} have the same paths but different node types "
        f"(e.g. a tuple where the other has a list):\n  {name}: {jax.tree.structure(tree)}\n"
        f"  {reference_name}: {jax.tree.structure(reference)}"
    )


def apply_updates(params: Params, updates: Updates) -> Params:
    """Return `params + updates`, leaf by leaf, keeping each parameter's dtype.

    The rule is `p_new = (p + u).astype(p.dtype)`: a float32 update added to bfloat16
    parameters leaves them bfloat16.

    Args:
      params: a tree of parameters.
      updates: a tree of the same structure (usually from `tx.update`).

    Returns:
      The updated parameters, with the structure and dtypes of `params`.

    Raises:
      ValueError: `updates` and `params` differ in structure; the message names the paths.
    """
    check_same_structure(updates, params, name="updates", reference_name="params")
    return jax.tree.map(
        lambda p, u: None if p is None else jnp.asarray(p + u).astype(jnp.asarray(p).dtype),
        params,
        updates,
        is_leaf=lambda x: x is None,
    )
