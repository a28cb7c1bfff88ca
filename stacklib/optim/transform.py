"""Building blocks that rescale updates: by a constant, a schedule, or gradient statistics.

Mirrors `optax._src.transform` and `optax.add_decayed_weights` (optax 0.2.8). Each
factory returns a `GradientTransformation` that closes over its hyperparameters and
keeps its statistics in a `NamedTuple` state, so `adam` is simply
`chain(scale_by_adam(...), scale_by_learning_rate(lr))` (see `alias.py`).

The moment updates are written exactly as optax writes them (same operations, same
order), so in float64 ours and optax's agree to rounding error, step after step.

Complex parameters work as in optax: a second moment averages |g|^2 = conj(g) g, a real
number, not g^2, whose phase would make `sqrt(nu)` meaningless. (The state keeps the
params' complex dtype, with a zero imaginary part, as optax's does.)

Differences from optax:
- `scale_by_adam`, `scale_by_rms` and `scale_by_lion` reject updates whose structure
  differs from their state with an error that names the paths.
- `scale_by_lion` has only the paper's `sign` rule (optax also has 'smooth'/'refined').
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from stacklib.optim.base import (
    NO_PARAMS_MSG,
    EmptyState,
    GradientTransformation,
    ScalarOrSchedule,
    Schedule,
    Updates,
    check_same_structure,
    identity,
    init_empty_state,
    safe_increment,
)
from stacklib.optim.combine import masked


def _zeros_like(tree, dtype=None):
    return jax.tree.map(lambda x: jnp.zeros_like(x, dtype=dtype), tree)


def _cast(tree, dtype):
    return tree if dtype is None else jax.tree.map(lambda t: t.astype(dtype), tree)


def _update_moment(updates, moments, decay, order):
    """Exponential moving average of the `order`-th power: `(1 - decay) g^order + decay m`."""
    return jax.tree.map(lambda g, t: (1 - decay) * (g**order) + decay * t, updates, moments)


def _squared_norm(g):
    """|g|^2 element by element: `g**2` for real g, `(conj(g) g).real` for complex g (as optax)."""
    return g**2 if jnp.isrealobj(g) else (g.conj() * g).real


def _update_second_moment(updates, moments, decay):
    """Exponential moving average of |g|^2: `(1 - decay) |g|^2 + decay v`."""
    return jax.tree.map(lambda g, t: (1 - decay) * _squared_norm(g) + decay * t, updates, moments)


def _bias_correction(moment, decay, count):
    """Divide an EMA started at zero by `1 - decay^count`, so early estimates are unbiased."""
    bias_correction = 1 - decay**count  # computed in float32 or wider, then cast
    return jax.tree.map(lambda t: t / bias_correction.astype(t.dtype), moment)


def scale(step_size: jax.typing.ArrayLike) -> GradientTransformation:
    """Multiply every update by the constant `step_size`.

    Returns:
      A stateless `GradientTransformation`.
    """

    def update_fn(updates, state, params=None):
        del params
        return jax.tree.map(lambda g: step_size * g, updates), state

    return GradientTransformation(init_empty_state, update_fn)


class ScaleByScheduleState(NamedTuple):
    """How many updates have been made, to evaluate the schedule at."""

    count: jax.Array  # shape (), int32


def scale_by_schedule(step_size_fn: Schedule) -> GradientTransformation:
    """Multiply the updates by `step_size_fn(count)`, where `count` counts the updates so far.

    Returns:
      A `GradientTransformation` whose state is a `ScaleByScheduleState`.
    """

    def init_fn(params):
        del params
        return ScaleByScheduleState(count=jnp.zeros([], jnp.int32))

    def update_fn(updates, state, params=None):
        del params
        step_size = step_size_fn(state.count)
        updates = jax.tree.map(lambda g: jnp.array(step_size, dtype=g.dtype) * g, updates)
        return updates, ScaleByScheduleState(count=safe_increment(state.count))

    return GradientTransformation(init_fn, update_fn)


def scale_by_learning_rate(
    learning_rate: ScalarOrSchedule | None = None, *, flip_sign: bool = True
) -> GradientTransformation:
    """Multiply by `-learning_rate` (a number or a schedule): the step of gradient descent.

    The sign flip is why every optimizer's updates are *added* to the parameters by
    `apply_updates`: descent is `p + (-lr * g)`.

    Args:
      learning_rate: a number, or a function from the step count to a number. None means
        no scaling at all.
      flip_sign: multiply by `-learning_rate` (default) rather than `learning_rate`.

    Returns:
      A `GradientTransformation`: `scale` for a number, `scale_by_schedule` for a function.
    """
    if learning_rate is None:
        return identity()
    sign = -1 if flip_sign else 1
    if callable(learning_rate):
        return scale_by_schedule(lambda count: sign * learning_rate(count))
    return scale(sign * learning_rate)


class ScaleByAdamState(NamedTuple):
    """Adam's step count and its first (`mu`) and second (`nu`) moment estimates."""

    count: jax.Array  # shape (), int32
    mu: Updates
    nu: Updates


def scale_by_adam(
    b1: jax.typing.ArrayLike = 0.9,
    b2: jax.typing.ArrayLike = 0.999,
    eps: jax.typing.ArrayLike = 1e-8,
    eps_root: jax.typing.ArrayLike = 0.0,
    mu_dtype: Any | None = None,
    *,
    nesterov: bool = False,
) -> GradientTransformation:
    r"""Rescale updates by Adam's bias-corrected moment estimates.

    With $g_t$ the incoming update at step $t = 1, 2, \dots$:

        m_t = b1 m_{t-1} + (1 - b1) g_t          v_t = b2 v_{t-1} + (1 - b2) |g_t|^2
        m^_t = m_t / (1 - b1^t)                   v^_t = v_t / (1 - b2^t)
        u_t = m^_t / (sqrt(v^_t + eps_root) + eps)

    With `nesterov=True` (NAdam), `m^_t = b1 m_t / (1 - b1^{t+1}) + (1 - b1) g_t / (1 - b1^t)`.

    Args:
      b1: decay of the first-moment average.
      b2: decay of the second-moment average.
      eps: added to the denominator outside the square root.
      eps_root: added inside the square root (keeps gradients through Adam finite).
      mu_dtype: dtype of the first moment (e.g. bfloat16 to save memory); None: the params'.
      nesterov: use Nesterov momentum (NAdam, Dozat 2016).

    Returns:
      A `GradientTransformation` whose state is a `ScaleByAdamState`.

    Reference: Kingma & Ba, "Adam: A Method for Stochastic Optimization", 2014.
    """
    mu_dtype = None if mu_dtype is None else jnp.dtype(mu_dtype)

    def init_fn(params):
        return ScaleByAdamState(
            count=jnp.zeros([], jnp.int32), mu=_zeros_like(params, mu_dtype), nu=_zeros_like(params)
        )

    def update_fn(updates, state, params=None):
        del params
        check_same_structure(updates, state.mu, name="updates", reference_name="Adam's moments")
        mu = _update_moment(updates, state.mu, b1, 1)
        nu = _update_second_moment(updates, state.nu, b2)
        count_inc = safe_increment(state.count)
        if nesterov:
            mu_hat = jax.tree.map(
                lambda m, g: b1 * m + (1 - b1) * g,
                _bias_correction(mu, b1, safe_increment(count_inc)),
                _bias_correction(updates, b1, count_inc),
            )
        else:
            mu_hat = _bias_correction(mu, b1, count_inc)
        nu_hat = _bias_correction(nu, b2, count_inc)
        updates = jax.tree.map(lambda m, v: m / (jnp.sqrt(v + eps_root) + eps), mu_hat, nu_hat)
        mu = _cast(mu, mu_dtype)
        nu = jax.tree.map(lambda new, old: new.astype(old.dtype), nu, state.nu)
        return updates, ScaleByAdamState(count=count_inc, mu=mu, nu=nu)

    return GradientTransformation(init_fn, update_fn)


class ScaleByRmsState(NamedTuple):
    """RMSProp's running average of squared updates."""

    nu: Updates


class ScaleByRmsWithCountState(NamedTuple):
    """RMSProp's average of squared updates and a step count, for bias correction."""

    count: jax.Array  # shape (), int32
    nu: Updates


def scale_by_rms(
    decay: jax.typing.ArrayLike = 0.9,
    eps: jax.typing.ArrayLike = 1e-8,
    initial_scale: jax.typing.ArrayLike = 0.0,
    eps_in_sqrt: bool = True,
    bias_correction: bool = False,
) -> GradientTransformation:
    """Divide updates by the root of a moving average of their squares (RMSProp).

        nu_t = decay nu_{t-1} + (1 - decay) |g_t|^2
        u_t  = g_t / sqrt(nu_t + eps)          (eps_in_sqrt=True, optax's default)
        u_t  = g_t / (sqrt(nu_t) + eps)        (eps_in_sqrt=False, PyTorch's rule)

    Args:
      decay: decay of the moving average.
      eps: keeps the denominator away from zero.
      initial_scale: the average's starting value.
      eps_in_sqrt: add `eps` inside the square root rather than outside.
      bias_correction: divide the average by `1 - decay^t`, as Adam does.

    Returns:
      A `GradientTransformation` whose state is a `ScaleByRmsState`, or a
      `ScaleByRmsWithCountState` when `bias_correction` is set.

    Reference: Hinton, "Neural Networks for Machine Learning", lecture 6e, 2012.
    """

    def init_fn(params):
        nu = jax.tree.map(lambda p: jnp.full_like(p, initial_scale), params)
        if bias_correction:
            return ScaleByRmsWithCountState(count=jnp.zeros([], jnp.int32), nu=nu)
        return ScaleByRmsState(nu=nu)

    def update_fn(updates, state, params=None):
        del params
        check_same_structure(updates, state.nu, name="updates", reference_name="RMSProp's averages")
        nu = _update_second_moment(updates, state.nu, decay)
        if bias_correction:
            count_inc = safe_increment(state.count)
            nu_hat = _bias_correction(nu, decay, count_inc)
        else:
            nu_hat = nu
        if eps_in_sqrt:
            scaling = jax.tree.map(lambda n: jax.lax.rsqrt(n + eps), nu_hat)
        else:
            scaling = jax.tree.map(lambda n: 1 / (jnp.sqrt(n) + eps), nu_hat)
        updates = jax.tree.map(lambda s, g: s * g, scaling, updates)
        if bias_correction:
            return updates, ScaleByRmsWithCountState(count=count_inc, nu=nu)
        return updates, ScaleByRmsState(nu=nu)

    return GradientTransformation(init_fn, update_fn)


class ScaleByLionState(NamedTuple):
    """Lion's step count and momentum."""

    count: jax.Array  # shape (), int32
    mu: Updates


def scale_by_lion(
    b1: jax.typing.ArrayLike = 0.9,
    b2: jax.typing.ArrayLike = 0.99,
    mu_dtype: Any | None = None,
) -> GradientTransformation:
    """Replace each update by the sign of an interpolation between it and the momentum.

        u_t  = sign((1 - b1) g_t + b1 mu_{t-1})
        mu_t = (1 - b2) g_t + b2 mu_{t-1}

    Every coordinate moves by exactly the learning rate, which is why Lion wants a
    learning rate 3-10x smaller than Adam's.

    Returns:
      A `GradientTransformation` whose state is a `ScaleByLionState`.

    Reference: Chen et al., "Symbolic Discovery of Optimization Algorithms", 2023.
    """
    mu_dtype = None if mu_dtype is None else jnp.dtype(mu_dtype)

    def init_fn(params):
        return ScaleByLionState(count=jnp.zeros([], jnp.int32), mu=_zeros_like(params, mu_dtype))

    def update_fn(updates, state, params=None):
        del params
        check_same_structure(updates, state.mu, name="updates", reference_name="Lion's momentum")
        signs = jax.tree.map(lambda g, m: jnp.sign((1.0 - b1) * g + b1 * m), updates, state.mu)
        mu = _cast(_update_moment(updates, state.mu, b2, 1), mu_dtype)
        return signs, ScaleByLionState(count=safe_increment(state.count), mu=mu)

    return GradientTransformation(init_fn, update_fn)


class WeightDecaySchedule(NamedTuple):
    """The step count at which to evaluate a weight-decay schedule."""

    count: jax.Array  # shape (), int32


def add_decayed_weights(
    weight_decay: ScalarOrSchedule = 0.0,
    mask: Any | None = None,
) -> GradientTransformation:
    """Add `weight_decay * params` to the updates (decoupled weight decay, as in AdamW).

    Placed after Adam's rescaling and before the learning rate, this shrinks each weight
    by `lr * weight_decay * p` per step, independently of the gradient statistics.

    Args:
      weight_decay: a number or a schedule.
      mask: which params to decay: a tree of booleans (or a function of the params that
        returns one); biases and norm scales are usually excluded.

    Returns:
      A `GradientTransformation` (wrapped by `masked` if a mask is given).

    Raises:
      ValueError (from `update`): called without `params`.
    """

    def init_fn(params):
        del params
        if callable(weight_decay):
            return WeightDecaySchedule(count=jnp.zeros([], jnp.int32))
        return EmptyState()

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError(NO_PARAMS_MSG)
        new_state = WeightDecaySchedule(safe_increment(state.count)) if callable(weight_decay) else state
        if isinstance(weight_decay, int | float) and weight_decay == 0.0:
            return updates, new_state  # nothing to add; skip the tree map
        s = weight_decay(state.count) if callable(weight_decay) else weight_decay
        # A None update (a leaf some other transformation dropped) stays None, as in optax.
        updates = jax.tree.map(lambda g, p: None if g is None else g + s * p, updates, params,
                               is_leaf=lambda x: x is None)
        return updates, new_state

    tx = GradientTransformation(init_fn, update_fn)
    return masked(tx, mask) if mask is not None else tx
