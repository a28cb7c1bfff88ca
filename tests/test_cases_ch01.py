"""Chapter 01's exercise cases: right answers score full marks, planted wrong ones lose points."""

import re

import jax
import numpy as np
import pytest
from conftest import ROOT

import stacklib.transforms as st
from stacklib.grading import grade
from stacklib.transforms import batching, forward, lax, lowering, reverse

# --------------------------------------------------------------------------- right answers


def tanh_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    y = lax.tanh(x)
    return y, lax.mul(t, lax.sub(1.0, lax.integer_pow(y, 2)))


def reduce_sum_transpose(ct, operand, *, axes):
    shape = operand.aval.shape
    return [lax.broadcast_in_dim(ct, shape, [d for d in range(len(shape)) if d not in axes])]


def reduce_sum_batch(batched_args, batch_dims, *, axes):
    (x,), (d,) = batched_args, batch_dims
    out = lax.reduce_sum(x, [a + (a >= d) for a in axes])
    return out, d - sum(a < d for a in axes)


def define_logistic(logistic_p):
    logistic_p.def_impl(lambda x: 1.0 / (1.0 + np.exp(-x)))
    logistic_p.def_abstract_eval(lambda x: x)

    def jvp_rule(primals, tangents):
        (x,), (t,) = primals, tangents
        y = logistic_p.bind(x)
        return y, t * y * (1.0 - y)

    def batch_rule(batched_args, batch_dims):
        return logistic_p.bind(batched_args[0]), batch_dims[0]

    forward.primitive_jvps[logistic_p] = jvp_rule
    batching.primitive_batchers[logistic_p] = batch_rule


def jacfwd(f):
    def jacobian(x):
        return st.vmap(lambda v: st.jvp(f, (x,), (v,))[1], out_axes=-1)(np.eye(x.size))
    return jacobian


def reduce_max_lowering(ctx, x, *, axes):
    dtype = ctx.avals_in[0].dtype
    init = ctx.constant(-np.inf if np.issubdtype(dtype, np.floating) else np.iinfo(dtype).min, dtype)
    return lowering.reduce(ctx, x, init, "maximum", axes)


RIGHT = {
    "01.tanh_jvp": tanh_jvp,
    "01.reduce_sum_transpose": reduce_sum_transpose,
    "01.reduce_sum_batch": reduce_sum_batch,
    "01.logistic": define_logistic,
    "01.jacfwd": jacfwd,
    "01.reduce_max_lowering": reduce_max_lowering,
}


@pytest.mark.parametrize("exercise_id", sorted(RIGHT))
def test_a_right_answer_scores_full_marks(exercise_id):
    result = grade(exercise_id, RIGHT[exercise_id])
    assert result.points == result.max_points, [c.message for c in result.cases]


def test_the_rule_tables_are_restored_after_grading():
    tables = [dict(forward.primitive_jvps), dict(reverse.primitive_transposes),
              dict(batching.primitive_batchers), dict(lowering.lowering_rules)]
    for exercise_id, answer in RIGHT.items():
        grade(exercise_id, answer)
    assert tables == [forward.primitive_jvps, reverse.primitive_transposes, batching.primitive_batchers,
                      lowering.lowering_rules]


# --------------------------------------------------------------------------- planted wrong answers


def tanh_jvp_forgets_the_square(primals, tangents):
    (x,), (t,) = primals, tangents
    y = lax.tanh(x)
    return y, lax.mul(t, lax.sub(1.0, y))


def tanh_jvp_with_numpy(primals, tangents):
    (x,), (t,) = primals, tangents
    y = np.tanh(x)  # fine on concrete values, fails once x is a tracer (grad of grad)
    return y, lax.mul(t, 1.0 - y**2)


def tanh_jvp_without_the_tangent(primals, tangents):
    (x,), _ = primals, tangents
    y = lax.tanh(x)
    return y, lax.sub(1.0, lax.integer_pow(y, 2))  # the derivative, not the derivative times t


def tanh_jvp_with_the_wrong_sign(primals, tangents):
    (x,), (t,) = primals, tangents
    y = lax.tanh(x)
    return y, lax.mul(t, lax.sub(lax.integer_pow(y, 2), 1.0))  # tanh'' alone cannot tell


def tanh_jvp_computing_tanh_twice(primals, tangents):
    (x,), (t,) = primals, tangents
    return lax.tanh(x), lax.mul(t, lax.sub(1.0, lax.integer_pow(lax.tanh(x), 2)))


def tanh_jvp_returning_only_the_tangent(primals, tangents):
    (x,), (t,) = primals, tangents
    return lax.mul(t, lax.sub(1.0, lax.integer_pow(lax.tanh(x), 2)))


def transpose_without_broadcast(ct, operand, *, axes):
    return [ct]


def transpose_with_numpy_broadcasting(ct, operand, *, axes):
    return [st.numpy.broadcast_to(ct, operand.aval.shape)]  # right only when leading axes are summed


def transpose_returning_a_bare_array(ct, operand, *, axes):
    shape = operand.aval.shape
    return lax.broadcast_in_dim(ct, shape, [d for d in range(len(shape)) if d not in axes])


def transpose_with_numpy(ct, operand, *, axes):
    return [np.broadcast_to(np.expand_dims(ct, tuple(axes)), operand.aval.shape)]  # not under jit


def batch_without_shifting(batched_args, batch_dims, *, axes):
    (x,), (d,) = batched_args, batch_dims
    return lax.reduce_sum(x, axes), d


def batch_keeping_the_batch_dim(batched_args, batch_dims, *, axes):
    (x,), (d,) = batched_args, batch_dims
    return lax.reduce_sum(x, [a + (a >= d) for a in axes]), d  # right only if nothing before d is summed


def batch_with_numpy(batched_args, batch_dims, *, axes):
    (x,), (d,) = batched_args, batch_dims
    return np.sum(x, axis=tuple(a + (a >= d) for a in axes)), d - sum(a < d for a in axes)


def batch_returning_only_the_array(batched_args, batch_dims, *, axes):
    (x,), (d,) = batched_args, batch_dims
    return lax.reduce_sum(x, [a + (a >= d) for a in axes])


def logistic_with_a_scalar_type(logistic_p):
    define_logistic(logistic_p)
    logistic_p.def_abstract_eval(lambda x: st.ShapedArray((), x.dtype))


def logistic_jvp_with_numpy(logistic_p):
    define_logistic(logistic_p)

    def jvp_rule(primals, tangents):
        (x,), (t,) = primals, tangents
        y = 1.0 / (1.0 + np.exp(-x))  # NumPy: breaks under jit
        return y, t * y * (1.0 - y)

    forward.primitive_jvps[logistic_p] = jvp_rule


def logistic_jvp_without_the_tangent(logistic_p):
    define_logistic(logistic_p)

    def jvp_rule(primals, tangents):
        y = logistic_p.bind(primals[0])
        return y, y * (1.0 - y)

    forward.primitive_jvps[logistic_p] = jvp_rule


def logistic_batched_at_zero(logistic_p):
    define_logistic(logistic_p)
    batching.primitive_batchers[logistic_p] = lambda args, dims: (logistic_p.bind(args[0]), 0)


def jacfwd_with_a_loop(f):
    def jacobian(x):
        return np.stack([st.jvp(f, (x,), (e,))[1] for e in np.eye(x.size)], axis=-1)
    return jacobian


def jacfwd_transposed(f):
    def jacobian(x):
        return st.vmap(lambda v: st.jvp(f, (x,), (v,))[1])(np.eye(x.size))  # (inputs, outputs)
    return jacobian


def max_lowering_starting_at_zero(ctx, x, *, axes):
    return lowering.reduce(ctx, x, ctx.constant(0, ctx.avals_in[0].dtype), "maximum", axes)


def max_lowering_with_add(ctx, x, *, axes):
    return lowering.reduce(ctx, x, ctx.constant(-np.inf, ctx.avals_in[0].dtype), "add", axes)


def max_lowering_starting_at_minus_inf_for_integers_too(ctx, x, *, axes):
    return lowering.reduce(ctx, x, ctx.constant(-np.inf, ctx.avals_in[0].dtype), "maximum", axes)


def max_lowering_with_the_operand_type_as_result(ctx, x, *, axes):
    dtype = ctx.avals_in[0].dtype
    init = ctx.constant(-np.inf if np.issubdtype(dtype, np.floating) else np.iinfo(dtype).min, dtype)
    t, scalar = lowering.tensor_type(ctx.avals_in[0]), lowering.tensor_type(st.ShapedArray((), dtype))
    return ctx.emit(f"stablehlo.reduce({x} init: {init}) applies stablehlo.maximum across dimensions = "
                    f"{list(axes)} : ({t}, {scalar}) -> {t}")


def max_lowering_with_numpy(ctx, x, *, axes):
    return np.max(x)


def tanh_jvp_with_x_for_tanh_x(primals, tangents):
    (x,), (t,) = primals, tangents
    return lax.tanh(x), lax.mul(t, lax.sub(1.0, lax.integer_pow(x, 2)))  # 1 - x**2, not 1 - tanh(x)**2


def tanh_jvp_returning_x_as_the_primal(primals, tangents):
    (x,), (t,) = primals, tangents
    return x, lax.mul(t, lax.sub(1.0, lax.integer_pow(lax.tanh(x), 2)))


def transpose_broadcasting_along_the_summed_axes(ct, operand, *, axes):
    return [lax.broadcast_in_dim(ct, operand.aval.shape, list(axes))]  # the summed axes, not the kept ones


def transpose_for_one_summed_axis(ct, operand, *, axes):
    shape = operand.aval.shape
    return [lax.broadcast_in_dim(ct, shape, [d for d in range(len(shape)) if d != axes[0]])]


def transpose_dividing_by_the_count(ct, operand, *, axes):
    shape = operand.aval.shape
    count = float(np.prod([shape[a] for a in axes]))  # the transpose of a mean, not of a sum
    return [lax.div(lax.broadcast_in_dim(ct, shape, [d for d in range(len(shape)) if d not in axes]), count)]


def batch_shifting_only_axes_after_the_batch(batched_args, batch_dims, *, axes):
    (x,), (d,) = batched_args, batch_dims
    return lax.reduce_sum(x, [a + 1 if a > d else a for a in axes]), d - sum(a < d for a in axes)  # a == d


def batch_moving_left_by_every_summed_axis(batched_args, batch_dims, *, axes):
    (x,), (d,) = batched_args, batch_dims
    return lax.reduce_sum(x, [a + (a >= d) for a in axes]), max(d - len(axes), 0)


def batch_counting_summed_axes_up_to_the_batch(batched_args, batch_dims, *, axes):
    (x,), (d,) = batched_args, batch_dims
    return lax.reduce_sum(x, [a + (a >= d) for a in axes]), d - sum(a <= d for a in axes)


def batch_output_always_at_zero(batched_args, batch_dims, *, axes):
    (x,), (d,) = batched_args, batch_dims
    return lax.reduce_sum(x, [a + (a >= d) for a in axes]), 0


def logistic_jvp_with_a_formula_for_the_primal(logistic_p):
    define_logistic(logistic_p)

    def jvp_rule(primals, tangents):
        (x,), (t,) = primals, tangents
        y = lax.div(1.0, lax.add(1.0, lax.exp(lax.neg(x))))  # right numbers, but not the primitive
        return y, t * y * (1.0 - y)

    forward.primitive_jvps[logistic_p] = jvp_rule


def logistic_with_a_float64_type(logistic_p):
    define_logistic(logistic_p)
    logistic_p.def_abstract_eval(lambda x: st.ShapedArray(x.shape, np.float64))


def logistic_with_a_shape_for_a_type(logistic_p):
    define_logistic(logistic_p)
    logistic_p.def_abstract_eval(lambda x: x.shape)


def logistic_batched_with_the_list_of_axes(logistic_p):
    define_logistic(logistic_p)
    batching.primitive_batchers[logistic_p] = lambda args, dims: (logistic_p.bind(args[0]), dims)


def jacfwd_of_the_primal(f):
    def jacobian(x):
        return st.vmap(lambda v: st.jvp(f, (x,), (v,))[0], out_axes=-1)(np.eye(x.size))
    return jacobian


def jacfwd_with_the_outputs_as_directions(f):
    def jacobian(x):
        return st.vmap(lambda v: st.jvp(f, (x,), (v,))[1], out_axes=-1)(np.eye(f(x).size))
    return jacobian


def jacfwd_along_ones(f):
    def jacobian(x):
        return st.jvp(f, (x,), (np.ones_like(x),))[1]  # J @ 1: the rows' sums, not J
    return jacobian


def _max_lowering_from(ctx, x, axes, lowest):
    dtype = ctx.avals_in[0].dtype
    return lowering.reduce(ctx, x, ctx.constant(lowest, dtype), "maximum", axes)


def max_lowering_from_the_lowest_finite_float(ctx, x, *, axes):
    dtype = ctx.avals_in[0].dtype
    lowest = np.finfo(dtype).min if np.issubdtype(dtype, np.floating) else np.iinfo(dtype).min  # beats -inf
    return _max_lowering_from(ctx, x, axes, lowest)


def max_lowering_from_minus_a_billion(ctx, x, *, axes):
    return _max_lowering_from(ctx, x, axes, -1e9)


def max_lowering_from_minus_the_largest_integer(ctx, x, *, axes):
    dtype = ctx.avals_in[0].dtype
    lowest = -np.inf if np.issubdtype(dtype, np.floating) else -np.iinfo(dtype).max  # one above the minimum
    return _max_lowering_from(ctx, x, axes, lowest)


def max_lowering_from_int32s_minimum(ctx, x, *, axes):
    dtype = ctx.avals_in[0].dtype
    lowest = -np.inf if np.issubdtype(dtype, np.floating) else np.iinfo(np.int32).min  # not int8's
    return _max_lowering_from(ctx, x, axes, lowest)


def max_lowering_in_float32_always(ctx, x, *, axes):
    return lowering.reduce(ctx, x, ctx.constant(-np.inf, np.float32), "maximum", axes)


# (exercise, planted wrong answer, points it should still get)
# Fresh wrong answers a learner writes (issue 38).


def tanh_jvp_with_jnp(primals, tangents):
    import jax.numpy as jnp

    (x,), (t,) = primals, tangents
    y = jnp.tanh(x)  # jax.numpy, not the mini-JAX's lax: cannot compute on its tracers
    return y, lax.mul(t, lax.sub(1.0, lax.integer_pow(y, 2)))


def tanh_jvp_returning_a_list_of_tangents(primals, tangents):
    (x,), (t,) = primals, tangents
    y = lax.tanh(x)
    return y, [lax.mul(t, lax.sub(1.0, lax.integer_pow(y, 2)))]


def tanh_jvp_with_x_times_tanh(primals, tangents):
    (x,), (t,) = primals, tangents
    y = lax.tanh(x)
    return y, lax.mul(t, lax.sub(1.0, lax.mul(x, y)))


def transpose_with_an_extra_cotangent(ct, operand, *, axes):
    return [*reduce_sum_transpose(ct, operand, axes=axes), None]


def transpose_broadcasting_into_the_kept_axes_reversed(ct, operand, *, axes):
    shape = operand.aval.shape
    kept = [d for d in range(len(shape)) if d not in axes]
    return [lax.broadcast_in_dim(ct, shape, kept[::-1])]


def batch_shifting_every_axis(batched_args, batch_dims, *, axes):
    (x,), (d,) = batched_args, batch_dims
    return lax.reduce_sum(x, [a + 1 for a in axes]), d - sum(a < d for a in axes)  # as if d were 0


def batch_shifting_axes_past_the_batch_strictly(batched_args, batch_dims, *, axes):
    (x,), (d,) = batched_args, batch_dims
    out = lax.reduce_sum(x, [a + (a > d) for a in axes])  # off by one at a == d
    return out, d - sum(a < d for a in axes)


def batch_keeping_d_or_zero(batched_args, batch_dims, *, axes):
    (x,), (d,) = batched_args, batch_dims
    out = lax.reduce_sum(x, [a + (a >= d) for a in axes])
    return out, d if all(a >= d for a in axes) else 0


def _logistic_with_jvp(name, tangent_of):
    def define(logistic_p):
        define_logistic(logistic_p)

        def jvp_rule(primals, tangents):
            (x,), (t,) = primals, tangents
            y = logistic_p.bind(x)
            return y, tangent_of(y, t)

        forward.primitive_jvps[logistic_p] = jvp_rule

    define.__name__ = name
    return define


def logistic_with_the_sign_of_the_exponent_flipped(logistic_p):
    define_logistic(logistic_p)
    logistic_p.def_impl(lambda x: 1.0 / (1.0 + np.exp(x)))


def jacfwd_by_finite_differences(f):
    def jacobian(x):
        eps = 1e-4
        return st.vmap(lambda v: (f(x + eps * v) - f(x)) / eps, out_axes=-1)(np.eye(x.size))
    return jacobian


def jacfwd_on_the_first_direction(f):
    def jacobian(x):
        column = st.jvp(f, (x,), (np.eye(x.size)[0],))[1]
        return st.vmap(lambda v: column, out_axes=-1)(np.eye(x.size))  # every column is column 0
    return jacobian


def max_lowering_with_op_max(ctx, x, *, axes):
    dtype = ctx.avals_in[0].dtype
    init = ctx.constant(-np.inf if np.issubdtype(dtype, np.floating) else np.iinfo(dtype).min, dtype)
    return lowering.reduce(ctx, x, init, "max", axes)  # StableHLO's op is maximum


def max_lowering_over_every_axis(ctx, x, *, axes):
    dtype = ctx.avals_in[0].dtype
    init = ctx.constant(-np.inf if np.issubdtype(dtype, np.floating) else np.iinfo(dtype).min, dtype)
    return lowering.reduce(ctx, x, init, "maximum", tuple(range(len(ctx.avals_in[0].shape))))


def max_lowering_from_minus_one_million(ctx, x, *, axes):
    return _max_lowering_from(ctx, x, axes, -1e6)  # an int8 cannot even hold it


def jacfwd_from_jax(f):
    import jax

    return jax.jacfwd(f)  # the real one: f is written with the mini-JAX, which jax cannot trace


def jacfwd_by_vmapping_over_the_outputs(f):
    def jacobian(x):
        m = np.size(f(x))
        return st.vmap(lambda v: st.jvp(f, (x,), (v[: x.size],))[1], out_axes=-1)(np.eye(max(m, x.size)))
    return jacobian


def tanh_jvp_at_the_tangent(primals, tangents):
    (x,), (t,) = primals, tangents
    return lax.tanh(x), lax.mul(t, lax.sub(1.0, lax.integer_pow(lax.tanh(t), 2)))  # tanh'(t), not tanh'(x)


def transpose_into_the_leading_axes(ct, operand, *, axes):
    shape = operand.aval.shape
    return [lax.broadcast_in_dim(ct, shape, list(range(len(shape) - len(axes))))]  # last axes summed?


def batch_with_reduce_max(batched_args, batch_dims, *, axes):
    (x,), (d,) = batched_args, batch_dims
    return lax.reduce_max(x, [a + (a >= d) for a in axes]), d - sum(a < d for a in axes)  # max, not sum


def logistic_with_jax_sigmoid(logistic_p):
    define_logistic(logistic_p)
    logistic_p.def_impl(jax.nn.sigmoid)  # the real JAX's: float32 arrays, where the statement asks for NumPy


def jacfwd_swapping_primal_and_tangent(f):
    def jacobian(x):
        return st.vmap(lambda v: st.jvp(f, (v,), (x,))[1], out_axes=-1)(np.eye(x.size))  # at e_j along x
    return jacobian


def jacfwd_converted_to_numpy(f):
    def jacobian(x):
        jac = st.vmap(lambda v: st.jvp(f, (x,), (v,))[1], out_axes=-1)(np.eye(x.size))
        return np.asarray(jac)  # "a float64 NumPy array": but under jit, jac is a tracer
    return jacobian


def min_lowering(ctx, x, *, axes):
    dtype = ctx.avals_in[0].dtype
    init = ctx.constant(np.inf if np.issubdtype(dtype, np.floating) else np.iinfo(dtype).max, dtype)
    return lowering.reduce(ctx, x, init, "minimum", axes)  # the minimum, with its own identity


FRESH = [
    ("01.tanh_jvp", tanh_jvp_with_jnp, 0),
    ("01.tanh_jvp", tanh_jvp_returning_a_list_of_tangents, 1),
    ("01.tanh_jvp", tanh_jvp_with_x_times_tanh, 1),
    ("01.tanh_jvp", tanh_jvp_at_the_tangent, 0),
    ("01.reduce_sum_transpose", transpose_with_an_extra_cotangent, 0),
    ("01.reduce_sum_transpose", transpose_broadcasting_into_the_kept_axes_reversed, 6),
    ("01.reduce_sum_transpose", transpose_into_the_leading_axes, 3),
    ("01.reduce_sum_batch", batch_shifting_every_axis, 1),
    ("01.reduce_sum_batch", batch_shifting_axes_past_the_batch_strictly, 2),
    ("01.reduce_sum_batch", batch_keeping_d_or_zero, 1),
    ("01.reduce_sum_batch", batch_with_reduce_max, 0),
    ("01.logistic", _logistic_with_jvp("logistic_jvp_with_y_squared", lambda y, t: t * y * y), 4),
    ("01.logistic", _logistic_with_jvp("logistic_jvp_without_y", lambda y, t: t * (1.0 - y)), 4),
    ("01.logistic", logistic_with_the_sign_of_the_exponent_flipped, 3),
    ("01.logistic", logistic_with_jax_sigmoid, 5),
    ("01.jacfwd", jacfwd_by_finite_differences, 0),
    ("01.jacfwd", jacfwd_on_the_first_direction, 1),
    ("01.jacfwd", jacfwd_from_jax, 0),
    ("01.jacfwd", jacfwd_by_vmapping_over_the_outputs, 0),
    ("01.jacfwd", jacfwd_swapping_primal_and_tangent, 1),
    ("01.jacfwd", jacfwd_converted_to_numpy, 4),
    ("01.reduce_max_lowering", max_lowering_with_op_max, 0),
    ("01.reduce_max_lowering", max_lowering_over_every_axis, 1),
    ("01.reduce_max_lowering", max_lowering_from_minus_one_million, 4),
    ("01.reduce_max_lowering", min_lowering, 0),
]


WRONG = [
    ("01.tanh_jvp", tanh_jvp_forgets_the_square, 1),
    ("01.tanh_jvp", tanh_jvp_with_numpy, 3),
    ("01.tanh_jvp", tanh_jvp_without_the_tangent, 1),
    ("01.tanh_jvp", tanh_jvp_with_the_wrong_sign, 1),
    ("01.tanh_jvp", tanh_jvp_computing_tanh_twice, 4),
    ("01.tanh_jvp", tanh_jvp_returning_only_the_tangent, 0),
    ("01.tanh_jvp", tanh_jvp_with_x_for_tanh_x, 1),
    ("01.tanh_jvp", tanh_jvp_returning_x_as_the_primal, 1),
    ("01.reduce_sum_transpose", transpose_without_broadcast, 0),
    ("01.reduce_sum_transpose", transpose_with_numpy_broadcasting, 3),
    ("01.reduce_sum_transpose", transpose_returning_a_bare_array, 0),
    ("01.reduce_sum_transpose", transpose_with_numpy, 5),
    ("01.reduce_sum_transpose", transpose_broadcasting_along_the_summed_axes, 0),
    ("01.reduce_sum_transpose", transpose_for_one_summed_axis, 5),
    ("01.reduce_sum_transpose", transpose_dividing_by_the_count, 0),
    ("01.reduce_sum_batch", batch_without_shifting, 0),
    ("01.reduce_sum_batch", batch_keeping_the_batch_dim, 1),
    ("01.reduce_sum_batch", batch_with_numpy, 4),
    ("01.reduce_sum_batch", batch_returning_only_the_array, 0),
    ("01.reduce_sum_batch", batch_shifting_only_axes_after_the_batch, 2),
    ("01.reduce_sum_batch", batch_moving_left_by_every_summed_axis, 4),
    ("01.reduce_sum_batch", batch_counting_summed_axes_up_to_the_batch, 3),
    ("01.reduce_sum_batch", batch_output_always_at_zero, 1),
    ("01.logistic", logistic_with_a_scalar_type, 5),
    ("01.logistic", logistic_jvp_with_numpy, 5),
    ("01.logistic", logistic_jvp_without_the_tangent, 4),
    ("01.logistic", logistic_batched_at_zero, 5),
    ("01.logistic", logistic_jvp_with_a_formula_for_the_primal, 6),
    ("01.logistic", logistic_with_a_float64_type, 6),
    ("01.logistic", logistic_with_a_shape_for_a_type, 4),
    ("01.logistic", logistic_batched_with_the_list_of_axes, 5),
    ("01.jacfwd", jacfwd_with_a_loop, 3),
    ("01.jacfwd", jacfwd_transposed, 2),
    ("01.jacfwd", jacfwd_of_the_primal, 1),
    ("01.jacfwd", jacfwd_with_the_outputs_as_directions, 2),
    ("01.jacfwd", jacfwd_along_ones, 1),
    ("01.reduce_max_lowering", max_lowering_starting_at_zero, 1),
    ("01.reduce_max_lowering", max_lowering_with_add, 0),
    ("01.reduce_max_lowering", max_lowering_starting_at_minus_inf_for_integers_too, 6),
    ("01.reduce_max_lowering", max_lowering_with_the_operand_type_as_result, 0),
    ("01.reduce_max_lowering", max_lowering_with_numpy, 0),
    ("01.reduce_max_lowering", max_lowering_from_the_lowest_finite_float, 6),
    ("01.reduce_max_lowering", max_lowering_from_minus_a_billion, 4),
    ("01.reduce_max_lowering", max_lowering_from_minus_the_largest_integer, 6),
    ("01.reduce_max_lowering", max_lowering_from_int32s_minimum, 6),
    ("01.reduce_max_lowering", max_lowering_in_float32_always, 1),
    *FRESH,
]


@pytest.mark.parametrize("exercise_id, answer, points", WRONG, ids=[w[1].__name__ for w in WRONG])
def test_a_planted_wrong_answer_loses_points(exercise_id, answer, points):
    result = grade(exercise_id, answer)
    assert result.points == points, [(c.name, c.status, c.message) for c in result.cases]
    assert result.points < result.max_points


# (exercise, planted wrong answer, words every failing case's message contains, words none contains)
MESSAGES = [
    ("01.tanh_jvp", tanh_jvp_with_numpy, ["NumPy function to a traced value", "np.tanh(x)", "lax.tanh"],
     ["stacklib.transforms.numpy", "branch"]),
    ("01.tanh_jvp", tanh_jvp_computing_tanh_twice, ["computes tanh 2 times"], []),
    ("01.tanh_jvp", tanh_jvp_returning_only_the_tangent, ["returns a pair (primal_out, tangent_out)"], []),
    ("01.reduce_sum_transpose", transpose_returning_a_bare_array,
     ["returned a single array", "a list with one cotangent per input"], ["shape f64"]),
    ("01.reduce_sum_transpose", transpose_with_numpy,
     ["NumPy function to a traced value", "lax.broadcast_in_dim"], ["branch"]),
    ("01.reduce_sum_batch", batch_with_numpy, ["NumPy function to a traced value", "lax.reduce_sum"], []),
    ("01.reduce_sum_batch", batch_returning_only_the_array, ["returns a pair"], []),
    ("01.logistic", logistic_jvp_with_numpy, ["NumPy function to a traced value", "np.exp(-x)"], ["branch"]),
    ("01.jacfwd", jacfwd_transposed, ["is transposed", "out_axes=-1"], ["must itself be traceable"]),
    ("01.jacfwd", jacfwd_with_a_loop, [], ["branch"]),
    ("01.reduce_max_lowering", max_lowering_with_the_operand_type_as_result,
     ["XLA could not compile", "stablehlo.reduce(%arg0 init:"], []),
    ("01.reduce_max_lowering", max_lowering_with_numpy, ["applied NumPy to an operand", "np.max(x)",
                                                         "SSA names like '%arg0'"], []),
]


@pytest.mark.parametrize("exercise_id, answer, present, absent", MESSAGES,
                         ids=[m[1].__name__ for m in MESSAGES])
def test_a_planted_wrong_answer_is_told_the_cause(exercise_id, answer, present, absent):
    failures = [c.message for c in grade(exercise_id, answer).cases if c.points < c.max_points]
    assert failures
    for message in failures:
        assert all(words in message for words in present), message
        assert not any(words in message for words in absent), message


def test_the_chapter_does_not_print_the_rules_the_exercises_ask_for():
    chapter = (ROOT / "chapters" / "01_transforms.md").read_text()
    shown = " ".join(re.findall(r"^show\((.*?)\)$", chapter, flags=re.M | re.S))
    for answer in ["forward._tanh_jvp", "reverse._reduce_sum_transpose", "batching._reduce_batcher",
                   "lowering._reduce_max_rule", "lowering._lowest"]:
        assert answer not in shown, f"chapter 01 shows {answer}, the answer to an exercise"



def test_an_untouched_exercise_reports_not_implemented():
    def stub(*args, **kwargs):
        raise NotImplementedError

    for exercise_id in RIGHT:
        result = grade(exercise_id, stub)
        assert result.points == 0
        assert all(c.status == "not implemented" for c in result.cases), exercise_id
