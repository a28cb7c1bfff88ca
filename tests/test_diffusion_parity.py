"""stacklib.diffusion's schedules, forward process and sampler updates vs the papers' equations.

The reference would be diffusers' schedulers, but diffusers 0.42 ships only PyTorch ones
(its Flax schedulers are gone) and torch is far too heavy an extra for a schedule table.
So the reference here is each paper's closed form, written out again in float64 NumPy,
independently of stacklib's code (which runs in float32 under JAX):

  Ho et al. 2020 (DDPM): eq. 4 (forward process), eqs. 6-7 (posterior mean and variance),
    eq. 11 (the ancestral step written with ε), eq. 15 (x0 from ε);
  Nichol & Dhariwal 2021: eq. 17 (the cosine ᾱ);
  Song et al. 2021 (DDIM): eq. 12 (the generalised step, σ from eq. 16 times η);
  Liu et al. 2022 / Lipman et al. 2023: the straight path x_t = (1 - t) x0 + t ε and its
    velocity ε - x0.

Tolerances are float32 rounding: rtol 2e-6 for a few float32 operations; 1e-4 relative for
ᾱ, a float32 running product over up to 1000 factors (each factor adds a rounding of ~6e-8).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stacklib.diffusion import samplers, schedules

T = 1000


def reference_alphas_cumprod(beta_schedule: str) -> tuple[np.ndarray, np.ndarray]:
    """(β, ᾱ) in float64, from the papers."""
    t = np.arange(T, dtype=np.float64)
    if beta_schedule == "linear":                       # Ho et al. §4: β from 1e-4 to 0.02, linearly
        betas = 1e-4 + (0.02 - 1e-4) * t / (T - 1)
    elif beta_schedule == "scaled_linear":              # Stable Diffusion: sqrt(β) linear
        betas = (1e-4 ** 0.5 + (0.02 ** 0.5 - 1e-4 ** 0.5) * t / (T - 1)) ** 2
    else:                                               # Nichol & Dhariwal eq. 17, β capped at 0.999
        f = np.cos((np.arange(T + 1) / T + 0.008) / 1.008 * np.pi / 2) ** 2
        betas = np.minimum(1 - f[1:] / f[:-1], 0.999)
    return betas, np.cumprod(1 - betas)


@pytest.mark.parametrize("beta_schedule", schedules.BETA_SCHEDULES)
def test_noise_schedules_equal_the_papers_closed_forms(beta_schedule):
    ours = schedules.make_schedule(T, beta_schedule=beta_schedule)
    betas, alphas_cumprod = reference_alphas_cumprod(beta_schedule)
    np.testing.assert_allclose(ours.betas, betas, rtol=2e-6, atol=1e-9)
    np.testing.assert_allclose(ours.alphas, 1 - betas, rtol=2e-6, atol=3e-8)  # 1 - 0.999 in float32
    np.testing.assert_allclose(ours.alphas_cumprod, alphas_cumprod, rtol=1e-4)  # a product of 1000 floats


def case(seed=0, shape=(6, 8, 8, 1)):
    rng = np.random.default_rng(seed)
    return rng.uniform(-1, 1, shape), rng.standard_normal(shape), rng.standard_normal(shape)


def test_the_forward_process_equals_ho_et_al_equation_4():
    x0, eps, _ = case()
    t = np.array([0, 1, 10, 300, 700, 999])
    schedule = schedules.make_schedule(T)
    abar = np.asarray(schedule.alphas_cumprod, np.float64)[t][:, None, None, None]
    expected = np.sqrt(abar) * x0 + np.sqrt(1 - abar) * eps              # eq. 4, reparameterised
    ours = schedules.add_noise(schedule, jnp.float32(x0), jnp.float32(eps), jnp.asarray(t))
    np.testing.assert_allclose(ours, expected, rtol=2e-6, atol=2e-6)


def test_the_flow_path_and_euler_step_are_the_straight_line():
    x0, eps, _ = case(1)
    t = np.linspace(0, 1, 6)
    ours = schedules.flow_add_noise(jnp.float32(x0), jnp.float32(eps), jnp.float32(t))
    np.testing.assert_allclose(ours, (1 - t[:, None, None, None]) * x0 + t[:, None, None, None] * eps,
                               rtol=2e-6, atol=2e-6)
    # The exact velocity ε - x0 takes one Euler step from pure noise (t = 1) to the data (t = 0).
    np.testing.assert_allclose(samplers.euler_step(jnp.float32(eps - x0), 1.0, 0.0, jnp.float32(eps)), x0,
                               atol=2e-6)


def reference_ddpm_step(abar_t, abar_prev, eps, x_t, z, clip):
    """Ho et al. eqs. 15 (x0 from ε) and 6-7 (posterior mean and variance), with ᾱ_t / ᾱ_prev for α_t."""
    alpha_t = abar_t / abar_prev
    beta_t = 1 - alpha_t
    x0 = (x_t - np.sqrt(1 - abar_t) * eps) / np.sqrt(abar_t)
    x0 = np.clip(x0, -1, 1) if clip else x0
    mean = (np.sqrt(abar_prev) * beta_t / (1 - abar_t) * x0
            + np.sqrt(alpha_t) * (1 - abar_prev) / (1 - abar_t) * x_t)
    return mean + np.sqrt((1 - abar_prev) / (1 - abar_t) * beta_t) * z


# At t = 7, β'_t = 1 - ᾱ_t/ᾱ_prev ≈ 4e-5 cancels: float32 keeps about 3 digits of it (diffusers computes it
# the same way), so the tolerance is float32's ε / β'_t.
@pytest.mark.parametrize("t, prev_t, clip, tol", [(999, 949, True, 2e-5), (500, 450, False, 2e-5),
                                                  (50, 0, True, 2e-5), (7, 6, False, 2e-4)])
def test_a_ddpm_step_equals_the_posterior_of_ho_et_al_equations_6_and_7(t, prev_t, clip, tol):
    x_t, eps, z = case(2)
    schedule = schedules.make_schedule(T, beta_schedule="squaredcos_cap_v2")
    abar = np.asarray(schedule.alphas_cumprod, np.float64)
    ours = samplers.ddpm_step(schedule, jnp.float32(eps), jnp.int32(t), jnp.int32(prev_t), jnp.float32(x_t),
                              jnp.float32(z), clip_sample=clip)
    expected = reference_ddpm_step(abar[t], abar[prev_t], eps, x_t, z, clip)
    np.testing.assert_allclose(ours, expected, rtol=tol, atol=tol)  # 1/sqrt(ᾱ) amplifies float32 rounding


def test_with_every_step_visited_the_ddpm_step_is_ho_et_al_equation_11():
    x_t, eps, z = case(3)
    schedule = schedules.make_schedule(T)
    betas, abar = (np.asarray(a, np.float64) for a in (schedule.betas, schedule.alphas_cumprod))
    t = 400
    sigma = np.sqrt((1 - abar[t - 1]) / (1 - abar[t]) * betas[t])          # σ_t² = β̃_t
    expected = (x_t - betas[t] / np.sqrt(1 - abar[t]) * eps) / np.sqrt(1 - betas[t]) + sigma * z
    ours = samplers.ddpm_step(schedule, jnp.float32(eps), jnp.int32(t), jnp.int32(t - 1), jnp.float32(x_t),
                              jnp.float32(z), clip_sample=False)
    np.testing.assert_allclose(ours, expected, rtol=2e-5, atol=2e-5)


def test_the_last_ddpm_step_adds_no_noise():
    x_t, eps, z = case(4)
    schedule = schedules.make_schedule(T)
    step = jax.jit(lambda z: samplers.ddpm_step(schedule, jnp.float32(eps), jnp.int32(0), jnp.int32(-50),
                                                jnp.float32(x_t), z))
    np.testing.assert_array_equal(step(jnp.float32(z)), step(jnp.zeros_like(jnp.float32(z))))


@pytest.mark.parametrize("eta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("t, prev_t", [(950, 900), (100, 50), (20, -30)])
def test_a_ddim_step_equals_song_et_al_equation_12(t, prev_t, eta):
    x_t, eps, z = case(5)
    schedule = schedules.make_schedule(T)
    abar = np.asarray(schedule.alphas_cumprod, np.float64)
    a_t, a_prev = abar[t], (abar[prev_t] if prev_t >= 0 else 1.0)
    x0 = np.clip((x_t - np.sqrt(1 - a_t) * eps) / np.sqrt(a_t), -1, 1)     # "predicted x0", clipped
    sigma = eta * np.sqrt((1 - a_prev) / (1 - a_t) * (1 - a_t / a_prev))   # eq. 16 times η
    expected = np.sqrt(a_prev) * x0 + np.sqrt(1 - a_prev - sigma ** 2) * eps + sigma * z
    ours = samplers.ddim_step(schedule, jnp.float32(eps), jnp.int32(t), jnp.int32(prev_t), jnp.float32(x_t),
                              jnp.float32(z), eta=eta)
    np.testing.assert_allclose(ours, expected, rtol=2e-5, atol=2e-5)


def test_timesteps_are_spaced_as_diffusers_leading_spacing():
    # diffusers' DDIMScheduler.set_timesteps with timestep_spacing="leading", steps_offset=0.
    np.testing.assert_array_equal(schedules.set_timesteps(1000, 10), np.arange(900, -1, -100))
    np.testing.assert_array_equal(schedules.set_timesteps(1000, 3), [666, 333, 0])
    np.testing.assert_allclose(schedules.flow_timesteps(4), [1.0, 0.75, 0.5, 0.25, 0.0])
