"""Chapter 00 warm-up: pytrees and jax.numpy.

Every case computes its expected answer first and hands the learner copies of its inputs
(`call_on_copies`), so an answer that changes the caller's arrays, lists or dicts in place
is told so instead of being graded against the data it changed.
"""

import jax
import jax.numpy as jnp
import numpy as np

from stacklib.grading import Exercise, call_on_copies, expect, expect_close

count_params = Exercise("00.count_params", "Count the numbers in a pytree of arrays")


def _is_whole_number(value) -> bool:
    """An int, or a NumPy/JAX integer scalar; not a float that happens to be whole, not a bool.

    The statement asks for an `int`; an `np.int64` (what `np.sum` of sizes returns) is accepted
    on purpose: it compares, adds and prints as an int, and the mistake worth catching is a
    float count (`np.prod(())` is 1.0), which is rejected.
    """
    if isinstance(value, bool):
        return False
    if isinstance(value, int | np.integer):
        return True
    try:
        array = np.asarray(value)
    except Exception:  # not array-like at all
        return False
    return array.ndim == 0 and array.dtype.kind in "iu"


def _expect_count(got, expected: int, what: str) -> None:
    expect(_is_whole_number(got),
           f"{what} returned {got!r:.60} ({type(got).__name__}): a count of numbers is a whole "
           "number, so return an int (np.size(leaf) is one; np.prod(()) is the float 1.0)")
    expect(int(got) == expected, f"{what}: expected {expected}, got {int(got)}")


@count_params.case(hint="Visit every leaf with jax.tree.leaves and add up each leaf's size.")
def a_flat_list_of_arrays(count):
    tree = [np.zeros((3, 4)), np.ones(5)]
    _expect_count(call_on_copies(count, tree, what="count_params"), 17, what="count([3x4, 5])")


@count_params.case(hint="The leaves of a nested dict are its arrays, at any depth.")
def a_model_like_nested_dict(count):
    params = {
        "embed": {"embedding": np.zeros((10, 8))},
        "layers": [{"kernel": np.zeros((8, 8)), "bias": np.zeros(8)} for _ in range(2)],
    }
    _expect_count(call_on_copies(count, params, what="count_params"), 10 * 8 + 2 * (8 * 8 + 8),
                  what="count(params)")


@count_params.case(points=2, hint="A Python float is one number; an array of shape (0,) holds none; "
                                  "None is an empty subtree, not a leaf.")
def scalars_empty_arrays_and_none(count):
    tree = (1.5, np.zeros((0,)), None, {"w": jnp.ones((2, 3))})
    _expect_count(call_on_copies(count, tree, what="count_params"), 1 + 0 + 0 + 6,
                  what="count((1.5, zeros(0), None, {w: 2x3}))")


# A 7-billion-parameter model is counted before any memory is allocated, on the shapes that
# jax.eval_shape returns. Its count is past 2**31, where an int32 sum (jnp's default integer)
# overflows: OverflowError when jnp.array holds the sizes, a negative number when np.sum is
# told dtype=int32.
@count_params.case(points=2, hint="Some counts are past 2**31 - 1, the largest int32: add the sizes as "
                                  "Python ints (sum(...)), not in a jnp array, whose integers are int32.")
def abstract_parameters_past_two_to_the_31(count):
    params = {"embed": jax.ShapeDtypeStruct((50_000, 50_000), jnp.bfloat16),
              "head": {"kernel": jax.ShapeDtypeStruct((3, 7), jnp.float32)}}
    _expect_count(call_on_copies(count, params, what="count_params"), 50_000 * 50_000 + 3 * 7,
                  what="count(jax.eval_shape of a model with a 50000 x 50000 embedding)")


tree_axpy = Exercise("00.tree_axpy", "a * x + y, leaf by leaf, over two pytrees")


@tree_axpy.case(hint="Leaves are matched by their place in the tree (in a dict, by key, whatever order the "
                    "keys were inserted in), not by their order: jax.tree.map(f, x, y) pairs them so.")
def matches_leafwise_arithmetic_by_key(axpy):
    x = {"w": np.arange(6.0).reshape(2, 3), "b": np.ones(3)}
    y = {"b": np.arange(3.0), "w": np.full((2, 3), 10.0)}  # the same tree: a dict's keys, not their order
    expected = {"w": 0.5 * x["w"] + 10.0, "b": 0.5 + np.arange(3.0)}
    expect_close(call_on_copies(axpy, 0.5, x, y, what="tree_axpy"), expected)


@tree_axpy.case(hint="Return the same containers as the inputs: tuples stay tuples, lists lists.")
def keeps_the_tree_structure(axpy):
    x = (np.ones(2), [np.ones(()), np.ones(3)])
    y = (np.zeros(2), [np.ones(()), np.zeros(3)])
    expected = (np.full(2, 2.0), [np.array(3.0), np.full(3, 2.0)])
    expect_close(call_on_copies(axpy, 2.0, x, y, what="tree_axpy"), expected)


@tree_axpy.case(hint="Use jax.numpy operations only, so jax.jit can trace the function. (If a case above "
                     "fails too, fix it first: this one runs the same kind of input under jit.)")
def works_under_jit(axpy):
    x = [jnp.ones((2, 2)), jnp.arange(3.0)]
    y = [jnp.zeros((2, 2)), jnp.ones(3)]
    expected = [np.full((2, 2), 3.0), 3 * np.arange(3.0) + 1]
    got = call_on_copies(jax.jit(lambda a, x, y: axpy(a, x, y)), 3.0, x, y, what="tree_axpy")
    expect_close(got, expected)


softmax = Exercise("00.softmax", "A numerically stable softmax")


def _reference_softmax(logits, axis=-1):
    logits = np.asarray(logits, dtype=np.float64)
    shifted = np.exp(logits - logits.max(axis=axis, keepdims=True))
    return shifted / shifted.sum(axis=axis, keepdims=True)


@softmax.case(hint="softmax(z)_i = exp(z_i) / sum_j exp(z_j).")
def matches_the_definition_on_small_logits(softmax_fn):
    logits = np.array([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]], dtype=np.float32)
    expected = _reference_softmax(logits)
    expect_close(call_on_copies(softmax_fn, logits, what="softmax"), expected, rtol=1e-5)


# The third row spans 2000: shifting by its minimum or its mean (both harmless on the first
# two rows) still leaves exp(2000.) or exp(1000.), which overflow.
@softmax.case(points=2, hint="exp overflows float32 above about 88 (exp(1000.) is inf, and inf / inf is "
                             "NaN). Softmax does not change when the same number is subtracted from every "
                             "logit of a row: choose that number so that no exp overflows, whatever the "
                             "row's range.")
def large_logits_do_not_overflow(softmax_fn):
    logits = np.array([[1000.0, 1000.0, 990.0], [-1000.0, -1001.0, -1002.0], [1000.0, 0.0, -1000.0]],
                      dtype=np.float32)
    expected = _reference_softmax(logits)
    got = np.asarray(call_on_copies(softmax_fn, logits, what="softmax"))
    expect(not np.isnan(got).any(), f"{np.isnan(got).sum()} of {got.size} probabilities are NaN")
    expect_close(got, expected, rtol=1e-5)


@softmax.case(hint="Reduce over `axis` (with keepdims=True), not always over the last axis.")
def respects_the_axis_argument(softmax_fn):
    logits = np.random.default_rng(0).normal(size=(4, 3, 5)).astype(np.float32)
    expected = _reference_softmax(logits, axis=1)
    expect_close(call_on_copies(softmax_fn, logits, axis=1, what="softmax"), expected, rtol=1e-5)
    # "Any shape" includes one example's logits, a vector: an answer that restores the reduced
    # axis with [:, None] passes every 2-D and 3-D input above and fails here.
    vector = np.array([2.0, -1.0, 0.5, 0.0], dtype=np.float32)
    expect_close(call_on_copies(softmax_fn, vector, what="softmax"), _reference_softmax(vector), rtol=1e-5,
                 what="softmax of a 1-D vector of logits",
                 hint="The logits may have any number of dimensions, a single vector too: keep the reduced "
                      "axis with keepdims=True rather than adding it back by indexing, which assumes 2-D.")


@softmax.case(hint="Use jax.numpy (jnp.exp, jnp.sum and the like), not NumPy: under jax.jit the logits are a "
                   "traced array, which NumPy functions cannot compute on. (If a case above fails too, fix "
                   "it first: this one runs the same kind of input under jit.)")
def is_traceable_by_jit(softmax_fn):
    logits = jnp.array([[0.5, -1.0, 2.0], [3.0, 3.0, 3.0]])
    expected = _reference_softmax(logits)
    expect_close(jax.jit(lambda z: softmax_fn(z))(logits), expected, rtol=1e-5,
                 what="jax.jit(softmax)(logits)")


pairwise = Exercise("00.pairwise_sq_dists", "All pairwise squared distances, by broadcasting")


def _reference_pairwise(x, y):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    # |x - y|^2 = |x|^2 + |y|^2 - 2 x.y, without an (n, m, d) intermediate.
    return (x**2).sum(1)[:, None] + (y**2).sum(1)[None, :] - 2 * x @ y.T


@pairwise.case(hint="out[i, j] = sum_k (x[i, k] - y[j, k]) ** 2.")
def matches_a_double_loop(dists):
    x = np.array([[0.0, 0.0], [1.0, 1.0]], dtype=np.float32)
    y = np.array([[1.0, 0.0], [3.0, 4.0], [0.0, 0.0]], dtype=np.float32)
    expected = _reference_pairwise(x, y)
    expect_close(call_on_copies(dists, x, y, what="pairwise_sq_dists"), expected)


@pairwise.case(hint="x has n rows and y has m rows: the result is (n, m), not (m, n).")
def returns_n_by_m(dists):
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(5, 3)).astype(np.float32), rng.normal(size=(7, 3)).astype(np.float32)
    expected = _reference_pairwise(x, y)
    expect_close(call_on_copies(dists, x, y, what="pairwise_sq_dists"), expected,
                 rtol=1e-4, atol=1e-4)


# A Python loop pays about a microsecond or more per iteration whatever the width, while
# broadcasting pays per number. 3 M rows of x against 2 of y catch a loop over x's rows
# (3 M iterations of a few NumPy calls: about 10 s here) and a double loop (6 M); the
# mirror image catches a loop over y's rows. Broadcasting does both in a fraction of a
# second (0.6-1.0 s on a 2-core CPU with load 9), and load slows both alike: the 6 s limit
# sits about 20x above broadcasting at rest and well below the loops. To keep the case
# itself cheap, the answer is checked on 2000 sampled entries per shape, computed
# beforehand, and the inputs are made read-only instead of copied: writing into them raises.
_FAST_SHAPES = [(3_000_000, 2), (2, 3_000_000)]


@pairwise.case(time_limit_s=6, hint="A Python loop over the rows of x or of y (or over pairs) runs "
                                    "millions of times here. Let broadcasting form every difference at "
                                    "once: give x and y each a new axis, so that x - y has shape (n, m, d).")
def is_fast_on_large_inputs(dists):
    rng = np.random.default_rng(2)
    for n, m in _FAST_SHAPES:
        x, y = rng.random((n, 2), dtype=np.float32), rng.random((m, 2), dtype=np.float32)
        x.flags.writeable = y.flags.writeable = False
        rows, cols = rng.integers(0, n, size=2000), rng.integers(0, m, size=2000)
        expected = ((x[rows].astype(np.float64) - y[cols]) ** 2).sum(axis=1)
        got = np.asarray(dists(x, y))
        expect(got.shape == (n, m), f"pairwise_sq_dists(x, y) with x {x.shape} and y {y.shape}: "
                                    f"expected shape {(n, m)}, got {got.shape}")
        expect_close(got[rows, cols], expected, rtol=1e-3, atol=1e-3,
                     what=f"2000 sampled entries of the {n} x {m} result")
