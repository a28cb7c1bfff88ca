"""Chapter 17 exercises: the pieces of a diffusion model, each one equation.

The cumulative product ᾱ of a noise schedule, the forward process q(x_t | x0), one DDIM
step, and classifier-free guidance. Expected answers come from stacklib.diffusion (whose
own parity tests compare it with the papers' equations) or from closed forms written
here; the learner's function gets copies of its inputs (`call_on_copies`).
"""

import numpy as np

from stacklib.diffusion import samplers, schedules
from stacklib.grading import Exercise, call_on_copies, expect, expect_close


def _rng(seed):
    return np.random.default_rng(seed)


# ---------------------------------------------------------------- 17.alpha_bar

alpha_bar = Exercise("17.alpha_bar", "ᾱ_t, the share of the signal left after t+1 noising steps")


@alpha_bar.case(points=1, hint="ᾱ_t = (1 − β_0)(1 − β_1)…(1 − β_t): a running product of 1 − β, not of β.")
def three_steps_by_hand(fn):
    got = call_on_copies(fn, np.array([0.1, 0.2, 0.5]), what="alpha_bar")
    expect_close(np.asarray(got), np.array([0.9, 0.72, 0.36]), rtol=1e-6, what="alpha_bar([0.1, 0.2, 0.5])")


@alpha_bar.case(points=1, hint="Entry t includes step t itself: ᾱ_0 = 1 − β_0, not 1.")
def the_first_entry_already_has_one_step_of_noise(fn):
    got = np.asarray(call_on_copies(fn, np.array([0.25]), what="alpha_bar"))
    expect(got.shape == (1,), f"alpha_bar of one β returns one value; got shape {got.shape}")
    expect_close(got, np.array([0.75]), rtol=1e-6, what="alpha_bar([0.25])")


@alpha_bar.case(points=2, hint="Compare with stacklib.diffusion.schedules.make_schedule(1000)"
                               ".alphas_cumprod; np.cumprod does the running product.")
def hos_linear_schedule_of_1000_steps(fn):
    betas = np.linspace(1e-4, 0.02, 1000)
    got = np.asarray(call_on_copies(fn, betas, what="alpha_bar"))
    expect(got.shape == (1000,), f"one ᾱ per step: expected shape (1000,), got {got.shape}")
    expect_close(got, schedules.make_schedule(1000).alphas_cumprod, rtol=1e-4,
                 what="ᾱ of the linear schedule")


# ---------------------------------------------------------------- 17.q_sample

q_sample = Exercise("17.q_sample", "The forward process: x_t = sqrt(ᾱ_t) x0 + sqrt(1 − ᾱ_t) ε")


def _q_sample_case(fn, shape, seed):
    x0, noise = _rng(seed).uniform(-1, 1, shape), _rng(seed + 1).standard_normal(shape)
    abar = _rng(seed + 2).uniform(0.01, 0.99, shape[0])
    b = abar.reshape((-1,) + (1,) * (len(shape) - 1))
    expected = np.sqrt(b) * x0 + np.sqrt(1 - b) * noise
    got = np.asarray(call_on_copies(fn, x0, noise, abar, what="q_sample"))
    expect(got.shape == shape, f"x_t has x0's shape {shape}; got {got.shape}")
    expect_close(got, expected, rtol=1e-5, atol=1e-6, what=f"q_sample on images of shape {shape}")


@q_sample.case(points=2, hint="Square roots: the variances sum to one (ᾱ + (1 − ᾱ) = 1), the scales do not.")
def one_value_per_example(fn):
    _q_sample_case(fn, (5, 1), seed=0)


@q_sample.case(points=2, hint="alpha_bar_t has one value per example, shape (B,): reshape it to (B, 1, 1, 1) "
                              "to broadcast over an image's pixels.")
def a_batch_of_images(fn):
    _q_sample_case(fn, (4, 8, 8, 1), seed=3)


@q_sample.case(points=2, hint="At ᾱ = 1 nothing is noised; at ᾱ = 0 only noise is left.")
def the_two_ends_of_the_schedule(fn):
    x0, noise = np.full((2, 3), 0.5), np.full((2, 3), -2.0)
    got = call_on_copies(fn, x0, noise, np.array([1.0, 0.0]), what="q_sample")
    expect_close(np.asarray(got), np.array([[0.5] * 3, [-2.0] * 3]), atol=1e-6,
                 what="q_sample at ᾱ = 1 and ᾱ = 0")


# ---------------------------------------------------------------- 17.ddim_step

ddim_step = Exercise("17.ddim_step", "One deterministic DDIM step (η = 0, no clipping)")


def _ddim_expected(x_t, eps, abar_t, abar_prev):
    schedule = schedules.NoiseSchedule(*(np.array([0.0, 0.0]),) * 2, np.array([abar_prev, abar_t]))
    return np.asarray(samplers.ddim_step(schedule, eps, 1, 0, x_t, clip_sample=False))


def _ddim_case(fn, abar_t, abar_prev, seed, scale=1.0):
    x_t, eps = scale * _rng(seed).standard_normal((3, 8, 8, 1)), _rng(seed + 1).standard_normal((3, 8, 8, 1))
    got = np.asarray(call_on_copies(fn, x_t, eps, abar_t, abar_prev, what="ddim_step"))
    expect(got.shape == x_t.shape, f"x_prev has x_t's shape {x_t.shape}; got {got.shape}")
    expect_close(got, _ddim_expected(x_t, eps, abar_t, abar_prev), rtol=1e-4, atol=1e-5,
                 what=f"ddim_step(ᾱ_t={abar_t}, ᾱ_prev={abar_prev})")


@ddim_step.case(points=2, hint="First x̂0 = (x_t − sqrt(1 − ᾱ_t) ε) / sqrt(ᾱ_t); then "
                               "x_prev = sqrt(ᾱ_prev) x̂0 + sqrt(1 − ᾱ_prev) ε.")
def a_step_in_the_middle_of_the_schedule(fn):
    _ddim_case(fn, 0.3, 0.5, seed=0)


@ddim_step.case(points=2, hint="The direction term uses ᾱ_prev, the level we step to, not ᾱ_t.")
def a_step_from_almost_pure_noise(fn):
    _ddim_case(fn, 0.01, 0.2, seed=2)


@ddim_step.case(points=2, hint="The last step goes to ᾱ_prev = 1: it returns x̂0 itself.")
def the_last_step_returns_the_predicted_x0(fn):
    _ddim_case(fn, 0.9, 1.0, seed=4)


@ddim_step.case(points=2, hint="Do not clip x̂0 here: the exercise asks for the plain equation (the library "
                               "clips as an option, clip_sample).")
def a_predicted_x0_outside_the_data_range_is_kept(fn):
    _ddim_case(fn, 0.5, 0.8, seed=6, scale=4.0)


# ---------------------------------------------------------------- 17.guidance

guidance = Exercise("17.guidance", "Classifier-free guidance: extrapolate from unconditional to conditional")


def _guidance_case(fn, scale, seed):
    cond, uncond = _rng(seed).standard_normal((2, 8, 8, 1)), _rng(seed + 1).standard_normal((2, 8, 8, 1))
    got = call_on_copies(fn, cond, uncond, scale, what="classifier_free_guidance")
    expect_close(got, np.asarray(samplers.guide(cond, uncond, scale)), rtol=1e-5, atol=1e-6,
                 what=f"guidance at scale {scale}")


@guidance.case(points=2, hint="Scale 1 is the conditional prediction itself; scale 0 the unconditional one.")
def scale_one_is_the_conditional_model(fn):
    _guidance_case(fn, 1.0, seed=0)
    _guidance_case(fn, 0.0, seed=2)


@guidance.case(points=2, hint="ε̃ = ε_u + w (ε_c − ε_u): start at the unconditional prediction and move w "
                              "times the difference towards (and past) the conditional one.")
def scale_three_extrapolates_past_the_conditional(fn):
    _guidance_case(fn, 3.0, seed=4)


@guidance.case(points=2, hint="w multiplies the difference, not the conditional prediction alone.")
def a_fractional_scale(fn):
    _guidance_case(fn, 1.5, seed=6)
