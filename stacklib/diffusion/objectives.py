"""The training objectives: what the network is asked to predict, one equation each.

Both draw a clean batch x0, a noise ε ~ N(0, I) and a time t per example, corrupt x0 to
x_t by the forward process (schedules.py), and regress the network's output on a target
with a mean squared error:

* **DDPM, ε-prediction** (Ho et al. 2020, the "simple" loss, their eq. 14), t uniform over
  the integer steps 0..T-1:

      L = E ‖ε − ε_θ(sqrt(ᾱ_t) x0 + sqrt(1 − ᾱ_t) ε, t, y)‖²

* **Rectified flow / flow matching** (Liu et al. 2022; Lipman et al. 2023), t uniform in
  [0, 1]: the velocity of the straight path x_t = (1 − t) x0 + t ε is dx_t/dt = ε − x0, so

      L = E ‖(ε − x0) − v_θ((1 − t) x0 + t ε, t, y)‖²

The network sees time as a number in [0, 1] (DDPM's step t as t / T). For classifier-free
guidance (Ho & Salimans 2022) a share `label_dropout` of the labels is replaced by the
"no class" label, so that the same network also learns the unconditional prediction.

Mirrors the losses of MaxDiffusion's and diffusers' training scripts (`noise_scheduler.
add_noise`, target `noise` or `noise - latents` for flow matching, then `mse`). Differences:
no loss weighting (min-SNR, logit-normal t as in Stable Diffusion 3), no v-prediction.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from stacklib.diffusion import schedules

OBJECTIVES = ("flow", "ddpm")
Predict = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]  # (x_t, t in [0, 1], y) -> output


def drop_labels(key: jax.Array, y: jax.Array, null_class: int, rate: float) -> jax.Array:
    """Replace each label by `null_class` with probability `rate` (classifier-free guidance's training)."""
    return jnp.where(jax.random.uniform(key, y.shape) < rate, null_class, y)


def ddpm_loss(predict: Predict, schedule: schedules.NoiseSchedule, x0: jax.Array, y: jax.Array,
              key: jax.Array) -> jax.Array:
    """‖ε − ε_θ(x_t, t, y)‖², averaged; t uniform over 0..T-1 (Ho et al. eq. 14)."""
    t_key, noise_key = jax.random.split(key)
    T = schedule.num_train_timesteps
    t = jax.random.randint(t_key, (x0.shape[0],), 0, T)
    noise = jax.random.normal(noise_key, x0.shape, x0.dtype)
    x_t = schedules.add_noise(schedule, x0, noise, t)
    return jnp.mean((noise - predict(x_t, t / T, y)) ** 2)


def flow_loss(predict: Predict, x0: jax.Array, y: jax.Array, key: jax.Array) -> jax.Array:
    """‖(ε − x0) − v_θ(x_t, t, y)‖², averaged; t uniform in [0, 1] (rectified flow)."""
    t_key, noise_key = jax.random.split(key)
    t = jax.random.uniform(t_key, (x0.shape[0],))
    noise = jax.random.normal(noise_key, x0.shape, x0.dtype)
    x_t = schedules.flow_add_noise(x0, noise, t)
    return jnp.mean((noise - x0 - predict(x_t, t, y)) ** 2)


def loss(objective: str, predict: Predict, x0: jax.Array, y: jax.Array, key: jax.Array, *,
         schedule: schedules.NoiseSchedule | None = None) -> jax.Array:
    """The loss of `objective` ("flow" or "ddpm"; "ddpm" needs `schedule`).

    Raises:
      ValueError: an unknown objective, or "ddpm" without a schedule.
    """
    if objective == "flow":
        return flow_loss(predict, x0, y, key)
    if objective == "ddpm":
        if schedule is None:
            raise ValueError("objective='ddpm' needs schedule=schedules.make_schedule(...).")
        return ddpm_loss(predict, schedule, x0, y, key)
    raise ValueError(f"objective={objective!r} is not one of {', '.join(OBJECTIVES)}.")
