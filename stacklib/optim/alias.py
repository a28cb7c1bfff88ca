"""Optimizers as they are usually named: each one a short `chain` of building blocks.

Mirrors `optax._src.alias` (optax 0.2.8): `sgd`, `adam`, `adamw`, `rmsprop` and `lion`,
with optax's argument names, order and defaults. Reading one of these is reading the
algorithm: `adamw` is "Adam's rescaling, plus decayed weights, times -learning_rate".

Differences from optax:
- `rmsprop(centered=True)` raises NotImplementedError (it needs `scale_by_stddev`).
- The other optax aliases (adagrad, lamb, lars, nadam, ...) are not here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from stacklib.optim.accumulate import trace
from stacklib.optim.base import GradientTransformationExtraArgs, Params, ScalarOrSchedule, identity
from stacklib.optim.combine import chain
from stacklib.optim.transform import (
    add_decayed_weights,
    scale_by_adam,
    scale_by_learning_rate,
    scale_by_lion,
    scale_by_rms,
)


def sgd(
    learning_rate: ScalarOrSchedule,
    momentum: jax.typing.ArrayLike | None = None,
    nesterov: bool = False,
    accumulator_dtype: Any | None = None,
) -> GradientTransformationExtraArgs:
    """Stochastic gradient descent, optionally with (Nesterov) momentum.

        m_t = g_t + momentum * m_{t-1}
        u_t = -lr * m_t        (or -lr * (g_t + momentum * m_t) with nesterov)

    Args:
      learning_rate: a number or a schedule.
      momentum: the momentum coefficient; None for plain SGD (no state).
      nesterov: use Nesterov momentum.
      accumulator_dtype: dtype of the momentum; None: the params'.

    Returns:
      `chain(trace(momentum, nesterov), scale_by_learning_rate(learning_rate))`.

    Reference: Sutskever et al., "On the importance of initialization and momentum", 2013.
    """
    momentum_tx = (
        trace(decay=momentum, nesterov=nesterov, accumulator_dtype=accumulator_dtype)
        if momentum is not None
        else identity()
    )
    return chain(momentum_tx, scale_by_learning_rate(learning_rate))


def adam(
    learning_rate: ScalarOrSchedule,
    b1: jax.typing.ArrayLike = 0.9,
    b2: jax.typing.ArrayLike = 0.999,
    eps: jax.typing.ArrayLike = 1e-8,
    eps_root: jax.typing.ArrayLike = 0.0,
    mu_dtype: Any | None = None,
    *,
    nesterov: bool = False,
) -> GradientTransformationExtraArgs:
    """Adam: momentum divided by the root of a running average of squared gradients.

    `u_t = -lr * m^_t / (sqrt(v^_t + eps_root) + eps)`; see `scale_by_adam` for `m^`, `v^`.

    Returns:
      `chain(scale_by_adam(b1, b2, eps, eps_root, mu_dtype), scale_by_learning_rate(lr))`.

    Reference: Kingma & Ba, "Adam: A Method for Stochastic Optimization", 2014.
    """
    return chain(
        scale_by_adam(b1=b1, b2=b2, eps=eps, eps_root=eps_root, mu_dtype=mu_dtype, nesterov=nesterov),
        scale_by_learning_rate(learning_rate),
    )


def adamw(
    learning_rate: ScalarOrSchedule,
    b1: jax.typing.ArrayLike = 0.9,
    b2: jax.typing.ArrayLike = 0.999,
    eps: jax.typing.ArrayLike = 1e-8,
    eps_root: jax.typing.ArrayLike = 0.0,
    mu_dtype: Any | None = None,
    weight_decay: ScalarOrSchedule = 1e-4,
    mask: Any | Callable[[Params], Any] | None = None,
    *,
    nesterov: bool = False,
) -> GradientTransformationExtraArgs:
    """Adam with decoupled weight decay.

        u_t = -lr * (m^_t / (sqrt(v^_t + eps_root) + eps) + weight_decay * p_t)

    The decay is added after Adam's rescaling, so every weight shrinks by the same
    fraction `lr * weight_decay`, however large its gradients; an L2 term in the loss
    would instead be divided by Adam's denominator.

    Args:
      weight_decay: the decay rate (a number or a schedule); note the default, 1e-4.
      mask: which params to decay (a tree of booleans or a function returning one).
      (the others as in `adam`)

    Returns:
      `chain(scale_by_adam(...), add_decayed_weights(weight_decay, mask),
      scale_by_learning_rate(learning_rate))`.

    Reference: Loshchilov & Hutter, "Decoupled Weight Decay Regularization", 2019.
    """
    return chain(
        scale_by_adam(b1=b1, b2=b2, eps=eps, eps_root=eps_root, mu_dtype=mu_dtype, nesterov=nesterov),
        add_decayed_weights(weight_decay, mask),
        scale_by_learning_rate(learning_rate),
    )


def rmsprop(
    learning_rate: ScalarOrSchedule,
    decay: jax.typing.ArrayLike = 0.9,
    eps: jax.typing.ArrayLike = 1e-8,
    initial_scale: jax.typing.ArrayLike = 0.0,
    eps_in_sqrt: bool = True,
    centered: bool = False,
    momentum: jax.typing.ArrayLike | None = None,
    nesterov: bool = False,
    bias_correction: bool = False,
) -> GradientTransformationExtraArgs:
    """RMSProp: divide by the root of a running average of squared gradients.

        nu_t = decay nu_{t-1} + (1 - decay) g_t^2;   u_t = -lr * g_t / sqrt(nu_t + eps)

    With `momentum`, a `trace` is applied *after* the learning rate, as in optax.

    Args:
      centered: not supported here (raises NotImplementedError).
      (the others as in `scale_by_rms` and `trace`)

    Returns:
      `chain(scale_by_rms(...), scale_by_learning_rate(lr), trace(momentum) or identity())`.

    Reference: Hinton, "Neural Networks for Machine Learning", lecture 6e, 2012.
    """
    if centered:
        raise NotImplementedError(
            "stacklib.optim.rmsprop does not implement centered=True; use optax.rmsprop."
        )
    return chain(
        scale_by_rms(
            decay=decay,
            eps=eps,
            initial_scale=initial_scale,
            eps_in_sqrt=eps_in_sqrt,
            bias_correction=bias_correction,
        ),
        scale_by_learning_rate(learning_rate),
        trace(decay=momentum, nesterov=nesterov) if momentum is not None else identity(),
    )


def lion(
    learning_rate: ScalarOrSchedule,
    b1: jax.typing.ArrayLike = 0.9,
    b2: jax.typing.ArrayLike = 0.99,
    mu_dtype: Any | None = None,
    weight_decay: ScalarOrSchedule = 1e-3,
    mask: Any | Callable[[Params], Any] | None = None,
) -> GradientTransformationExtraArgs:
    """Lion: the sign of interpolated momentum, plus decoupled weight decay.

        u_t = -lr * (sign((1 - b1) g_t + b1 mu_{t-1}) + weight_decay * p_t)

    Returns:
      `chain(scale_by_lion(b1, b2, mu_dtype), add_decayed_weights(weight_decay, mask),
      scale_by_learning_rate(learning_rate))`.

    Reference: Chen et al., "Symbolic Discovery of Optimization Algorithms", 2023.
    """
    return chain(
        scale_by_lion(b1=b1, b2=b2, mu_dtype=mu_dtype),
        add_decayed_weights(weight_decay, mask),
        scale_by_learning_rate(learning_rate),
    )
