"""Chapter 17's exercise cases: right answers score full marks, planted wrong ones lose points."""

import numpy as np
import pytest
import scipy.linalg

from stacklib.diffusion import schedules
from stacklib.grading import grade

# ---------------------------------------------------------------- right answers


def euler_sample(velocity, x1, num_steps):
    times = schedules.flow_timesteps(num_steps)
    x = x1
    for t, t_next in zip(times[:-1], times[1:], strict=True):
        x = x + (t_next - t) * velocity(x, t)
    return x


def euler_sample_by_index(velocity, x1, num_steps):  # a right answer written another way
    x, dt = np.array(x1), np.float32(1.0 / num_steps)
    for i in range(num_steps):
        x = x - dt * velocity(x, 1.0 - i / num_steps)
    return x.astype(np.float32)


def ddpm_posterior(x0, x_t, alpha_bar_t, alpha_bar_prev):
    alpha = alpha_bar_t / alpha_bar_prev
    beta = 1.0 - alpha
    mean = (np.sqrt(alpha_bar_prev) * beta / (1.0 - alpha_bar_t)) * x0 \
        + (np.sqrt(alpha) * (1.0 - alpha_bar_prev) / (1.0 - alpha_bar_t)) * x_t
    return mean, float((1.0 - alpha_bar_prev) / (1.0 - alpha_bar_t) * beta)


def frechet_distance(features_a, features_b):
    a, b = np.asarray(features_a, np.float64), np.asarray(features_b, np.float64)
    cov_a, cov_b = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    cross = scipy.linalg.sqrtm(cov_a @ cov_b).real
    return float(np.sum((a.mean(0) - b.mean(0)) ** 2) + np.trace(cov_a + cov_b - 2 * cross))


def guided_prediction(model, x, t, labels, scale, null_class):
    B = x.shape[0]
    both = model(np.concatenate([x, x]), np.concatenate([t, t]),
                 np.concatenate([labels, np.full_like(labels, null_class)]))  # (2B, H, W, C)
    cond, uncond = both[:B], both[B:]
    return uncond + scale * (cond - uncond)


RIGHT = [("17.euler_sample", euler_sample), ("17.euler_sample", euler_sample_by_index),
         ("17.ddpm_posterior", ddpm_posterior), ("17.frechet", frechet_distance),
         ("17.guided_batch", guided_prediction)]


@pytest.mark.parametrize("exercise_id, answer", RIGHT, ids=[f"{e}-{a.__name__}" for e, a in RIGHT])
def test_a_right_answer_scores_full_marks(exercise_id, answer):
    result = grade(exercise_id, answer)
    assert result.points == result.max_points, [c.message for c in result.cases]


# ---------------------------------------------------------------- planted wrong answers: 17.euler_sample


def time_goes_up(velocity, x1, num_steps):  # integrates from 0 to 1
    times = np.linspace(0.0, 1.0, num_steps + 1, dtype=np.float32)
    x = x1
    for t, t_next in zip(times[:-1], times[1:], strict=True):
        x = x + (t_next - t) * velocity(x, t)
    return x


def adds_the_step(velocity, x1, num_steps):  # x + dt · v with dt > 0: the sign of (t' − t) lost
    x = x1
    for t in schedules.flow_timesteps(num_steps)[:-1]:
        x = x + np.float32(1 / num_steps) * velocity(x, t)
    return x


def velocity_at_the_end_of_the_step(velocity, x1, num_steps):  # implicit-looking, calls v at t_next
    times = schedules.flow_timesteps(num_steps)
    x = x1
    for t, t_next in zip(times[:-1], times[1:], strict=True):
        x = x + (t_next - t) * velocity(x, t_next)
    return x


def one_step_too_few(velocity, x1, num_steps):
    times = schedules.flow_timesteps(num_steps)
    x = x1
    for t, t_next in zip(times[:-2], times[1:-1], strict=True):
        x = x + (t_next - t) * velocity(x, t)
    return x


def every_step_from_x1(velocity, x1, num_steps):  # the velocity of the noise at every step
    times = schedules.flow_timesteps(num_steps)
    x = x1
    for t, t_next in zip(times[:-1], times[1:], strict=True):
        x = x + (t_next - t) * velocity(x1, t)
    return x


def float64_times(velocity, x1, num_steps):  # np.linspace's float64 scalars promote x to float64
    times = np.linspace(1.0, 0.0, num_steps + 1)
    x = x1
    for t, t_next in zip(times[:-1], times[1:], strict=True):
        x = x + (t_next - t) * velocity(x, t)
    return x


def times_without_the_end(velocity, x1, num_steps):  # n times from 1 to 0: steps of 1/(n−1)
    times = np.linspace(1.0, 0.0, num_steps, dtype=np.float32)
    x = x1
    for t, t_next in zip(times, np.append(times[1:], np.float32(0)), strict=True):
        x = x + (t_next - t) * velocity(x, t)
    return x


def batch_of_times(velocity, x1, num_steps):  # t as a (B,) array, as samplers.sample builds it
    times = schedules.flow_timesteps(num_steps)
    x = x1
    for t, t_next in zip(times[:-1], times[1:], strict=True):
        x = x + (t_next - t) * velocity(x, np.full(x.shape[0], t))
    return x


def midpoint_times(velocity, x1, num_steps):  # v at the middle of each step
    times = schedules.flow_timesteps(num_steps)
    x = x1
    for t, t_next in zip(times[:-1], times[1:], strict=True):
        x = x + (t_next - t) * velocity(x, (t + t_next) / 2)
    return x


def returns_the_trajectory(velocity, x1, num_steps):  # every x, not the last
    times = schedules.flow_timesteps(num_steps)
    path = [x1]
    for t, t_next in zip(times[:-1], times[1:], strict=True):
        path.append(path[-1] + (t_next - t) * velocity(path[-1], t))
    return np.stack(path)


def updates_in_place(velocity, x1, num_steps):  # changes the caller's noise
    times = schedules.flow_timesteps(num_steps)
    for t, t_next in zip(times[:-1], times[1:], strict=True):
        x1 += (t_next - t) * velocity(x1, t)
    return x1


# ---------------------------------------------------------------- planted wrong answers: 17.ddpm_posterior


def _mean(x0, x_t, abar_t, abar_prev, alpha):
    beta = 1.0 - alpha
    return (np.sqrt(abar_prev) * beta / (1.0 - abar_t)) * x0 \
        + (np.sqrt(alpha) * (1.0 - abar_prev) / (1.0 - abar_t)) * x_t


def variance_is_beta(x0, x_t, abar_t, abar_prev):  # DDPM's "fixed_large" σ² = β, not the posterior's β̃
    mean, _ = ddpm_posterior(x0, x_t, abar_t, abar_prev)
    return mean, float(1.0 - abar_t / abar_prev)


def standard_deviation(x0, x_t, abar_t, abar_prev):
    mean, variance = ddpm_posterior(x0, x_t, abar_t, abar_prev)
    return mean, float(np.sqrt(variance))


def alpha_is_alpha_bar(x0, x_t, abar_t, abar_prev):  # α_t taken as ᾱ_t
    alpha = abar_t
    mean = _mean(x0, x_t, abar_t, abar_prev, alpha)
    return mean, float((1.0 - abar_prev) / (1.0 - abar_t) * (1.0 - alpha))


def roles_swapped(x0, x_t, abar_t, abar_prev):
    return ddpm_posterior(x_t, x0, abar_t, abar_prev)


def coefficient_at_alpha_bar_t(x0, x_t, abar_t, abar_prev):  # sqrt(ᾱ_t) where sqrt(ᾱ_prev) belongs
    alpha = abar_t / abar_prev
    beta = 1.0 - alpha
    mean = (np.sqrt(abar_t) * beta / (1.0 - abar_t)) * x0 \
        + (np.sqrt(alpha) * (1.0 - abar_prev) / (1.0 - abar_t)) * x_t
    return mean, float((1.0 - abar_prev) / (1.0 - abar_t) * beta)


def alpha_without_square_root(x0, x_t, abar_t, abar_prev):
    alpha = abar_t / abar_prev
    beta = 1.0 - alpha
    mean = (np.sqrt(abar_prev) * beta / (1.0 - abar_t)) * x0 \
        + (alpha * (1.0 - abar_prev) / (1.0 - abar_t)) * x_t
    return mean, float((1.0 - abar_prev) / (1.0 - abar_t) * beta)


def per_pixel_variance(x0, x_t, abar_t, abar_prev):  # an array where one number belongs
    mean, variance = ddpm_posterior(x0, x_t, abar_t, abar_prev)
    return mean, np.full_like(x_t, variance)


def variance_ratio_inverted(x0, x_t, abar_t, abar_prev):  # (1 − ᾱ_t) / (1 − ᾱ_prev)
    mean, _ = ddpm_posterior(x0, x_t, abar_t, abar_prev)
    return mean, float((1.0 - abar_t) / (1.0 - abar_prev) * (1.0 - abar_t / abar_prev))


def mean_from_x0_only(x0, x_t, abar_t, abar_prev):  # sqrt(ᾱ_prev) x0, the forward process's mean
    _, variance = ddpm_posterior(x0, x_t, abar_t, abar_prev)
    return np.sqrt(abar_prev) * x0, variance


def alpha_inverted(x0, x_t, abar_t, abar_prev):  # ᾱ_prev / ᾱ_t: the step's α upside down
    alpha = abar_prev / abar_t
    beta = 1.0 - alpha
    mean = (np.sqrt(abar_prev) * beta / (1.0 - abar_t)) * x0 \
        + (np.sqrt(alpha) * (1.0 - abar_prev) / (1.0 - abar_t)) * x_t
    return mean, float((1.0 - abar_prev) / (1.0 - abar_t) * beta)


# ---------------------------------------------------------------- planted wrong answers: 17.frechet


def _parts(a, b, **cov):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return a, b, np.cov(a, rowvar=False, **cov), np.cov(b, rowvar=False, **cov)


def population_covariance(features_a, features_b):  # ddof=0: off by N/(N−1)
    a, b, cov_a, cov_b = _parts(features_a, features_b, ddof=0)
    cross = scipy.linalg.sqrtm(cov_a @ cov_b).real
    return float(np.sum((a.mean(0) - b.mean(0)) ** 2) + np.trace(cov_a + cov_b - 2 * cross))


def elementwise_square_root(features_a, features_b):  # np.sqrt of a matrix is not its square root
    a, b, cov_a, cov_b = _parts(features_a, features_b)
    cross = np.sqrt(np.abs(cov_a @ cov_b))
    return float(np.sum((a.mean(0) - b.mean(0)) ** 2) + np.trace(cov_a + cov_b - 2 * cross))


def diagonal_only(features_a, features_b):  # independent features assumed
    a, b = np.asarray(features_a, np.float64), np.asarray(features_b, np.float64)
    var_a, var_b = a.var(0, ddof=1), b.var(0, ddof=1)
    return float(np.sum((a.mean(0) - b.mean(0)) ** 2) + np.sum(var_a + var_b - 2 * np.sqrt(var_a * var_b)))


def distance_not_squared(features_a, features_b):
    return float(np.sqrt(frechet_distance(features_a, features_b)))


def means_only(features_a, features_b):
    a, b = np.asarray(features_a), np.asarray(features_b)
    return float(np.sum((a.mean(0) - b.mean(0)) ** 2))


def rows_as_variables(features_a, features_b):  # np.cov's default rowvar=True: an N × N "covariance"
    a, b = np.asarray(features_a, np.float64), np.asarray(features_b, np.float64)
    n = min(len(a), len(b))
    cov_a, cov_b = np.cov(a[:n]), np.cov(b[:n])
    cross = scipy.linalg.sqrtm(cov_a @ cov_b).real
    return float(np.sum((a.mean(0) - b.mean(0)) ** 2) + np.trace(cov_a + cov_b - 2 * cross))


def keeps_the_complex_value(features_a, features_b):  # forgets .real: a complex number when singular
    a, b, cov_a, cov_b = _parts(features_a, features_b)
    cross = scipy.linalg.sqrtm(cov_a @ cov_b)
    value = np.sum((a.mean(0) - b.mean(0)) ** 2) + np.trace(cov_a + cov_b - 2 * cross)
    return complex(value) if np.iscomplexobj(value) else float(value)


def no_factor_two(features_a, features_b):
    a, b, cov_a, cov_b = _parts(features_a, features_b)
    cross = scipy.linalg.sqrtm(cov_a @ cov_b).real
    return float(np.sum((a.mean(0) - b.mean(0)) ** 2) + np.trace(cov_a + cov_b - cross))


def float32_features(features_a, features_b):  # float32 throughout (what jnp would do)
    a, b = np.asarray(features_a, np.float32), np.asarray(features_b, np.float32)
    cov_a, cov_b = np.cov(a, rowvar=False).astype(np.float32), np.cov(b, rowvar=False).astype(np.float32)
    values, vectors = np.linalg.eigh(cov_a)
    root_a = (vectors * np.sqrt(np.clip(values, 0, None))) @ vectors.T
    cross = np.sum(np.sqrt(np.clip(np.linalg.eigvalsh(root_a @ cov_b @ root_a), 0, None)))
    return float(np.sum((a.mean(0) - b.mean(0)) ** 2) + np.trace(cov_a) + np.trace(cov_b) - 2 * cross)


def returns_a_numpy_array(features_a, features_b):  # a 0-d array, not a float
    return np.asarray(frechet_distance(features_a, features_b))


def absolute_mean_difference(features_a, features_b):  # Σ|Δμ| where ‖Δμ‖² belongs
    a, b, cov_a, cov_b = _parts(features_a, features_b)
    cross = scipy.linalg.sqrtm(cov_a @ cov_b).real
    return float(np.sum(np.abs(a.mean(0) - b.mean(0))) + np.trace(cov_a + cov_b - 2 * cross))


# ---------------------------------------------------------------- planted wrong answers: 17.guided_batch


def two_calls(model, x, t, labels, scale, null_class):  # right values, twice the calls
    cond = model(x, t, labels)
    uncond = model(x, t, np.full_like(labels, null_class))
    return uncond + scale * (cond - uncond)


def halves_swapped(model, x, t, labels, scale, null_class):  # null first, but split as if labels first
    B = x.shape[0]
    both = model(np.concatenate([x, x]), np.concatenate([t, t]),
                 np.concatenate([np.full_like(labels, null_class), labels]))
    cond, uncond = both[:B], both[B:]
    return uncond + scale * (cond - uncond)


def interleaved(model, x, t, labels, scale, null_class):  # repeat, then split in halves
    B = x.shape[0]
    paired = np.stack([labels, np.full_like(labels, null_class)], 1).ravel()  # y0, null, y1, null, ...
    both = model(np.repeat(x, 2, 0), np.repeat(t, 2), paired)
    cond, uncond = both[:B], both[B:]
    return uncond + scale * (cond - uncond)


def null_label_ten(model, x, t, labels, scale, null_class):  # the digits model's null, hard-coded
    return guided_prediction(model, x, t, labels, scale, 10)


def labels_in_both_halves(model, x, t, labels, scale, null_class):  # no "no class" half at all
    B = x.shape[0]
    both = model(np.concatenate([x, x]), np.concatenate([t, t]), np.concatenate([labels, labels]))
    cond, uncond = both[:B], both[B:]
    return uncond + scale * (cond - uncond)


def guides_from_the_conditional(model, x, t, labels, scale, null_class):  # ε_c + w (ε_c − ε_u)
    B = x.shape[0]
    both = model(np.concatenate([x, x]), np.concatenate([t, t]),
                 np.concatenate([labels, np.full_like(labels, null_class)]))
    cond, uncond = both[:B], both[B:]
    return cond + scale * (cond - uncond)


def times_not_doubled(model, x, t, labels, scale, null_class):  # t of shape (B,) in a call of 2B
    B = x.shape[0]
    both = model(np.concatenate([x, x]), t, np.concatenate([labels, np.full_like(labels, null_class)]))
    return both[B:] + scale * (both[:B] - both[B:])


def float_null_labels(model, x, t, labels, scale, null_class):  # np.full(B, 10.0): float labels
    B = x.shape[0]
    both = model(np.concatenate([x, x]), np.concatenate([t, t]),
                 np.concatenate([labels, np.full(B, float(null_class))]))
    return both[B:] + scale * (both[:B] - both[B:])


def returns_the_doubled_batch(model, x, t, labels, scale, null_class):  # (2B, ...) guided twice over
    both = model(np.concatenate([x, x]), np.concatenate([t, t]),
                 np.concatenate([labels, np.full_like(labels, null_class)]))
    return np.concatenate([both, both])[: 2 * x.shape[0]]


def scale_on_the_conditional(model, x, t, labels, scale, null_class):  # w ε_c + (1 − w) ε_u, written as
    B = x.shape[0]                                                    # w · ε_c alone
    both = model(np.concatenate([x, x]), np.concatenate([t, t]),
                 np.concatenate([labels, np.full_like(labels, null_class)]))
    return scale * both[:B]


# (exercise, planted wrong answer, points it keeps, why)
WRONG = [
    ("17.euler_sample", time_goes_up, 0, "integrates from t = 0 up to 1"),
    ("17.euler_sample", adds_the_step, 2, "+dt · v: the step's sign lost"),
    ("17.euler_sample", velocity_at_the_end_of_the_step, 4, "v at the step's end time"),
    ("17.euler_sample", one_step_too_few, 0, "num_steps − 1 steps"),
    ("17.euler_sample", every_step_from_x1, 5, "v of x1 at every step"),
    ("17.euler_sample", float64_times, 0, "float64 times promote x to float64"),
    ("17.euler_sample", times_without_the_end, 3, "num_steps times from 1 to 0: wrong spacing"),
    ("17.euler_sample", batch_of_times, 0, "t as a (B,) array"),
    ("17.euler_sample", midpoint_times, 4, "v at each step's midpoint"),
    ("17.euler_sample", returns_the_trajectory, 0, "returns every x, not the last"),
    ("17.euler_sample", updates_in_place, 2, "updates the caller's noise in place"),
    ("17.ddpm_posterior", variance_is_beta, 2, "σ² = β ('fixed_large'), not β̃"),
    ("17.ddpm_posterior", standard_deviation, 4, "the standard deviation"),
    ("17.ddpm_posterior", alpha_is_alpha_bar, 2, "α taken as ᾱ_t"),
    ("17.ddpm_posterior", roles_swapped, 2, "x0 and x_t swapped"),
    ("17.ddpm_posterior", coefficient_at_alpha_bar_t, 2, "sqrt(ᾱ_t) where sqrt(ᾱ_prev) belongs"),
    ("17.ddpm_posterior", alpha_without_square_root, 4, "α where sqrt(α) belongs"),
    ("17.ddpm_posterior", per_pixel_variance, 2, "the variance as an array"),
    ("17.ddpm_posterior", variance_ratio_inverted, 2, "the variance's ratio inverted"),
    ("17.ddpm_posterior", mean_from_x0_only, 4, "the forward process's mean"),
    ("17.ddpm_posterior", alpha_inverted, 0, "α as ᾱ_prev / ᾱ_t"),
    ("17.frechet", population_covariance, 3, "covariance with ddof=0"),
    ("17.frechet", elementwise_square_root, 0, "np.sqrt of a matrix, elementwise"),
    ("17.frechet", diagonal_only, 3, "features assumed independent"),
    ("17.frechet", distance_not_squared, 0, "d, not d²"),
    ("17.frechet", means_only, 3, "the means only"),
    ("17.frechet", rows_as_variables, 0, "np.cov with rowvar=True"),
    ("17.frechet", keeps_the_complex_value, 9, "a complex value when the covariances are singular"),
    ("17.frechet", no_factor_two, 0, "the cross term without its factor 2"),
    ("17.frechet", float32_features, 5, "float32 throughout"),
    ("17.frechet", returns_a_numpy_array, 0, "a NumPy array, not a float"),
    ("17.frechet", absolute_mean_difference, 1, "Σ|Δμ|, not ‖Δμ‖²"),
    ("17.guided_batch", two_calls, 4, "two calls of batch B"),
    ("17.guided_batch", halves_swapped, 2, "the halves swapped"),
    ("17.guided_batch", interleaved, 2, "the doubled batch interleaved"),
    ("17.guided_batch", null_label_ten, 8, "null_class hard-coded to 10"),
    ("17.guided_batch", labels_in_both_halves, 2, "the labels in both halves"),
    ("17.guided_batch", guides_from_the_conditional, 5, "extrapolates from ε_c"),
    ("17.guided_batch", times_not_doubled, 0, "t not doubled"),
    ("17.guided_batch", float_null_labels, 0, "float null labels"),
    ("17.guided_batch", returns_the_doubled_batch, 5, "returns the doubled batch"),
    ("17.guided_batch", scale_on_the_conditional, 5, "w · ε_c"),
]


@pytest.mark.parametrize("exercise_id, answer, points, why", WRONG, ids=[w[3] for w in WRONG])
def test_a_planted_wrong_answer_loses_points(exercise_id, answer, points, why):
    result = grade(exercise_id, answer)
    assert result.points == points, [(c.name, c.status, c.message) for c in result.cases]
    assert result.points < result.max_points

