"""Chapter 17's exercise cases: right answers score full marks, planted wrong ones lose points."""

import numpy as np
import pytest

from stacklib.grading import grade


def alpha_bar(betas):
    return np.cumprod(1.0 - np.asarray(betas, np.float64))


def q_sample(x0, noise, alpha_bar_t):
    b = np.asarray(alpha_bar_t).reshape((-1,) + (1,) * (np.ndim(x0) - 1))
    return np.sqrt(b) * x0 + np.sqrt(1.0 - b) * noise


def ddim_step(x_t, eps, alpha_bar_t, alpha_bar_prev):
    x0 = (x_t - np.sqrt(1.0 - alpha_bar_t) * eps) / np.sqrt(alpha_bar_t)
    return np.sqrt(alpha_bar_prev) * x0 + np.sqrt(1.0 - alpha_bar_prev) * eps


def classifier_free_guidance(pred_cond, pred_uncond, scale):
    return pred_uncond + scale * (pred_cond - pred_uncond)


RIGHT = {"17.alpha_bar": alpha_bar, "17.q_sample": q_sample, "17.ddim_step": ddim_step,
         "17.guidance": classifier_free_guidance}


@pytest.mark.parametrize("exercise_id", sorted(RIGHT))
def test_a_right_answer_scores_full_marks(exercise_id):
    result = grade(exercise_id, RIGHT[exercise_id])
    assert result.points == result.max_points, [c.message for c in result.cases]


# Planted wrong answers.

def product_of_betas(betas):  # the noise that accumulates, not the signal
    return np.cumprod(betas)


def starts_at_one(betas):  # shifted by one step: ᾱ_{t-1}
    return np.concatenate([[1.0], np.cumprod(1.0 - np.asarray(betas))[:-1]])


def float32_product(betas):  # right, in float32: 1000 roundings stay within the tolerance
    return np.cumprod(1.0 - np.asarray(betas, np.float32))


def sum_not_product(betas):
    return 1.0 - np.cumsum(betas)


def no_square_roots(x0, noise, alpha_bar_t):  # mixes variances where scales belong
    b = np.asarray(alpha_bar_t).reshape((-1,) + (1,) * (np.ndim(x0) - 1))
    return b * x0 + (1.0 - b) * noise


def flat_broadcast(x0, noise, alpha_bar_t):  # (B,) against (B, H, W, C) broadcasts over the last axis
    b = np.asarray(alpha_bar_t)[:, None]
    return np.sqrt(b) * x0 + np.sqrt(1.0 - b) * noise


def swapped_roles(x0, noise, alpha_bar_t):
    return q_sample(noise, x0, alpha_bar_t)


def direction_at_alpha_bar_t(x_t, eps, alpha_bar_t, alpha_bar_prev):
    x0 = (x_t - np.sqrt(1.0 - alpha_bar_t) * eps) / np.sqrt(alpha_bar_t)
    return np.sqrt(alpha_bar_prev) * x0 + np.sqrt(1.0 - alpha_bar_t) * eps


def forgets_to_divide(x_t, eps, alpha_bar_t, alpha_bar_prev):  # x̂0 without / sqrt(ᾱ_t)
    x0 = x_t - np.sqrt(1.0 - alpha_bar_t) * eps
    return np.sqrt(alpha_bar_prev) * x0 + np.sqrt(1.0 - alpha_bar_prev) * eps


def clips_x0(x_t, eps, alpha_bar_t, alpha_bar_prev):  # the library's option, not the plain equation
    x0 = np.clip((x_t - np.sqrt(1.0 - alpha_bar_t) * eps) / np.sqrt(alpha_bar_t), -1, 1)
    return np.sqrt(alpha_bar_prev) * x0 + np.sqrt(1.0 - alpha_bar_prev) * eps


def returns_x0(x_t, eps, alpha_bar_t, alpha_bar_prev):  # jumps straight to the end
    return (x_t - np.sqrt(1.0 - alpha_bar_t) * eps) / np.sqrt(alpha_bar_t)


def guides_from_the_conditional(pred_cond, pred_uncond, scale):  # one scale too far
    return pred_cond + scale * (pred_cond - pred_uncond)


def scales_the_conditional(pred_cond, pred_uncond, scale):
    return scale * pred_cond


def averages(pred_cond, pred_uncond, scale):
    return (pred_cond + pred_uncond) / 2


WRONG = [
    ("17.alpha_bar", product_of_betas, 0, "the product of β, not of 1 − β"),
    ("17.alpha_bar", starts_at_one, 0, "shifted: ᾱ_{t−1}"),
    ("17.alpha_bar", sum_not_product, 1, "1 − Σβ: a first-order guess (right for one step)"),
    ("17.q_sample", no_square_roots, 2, "variances for scales (right only at the ends)"),
    ("17.q_sample", flat_broadcast, 4, "(B,) broadcast over the channel axis"),
    ("17.q_sample", swapped_roles, 0, "x0 and ε swapped"),
    ("17.ddim_step", direction_at_alpha_bar_t, 0, "the direction term at ᾱ_t"),
    ("17.ddim_step", forgets_to_divide, 0, "x̂0 not divided by sqrt(ᾱ_t)"),
    ("17.ddim_step", clips_x0, 0, "x̂0 clipped (noise makes x̂0 leave [−1, 1] in every case)"),
    ("17.ddim_step", returns_x0, 2, "returns x̂0 at every step"),
    ("17.guidance", guides_from_the_conditional, 0, "extrapolates from ε_c"),
    ("17.guidance", scales_the_conditional, 0, "w · ε_c"),
    ("17.guidance", averages, 0, "the mean of the two"),
]


@pytest.mark.parametrize("exercise_id, answer, points, why", WRONG, ids=[w[3] for w in WRONG])
def test_a_planted_wrong_answer_loses_points(exercise_id, answer, points, why):
    result = grade(exercise_id, answer)
    assert result.points == points, [(c.name, c.status, c.message) for c in result.cases]
    assert result.points < result.max_points


def test_float32_is_accurate_enough_for_alpha_bar():
    result = grade("17.alpha_bar", float32_product)
    assert result.points == result.max_points, [c.message for c in result.cases]
