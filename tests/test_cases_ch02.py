"""Chapter 02's exercise cases: right answers score full marks, planted wrong ones lose points."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stacklib.nn as nnx
from stacklib.grading import grade


class Linear(nnx.Module):
    def __init__(self, in_features, out_features, *, rngs):
        init = jax.nn.initializers.lecun_normal()
        self.kernel = nnx.Param(init(rngs.params(), (in_features, out_features), jnp.float32))
        rngs.params()  # Flax draws the bias's key too
        self.bias = nnx.Param(jnp.zeros((out_features,), jnp.float32))

    def __call__(self, x):
        return x @ self.kernel[...] + self.bias[...]


def dropout(x, rate, rngs, deterministic=False):
    if deterministic or rate == 0.0:
        return x
    if rate == 1.0:
        return jnp.zeros_like(x)
    keep = jax.random.bernoulli(rngs.dropout(), 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0.0)


def functional_call(graphdef, state, x):
    model = nnx.merge(graphdef, state, copy=True)
    return model(x), nnx.state(model)


def rms_norm(x, scale, epsilon=1e-6):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32**2, axis=-1, keepdims=True) + epsilon) * scale
    return y.astype(x.dtype)


RIGHT = {
    "02.linear": Linear,
    "02.dropout": dropout,
    "02.functional_call": functional_call,
    "02.rms_norm": rms_norm,
}


@pytest.mark.parametrize("exercise_id", sorted(RIGHT))
def test_a_right_answer_scores_full_marks(exercise_id):
    result = grade(exercise_id, RIGHT[exercise_id])
    assert result.points == result.max_points, [(c.name, c.message) for c in result.cases]



# Planted wrong answers.

class NoBiasKey(Linear):
    def __init__(self, in_features, out_features, *, rngs):
        init = jax.nn.initializers.lecun_normal()
        self.kernel = nnx.Param(init(rngs.params(), (in_features, out_features), jnp.float32))
        self.bias = nnx.Param(jnp.zeros((out_features,), jnp.float32))


class NormalInit(Linear):
    def __init__(self, in_features, out_features, *, rngs):
        self.kernel = nnx.Param(jax.random.normal(rngs.params(), (in_features, out_features)))
        rngs.params()
        self.bias = nnx.Param(jnp.zeros((out_features,)))


class Transposed(Linear):
    def __init__(self, in_features, out_features, *, rngs):
        init = jax.nn.initializers.lecun_normal()
        self.kernel = nnx.Param(init(rngs.params(), (out_features, in_features), jnp.float32))
        rngs.params()
        self.bias = nnx.Param(jnp.zeros((out_features,), jnp.float32))

    def __call__(self, x):
        return x @ self.kernel[...].T + self.bias[...]


class BareArrays(Linear):
    def __init__(self, in_features, out_features, *, rngs):
        init = jax.nn.initializers.lecun_normal()
        object.__setattr__(self, "kernel", init(rngs.params(), (in_features, out_features), jnp.float32))
        rngs.params()
        object.__setattr__(self, "bias", jnp.zeros((out_features,)))

    def __call__(self, x):
        return x @ self.kernel + self.bias


class RandomBias(Linear):
    def __init__(self, in_features, out_features, *, rngs):
        init = jax.nn.initializers.lecun_normal()
        self.kernel = nnx.Param(init(rngs.params(), (in_features, out_features), jnp.float32))
        self.bias = nnx.Param(jax.random.normal(rngs.params(), (out_features,)) * 0.01)  # "uses" its key


class NoBias(Linear):
    def __call__(self, x):
        return x @ self.kernel[...]


class BatchOfVectorsOnly(Linear):
    def __call__(self, x):
        return jnp.einsum("bi,io->bo", x, self.kernel[...]) + self.bias[...]  # fails on (2, 5, 4)


class BiasKeyFirst(Linear):
    def __init__(self, in_features, out_features, *, rngs):
        rngs.params()  # the right number of keys, in the wrong order
        init = jax.nn.initializers.lecun_normal()
        self.kernel = nnx.Param(init(rngs.params(), (in_features, out_features), jnp.float32))
        self.bias = nnx.Param(jnp.zeros((out_features,), jnp.float32))


class UnscaledTruncatedNormal(Linear):
    def __init__(self, in_features, out_features, *, rngs):
        # lecun_normal's truncated normal is rescaled to variance 1 / in_features; this one is not
        kernel = jax.random.truncated_normal(rngs.params(), -2.0, 2.0, (in_features, out_features))
        self.kernel = nnx.Param(kernel / jnp.sqrt(in_features))
        rngs.params()
        self.bias = nnx.Param(jnp.zeros((out_features,), jnp.float32))


class GlorotInit(Linear):
    def __init__(self, in_features, out_features, *, rngs):
        init = jax.nn.initializers.glorot_normal()
        self.kernel = nnx.Param(init(rngs.params(), (in_features, out_features), jnp.float32))
        rngs.params()
        self.bias = nnx.Param(jnp.zeros((out_features,), jnp.float32))


class Bfloat16Weights(Linear):
    def __init__(self, in_features, out_features, *, rngs):
        init = jax.nn.initializers.lecun_normal()
        self.kernel = nnx.Param(init(rngs.params(), (in_features, out_features), jnp.bfloat16))
        rngs.params()
        self.bias = nnx.Param(jnp.zeros((out_features,), jnp.bfloat16))


def _dropout_with(mask_and_scale):
    """Dropout as the exercise describes it, with the mask-and-rescale step replaced."""

    def dropout_fn(x, rate, rngs, deterministic=False):
        if deterministic:
            return x
        return mask_and_scale(x, rate, rngs.dropout())

    return dropout_fn


# x * mask / (1 - rate): right for 0 < rate < 1, NaN (0 / 0) at rate 1, and draws keys at rates 0 and 1
multiplying_by_the_mask = _dropout_with(
    lambda x, rate, key: x * jax.random.bernoulli(key, 1.0 - rate, x.shape) / (1.0 - rate))
uniform_above_rate = _dropout_with(  # keeps 1 - rate of the elements, but not nnx.Dropout's ones
    lambda x, rate, key: jnp.where(jax.random.uniform(key, x.shape) > rate, x / (1.0 - rate), 0.0))
scaling_by_the_keep_rate = _dropout_with(
    lambda x, rate, key: jnp.where(jax.random.bernoulli(key, 1.0 - rate, x.shape), x * (1.0 - rate), 0.0))
one_mask_for_the_whole_array = _dropout_with(
    lambda x, rate, key: jnp.where(jax.random.bernoulli(key, 1.0 - rate), x / (1.0 - rate), 0.0))
splitting_the_key_first = _dropout_with(
    lambda x, rate, key: jnp.where(jax.random.bernoulli(jax.random.split(key)[0], 1.0 - rate, x.shape),
                                   x / (1.0 - rate), 0.0))


def drawing_a_key_at_rate_0_and_1(x, rate, rngs, deterministic=False):
    if deterministic:
        return x
    keep = jax.random.bernoulli(rngs.dropout(), 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0.0)  # zeros at rate 1, but a key was drawn


def unscaled_dropout(x, rate, rngs, deterministic=False):
    if deterministic:
        return x
    return jnp.where(jax.random.bernoulli(rngs.dropout(), 1.0 - rate, x.shape), x, 0.0)


def fixed_key_dropout(x, rate, rngs, deterministic=False):
    if deterministic:
        return x
    keep = jax.random.bernoulli(jax.random.key(0), 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0.0)


def keeps_with_probability_rate(x, rate, rngs, deterministic=False):
    if deterministic:
        return x
    keep = jax.random.bernoulli(rngs.dropout(), rate, x.shape)  # True must mean keep: p = 1 - rate
    return jnp.where(keep, x / (1.0 - rate), 0.0)


def key_before_deterministic(x, rate, rngs, deterministic=False):
    key = rngs.dropout()  # drawn even when it is not used
    if deterministic:
        return x
    return jnp.where(jax.random.bernoulli(key, 1.0 - rate, x.shape), x / (1.0 - rate), 0.0)


def sharing_functional_call(graphdef, state, x):
    model = nnx.merge(graphdef, state)
    return model(x), nnx.state(model)


def stale_state_functional_call(graphdef, state, x):
    return nnx.merge(graphdef, state, copy=True)(x), state


def returns_the_model(graphdef, state, x):
    model = nnx.merge(graphdef, state, copy=True)
    return model(x), model  # a module is not a state: it cannot leave a jitted function


def returns_only_y(graphdef, state, x):
    return nnx.merge(graphdef, state, copy=True)(x)


def returns_only_the_params(graphdef, state, x):
    model = nnx.merge(graphdef, state, copy=True)
    return model(x), nnx.state(model, nnx.Param)  # the dropout counter is left out


def calls_the_model_twice(graphdef, state, x):
    model = nnx.merge(graphdef, state, copy=True)
    model(x)  # e.g. to look at the output first: the counter advances twice
    return model(x), nnx.state(model)


def returns_split(graphdef, state, x):
    model = nnx.merge(graphdef, state, copy=True)
    return model(x), nnx.split(model)  # (graphdef, state), not the state


def layer_norm_instead(x, scale, epsilon=1e-6):
    x32 = x.astype(jnp.float32)
    centered = x32 - x32.mean(-1, keepdims=True)
    y = centered * jax.lax.rsqrt(jnp.mean(centered**2, -1, keepdims=True) + epsilon) * scale
    return y.astype(x.dtype)


def epsilon_outside(x, scale, epsilon=1e-6):
    x32 = x.astype(jnp.float32)
    return (x32 / (jnp.sqrt(jnp.mean(x32**2, -1, keepdims=True)) + epsilon) * scale).astype(x.dtype)


def other_default_epsilon(x, scale, epsilon=1e-5):
    return rms_norm(x, scale, epsilon)


def mean_over_every_axis(x, scale, epsilon=1e-6):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32**2) + epsilon) * scale).astype(x.dtype)


def bfloat16_statistics(x, scale, epsilon=1e-6):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) / x.shape[-1] + epsilon) * scale


def float32_output(x, scale, epsilon=1e-6):
    return rms_norm(x, scale, epsilon).astype(jnp.float32)


def forgets_the_scale(x, scale, epsilon=1e-6):
    return rms_norm(x, jnp.ones_like(scale), epsilon)


def scale_after_the_cast(x, scale, epsilon=1e-6):
    return rms_norm(x, jnp.ones_like(scale), epsilon) * scale  # bfloat16 * float32 is float32


def scale_dtype_output(x, scale, epsilon=1e-6):
    return rms_norm(x, scale, epsilon).astype(scale.dtype)


def divides_by_the_standard_deviation(x, scale, epsilon=1e-6):
    x32 = x.astype(jnp.float32)
    return (x32 / (jnp.std(x32, -1, keepdims=True) + epsilon) * scale).astype(x.dtype)


def normalising_factor_in_bfloat16(x, scale, epsilon=1e-6):
    x32 = x.astype(jnp.float32)
    factor = jax.lax.rsqrt(jnp.mean(x32**2, axis=-1, keepdims=True) + epsilon).astype(x.dtype)
    return x * factor * scale


# (exercise, planted wrong answer, points it should still get, why)
# Fresh wrong answers a learner writes (issue 38).


class VariableNotParam(Linear):
    def __init__(self, in_features, out_features, *, rngs):
        super().__init__(in_features, out_features, rngs=rngs)
        self.kernel = nnx.Variable(self.kernel[...])  # not a Param: an optimizer filtering Params misses it


class DefaultStreamKeys(Linear):
    def __init__(self, in_features, out_features, *, rngs):
        init = jax.nn.initializers.lecun_normal()
        self.kernel = nnx.Param(init(rngs(), (in_features, out_features), jnp.float32))  # the default stream
        rngs()
        self.bias = nnx.Param(jnp.zeros((out_features,), jnp.float32))


class TransposedInit(Linear):
    def __init__(self, in_features, out_features, *, rngs):
        init = jax.nn.initializers.lecun_normal()
        self.kernel = nnx.Param(init(rngs.params(), (out_features, in_features), jnp.float32).T)
        rngs.params()
        self.bias = nnx.Param(jnp.zeros((out_features,), jnp.float32))


def dropout_drawing_from_the_params_stream(x, rate, rngs, deterministic=False):
    if deterministic or rate == 0.0:
        return x
    if rate == 1.0:
        return jnp.zeros_like(x)
    keep = jax.random.bernoulli(rngs.params(), 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0.0)


dropping_where_a_draw_says_drop = _dropout_with(  # drops rate of them, but not nnx.Dropout's ones
    lambda x, rate, key: jnp.where(jax.random.bernoulli(key, rate, x.shape), 0.0, x / (1.0 - rate)))


def dropout_drawing_two_keys(x, rate, rngs, deterministic=False):
    if deterministic or rate == 0.0:
        return x
    if rate == 1.0:
        return jnp.zeros_like(x)
    rngs.dropout()  # a key drawn and thrown away: later masks shift by one
    return dropout(x, rate, rngs)


def functional_call_on_split_params_only(graphdef, state, x):
    model = nnx.merge(graphdef, state, copy=True)
    y = model(x)
    _, new_state = nnx.split(model, nnx.Param, ...)  # two states: the Params, and the rest
    return y, new_state


def functional_call_returning_the_input_state(graphdef, state, x):
    return nnx.merge(graphdef, state, copy=True)(x), state


def rms_norm_by_the_l2_norm(x, scale, epsilon=1e-6):
    x32 = x.astype(jnp.float32)
    return (x32 / jnp.sqrt(jnp.sum(x32**2, axis=-1, keepdims=True) + epsilon) * scale).astype(x.dtype)


def rms_norm_by_the_mean_absolute_value(x, scale, epsilon=1e-6):
    x32 = x.astype(jnp.float32)
    return (x32 / (jnp.mean(jnp.abs(x32), axis=-1, keepdims=True) + epsilon) * scale).astype(x.dtype)


def rms_norm_over_the_first_axis(x, scale, epsilon=1e-6):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32**2, axis=0, keepdims=True) + epsilon) * scale).astype(x.dtype)


class NumpyMatmul(Linear):
    def __call__(self, x):
        return np.matmul(x, self.kernel[...]) + self.bias[...]  # NumPy: right eagerly, fails under jit


def dropout_with_numpys_generator(x, rate, rngs, deterministic=False):
    if deterministic or rate == 0.0:
        return x
    if rate == 1.0:
        return jnp.zeros_like(x)
    keep = np.random.default_rng(0).random(x.shape) >= rate  # NumPy's generator, not the dropout stream
    return jnp.where(keep, x / (1.0 - rate), 0.0)


def functional_call_in_eval_mode(graphdef, state, x):
    model = nnx.merge(graphdef, state, copy=True)
    model.eval()  # "pure" read as "deterministic": dropout is switched off and its counter stays
    return model(x), nnx.state(model)


def functional_call_returning_a_pure_dict(graphdef, state, x):
    model = nnx.merge(graphdef, state, copy=True)
    return model(x), nnx.to_pure_dict(nnx.state(model))  # plain arrays: cannot be merged back


def rms_norm_by_the_square_of_the_mean(x, scale, epsilon=1e-6):
    x32 = x.astype(jnp.float32)
    mean_squared = jnp.mean(x32, axis=-1, keepdims=True) ** 2  # (mean x)^2, not mean(x^2)
    return (x32 * jax.lax.rsqrt(mean_squared + epsilon) * scale).astype(x.dtype)


def rms_norm_with_numpy(x, scale, epsilon=1e-6):
    x32 = np.asarray(x, np.float32)  # NumPy: the right numbers on concrete arrays, fails under jit
    rms = np.sqrt(np.mean(x32**2, axis=-1, keepdims=True) + epsilon)
    return (x32 / rms * np.asarray(scale)).astype(x.dtype)


FRESH = [
    ("02.linear", VariableNotParam, 6, "kernel in a plain Variable, not a Param"),
    ("02.linear", DefaultStreamKeys, 5, "keys from the default stream, not params"),
    ("02.linear", TransposedInit, 5, "initialises (out, in) and transposes"),
    ("02.linear", NumpyMatmul, 6, "np.matmul: fails under jit"),
    ("02.dropout", dropout_drawing_from_the_params_stream, 2, "draws from the params stream"),
    ("02.dropout", dropping_where_a_draw_says_drop, 4, "bernoulli(rate) marks the dropped ones"),
    ("02.dropout", dropout_drawing_two_keys, 4, "draws two keys per call"),
    ("02.dropout", dropout_with_numpys_generator, 4, "NumPy's random generator, not the Rngs stream"),
    ("02.functional_call", functional_call_on_split_params_only, 0, "returns the Params' state alone"),
    ("02.functional_call", functional_call_returning_the_input_state, 3, "returns the state it was given"),
    ("02.functional_call", functional_call_in_eval_mode, 3, "switches dropout off with model.eval()"),
    ("02.functional_call", functional_call_returning_a_pure_dict, 4, "returns a pure dict, not an nnx.State"),
    ("02.rms_norm", rms_norm_by_the_l2_norm, 0, "divides by the L2 norm, not the RMS"),
    ("02.rms_norm", rms_norm_by_the_mean_absolute_value, 0, "divides by the mean absolute value"),
    ("02.rms_norm", rms_norm_over_the_first_axis, 2, "the mean over the first axis"),
    ("02.rms_norm", rms_norm_by_the_square_of_the_mean, 2, "the square of the mean, not the mean of squares"),
    ("02.rms_norm", rms_norm_with_numpy, 5, "NumPy: right numbers, fails under jit"),
]


WRONG = [
    ("02.linear", NoBiasKey, 6, "draws no key for the bias"),
    ("02.linear", NormalInit, 5, "standard normal instead of lecun_normal"),
    ("02.linear", Transposed, 2, "kernel stored (out, in)"),
    ("02.linear", BareArrays, 3, "arrays outside Variables: right weights, but no state"),
    ("02.linear", RandomBias, 5, "a random bias from the second key"),
    ("02.linear", NoBias, 5, "forgets the bias"),
    ("02.linear", BatchOfVectorsOnly, 5, "works only on 2-D inputs"),
    ("02.linear", BiasKeyFirst, 5, "draws the bias's key before the kernel's"),
    ("02.linear", UnscaledTruncatedNormal, 5, "a truncated normal without lecun_normal's rescaling"),
    ("02.linear", GlorotInit, 5, "glorot_normal instead of lecun_normal"),
    ("02.linear", Bfloat16Weights, 5, "bfloat16 weights"),
    ("02.dropout", unscaled_dropout, 2, "forgets to rescale by 1 / (1 - rate)"),
    ("02.dropout", fixed_key_dropout, 4, "a fixed key instead of the stream"),
    ("02.dropout", keeps_with_probability_rate, 2, "keeps with probability rate, not 1 - rate"),
    ("02.dropout", key_before_deterministic, 4, "draws a key even when deterministic"),
    ("02.dropout", multiplying_by_the_mask, 5, "x * mask / (1 - rate): NaN at rate 1"),
    ("02.dropout", uniform_above_rate, 4, "uniform(key) > rate: another mask than nnx.Dropout's"),
    ("02.dropout", scaling_by_the_keep_rate, 2, "multiplies by 1 - rate instead of dividing"),
    ("02.dropout", one_mask_for_the_whole_array, 2, "one Bernoulli draw for the whole array"),
    ("02.dropout", splitting_the_key_first, 4, "splits the key before drawing the mask"),
    ("02.dropout", drawing_a_key_at_rate_0_and_1, 5, "draws a key at rates 0 and 1"),
    ("02.functional_call", sharing_functional_call, 3, "merge without copy mutates the input state"),
    ("02.functional_call", stale_state_functional_call, 3, "returns the old state"),
    ("02.functional_call", returns_the_model, 3, "returns the model, not its state"),
    ("02.functional_call", returns_only_y, 2, "returns y alone"),
    ("02.functional_call", returns_only_the_params, 3, "returns only the Params"),
    ("02.functional_call", calls_the_model_twice, 3, "calls the model twice"),
    ("02.functional_call", returns_split, 3, "returns split(model), not the state"),
    ("02.rms_norm", layer_norm_instead, 0, "subtracts the mean (LayerNorm)"),
    ("02.rms_norm", epsilon_outside, 5, "epsilon outside the square root"),
    ("02.rms_norm", other_default_epsilon, 5, "default epsilon 1e-5"),
    ("02.rms_norm", mean_over_every_axis, 2, "the mean over every axis, not the last"),
    ("02.rms_norm", bfloat16_statistics, 4, "statistics in bfloat16"),
    ("02.rms_norm", float32_output, 5, "returns float32 for bfloat16 inputs"),
    ("02.rms_norm", forgets_the_scale, 3, "ignores scale"),
    ("02.rms_norm", scale_after_the_cast, 5, "multiplies by a float32 scale after the cast"),
    ("02.rms_norm", scale_dtype_output, 5, "returns scale's dtype, not x's"),
    ("02.rms_norm", divides_by_the_standard_deviation, 0, "divides by the standard deviation"),
    ("02.rms_norm", normalising_factor_in_bfloat16, 4, "rounds the normalising factor to bfloat16"),
    *FRESH,
]


@pytest.mark.parametrize("exercise_id, answer, points, why", WRONG, ids=[w[3] for w in WRONG])
def test_a_planted_wrong_answer_loses_points(exercise_id, answer, points, why):
    result = grade(exercise_id, answer)
    assert result.points == points, [(c.name, c.status, c.message) for c in result.cases]
    assert result.points < result.max_points
