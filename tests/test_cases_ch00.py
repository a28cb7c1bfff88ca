"""Chapter 00's exercise cases: right answers score full marks, planted wrong ones lose points."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stacklib.grading import grade


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


def loop_pairwise(x, y):
    out = np.zeros((len(x), len(y)))
    for i in range(len(x)):
        for j in range(len(y)):
            out[i, j] = ((x[i] - y[j]) ** 2).sum()
    return out


def flat_pairs(x, y):
    return zip(jax.tree.leaves(x), jax.tree.leaves(y), strict=True)


# (exercise, planted wrong answer, points it should still get, why)
WRONG = [
    ("00.count_params", lambda tree: len(jax.tree.leaves(tree)), 0, "counts leaves, not numbers"),
    ("00.count_params", lambda tree: sum(np.size(v) for v in (tree if isinstance(tree, list) else [])),
     1, "only handles a flat list"),
    ("00.count_params", lambda tree: sum(np.size(leaf) for leaf in jax.tree.leaves(tree) if np.ndim(leaf)),
     2, "drops Python scalars"),
    ("00.tree_axpy", lambda a, x, y: jax.tree.map(lambda xl, yl: xl + yl, x, y), 0, "forgets a"),
    ("00.tree_axpy", lambda a, x, y: [a * xl + yl for xl, yl in flat_pairs(x, y)], 1, "returns a flat list"),
    ("00.softmax", naive_softmax, 2, "overflows on large logits"),
    ("00.softmax", lambda z, axis=-1: softmax(z), 3, "ignores axis"),
    ("00.softmax", lambda z, axis=-1: jnp.exp(z) / jnp.exp(z).sum(), 0, "normalises over everything"),
    ("00.pairwise_sq_dists", lambda x, y: pairwise_sq_dists(y, x), 0, "transposed result"),
    ("00.pairwise_sq_dists", lambda x, y: jnp.sqrt(pairwise_sq_dists(x, y)), 0, "distances, not squared"),
    ("00.pairwise_sq_dists", loop_pairwise, 2, "a Python double loop is too slow"),
]


@pytest.mark.parametrize("exercise_id, answer, points, why", WRONG, ids=[w[3] for w in WRONG])
def test_a_planted_wrong_answer_loses_points(exercise_id, answer, points, why):
    result = grade(exercise_id, answer)
    assert result.points == points, [(c.name, c.status, c.message) for c in result.cases]
    assert result.points < result.max_points
