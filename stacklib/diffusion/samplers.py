"""Samplers: from noise back to data, one network call per step, with classifier-free guidance.

Each sampler starts from x ~ N(0, I) and repeats one update, newest noise first:

* **DDPM ancestral** (Ho et al. 2020): estimate x0 from the predicted noise, then draw from
  the Gaussian posterior q(x_prev | x_t, x0) (their eqs. 6-7), whose mean and variance are

      x̂0 = (x_t − sqrt(1 − ᾱ_t) ε̂) / sqrt(ᾱ_t)
      μ = sqrt(ᾱ_prev) β'_t / (1 − ᾱ_t) · x̂0 + sqrt(α'_t) (1 − ᾱ_prev) / (1 − ᾱ_t) · x_t
      σ² = (1 − ᾱ_prev) / (1 − ᾱ_t) · β'_t,       α'_t = ᾱ_t / ᾱ_prev,  β'_t = 1 − α'_t

  (with every step visited, α'_t = α_t and this is their eq. 11 plus σ_t² = β̃_t).
* **DDIM** (Song et al. 2021, eq. 12): the same x̂0, then a deterministic step (η = 0)

      x_prev = sqrt(ᾱ_prev) x̂0 + sqrt(1 − ᾱ_prev − σ²) ε̂ + σ z,
      σ = η · sqrt((1 − ᾱ_prev) / (1 − ᾱ_t)) · sqrt(1 − ᾱ_t / ᾱ_prev).

* **Euler** for flow matching: integrate dx/dt = v_θ(x, t) from t = 1 to 0,
  x_{t'} = x_t + (t' − t) v̂.

**Classifier-free guidance** (Ho & Salimans 2022): run the network with the label and with
the "no class" label in one doubled batch and extrapolate, ε̃ = ε_u + w (ε_c − ε_u); w = 1
is the plain conditional model, w > 1 trades diversity for fidelity to the class.

Mirrors diffusers' `DDPMScheduler.step`, `DDIMScheduler.step` (variance "fixed_small",
`clip_sample` to [−1, 1], `eta`) and `FlowMatchEulerDiscreteScheduler.step`, and the
guidance of MaxDiffusion's generate scripts (`guidance_scale`, a doubled batch). Differences:
the step functions are pure (schedule, prediction, t, prev_t, x, noise) -> x_prev and the
whole loop is one `jax.lax.scan` under `jax.jit`; no `use_clipped_model_output`, no
thresholding, no guidance rescale.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

import stacklib.nn as nnx
from stacklib.diffusion import schedules
from stacklib.diffusion.model import DiT

SAMPLERS = ("euler", "ddim", "ddpm")
SAMPLERS_FOR = {"flow": ("euler",), "ddpm": ("ddim", "ddpm")}
"""objective -> the methods that read its prediction: Euler integrates a velocity v; DDIM and
DDPM turn a noise ε into x̂0. Another pairing runs, and silently produces noise."""


def _alphas(schedule: schedules.NoiseSchedule, t: jax.Array, prev_t: jax.Array):
    """ᾱ_t and ᾱ_prev, with ᾱ = 1 before the first step (diffusers' `set_alpha_to_one`)."""
    abar_t = schedule.alphas_cumprod[t]
    abar_prev = jnp.where(prev_t >= 0, schedule.alphas_cumprod[jnp.maximum(prev_t, 0)], 1.0)
    return abar_t, abar_prev


def predict_x0(abar_t: jax.Array, eps: jax.Array, x_t: jax.Array, clip_sample: bool) -> jax.Array:
    """x̂0 = (x_t − sqrt(1 − ᾱ_t) ε̂) / sqrt(ᾱ_t), optionally clipped to the data range [−1, 1]."""
    x0 = (x_t - jnp.sqrt(1.0 - abar_t) * eps) / jnp.sqrt(abar_t)
    return jnp.clip(x0, -1.0, 1.0) if clip_sample else x0


def ddpm_step(schedule: schedules.NoiseSchedule, eps: jax.Array, t: jax.Array, prev_t: jax.Array,
              x_t: jax.Array, noise: jax.Array, *, clip_sample: bool = True) -> jax.Array:
    """One ancestral step x_t -> x_prev: the posterior mean from x̂0, plus σ·noise unless t = 0."""
    abar_t, abar_prev = _alphas(schedule, t, prev_t)
    alpha_t = abar_t / abar_prev
    beta_t = 1.0 - alpha_t
    x0 = predict_x0(abar_t, eps, x_t, clip_sample)
    mean = (jnp.sqrt(abar_prev) * beta_t / (1.0 - abar_t)) * x0 \
        + (jnp.sqrt(alpha_t) * (1.0 - abar_prev) / (1.0 - abar_t)) * x_t
    variance = jnp.maximum((1.0 - abar_prev) / (1.0 - abar_t) * beta_t, 1e-20)
    return mean + jnp.where(t > 0, jnp.sqrt(variance), 0.0) * noise


def ddim_step(schedule: schedules.NoiseSchedule, eps: jax.Array, t: jax.Array, prev_t: jax.Array,
              x_t: jax.Array, noise: jax.Array | None = None, *, eta: float = 0.0,
              clip_sample: bool = True) -> jax.Array:
    """One DDIM step x_t -> x_prev (Song et al. eq. 12); deterministic at eta = 0."""
    abar_t, abar_prev = _alphas(schedule, t, prev_t)
    x0 = predict_x0(abar_t, eps, x_t, clip_sample)
    sigma = eta * jnp.sqrt((1.0 - abar_prev) / (1.0 - abar_t) * (1.0 - abar_t / abar_prev))
    x_prev = jnp.sqrt(abar_prev) * x0 + jnp.sqrt(1.0 - abar_prev - sigma ** 2) * eps
    return x_prev if noise is None else x_prev + sigma * noise


def euler_step(v: jax.Array, t: jax.Array, t_next: jax.Array, x_t: jax.Array) -> jax.Array:
    """One Euler step of dx/dt = v along the flow: x_{t'} = x_t + (t' − t) v."""
    return x_t + (t_next - t) * v


def guide(prediction_cond: jax.Array, prediction_uncond: jax.Array, guidance_scale: float) -> jax.Array:
    """Classifier-free guidance: ε_u + w (ε_c − ε_u). w = 1 gives the conditional prediction."""
    return prediction_uncond + guidance_scale * (prediction_cond - prediction_uncond)


def guided_prediction(model: DiT, x: jax.Array, t: jax.Array, y: jax.Array,
                      guidance_scale: float) -> jax.Array:
    """The network's output under guidance: one call on [x, x] with labels [y, null] (B -> 2B)."""
    null = jnp.full_like(y, model.config.num_classes)
    both = model(jnp.concatenate([x, x]), jnp.concatenate([t, t]), jnp.concatenate([y, null]))  # (2B, ...)
    cond, uncond = jnp.split(both, 2)
    return guide(cond, uncond, guidance_scale)


class Samples(NamedTuple):
    images: jax.Array           # (B, H, W, C), roughly in [-1, 1]
    trajectory: jax.Array       # (steps + 1, B, H, W, C): x from pure noise to the result


def sample(model: DiT, labels: jax.Array, key: jax.Array, *, method: str = "euler", num_steps: int = 20,
           guidance_scale: float = 1.0, schedule: schedules.NoiseSchedule | None = None,
           eta: float = 0.0, clip_sample: bool = True) -> Samples:
    """Generate one image per label with `method`: "euler" (a flow model), "ddim" or "ddpm" (an ε model).

    The model's `config.objective` says which it is; a method that does not fit it is refused.

    The same key gives the same images. Compiled once per (architecture, method, steps,
    guided or not, batch size); the weights are an argument, so another model of the same
    architecture reuses the compiled loop.

    Raises:
      ValueError: an unknown method, one that does not fit the model's objective, a DDPM/DDIM
        sampler without a schedule, a label outside 0..num_classes, or a bad step count.
    """
    if method not in SAMPLERS:
        raise ValueError(f"method={method!r} is not one of {', '.join(SAMPLERS)} (euler for a flow-matching "
                         "model, ddim or ddpm for a noise-predicting one).")
    objective = model.config.objective
    if method not in SAMPLERS_FOR[objective]:
        fitting = " or ".join(f"method={m!r}" for m in SAMPLERS_FOR[objective])
        predicts = "a velocity v" if objective == "flow" else "the noise ε"
        raise ValueError(f"method={method!r} does not fit this model: it was trained with objective="
                         f"{objective!r} and predicts {predicts}. Sample it with {fitting}.")
    if method != "euler" and schedule is None:
        raise ValueError(f"method={method!r} walks a noise schedule: pass schedule=schedules.make_schedule() "
                         "(the one the model was trained with).")
    labels = jnp.asarray(labels, jnp.int32)
    num_classes = model.config.num_classes
    if labels.ndim != 1 or int(jnp.min(labels)) < 0 or int(jnp.max(labels)) > num_classes:
        raise ValueError(f"labels must be a 1-D array of classes in 0..{num_classes - 1} (or {num_classes}, "
                         f"no class); got shape {labels.shape} with values {labels.tolist()[:8]}.")
    if method == "euler":
        times = jnp.asarray(schedules.flow_timesteps(num_steps))
    else:
        timesteps = schedules.set_timesteps(schedule.num_train_timesteps, num_steps)
        last = int(timesteps[-1]) - schedule.num_train_timesteps // num_steps  # < 0: ᾱ_prev = 1
        times = jnp.asarray(timesteps.tolist() + [last])
    graphdef, state = nnx.split(model)
    run = _compiled(graphdef, method, guidance_scale != 1.0, clip_sample)
    return run(state, labels, key, times, jnp.float32(guidance_scale), schedule, jnp.float32(eta))


@functools.lru_cache(maxsize=16)
def _compiled(graphdef, method: str, guided: bool, clip_sample: bool):
    @jax.jit
    def run(state, labels, key, times, guidance_scale, schedule, eta):
        model = nnx.merge(graphdef, state)
        cfg = model.config
        start_key, steps_key = jax.random.split(key)
        x = jax.random.normal(start_key, (labels.shape[0], cfg.image_size, cfg.image_size, cfg.channels))

        def step(x, inputs):
            t, t_next, step_key = inputs
            if method == "euler":
                network_time = jnp.full(labels.shape, t)
            else:
                network_time = jnp.full(labels.shape, t / schedule.num_train_timesteps, jnp.float32)
            if guided:  # known when compiling: an unguided sampler makes one call of batch B, not 2B
                out = guided_prediction(model, x, network_time, labels, guidance_scale)
            else:
                out = model(x, network_time, labels)
            noise = jax.random.normal(step_key, x.shape)
            if method == "euler":
                x = euler_step(out, t, t_next, x)
            elif method == "ddim":
                x = ddim_step(schedule, out, t, t_next, x, noise, eta=eta, clip_sample=clip_sample)
            else:
                x = ddpm_step(schedule, out, t, t_next, x, noise, clip_sample=clip_sample)
            return x, x

        keys = jax.random.split(steps_key, times.shape[0] - 1)
        x_final, path = jax.lax.scan(step, x, (times[:-1], times[1:], keys))
        return Samples(x_final, jnp.concatenate([x[None], path]))

    return run
