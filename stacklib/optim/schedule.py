"""Schedules: functions from the step count to a hyperparameter value.

Mirrors `optax.schedules` (optax/schedules/_schedule.py and _join.py, optax 0.2.8).

A schedule is any function `count -> value`. It is called inside `update` with the
step count kept in the optimizer's state (a traced int32 under `jit`), so it must use
`jnp` operations, not Python `if`s on the count. `join_schedules` stitches schedules
together in time; `warmup_cosine_decay_schedule` is a linear warm-up joined to a cosine
decay, the usual schedule for training transformers.

Differences from optax: only the schedules below (no exponential, piecewise, one-cycle
or SGDR schedules); no logging when `transition_steps <= 0`.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from stacklib.optim.base import Schedule


def constant_schedule(value: jax.typing.ArrayLike) -> Schedule:
    """`count -> value`, for every count."""
    return lambda count: value


def polynomial_schedule(
    init_value: jax.typing.ArrayLike,
    end_value: jax.typing.ArrayLike,
    power: jax.typing.ArrayLike,
    transition_steps: int,
    transition_begin: int = 0,
) -> Schedule:
    """Go from `init_value` to `end_value` along a polynomial of degree `power`.

        t' = clip(count - transition_begin, 0, transition_steps)
        value = (init - end) * (1 - t' / transition_steps) ** power + end

    A non-positive `transition_steps` gives the constant `init_value`.
    """
    if transition_steps <= 0:
        return lambda count: init_value
    transition_begin = max(transition_begin, 0)

    def schedule(count):
        count = jnp.clip(count - transition_begin, 0, transition_steps)
        frac = 1 - count / transition_steps
        return (init_value - end_value) * (frac**power) + end_value

    return schedule


def linear_schedule(
    init_value: jax.typing.ArrayLike,
    end_value: jax.typing.ArrayLike,
    transition_steps: int,
    transition_begin: int = 0,
) -> Schedule:
    """Go linearly from `init_value` to `end_value` over `transition_steps` steps, then stay.

    Before `transition_begin` the value is `init_value`. This is `polynomial_schedule`
    with `power=1`.
    """
    return polynomial_schedule(init_value, end_value, 1, transition_steps, transition_begin)


def cosine_decay_schedule(
    init_value: jax.typing.ArrayLike,
    decay_steps: int,
    alpha: jax.typing.ArrayLike = 0.0,
    exponent: jax.typing.ArrayLike = 1.0,
) -> Schedule:
    """Decay from `init_value` to `alpha * init_value` along half a cosine, then stay.

        t' = min(count, decay_steps)
        value = init * ((1 - alpha) * (0.5 * (1 + cos(pi t' / decay_steps))) ** exponent + alpha)

    Raises:
      ValueError: `decay_steps` is not positive.

    Reference: Loshchilov & Hutter, "SGDR: Stochastic Gradient Descent with Warm Restarts", 2017.
    """
    if not decay_steps > 0:
        raise ValueError(f"cosine_decay_schedule needs decay_steps > 0, got decay_steps={decay_steps}.")
    decay_steps = float(decay_steps)  # float math: an int32 count * pi would lose precision

    def schedule(count):
        count = float(count) if isinstance(count, int) else count
        count = jnp.minimum(count, decay_steps)
        cosine_decay = 0.5 * (1 + jnp.cos(jnp.pi * count / decay_steps))
        return init_value * ((1 - alpha) * cosine_decay**exponent + alpha)

    return schedule


def join_schedules(schedules: Sequence[Schedule], boundaries: Sequence[int]) -> Schedule:
    """Run `schedules[0]` until `boundaries[0]`, then `schedules[1]`, and so on.

    Each schedule sees the count since its own start: `schedules[i](count - boundaries[i-1])`.

    Raises:
      ValueError: there is not exactly one boundary fewer than schedules.
    """
    if len(boundaries) != len(schedules) - 1:
        raise ValueError(
            f"join_schedules needs one boundary fewer than schedules; got {len(schedules)} "
            f"schedules and {len(boundaries)} boundaries."
        )

    def schedule(count):
        output = schedules[0](count)
        for boundary, later in zip(boundaries, schedules[1:], strict=True):
            output = jnp.where(count < boundary, output, later(count - boundary))
        return output

    return schedule


def warmup_cosine_decay_schedule(
    init_value: jax.typing.ArrayLike,
    peak_value: jax.typing.ArrayLike,
    warmup_steps: int,
    decay_steps: int,
    end_value: jax.typing.ArrayLike = 0.0,
    exponent: jax.typing.ArrayLike = 1.0,
) -> Schedule:
    """Linear warm-up from `init_value` to `peak_value`, then cosine decay to `end_value`.

    `decay_steps` is the length of the whole schedule, warm-up included, so the cosine
    part lasts `decay_steps - warmup_steps` steps.
    """
    alpha = 0.0 if peak_value == 0.0 else end_value / peak_value
    return join_schedules(
        [
            linear_schedule(init_value=init_value, end_value=peak_value, transition_steps=warmup_steps),
            cosine_decay_schedule(
                init_value=peak_value, decay_steps=decay_steps - warmup_steps, alpha=alpha, exponent=exponent
            ),
        ],
        [warmup_steps],
    )
