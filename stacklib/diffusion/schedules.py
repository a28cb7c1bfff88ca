"""Noise schedules and the forward process: how clean data x0 becomes noise.

Two ways to corrupt an image, one equation each:

* **DDPM** (Ho et al. 2020): a variance schedule β_1..β_T; with α_t = 1 - β_t and
  ᾱ_t = ∏_{s≤t} α_s, the forward process has the closed form (their eq. 4)

      x_t = sqrt(ᾱ_t) · x0 + sqrt(1 - ᾱ_t) · ε,        ε ~ N(0, I).

* **Rectified flow / flow matching** (Liu et al. 2022; Lipman et al. 2023): a straight
  line from data to noise, t ∈ [0, 1],

      x_t = (1 - t) · x0 + t · ε.

A sampler walks back along a subsequence of the training timesteps; `set_timesteps` picks
it the way diffusers' schedulers do ("leading" spacing: every (T // n)-th step from 0).

Mirrors diffusers' `DDPMScheduler`/`DDIMScheduler` (`betas`, `alphas`, `alphas_cumprod`,
`add_noise`, `set_timesteps`, `beta_schedule` in "linear", "scaled_linear",
"squaredcos_cap_v2") and `FlowMatchEulerDiscreteScheduler`'s interpolation. Differences:
a schedule is an immutable NamedTuple of arrays, not a stateful scheduler object; only
"leading" spacing; no `steps_offset`, no timestep shifting, no Karras sigmas.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

BETA_SCHEDULES = ("linear", "scaled_linear", "squaredcos_cap_v2")


class NoiseSchedule(NamedTuple):
    """β_t, α_t = 1 - β_t and ᾱ_t = ∏ α_s for t = 0..T-1 (float32, as diffusers keeps them)."""

    betas: jax.Array
    alphas: jax.Array
    alphas_cumprod: jax.Array

    @property
    def num_train_timesteps(self) -> int:
        return self.betas.shape[0]


def _cosine_betas(T: int, max_beta: float = 0.999) -> np.ndarray:
    """Nichol & Dhariwal (2021) eq. 17: ᾱ(t) = cos²((t/T + s)/(1 + s) · π/2), s = 0.008, via β."""
    def alpha_bar(t):
        return np.cos((t + 0.008) / 1.008 * np.pi / 2) ** 2
    t = np.arange(T)
    return np.minimum(1 - alpha_bar((t + 1) / T) / alpha_bar(t / T), max_beta)


def make_schedule(num_train_timesteps: int = 1000, beta_start: float = 1e-4, beta_end: float = 0.02,
                  beta_schedule: str = "linear") -> NoiseSchedule:
    """The DDPM variance schedule, with diffusers' `DDPMScheduler` arguments and defaults.

    Args:
      num_train_timesteps: T.
      beta_start, beta_end: β at the first and last step ("linear", "scaled_linear").
      beta_schedule: "linear" (Ho et al.: β evenly spaced), "scaled_linear" (Stable Diffusion:
        sqrt(β) evenly spaced) or "squaredcos_cap_v2" (Nichol & Dhariwal's cosine ᾱ).

    Raises:
      ValueError: an unknown `beta_schedule` or a non-positive T.
    """
    T = num_train_timesteps
    if T < 1:
        raise ValueError(f"num_train_timesteps={T} must be at least 1.")
    if beta_schedule == "linear":
        betas = np.linspace(beta_start, beta_end, T, dtype=np.float32)
    elif beta_schedule == "scaled_linear":
        betas = np.linspace(beta_start ** 0.5, beta_end ** 0.5, T, dtype=np.float32) ** 2
    elif beta_schedule == "squaredcos_cap_v2":
        betas = _cosine_betas(T).astype(np.float32)
    else:
        raise ValueError(f"beta_schedule={beta_schedule!r} is not one of {', '.join(BETA_SCHEDULES)}.")
    alphas = 1.0 - betas
    alphas_cumprod = np.cumprod(alphas, dtype=np.float32)
    return NoiseSchedule(jnp.asarray(betas), jnp.asarray(alphas), jnp.asarray(alphas_cumprod))


def _per_example(values: jax.Array, ndim: int) -> jax.Array:
    """(B,) -> (B, 1, ..., 1): one number per example, broadcast over its pixels."""
    return values.reshape(values.shape + (1,) * (ndim - 1))


def add_noise(schedule: NoiseSchedule, x0: jax.Array, noise: jax.Array, t: jax.Array) -> jax.Array:
    """q(x_t | x0): x_t = sqrt(ᾱ_t) x0 + sqrt(1 - ᾱ_t) ε (Ho et al. eq. 4); t (B,) integer steps."""
    abar = _per_example(schedule.alphas_cumprod[t], x0.ndim)
    return jnp.sqrt(abar) * x0 + jnp.sqrt(1.0 - abar) * noise


def flow_add_noise(x0: jax.Array, noise: jax.Array, t: jax.Array) -> jax.Array:
    """The straight path of rectified flow: x_t = (1 - t) x0 + t ε; t (B,) in [0, 1]."""
    t = _per_example(t, x0.ndim)
    return (1.0 - t) * x0 + t * noise


def set_timesteps(num_train_timesteps: int, num_inference_steps: int) -> np.ndarray:
    """The steps a sampler visits, newest noise first: every (T // n)-th step ("leading").

    Raises:
      ValueError: more inference steps than training steps, or fewer than one.
    """
    if not 1 <= num_inference_steps <= num_train_timesteps:
        raise ValueError(f"num_inference_steps={num_inference_steps} must be between 1 and "
                         f"num_train_timesteps={num_train_timesteps}.")
    step_ratio = num_train_timesteps // num_inference_steps
    return (np.arange(num_inference_steps) * step_ratio)[::-1].astype(np.int32)


def flow_timesteps(num_inference_steps: int) -> np.ndarray:
    """n + 1 times from 1 (pure noise) down to 0 (data), evenly spaced, for the Euler sampler."""
    if num_inference_steps < 1:
        raise ValueError(f"num_inference_steps={num_inference_steps} must be at least 1.")
    return np.linspace(1.0, 0.0, num_inference_steps + 1, dtype=np.float32)
