"""`inject_hyperparams`: make an optimizer's hyperparameters part of its state.

Mirrors `optax.inject_hyperparams` (optax/schedules/_inject.py, optax 0.2.8).

`adam(learning_rate=0.1)` closes over 0.1: to change it you would build a new optimizer
(and, under `jit`, compile again). `inject_hyperparams(adam)(learning_rate=0.1)` instead
keeps `learning_rate` in `state.hyperparams`, an array you can read (to log it) or
overwrite between steps without recompiling. A schedule given for a hyperparameter is
evaluated at `state.count` on every update, and the value used is stored there too.

Differences from optax:
- The state is `InjectHyperparamsState(count, hyperparams, inner_state)`; optax 0.2.8
  returns `InjectStatefulHyperparamsState`, which also has `hyperparams_states` (one
  `WrappedScheduleState(count)` per schedule). Schedules here are plain functions of the
  step count, so that extra count would always equal `count`.
- No stateful schedules.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from stacklib.optim.base import (
    GradientTransformation,
    GradientTransformationExtraArgs,
    safe_increment,
    with_extra_args_support,
)


class InjectHyperparamsState(NamedTuple):
    """Step count, current hyperparameter values, and the wrapped optimizer's state."""

    count: jax.Array  # shape (), int32
    hyperparams: dict[str, jax.Array]
    inner_state: Any


def _highest_float_dtype(params) -> Any:
    """The widest floating dtype among the params (float32 if none), for the hyperparams."""
    dtypes = [jnp.asarray(leaf).dtype for leaf in jax.tree.leaves(params)]
    floats = [d for d in dtypes if jnp.issubdtype(d, jnp.floating)]
    return jnp.result_type(*floats) if floats else jnp.dtype(jnp.float32)


def _convert_floats(x, dtype):
    """Cast Python floats and weakly typed float arrays to `dtype`; leave the rest alone."""
    if isinstance(x, jax.Array) and not getattr(x, "weak_type", False):
        return x
    current = x.dtype if hasattr(x, "dtype") else type(x)
    if jnp.issubdtype(current, jnp.floating):
        return jnp.asarray(x, dtype=dtype)
    return x


def inject_hyperparams(
    inner_factory: Callable[..., GradientTransformation],
    static_args: str | Iterable[str] = (),
    hyperparam_dtype: Any | None = None,
) -> Callable[..., GradientTransformationExtraArgs]:
    """Wrap an optimizer factory so that its numeric arguments live in the state.

    Usage: `tx = inject_hyperparams(adam)(learning_rate=schedule, b1=0.9)`; then
    `state.hyperparams["learning_rate"]` is the rate used by the last update, and
    assigning a new array to `state.hyperparams["b1"]` changes b1 from the next step on.

    Args:
      inner_factory: an optimizer factory such as `adam` or `sgd`.
      static_args: names of arguments that are callables but not schedules.
      hyperparam_dtype: dtype of the float hyperparameters; None: the widest float dtype
        among the params.

    Returns:
      A function with `inner_factory`'s signature that returns the wrapped optimizer.

    Raises:
      ValueError: a name in `static_args` is not an argument of `inner_factory`.
    """
    static_args = {static_args} if isinstance(static_args, str) else set(static_args)
    signature = inspect.signature(inner_factory)
    unknown = static_args - set(signature.parameters)
    if unknown:
        raise ValueError(
            f"static_args {sorted(unknown)} are not arguments of {inner_factory.__name__}; "
            f"its arguments are {list(signature.parameters)}."
        )

    @functools.wraps(inner_factory)
    def wrapped(*args, **kwargs) -> GradientTransformationExtraArgs:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        schedules, numeric, other = {}, {}, {}
        for name, value in bound.arguments.items():
            if name in static_args or isinstance(value, bool):
                other[name] = value
            elif callable(value):
                schedules[name] = value
            elif isinstance(value, int | float | jax.Array | np.ndarray):
                numeric[name] = value
            else:  # None, strings, dtypes: passed through unchanged
                other[name] = value

        def current(hyperparams, count, dtype):
            values = {name: _convert_floats(value, dtype) for name, value in hyperparams.items()}
            values.update({name: _convert_floats(f(count), dtype) for name, f in schedules.items()})
            return values

        def init_fn(params):
            dtype = hyperparam_dtype or _highest_float_dtype(params)
            count = jnp.zeros([], jnp.int32)
            hyperparams = {name: jnp.asarray(_convert_floats(v, dtype)) for name, v in numeric.items()}
            hyperparams = current(hyperparams, count, dtype)
            inner_state = inner_factory(**other, **hyperparams).init(params)
            return InjectHyperparamsState(count=count, hyperparams=hyperparams, inner_state=inner_state)

        def update_fn(updates, state, params=None, **extra_args):
            dtype = hyperparam_dtype or _highest_float_dtype(params if params is not None else updates)
            hyperparams = current(state.hyperparams, state.count, dtype)
            inner = with_extra_args_support(inner_factory(**other, **hyperparams))
            updates, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
            return updates, InjectHyperparamsState(
                count=safe_increment(state.count), hyperparams=hyperparams, inner_state=inner_state
            )

        return GradientTransformationExtraArgs(init_fn, update_fn)

    return wrapped
