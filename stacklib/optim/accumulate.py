"""Accumulating over steps: momentum (`trace`) and gradient accumulation (`MultiSteps`).

Mirrors `optax.trace` and `optax.MultiSteps` (optax/transforms/_accumulation.py,
optax 0.2.8).

`trace` keeps a decaying sum of past updates, which is what "momentum" means in SGD.
`MultiSteps` averages the gradients of k mini-batches and lets the wrapped optimizer
step only on the k-th; in between it returns zero updates. That is how a large batch
that does not fit in memory is trained as k small ones: with the same result, because
the average of k mini-batch gradients is the gradient of the big batch.

Differences from optax:
- `MultiSteps` has no `should_skip_update_fn`: passing one raises NotImplementedError,
  and `skip_state` is always `()`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from stacklib.optim.base import (
    GradientTransformation,
    Params,
    Updates,
    check_same_structure,
    safe_increment,
    with_extra_args_support,
)


class TraceState(NamedTuple):
    """The decaying sum of past updates."""

    trace: Params


def trace(
    decay: jax.typing.ArrayLike, nesterov: bool = False, accumulator_dtype: Any | None = None
) -> GradientTransformation:
    """Momentum: replace the update by a decaying sum of past updates.

        t_t = g_t + decay * t_{t-1};   u_t = t_t   (or g_t + decay * t_t with nesterov)

    Note this is a sum, not an average: with decay 0.9 a constant gradient is scaled by
    up to 10. `optax.ema` is the average; `sgd(momentum=...)` uses this one.

    Args:
      decay: the momentum coefficient.
      nesterov: look ahead by one step (Nesterov momentum).
      accumulator_dtype: dtype of the trace; None: the params'.

    Returns:
      A `GradientTransformation` whose state is a `TraceState`.

    Reference: Sutskever et al., "On the importance of initialization and momentum", 2013.
    """
    accumulator_dtype = None if accumulator_dtype is None else jnp.dtype(accumulator_dtype)

    def init_fn(params):
        return TraceState(trace=jax.tree.map(lambda p: jnp.zeros_like(p, dtype=accumulator_dtype), params))

    def update_fn(updates, state, params=None):
        del params
        check_same_structure(updates, state.trace, name="updates", reference_name="the momentum trace")
        new_trace = jax.tree.map(lambda g, t: g + decay * t, updates, state.trace)
        updates = jax.tree.map(lambda g, t: g + decay * t, updates, new_trace) if nesterov else new_trace
        if accumulator_dtype is not None:
            new_trace = jax.tree.map(lambda t: t.astype(accumulator_dtype), new_trace)
        return updates, TraceState(trace=new_trace)

    return GradientTransformation(init_fn, update_fn)


class MultiStepsState(NamedTuple):
    """The state of `MultiSteps`.

    Attributes:
      mini_step: mini-batches accumulated since the last real step (0 .. k-1).
      gradient_step: real steps taken by the wrapped optimizer.
      inner_opt_state: the wrapped optimizer's state.
      acc_grads: the running mean (or sum) of this step's mini-batch gradients.
      skip_state: always `()` here (optax keeps its skip function's output).
    """

    mini_step: jax.Array
    gradient_step: jax.Array
    inner_opt_state: Any
    acc_grads: Any
    skip_state: Any = ()


class MultiSteps:
    """Gradient accumulation: step the wrapped optimizer once every k calls.

    On calls 1 .. k-1 the gradients are accumulated and zero updates are returned; on
    call k the wrapped optimizer receives their mean (`use_grad_mean=True`) and its
    update is returned. The mean is kept with Welford's rule, `a += (g - a) / (n + 1)`,
    which never holds a sum that could overflow a low-precision accumulator.

    Both branches are computed every call and selected with `jnp.where`, so a jitted step
    has no Python control flow on traced values and compiles once.

    Usage: `tx = MultiSteps(adam(1e-3), every_k_schedule=4)`, then `tx.init`/`tx.update`
    like any transformation, or `tx.gradient_transformation()`.
    """

    def __init__(
        self,
        opt: GradientTransformation,
        every_k_schedule: int | Callable[[jax.Array], jax.Array],
        use_grad_mean: bool = True,
        should_skip_update_fn: Callable | None = None,
        accumulator_dtype: Any = jnp.float32,
    ):
        """
        Args:
          opt: the optimizer to step every k mini-batches.
          every_k_schedule: k, or a function from the real step count to k.
          use_grad_mean: average the accumulated gradients (default) or sum them.
          should_skip_update_fn: not supported here; must be None.
          accumulator_dtype: dtype of the accumulated gradients.

        Raises:
          NotImplementedError: `should_skip_update_fn` was given.
        """
        if should_skip_update_fn is not None:
            raise NotImplementedError(
                "stacklib.optim.MultiSteps does not support should_skip_update_fn; "
                "use optax.MultiSteps for skipping non-finite updates."
            )
        self._opt = with_extra_args_support(opt)
        if isinstance(every_k_schedule, int):
            self._every_k_schedule = lambda step: every_k_schedule
        else:
            self._every_k_schedule = every_k_schedule
        self._use_grad_mean = use_grad_mean
        self._accumulator_dtype = jnp.dtype(accumulator_dtype)

    @property
    def inner_opt(self) -> GradientTransformation:
        return self._opt

    def init(self, params: Params) -> MultiStepsState:
        """Zero accumulators and the wrapped optimizer's initial state."""
        return MultiStepsState(
            mini_step=jnp.zeros([], jnp.int32),
            gradient_step=jnp.zeros([], jnp.int32),
            inner_opt_state=self._opt.init(params),
            acc_grads=jax.tree.map(lambda p: jnp.zeros_like(p, dtype=self._accumulator_dtype), params),
            skip_state=(),
        )

    def _accumulate(self, grad, acc, n_acc):
        if self._use_grad_mean:
            return acc + (grad - acc) / (n_acc + 1)
        return grad + acc

    def update(
        self, updates: Updates, state: MultiStepsState, params: Params | None = None, **extra_args
    ) -> tuple[Updates, MultiStepsState]:
        """Accumulate `updates`; on every k-th call return the wrapped optimizer's update."""
        check_same_structure(updates, state.acc_grads, name="updates", reference_name="the accumulators")
        k_steps = self._every_k_schedule(state.gradient_step)
        acc_grads = jax.tree.map(
            lambda g, acc: self._accumulate(g, acc, state.mini_step), updates, state.acc_grads
        )
        final_updates, new_inner_state = self._opt.update(
            jax.tree.map(lambda a, g: a.astype(g.dtype), acc_grads, updates),
            state.inner_opt_state,
            params=params,
            **extra_args,
        )
        emit = state.mini_step == (k_steps - 1)
        new_state = MultiStepsState(
            mini_step=safe_increment(state.mini_step) % k_steps,
            gradient_step=emit * safe_increment(state.gradient_step) + (1 - emit) * state.gradient_step,
            inner_opt_state=jax.tree.map(
                lambda old, new: jnp.where(emit, new, old).astype(old.dtype),
                state.inner_opt_state,
                new_inner_state,
            ),
            acc_grads=jax.tree.map(
                lambda acc: ((1 - emit) * acc).astype(self._accumulator_dtype), acc_grads
            ),
            skip_state=(),
        )
        return jax.tree.map(lambda u: emit * u, final_updates), new_state

    def has_updated(self, state: MultiStepsState) -> jax.Array:
        """True right after a call on which the wrapped optimizer stepped."""
        return jnp.logical_and(state.mini_step == 0, state.gradient_step > 0)

    def gradient_transformation(self) -> GradientTransformation:
        return GradientTransformation(init=self.init, update=self.update)
