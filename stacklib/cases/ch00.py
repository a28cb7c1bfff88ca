"""Chapter 00 warm-up: pytrees and jax.numpy."""

import jax
import jax.numpy as jnp
import numpy as np

from stacklib.grading import Exercise, expect, expect_close

count_params = Exercise("00.count_params", "Count the numbers in a pytree of arrays")


@count_params.case(hint="Visit every leaf with jax.tree.leaves and add up each leaf's size.")
def a_flat_list_of_arrays(count):
    expect_close(count([np.zeros((3, 4)), np.ones(5)]), 17, what="count([3x4, 5])")


@count_params.case(hint="The leaves of a nested dict are its arrays, at any depth.")
def a_model_like_nested_dict(count):
    params = {
        "embed": {"embedding": np.zeros((10, 8))},
        "layers": [{"kernel": np.zeros((8, 8)), "bias": np.zeros(8)} for _ in range(2)],
    }
    expect_close(count(params), 10 * 8 + 2 * (8 * 8 + 8), what="count(params)")


@count_params.case(hint="A Python float is one number; an array of shape (0,) holds none; "
                        "None is an empty subtree, not a leaf.")
def scalars_empty_arrays_and_none(count):
    tree = (1.5, np.zeros((0,)), None, {"w": jnp.ones((2, 3))})
    expect_close(count(tree), 1 + 0 + 0 + 6, what="count((1.5, zeros(0), None, {w: 2x3}))")


tree_axpy = Exercise("00.tree_axpy", "a * x + y, leaf by leaf, over two pytrees")


@tree_axpy.case(hint="jax.tree.map(f, x, y) calls f on matching leaves of x and y.")
def matches_leafwise_arithmetic(axpy):
    x = {"w": np.arange(6.0).reshape(2, 3), "b": np.ones(3)}
    y = {"w": np.full((2, 3), 10.0), "b": np.arange(3.0)}
    expect_close(axpy(0.5, x, y), {"w": 0.5 * x["w"] + 10.0, "b": 0.5 + np.arange(3.0)})


@tree_axpy.case(hint="Return the same containers as the inputs: tuples stay tuples, lists lists.")
def keeps_the_tree_structure(axpy):
    x = (np.ones(2), [np.ones(()), np.ones(3)])
    y = (np.zeros(2), [np.ones(()), np.zeros(3)])
    expect_close(axpy(2.0, x, y), (np.full(2, 2.0), [np.array(3.0), np.full(3, 2.0)]))


@tree_axpy.case(hint="Use jax.numpy operations only, so jax.jit can trace the function.")
def works_under_jit(axpy):
    x = [jnp.ones((2, 2)), jnp.arange(3.0)]
    y = [jnp.zeros((2, 2)), jnp.ones(3)]
    got = jax.jit(lambda a, x, y: axpy(a, x, y))(3.0, x, y)
    expect_close(got, [np.full((2, 2), 3.0), 3 * np.arange(3.0) + 1])


softmax = Exercise("00.softmax", "A numerically stable softmax")


def _reference_softmax(logits, axis=-1):
    logits = np.asarray(logits, dtype=np.float64)
    shifted = np.exp(logits - logits.max(axis=axis, keepdims=True))
    return shifted / shifted.sum(axis=axis, keepdims=True)


@softmax.case(hint="softmax(z)_i = exp(z_i) / sum_j exp(z_j).")
def matches_the_definition_on_small_logits(softmax_fn):
    logits = np.array([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]], dtype=np.float32)
    expect_close(softmax_fn(logits), _reference_softmax(logits), rtol=1e-5)


@softmax.case(points=2, hint="exp(1000.) overflows float32 to inf; subtract the maximum of each "
                             "row first: softmax(z) = softmax(z - max(z)).")
def large_logits_do_not_overflow(softmax_fn):
    logits = np.array([[1000.0, 1000.0, 990.0], [-1000.0, -1001.0, -1002.0]], dtype=np.float32)
    got = np.asarray(softmax_fn(logits))
    expect(not np.isnan(got).any(), f"{np.isnan(got).sum()} of {got.size} probabilities are NaN")
    expect_close(got, _reference_softmax(logits), rtol=1e-5)


@softmax.case(hint="Reduce over `axis` (with keepdims=True), not always over the last axis.")
def respects_the_axis_argument(softmax_fn):
    logits = np.random.default_rng(0).normal(size=(4, 3, 5)).astype(np.float32)
    expect_close(softmax_fn(logits, axis=1), _reference_softmax(logits, axis=1), rtol=1e-5)


pairwise = Exercise("00.pairwise_sq_dists", "All pairwise squared distances, by broadcasting")


def _reference_pairwise(x, y):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    # |x - y|^2 = |x|^2 + |y|^2 - 2 x.y, without an (n, m, d) intermediate.
    return (x**2).sum(1)[:, None] + (y**2).sum(1)[None, :] - 2 * x @ y.T


@pairwise.case(hint="out[i, j] = sum_k (x[i, k] - y[j, k]) ** 2.")
def matches_a_double_loop(dists):
    x = np.array([[0.0, 0.0], [1.0, 1.0]], dtype=np.float32)
    y = np.array([[1.0, 0.0], [3.0, 4.0], [0.0, 0.0]], dtype=np.float32)
    expect_close(dists(x, y), _reference_pairwise(x, y))


@pairwise.case(hint="x has n rows and y has m rows: the result is (n, m), not (m, n).")
def returns_n_by_m(dists):
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(5, 3)), rng.normal(size=(7, 3))
    expect_close(dists(x.astype(np.float32), y.astype(np.float32)), _reference_pairwise(x, y),
                 rtol=1e-4, atol=1e-4)


# The cost of a Python double loop is about a microsecond per pair whatever the width,
# while broadcasting pays per number: with 3000 x 3000 pairs of 2-d points, a double
# loop takes ~10 s here and broadcasting ~0.1 s, so the 3 s limit separates them even on
# a loaded machine.
@pairwise.case(time_limit_s=3, hint="Python loops over 3000 x 3000 pairs are slow: broadcast "
                                    "x[:, None, :] against y[None, :, :], or expand the square.")
def is_fast_on_3000_points(dists):
    rng = np.random.default_rng(2)
    x = rng.normal(size=(3000, 2)).astype(np.float32)
    y = rng.normal(size=(3000, 2)).astype(np.float32)
    expect_close(dists(x, y), _reference_pairwise(x, y), rtol=1e-3, atol=1e-3)
