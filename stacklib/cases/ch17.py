"""Chapter 17 exercises: a whole Euler sampling loop, the DDPM posterior, the Fréchet distance, and
classifier-free guidance in one doubled batch.

Expected answers come from `stacklib.diffusion`'s own pieces (`schedules.flow_timesteps`,
`samplers.euler_step`, `samplers.guide`, `metrics.frechet_distance`, whose parity tests compare them
with the papers' equations) or from the closed form of Ho et al. eq. 7, written here in float64. The
learner's function gets copies of its inputs (`call_on_copies`). The "networks" are small NumPy
functions whose behaviour is known, so that a case can say what a loop did wrong: velocities whose
exact flow is known, and a model that records each call it receives.

A failed case names the first thing that differs (a call, a position, a shape or a dtype), never the
whole expected array.
"""

import functools

import numpy as np

from stacklib.diffusion import metrics, samplers, schedules
from stacklib.grading import Exercise, call_on_copies, expect, expect_close


def _rng(seed):
    return np.random.default_rng(seed)


def _first_difference(got, expected, what: str, *, rtol: float = 1e-6, atol: float = 1e-6) -> None:
    """Fail at the first position where two sequences differ, showing only that position."""
    got, expected = np.asarray(got, np.float64).ravel(), np.asarray(expected, np.float64).ravel()
    expect(got.size == expected.size, f"{what}: expected {expected.size} values, got {got.size}")
    differ = np.flatnonzero(~np.isclose(got, expected, rtol=rtol, atol=atol))
    if differ.size:
        i = int(differ[0])
        expect(False, f"{what}: the first difference is at position {i} of {expected.size}: "
                      f"expected {expected[i]:.6g}, got {got[i]:.6g}")


def _expect_array_like(got, shape, dtype, what: str) -> np.ndarray:
    """The answer as a NumPy array, after checking its shape and dtype (named in the statement)."""
    expect(hasattr(got, "shape") and hasattr(got, "dtype"),
           f"{what}: expected an array, got {type(got).__name__}")
    expect(tuple(got.shape) == tuple(shape), f"{what}: expected shape {tuple(shape)}, got {tuple(got.shape)}")
    expect(np.dtype(got.dtype) == np.dtype(dtype),
           f"{what}: expected dtype {np.dtype(dtype)}, got {np.dtype(got.dtype)} (a float64 scalar such as "
           "np.linspace's values promotes a float32 array: keep the times float32, or cast the result)")
    return np.asarray(got)


# ---------------------------------------------------------------- 17.euler_sample

euler_sample = Exercise("17.euler_sample", "A whole Euler sampling loop of a flow model, from t = 1 to 0")


class _RecordedVelocity:
    """A velocity v(x, t) that records the times it was called at (as floats)."""

    def __init__(self, v):
        self.v, self.times = v, []

    def __call__(self, x, t):
        expect(np.ndim(t) == 0, f"the velocity takes t as one number; it was called with shape {np.shape(t)}")
        self.times.append(float(t))
        return self.v(np.asarray(x), float(t))


def _euler_expected(v, x1, num_steps):
    """The library's loop: the times of schedules.flow_timesteps, one Euler step per interval."""
    times = schedules.flow_timesteps(num_steps)
    x = np.asarray(x1)
    for t, t_next in zip(times[:-1], times[1:], strict=True):
        x = x + (t_next - t) * v(x, float(t))  # samplers.euler_step, in NumPy (no dispatch per step)
    return x


def _run_euler(fn, v, x1, num_steps):
    recorded = _RecordedVelocity(v)
    # The velocity is handed over as it is (a copy would record elsewhere); the noise as a copy.
    got = call_on_copies(functools.partial(fn, recorded), x1, num_steps, what="euler_sample")
    got = _expect_array_like(got, x1.shape, np.float32, f"euler_sample(..., num_steps={num_steps})")
    return got, recorded.times


def _towards(target):
    """The exact velocity of the straight paths into one image `target`: (x_t − target) / t.

    Every path x_t = (1 − t) target + t ε is a straight line, so Euler lands on `target` exactly
    for any step count (up to float32 rounding); evaluating at t = 0 divides by zero.
    """
    return lambda x, t: ((x - target) / np.float32(t)).astype(np.float32)


@euler_sample.case(points=2, hint="Call the velocity once per step, at the time the step starts, going down "
                                  "from 1: the first call is at t = 1, and t = 0 (the end) is never a start.")
def the_velocity_is_called_at_each_steps_start(fn):
    x1 = _rng(0).standard_normal((2, 8, 8, 1)).astype(np.float32)
    _, times = _run_euler(fn, lambda x, t: np.zeros_like(x), x1, 4)
    expect(len(times) == 4, f"with num_steps=4 the velocity is called 4 times (one network call per step); "
                            f"it was called {len(times)} times")
    _first_difference(times, schedules.flow_timesteps(4)[:-1], "the times of the velocity calls, in order")


@euler_sample.case(points=2, hint="The step moves x by (t_next − t) · v: t goes down, so the step is "
                                  "negative; a velocity of +1 everywhere lowers x by 1 over the whole loop.")
def a_constant_velocity_moves_x_by_minus_v(fn):
    x1 = _rng(1).standard_normal((3, 8, 8, 1)).astype(np.float32)
    got, _ = _run_euler(fn, lambda x, t: np.ones_like(x), x1, 5)
    expect_close(got, x1 - 1.0, rtol=1e-5, atol=1e-5, what="x after 5 steps of v = 1")


@euler_sample.case(points=2, hint="Each step starts from the x of the previous step, not from x1; and the "
                                  "number of steps is num_steps.")
def each_step_starts_where_the_last_one_ended(fn):
    x1 = _rng(2).standard_normal((2, 8, 8, 1)).astype(np.float32)
    v = lambda x, t: x  # noqa: E731  dx/dt = x: Euler multiplies by (1 − 1/n) per step
    got, _ = _run_euler(fn, v, x1, 8)
    expect_close(got, _euler_expected(v, x1, 8), rtol=1e-5, atol=1e-6, what="x after 8 steps of v = x")


@euler_sample.case(points=2, hint="Evaluate the velocity at the start of each step (the Euler rule), not at "
                                  "its end: at t = 0 this velocity divides by zero.")
def the_exact_velocity_of_one_image_lands_on_it(fn):
    target = _rng(3).uniform(-1, 1, (4, 8, 8, 1)).astype(np.float32)
    x1 = _rng(4).standard_normal((4, 8, 8, 1)).astype(np.float32)
    got, _ = _run_euler(fn, _towards(target), x1, 10)
    expect_close(got, target, rtol=1e-4, atol=1e-4, what="x at t = 0 under the exact velocity into one image")


@euler_sample.case(points=2, hint="The velocity depends on t: pass each step's own start time, and step by "
                                  "the interval between consecutive times (1 / num_steps).")
def a_time_dependent_velocity(fn):
    x1 = _rng(5).standard_normal((16, 8, 8, 1)).astype(np.float32)
    direction = _rng(6).standard_normal((16, 8, 8, 1)).astype(np.float32)
    v = lambda x, t: (np.float32(t) * direction + 0.5 * x).astype(np.float32)  # noqa: E731
    got, _ = _run_euler(fn, v, x1, 20)
    expect_close(got, _euler_expected(v, x1, 20), rtol=1e-4, atol=1e-5,
                 what="x after 20 steps of v = t · d + x / 2 (the chapter's step count)")


@euler_sample.case(points=1, hint="num_steps = 1 is one step from t = 1 straight to t = 0.")
def one_step_goes_from_noise_to_data_at_once(fn):
    x1 = _rng(7).standard_normal((2, 8, 8, 1)).astype(np.float32)
    v = lambda x, t: (x * np.float32(t) - 0.25).astype(np.float32)  # noqa: E731
    got, times = _run_euler(fn, v, x1, 1)
    expect(len(times) == 1, f"num_steps=1 calls the velocity once; it was called {len(times)} times")
    expect_close(got, x1 - (x1 - 0.25), rtol=1e-5, atol=1e-6, what="x after one step")


# ---------------------------------------------------------------- 17.ddpm_posterior

ddpm_posterior = Exercise("17.ddpm_posterior", "The mean and variance of the posterior q(x_prev | x_t, x0)")


def _posterior(x0, x_t, abar_t, abar_prev):
    """Ho et al. eq. 7 for a step from ᾱ_t to ᾱ_prev: α = ᾱ_t / ᾱ_prev, β = 1 − α (as samplers.ddpm_step)."""
    alpha = abar_t / abar_prev
    beta = 1.0 - alpha
    mean = (np.sqrt(abar_prev) * beta / (1.0 - abar_t)) * x0 \
        + (np.sqrt(alpha) * (1.0 - abar_prev) / (1.0 - abar_t)) * x_t
    return mean, (1.0 - abar_prev) / (1.0 - abar_t) * beta


_ABAR = np.cumprod(1.0 - np.linspace(1e-4, 0.02, 1000))  # the linear schedule of Ho et al., float64


def _check_posterior(fn, abar_t, abar_prev, seed, *, check_mean=True, check_variance=True):
    x0 = _rng(seed).uniform(-1, 1, (4, 8, 8, 1))
    x_t = _rng(seed + 1).standard_normal((4, 8, 8, 1))
    got = call_on_copies(fn, x0, x_t, abar_t, abar_prev, what="ddpm_posterior")
    expect(isinstance(got, tuple) and len(got) == 2, f"return (mean, variance), got {type(got).__name__}")
    mean, variance = got
    expected_mean, expected_variance = _posterior(x0, x_t, abar_t, abar_prev)
    where = f"ᾱ_t={abar_t:.4g}, ᾱ_prev={abar_prev:.4g}"
    if check_mean:
        expect(np.shape(mean) == x_t.shape, f"the mean has x_t's shape {x_t.shape}; got {np.shape(mean)}")
        expect_close(mean, expected_mean, rtol=1e-6, atol=1e-9, what=f"the posterior mean ({where})")
    if check_variance:
        expect(np.ndim(variance) == 0, "the variance is one number for the whole batch (every pixel of every "
                                       f"example has the same); got shape {np.shape(variance)}")
        expect_close(float(variance), expected_variance, rtol=1e-6, atol=1e-12,
                     what=f"the posterior variance ({where})")


@ddpm_posterior.case(points=2, hint="The mean mixes x0 and x_t; each weight has 1 − ᾱ_t below it. Check that "
                                    "the two weights sum to about 1 when the step is small.")
def the_mean_of_one_step_of_the_linear_schedule(fn):
    _check_posterior(fn, _ABAR[500], _ABAR[499], seed=0, check_variance=False)


@ddpm_posterior.case(points=2, hint="The variance is β̃ = (1 − ᾱ_prev) / (1 − ᾱ_t) · β, smaller than β "
                                    "itself: it is the spread left once x0 is known, not the noise added.")
def the_variance_of_one_step_is_beta_tilde_not_beta(fn):
    _check_posterior(fn, _ABAR[500], _ABAR[499], seed=2, check_mean=False)


@ddpm_posterior.case(points=3, hint="A sampler of 10 steps jumps 100 training steps at once: the step's α is "
                                    "ᾱ_t / ᾱ_prev (what is left of the signal between the two levels), not "
                                    "1 − ᾱ_t nor ᾱ_t.")
def a_step_that_skips_a_hundred_training_steps(fn):
    _check_posterior(fn, _ABAR[600], _ABAR[500], seed=4)


@ddpm_posterior.case(points=2, hint="At the last step ᾱ_prev = 1: the posterior is x0 itself, with no "
                                    "spread left (variance 0).")
def the_last_step_returns_x0_with_no_variance(fn):
    _check_posterior(fn, _ABAR[99], 1.0, seed=6)


@ddpm_posterior.case(points=2, hint="Return the variance, not the standard deviation: the sampler adds "
                                    "sqrt(variance) · z itself.")
def a_step_from_almost_pure_noise(fn):
    _check_posterior(fn, _ABAR[999], _ABAR[899], seed=8)


# ---------------------------------------------------------------- 17.frechet

frechet = Exercise("17.frechet", "The Fréchet distance between two sets of features")


def _check_frechet(fn, a, b, what, rtol=1e-6):
    expected = metrics.frechet_distance(a, b)
    got = call_on_copies(fn, a, b, what="frechet_distance")
    expect(isinstance(got, float), f"return a Python float (float(...)), got {type(got).__name__}"
                                   + (": the result has an imaginary part; the distance is real, so keep the "
                                      "real part of a matrix square root" if np.iscomplexobj(got) else ""))
    expect_close(got, expected, rtol=rtol, atol=1e-9 * max(1.0, abs(expected)), what=what)


def _features(seed, n, f, scale=1.0, shift=0.0):
    return _rng(seed).standard_normal((n, f)) * scale + shift


@frechet.case(points=1, hint="A set is at distance 0 from itself: every term cancels.")
def a_set_is_at_distance_zero_from_itself(fn):
    a = _features(0, 200, 16)
    got = call_on_copies(fn, a, a.copy(), what="frechet_distance")
    expect(isinstance(got, float), f"return a Python float, got {type(got).__name__}")
    expect(abs(got) < 1e-8, f"d²(a, a) should be 0, got {got:.3g}")


@frechet.case(points=2, hint="Moving every feature vector by the same amount moves only the means: the first "
                             "term is the squared length of the difference of the means (a squared distance, "
                             "not its square root).")
def a_shift_adds_the_squared_distance_of_the_means(fn):
    a = _features(1, 300, 8)
    _check_frechet(fn, a, a + np.arange(8) / 4, "d² between a set and the same set shifted")


@frechet.case(points=2, hint="The covariance is F × F, over the features (columns), with np.cov's "
                             "default N − 1 normalisation; each set's own number of rows.")
def sets_of_different_sizes(fn):
    _check_frechet(fn, _features(2, 250, 12), _features(3, 180, 12, scale=1.3, shift=0.2),
                   "d² between sets of 250 and 180 rows")


@frechet.case(points=2, hint="The cross term needs the square root of a matrix (of Σ_a Σ_b, or "
                             "Σ_a^{1/2} Σ_b Σ_a^{1/2}), not the square root of each element, nor of the "
                             "diagonal alone: here the features are correlated.")
def correlated_features_need_a_matrix_square_root(fn):
    mix_a, mix_b = _rng(4).standard_normal((10, 10)), _rng(5).standard_normal((10, 10))
    a, b = _features(6, 400, 10) @ mix_a, _features(7, 400, 10) @ mix_b
    _check_frechet(fn, a, b, "d² between two sets of correlated features")


@frechet.case(points=2, hint="Compute in float64 NumPy: d² is a difference of large terms, and float32 "
                             "(or jax.numpy's default) loses the small distances the metric compares.")
def the_chapters_size_of_64_features(fn):
    a = _features(8, 300, 64)
    b = a[_rng(9).permutation(300)][:280] * 1.01 + 0.01  # nearly the same set: a small distance
    _check_frechet(fn, a, b, "d² between two similar sets of 64 features")


@frechet.case(points=2, hint="With fewer rows than features the covariances are singular: a matrix square "
                             "root may come back complex with tiny imaginary parts; the distance is its "
                             "real part.")
def fewer_examples_than_features(fn):
    _check_frechet(fn, _features(10, 40, 64), _features(11, 50, 64, scale=1.1, shift=0.1),
                   "d² between sets of 40 and 50 rows of 64 features", rtol=1e-5)


# ---------------------------------------------------------------- 17.guided_batch

guided_batch = Exercise("17.guided_batch", "Classifier-free guidance in one call on a doubled batch")


class _RecordingModel:
    """A stand-in network: out = x · (1 + y / 4) + t, per example; records every call it gets."""

    def __init__(self):
        self.calls = []

    def __call__(self, x, t, y):
        x, t, y = np.asarray(x), np.asarray(t), np.asarray(y)
        expect(x.ndim == 4 and t.shape == x.shape[:1] and y.shape == x.shape[:1],
               f"the model takes x (N, H, W, C), t (N,) and y (N,); it was called with shapes {x.shape}, "
               f"{t.shape} and {y.shape}")
        expect(np.issubdtype(y.dtype, np.integer), f"the labels are integers; the model got dtype {y.dtype}")
        self.calls.append((x.copy(), t.copy(), y.copy()))
        return (x * (1.0 + y[:, None, None, None] / 4.0) + t[:, None, None, None]).astype(np.float32)


def _guided_inputs(seed, batch):
    x = _rng(seed).standard_normal((batch, 8, 8, 1)).astype(np.float32)
    t = _rng(seed + 1).uniform(0, 1, batch).astype(np.float32)
    labels = _rng(seed + 2).integers(0, 10, batch).astype(np.int32)
    return x, t, labels


def _run_guided(fn, seed, batch, scale, null_class=10):
    x, t, labels = _guided_inputs(seed, batch)
    model = _RecordingModel()
    got = call_on_copies(functools.partial(fn, model), x, t, labels, scale, null_class,
                         what="guided_prediction")
    return got, model, (x, t, labels)


def _one_doubled_call(model, batch):
    expect(len(model.calls) == 1, f"the model was called {len(model.calls)} times: make one call on the "
                                  "doubled batch (one pass over 2B examples keeps the accelerator busier "
                                  "than two over B)")
    x, _, _ = model.calls[0]
    expect(x.shape[0] == 2 * batch, f"the one call has batch 2B = {2 * batch}, got {x.shape[0]}")
    return model.calls[0]


@guided_batch.case(points=2, hint="Concatenate x with itself, t with itself, and the labels with as many "
                                  "null labels, then call the model once.")
def the_model_is_called_once_on_twice_the_batch(fn):
    _, model, _ = _run_guided(fn, seed=0, batch=6, scale=2.0)
    _one_doubled_call(model, 6)


@guided_batch.case(points=2, hint="The first half of the doubled batch carries the labels, the second half "
                                  "null_class (the label the model learned 'no class' under), with the same "
                                  "x and t in both halves.")
def the_halves_carry_the_labels_then_the_null_class(fn):
    _, model, (x, t, labels) = _run_guided(fn, seed=3, batch=16, scale=2.0, null_class=10)
    xx, tt, yy = _one_doubled_call(model, 16)
    _first_difference(yy, np.concatenate([labels, np.full(16, 10)]), "the labels of the doubled batch")
    _first_difference(tt, np.concatenate([t, t]), "the times of the doubled batch")
    _first_difference(xx, np.concatenate([x, x]), "the images of the doubled batch")


@guided_batch.case(points=1, hint="Use the null_class you are given: a model with 7 classes learned 'no "
                                  "class' as label 7.")
def the_null_class_is_the_one_given(fn):
    _, model, (_, _, labels) = _run_guided(fn, seed=6, batch=4, scale=2.0, null_class=7)
    _, _, yy = _one_doubled_call(model, 4)
    _first_difference(yy[4:], np.full(4, 7), "the labels of the second half")


def _check_guided_value(fn, seed, batch, scale):
    got, model, (x, t, labels) = _run_guided(fn, seed=seed, batch=batch, scale=scale)
    both = _RecordingModel()(np.concatenate([x, x]), np.concatenate([t, t]),
                             np.concatenate([labels, np.full(batch, 10)]))
    expected = np.asarray(samplers.guide(both[:batch], both[batch:], scale))
    expect(np.shape(got) == x.shape, f"the guided prediction has x's shape {x.shape}; got {np.shape(got)}")
    expect_close(got, expected, rtol=1e-5, atol=1e-5, what=f"the guided prediction at scale {scale}")


@guided_batch.case(points=2, hint="Split the output back into its halves (conditional first), then move from "
                                  "the unconditional prediction w times the difference towards the "
                                  "conditional one.")
def scale_three_extrapolates_past_the_conditional(fn):
    _check_guided_value(fn, seed=9, batch=8, scale=3.0)


@guided_batch.case(points=2, hint="Scale 1 is the conditional prediction, scale 0 the unconditional one: "
                                  "check which half is which.")
def scales_one_and_zero_are_the_two_halves(fn):
    """At scale 1 an answer that calls the model once on the batch alone (the library's shortcut for an
    unguided sampler) is right, and accepted on purpose; the call structure is checked at scale 2."""
    _check_guided_value(fn, seed=12, batch=5, scale=1.0)
    _check_guided_value(fn, seed=15, batch=5, scale=0.0)
