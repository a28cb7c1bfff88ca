"""Chapter 00's exercise cases: right answers score full marks, planted wrong ones lose points."""


import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stacklib.grading import grade
from stacklib.grading.runner import get_exercise


def count_params(tree):
    return sum(np.size(leaf) for leaf in jax.tree.leaves(tree))


def tree_axpy(a, x, y):
    return jax.tree.map(lambda xl, yl: a * xl + yl, x, y)


def softmax(logits, axis=-1):
    exps = jnp.exp(logits - jnp.max(logits, axis=axis, keepdims=True))
    return exps / exps.sum(axis=axis, keepdims=True)


def pairwise_sq_dists(x, y):
    return jnp.sum((x[:, None, :] - y[None, :, :]) ** 2, axis=-1)


RIGHT = {
    "00.count_params": count_params,
    "00.tree_axpy": tree_axpy,
    "00.softmax": softmax,
    "00.pairwise_sq_dists": pairwise_sq_dists,
}


@pytest.mark.parametrize("exercise_id", sorted(RIGHT))
def test_a_right_answer_scores_full_marks(exercise_id):
    result = grade(exercise_id, RIGHT[exercise_id])
    assert result.points == result.max_points, [c.message for c in result.cases]


def naive_softmax(logits, axis=-1):
    exps = jnp.exp(logits)
    return exps / exps.sum(axis=axis, keepdims=True)


def softmax_shifting_in_place(logits, axis=-1):
    logits -= np.max(logits, axis=axis, keepdims=True)  # changes the caller's array
    exps = np.exp(logits)
    return exps / exps.sum(axis=axis, keepdims=True)


def softmax_shifting_by_the_global_max(logits, axis=-1):
    exps = jnp.exp(logits - jnp.max(logits))  # a row far below the maximum underflows to 0 / 0
    return exps / exps.sum(axis=axis, keepdims=True)


def numpy_softmax(logits, axis=-1):
    exps = np.exp(logits - np.max(logits, axis=axis, keepdims=True))
    return exps / exps.sum(axis=axis, keepdims=True)


def axpy_into_x(a, x, y):
    for key in x:  # written for dicts, and changes the caller's x
        x[key] = a * x[key] + y[key]
    return x


def count_with_prod(tree):
    return sum(np.prod(np.shape(leaf)) for leaf in jax.tree.leaves(tree))  # np.prod(()) is 1.0


def loop_pairwise(x, y):
    out = np.zeros((len(x), len(y)))
    for i in range(len(x)):
        for j in range(len(y)):
            out[i, j] = ((x[i] - y[j]) ** 2).sum()
    return out


def row_loop_pairwise(x, y):
    out = np.zeros((len(x), len(y)), np.float32)
    for i in range(len(x)):  # broadcasts over y, loops over x: fine for 7 rows, not 3 M
        out[i] = ((x[i] - y) ** 2).sum(-1)
    return out


def flat_pairs(x, y):
    return zip(jax.tree.leaves(x), jax.tree.leaves(y), strict=True)


def count_in_int32(tree):
    return jnp.sum(jnp.array([np.size(leaf) for leaf in jax.tree.leaves(tree)]))  # int32: overflows


def count_with_none_as_a_leaf(tree):
    leaves = jax.tree.leaves(tree, is_leaf=lambda x: x is None)
    return sum(np.size(leaf) for leaf in leaves)  # np.size(None) is 1


def count_by_flattening(tree):
    return sum(len(np.ravel(leaf)) for leaf in jax.tree.leaves(tree))  # an abstract leaf has no values


def axpy_pairing_dict_values_in_order(a, x, y):
    if isinstance(x, dict):  # pairs the i-th key of x with the i-th key of y
        pairs = zip(x, x.values(), y.values(), strict=True)
        return {key: axpy_pairing_dict_values_in_order(a, xv, yv) for key, xv, yv in pairs}
    if isinstance(x, list | tuple):
        return type(x)(axpy_pairing_dict_values_in_order(a, xv, yv) for xv, yv in zip(x, y, strict=True))
    return a * x + y


def axpy_making_lists_of_tuples(a, x, y):
    if isinstance(x, dict):
        return {key: axpy_making_lists_of_tuples(a, x[key], y[key]) for key in x}
    if isinstance(x, list | tuple):
        return [axpy_making_lists_of_tuples(a, xv, yv) for xv, yv in zip(x, y, strict=True)]
    return a * x + y


def axpy_adding_into_y(a, x, y):
    def leaf(x_leaf, y_leaf):
        y_leaf += a * x_leaf  # in place for NumPy arrays: the caller's y changes
        return y_leaf

    return jax.tree.map(leaf, x, y)


def softmax_shifting_by(reduce):
    def shifted_softmax(logits, axis=-1):
        exps = jnp.exp(logits - reduce(logits, axis=axis, keepdims=True))
        return exps / exps.sum(axis=axis, keepdims=True)

    return shifted_softmax


def softmax_shifting_by_the_last_axis_max(logits, axis=-1):
    exps = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))  # the shift varies along `axis`
    return exps / exps.sum(axis=axis, keepdims=True)


def softmax_clipping_the_logits(logits, axis=-1):
    exps = jnp.exp(jnp.clip(logits, -80.0, 80.0))  # no overflow, but 1000 and 990 become equal
    return exps / exps.sum(axis=axis, keepdims=True)


def pairwise_for_two_features(x, y):
    return (x[:, None, 0] - y[None, :, 0]) ** 2 + (x[:, None, 1] - y[None, :, 1]) ** 2  # d = 2 only


def pairwise_l1(x, y):
    return jnp.sum(jnp.abs(x[:, None, :] - y[None, :, :]), axis=-1)


def column_loop_pairwise(x, y):
    return np.stack([((x - y[j]) ** 2).sum(-1) for j in range(len(y))], axis=1)  # 3 M columns


def count_top_level_values(tree):
    values = tree.values() if isinstance(tree, dict) else tree  # one level deep only
    return sum(np.size(leaf) for leaf in values)


def count_from_shapes(tree):
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(tree))  # a Python float has no shape


def softmax_without_keepdims(logits, axis=-1):
    exps = jnp.exp(logits - jnp.max(logits, axis=axis))  # (rows,) against (rows, classes)
    return exps / exps.sum(axis=axis, keepdims=True)


def stable_softmax_normalised_over_everything(logits, axis=-1):
    exps = jnp.exp(logits - jnp.max(logits, axis=axis, keepdims=True))
    return exps / exps.sum()


def log_softmax(logits, axis=-1):
    shifted = logits - jnp.max(logits, axis=axis, keepdims=True)
    return shifted - jnp.log(jnp.exp(shifted).sum(axis=axis, keepdims=True))


def softmax_dividing_by_the_max(logits, axis=-1):
    exps = jnp.exp(logits / jnp.max(jnp.abs(logits), axis=axis, keepdims=True))  # scales, not shifts
    return exps / exps.sum(axis=axis, keepdims=True)


def count_the_flattened_pair(tree):
    return sum(np.size(part) for part in jax.tree.flatten(tree))  # (leaves, treedef), not the leaves


def softmax_for_2d_logits(logits, axis=-1):
    exps = jnp.exp(logits - logits.max(axis=axis)[:, None])  # adds the axis back at position 1: 2-D only
    return exps / exps.sum(axis=axis)[:, None]


def pairwise_expanded_without_new_axes(x, y):
    return (x**2).sum(1) + (y**2).sum(1) - 2 * x @ y.T  # (n,) + (m,): the norms never broadcast to (n, m)


def pairwise_expanded_without_the_two(x, y):
    return (x**2).sum(1)[:, None] + (y**2).sum(1)[None, :] - x @ y.T  # the cross term once, not twice


def pairwise_summing_the_wrong_axis(x, y):
    return jnp.sum((x[:, None, :] - y[None, :, :]) ** 2, axis=1)  # sums over y's rows, not the features


# Fresh wrong answers a learner writes (issue 38), beside the planted classes above.
FRESH = [
    ("00.count_params", lambda tree: sum(np.asarray(leaf).nbytes for leaf in jax.tree.leaves(tree)), 0,
     "counts bytes, not numbers"),
    ("00.count_params", lambda tree: max(np.size(leaf) for leaf in jax.tree.leaves(tree)), 0,
     "the largest leaf, not the sum"),
    ("00.count_params", count_top_level_values, 1, "looks one level deep only"),
    ("00.count_params", count_from_shapes, 4, "math.prod of .shape: a Python float has none"),
    ("00.count_params", count_the_flattened_pair, 0, "sums over jax.tree.flatten's (leaves, treedef)"),
    ("00.tree_axpy", lambda a, x, y: jax.tree.map(lambda xl, yl: a * (xl + yl), x, y), 0, "a * (x + y)"),
    ("00.tree_axpy", lambda a, x, y: jax.tree.map(lambda xl, yl: np.asarray(a * xl + yl), x, y), 2,
     "converts each leaf with np.asarray: fails under jit"),
    ("00.softmax", softmax_without_keepdims, 0, "the shift without keepdims"),
    ("00.softmax", stable_softmax_normalised_over_everything, 0, "stable, but one sum over everything"),
    ("00.softmax", log_softmax, 0, "returns log-probabilities"),
    ("00.softmax", softmax_dividing_by_the_max, 0, "divides by the maximum instead of subtracting it"),
    ("00.softmax", softmax_for_2d_logits, 4, "adds the reduced axis back with [:, None]: 2-D logits only"),
    ("00.pairwise_sq_dists", lambda x, y: jnp.mean((x[:, None, :] - y[None, :, :]) ** 2, axis=-1), 0,
     "the mean over features, not the sum"),
    ("00.pairwise_sq_dists", lambda x, y: jnp.sum((x - y) ** 2, axis=-1), 0, "no broadcasting: x - y"),
    ("00.pairwise_sq_dists", pairwise_expanded_without_new_axes, 0, "|x|^2 + |y|^2 - 2 x.y without new axes"),
    ("00.pairwise_sq_dists", pairwise_expanded_without_the_two, 0, "|x|^2 + |y|^2 - x.y: the 2 left out"),
    ("00.pairwise_sq_dists", lambda x, y: x @ y.T, 0, "dot products (attention scores), not distances"),
    ("00.pairwise_sq_dists", pairwise_summing_the_wrong_axis, 0, "sums over axis 1, the rows of y"),
]


# (exercise, planted wrong answer, points it should still get, why)
WRONG = [
    ("00.count_params", lambda tree: len(jax.tree.leaves(tree)), 0, "counts leaves, not numbers"),
    ("00.count_params", lambda tree: sum(np.size(v) for v in (tree if isinstance(tree, list) else [])),
     1, "only handles a flat list"),
    ("00.count_params", lambda tree: sum(np.size(leaf) for leaf in jax.tree.leaves(tree) if np.ndim(leaf)),
     4, "drops Python scalars"),
    ("00.count_params", count_with_prod, 4, "returns a float count"),
    ("00.count_params", lambda tree: sum(leaf.size for leaf in jax.tree.leaves(tree)), 4,
     "leaf.size: a Python float has none"),
    ("00.count_params", count_with_none_as_a_leaf, 4, "counts None as a number"),
    ("00.count_params", count_in_int32, 4, "adds the sizes in int32"),
    ("00.count_params", count_by_flattening, 4, "flattens each leaf: abstract leaves have no values"),
    ("00.tree_axpy", lambda a, x, y: jax.tree.map(lambda xl, yl: xl + yl, x, y), 0, "forgets a"),
    ("00.tree_axpy", lambda a, x, y: [a * xl + yl for xl, yl in flat_pairs(x, y)], 1, "returns a flat list"),
    ("00.tree_axpy", lambda a, x, y: jax.tree.map(lambda xl, yl: xl + a * yl, x, y), 0, "scales y, not x"),
    ("00.tree_axpy", axpy_into_x, 0, "writes the result into x"),
    ("00.tree_axpy", lambda a, x, y: {key: a * x[key] + y[key] for key in x}, 1, "handles dicts only"),
    ("00.tree_axpy", axpy_pairing_dict_values_in_order, 2, "pairs dict leaves by order, not by key"),
    ("00.tree_axpy", axpy_making_lists_of_tuples, 2, "returns lists where the input has tuples"),
    ("00.tree_axpy", axpy_adding_into_y, 1, "adds into the caller's y"),
    ("00.softmax", naive_softmax, 3, "overflows on large logits"),
    ("00.softmax", lambda z, axis=-1: softmax(z), 4, "ignores axis"),
    ("00.softmax", lambda z, axis=-1: jnp.exp(z) / jnp.exp(z).sum(), 0, "normalises over everything"),
    ("00.softmax", softmax_shifting_by_the_global_max, 3, "subtracts the global maximum"),
    ("00.softmax", softmax_shifting_in_place, 0, "shifts the caller's logits in place"),
    ("00.softmax", numpy_softmax, 4, "NumPy, not jax.numpy"),
    ("00.softmax", softmax_shifting_by(jnp.min), 3, "subtracts each row's minimum"),
    ("00.softmax", softmax_shifting_by(jnp.mean), 3, "subtracts each row's mean"),
    ("00.softmax", softmax_shifting_by_the_last_axis_max, 4, "subtracts the maximum over the last axis"),
    ("00.softmax", softmax_clipping_the_logits, 3, "clips the logits to [-80, 80]"),
    ("00.pairwise_sq_dists", lambda x, y: pairwise_sq_dists(y, x), 0, "transposed result"),
    ("00.pairwise_sq_dists", lambda x, y: jnp.sqrt(pairwise_sq_dists(x, y)), 0, "distances, not squared"),
    ("00.pairwise_sq_dists", pairwise_for_two_features, 2, "written for d = 2 only"),
    ("00.pairwise_sq_dists", pairwise_l1, 0, "absolute differences, not squares"),
    *FRESH,
]


@pytest.mark.parametrize("exercise_id, answer, points, why", WRONG, ids=[w[3] for w in WRONG])
def test_a_planted_wrong_answer_loses_points(exercise_id, answer, points, why):
    result = grade(exercise_id, answer)
    assert result.points == points, [(c.name, c.status, c.message) for c in result.cases]
    assert result.points < result.max_points


# (exercise, planted wrong answer, words the first failing case's message must contain)
MESSAGES = [
    ("00.count_params", count_with_prod, "whole number"),
    ("00.tree_axpy", axpy_into_x, "changed its input in place"),
    ("00.softmax", softmax_shifting_in_place, "changed its input in place"),
]


@pytest.mark.parametrize("exercise_id, answer, words", MESSAGES, ids=[m[1].__name__ for m in MESSAGES])
def test_a_planted_wrong_answer_is_told_the_cause(exercise_id, answer, words):
    result = grade(exercise_id, answer)
    first_failure = next(c for c in result.cases if c.points < c.max_points)
    assert words in first_failure.message, first_failure.message



# The Python loops run for about 10 s at rest (the case's comment), past the 6 s limit, and
# longer under load. Here the limit is 1 s: they time out just as surely, each 5 s sooner
# (the right answer, in test_a_right_answer_scores_full_marks, runs under the real 6 s).
SLOW_LOOPS = [loop_pairwise, row_loop_pairwise, column_loop_pairwise]


@pytest.mark.parametrize("answer", SLOW_LOOPS, ids=[f.__name__ for f in SLOW_LOOPS])
def test_a_python_loop_loses_the_speed_case_and_is_told_the_time_limit(answer, monkeypatch):
    exercise = get_exercise("00.pairwise_sq_dists")
    monkeypatch.setattr(exercise, "cases", [dataclasses.replace(case, time_limit_s=min(case.time_limit_s, 1))
                                            for case in exercise.cases])
    result = grade("00.pairwise_sq_dists", answer)
    assert result.points == 2, [(c.name, c.status, c.message) for c in result.cases]
    first_failure = next(c for c in result.cases if c.points < c.max_points)
    assert first_failure.status == "timed out" and "time limit" in first_failure.message
