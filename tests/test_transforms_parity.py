"""stacklib.transforms against jax: the same Python functions through both, on random inputs.

Each function is written once against a NumPy-like module `m`, and run with
`m = stacklib.transforms.numpy` under our transforms and with `m = jax.numpy` under
jax's. Hypothesis draws the sizes, the random seed and the scale of the inputs.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs

import stacklib.transforms as st
import stacklib.transforms.numpy as tnp


@pytest.fixture(autouse=True, scope="module")
def float64_jax():
    """Run this module's jax side in float64, without switching it on for other test files
    (a global `jax_enable_x64` would leak into every module the same worker runs)."""
    with jax.enable_x64(True):
        yield

# Both sides compute in float64 with the same formulas, so they differ by rounding only
# (about 1e-15 relative); the bar is 1e-6, far above that. atol covers values
# that cancel to nearly zero, where a relative bound means nothing.
RTOL, ATOL = 1e-6, 1e-9
EXAMPLES = settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --------------------------------------------------------------------------- the functions


def tanh_mlp_loss(m):
    def loss(params, x, y):
        (w1, b1), (w2, b2) = params
        hidden = m.tanh(x @ w1 + b1)
        return m.mean((hidden @ w2 + b2 - y) ** 2)

    def inputs(rng, n, d, scale):
        params = ((scale * rng.normal(size=(d, 2 * d)), rng.normal(size=2 * d)),
                  (rng.normal(size=(2 * d, 2)), rng.normal(size=2)))
        return params, rng.normal(size=(n, d)), rng.normal(size=(n, 2))

    return loss, inputs


def softmax_cross_entropy(m):
    def loss(logits, labels):
        shifted = logits - m.max(logits, axis=-1, keepdims=True)
        log_probs = shifted - m.log(m.sum(m.exp(shifted), axis=-1, keepdims=True))
        return -m.mean(m.sum(labels * log_probs, axis=-1))

    def inputs(rng, n, d, scale):
        return scale * rng.normal(size=(n, d)), np.eye(d)[rng.integers(0, d, size=n)]

    return loss, inputs


def polynomial(m):
    def p(x):
        return m.sum(3 * x**4 - 2 * x**3 + x**2 / 7 - x + 1.5)

    def inputs(rng, n, d, scale):
        return (scale * rng.normal(size=(n,)),)

    return p, inputs


def where_and_max(m):
    def f(x, y):
        picked = m.where(x > y, x * y, m.maximum(x, 0.5 * y))
        return m.sum(picked**3) / m.max(m.exp(x)) - m.sum(m.minimum(x, y))

    def inputs(rng, n, d, scale):
        return scale * rng.normal(size=(n, d)), scale * rng.normal(size=(n, d))

    return f, inputs


def matrix_function(m):
    def f(a, b):
        c = a @ b.T  # (n, n)
        d = m.transpose(m.reshape(c, (-1,)).reshape(c.shape))
        return m.sum(m.exp(-(d**2)) * m.broadcast_to(m.sum(a, axis=1, keepdims=True), d.shape)) + m.sum(
            m.dot(a.T, b) ** 2)

    def inputs(rng, n, d, scale):
        return scale * rng.normal(size=(n, d)), rng.normal(size=(n, d))

    return f, inputs


FUNCTIONS = {fn.__name__: fn for fn in (tanh_mlp_loss, softmax_cross_entropy, polynomial, where_and_max,
                                        matrix_function)}
# The argument that vmap batches (the data), and the one grad differentiates (the parameters):
# for the MLP, vmap(grad(loss)) over x gives per-example gradients.
BATCHED_ARG = {"tanh_mlp_loss": 1}


# --------------------------------------------------------------------------- the transforms
# Each takes (library, numpy module, function, args, rng) and returns a pytree of arrays.


def _like(tree, rng):
    return jax.tree.map(lambda a: rng.normal(size=np.shape(a)), tree)


def _random_extras(args, argnum, rng, batch=3):
    """The NumPy inputs a transform needs besides args: tangents, and a batch of args[argnum]."""
    stacked = np.stack([args[argnum] + 0.1 * rng.normal(size=np.shape(args[argnum])) for _ in range(batch)])
    batched_args = (*args[:argnum], stacked, *args[argnum + 1:])
    return {
        "tangents": _like(args, rng),
        "batched_args": batched_args,
        "batched_tangents": _like(batched_args, rng),
        "in_axes": tuple(0 if i == argnum else None for i in range(len(args))),
    }


def _value(lib, m, f, args, extra):
    return f(*args)


def _jvp(lib, m, f, args, extra):
    return lib.jvp(f, args, extra["tangents"])


def _grad(lib, m, f, args, extra):
    return lib.grad(f, argnums=tuple(range(len(args))))(*args)


def _second_derivative(lib, m, f, args, extra):
    # The derivative of the gradient along a direction (a Hessian-vector product, forward
    # over reverse), and the gradient of the squared gradient norm (reverse over reverse).
    def grad_0(a):
        return lib.grad(f)(a, *args[1:])

    hvp = lib.jvp(grad_0, (args[0],), (extra["tangents"][0],))[1]
    squared_norm = lambda a: sum(m.sum(g**2) for g in jax.tree.leaves(grad_0(a)))  # noqa: E731
    return hvp, lib.grad(squared_norm)(args[0])


def _vmap(lib, m, f, args, extra):
    return lib.vmap(f, in_axes=extra["in_axes"])(*extra["batched_args"])


def _vmap_grad(lib, m, f, args, extra):
    return lib.vmap(lib.grad(f), in_axes=extra["in_axes"])(*extra["batched_args"])


def _jit_vmap_grad(lib, m, f, args, extra):
    return lib.jit(lib.vmap(lib.grad(f), in_axes=extra["in_axes"], out_axes=-1))(*extra["batched_args"])


def _jvp_of_vmap(lib, m, f, args, extra):
    return lib.jvp(lib.vmap(f, in_axes=extra["in_axes"]), extra["batched_args"], extra["batched_tangents"])


TRANSFORMS = {fn.__name__.strip("_"): fn for fn in (_value, _jvp, _grad, _second_derivative, _vmap,
                                                    _vmap_grad, _jit_vmap_grad, _jvp_of_vmap)}


def _assert_trees_close(ours, theirs):
    ours_leaves, ours_tree = jax.tree.flatten(ours)
    theirs_leaves, theirs_tree = jax.tree.flatten(theirs)
    assert ours_tree == theirs_tree
    for a, b in zip(ours_leaves, theirs_leaves, strict=True):
        assert np.shape(a) == np.shape(b)
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=RTOL, atol=ATOL)


@pytest.mark.slow  # 40 cases of 4 examples; jax compiles each example: 40-70 s in all on 2 busy cores
@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("function", FUNCTIONS)
@EXAMPLES
@given(seed=hs.integers(0, 2**32 - 2), n=hs.integers(1, 4), d=hs.integers(1, 3),
       scale=hs.sampled_from([0.1, 1.0, 3.0]))
def test_ours_agree_with_jax(function, transform, seed, n, d, scale):
    rng = np.random.default_rng(seed)
    args = FUNCTIONS[function](np)[1](rng, n, d, scale)
    extra = _random_extras(args, BATCHED_ARG.get(function, 0), rng)

    def run(lib, m, args, extra):
        return TRANSFORMS[transform](lib, m, FUNCTIONS[function](m)[0], args, extra)

    ours = run(st, tnp, args, extra)
    theirs = _run_jax_jitted(run, args, extra)
    _assert_trees_close(ours, theirs)


def _run_jax_jitted(run, args, extra):
    """jax's result under jax.jit: compiled once per example instead of op by op (several times
    faster here), which does not change what jax computes."""
    arrays = {k: v for k, v in extra.items() if k != "in_axes"}
    return jax.jit(lambda args, arrays: run(jax, jnp, args, {**arrays, "in_axes": extra["in_axes"]}))(
        args, arrays)


# --------------------------------------------------------------------------- staging


def _primitive_names(closed):
    """Primitive names in order, with jax's nested `jit` equations (e.g. around where) inlined."""
    names = []
    for eqn in closed.eqns:
        if eqn.primitive.name in ("jit", "pjit"):
            names += _primitive_names(eqn.params["jaxpr"])
        else:
            names.append(eqn.primitive.name)
    return names


# jnp's broadcasting differs in two places (size-1 axes, weak-typed scalars): these agree.
SAME_PRIMITIVES = ["tanh_mlp_loss", "polynomial", "where_and_max", "matrix_function"]


@pytest.mark.parametrize("function", SAME_PRIMITIVES)
def test_our_jaxprs_have_the_same_equations_as_jax(function):
    args = FUNCTIONS[function](np)[1](np.random.default_rng(0), 3, 2, 1.0)
    if function == "tanh_mlp_loss":  # jax adds the bias through a (1, k) broadcast: skip b
        ours = st.make_jaxpr(lambda x, w: tnp.sum(tnp.tanh(x @ w)))(args[1], args[0][0][0])
        theirs = jax.make_jaxpr(lambda x, w: jnp.sum(jnp.tanh(x @ w)))(args[1], args[0][0][0])
    else:
        ours = st.make_jaxpr(FUNCTIONS[function](tnp)[0])(*args)
        theirs = jax.make_jaxpr(FUNCTIONS[function](jnp)[0])(*args)
    assert _primitive_names(ours) == _primitive_names(theirs)
    assert [str(a) for a in ours.in_avals] == [a.str_short(short_dtypes=True) for a in theirs.in_avals]
    assert [str(a) for a in ours.out_avals] == [a.str_short(short_dtypes=True) for a in theirs.out_avals]


def test_the_jit_caches_grow_alike():
    ours = st.jit(lambda x, n: x * n, static_argnums=1)
    theirs = jax.jit(lambda x, n: x * n, static_argnums=1)
    calls = [(np.ones(3), 2), (np.ones(3), 2), (np.zeros(3), 2), (np.ones(4), 2),
             (np.ones(4, np.float32), 2), (np.ones(4), 3), (np.ones((2, 2)), 3)]
    sizes = {"ours": [], "theirs": []}
    for args in calls:
        ours(*args)
        theirs(*args)
        sizes["ours"].append(ours._cache_size())
        sizes["theirs"].append(theirs._cache_size())
    assert sizes["ours"] == sizes["theirs"] == [1, 1, 1, 2, 3, 4, 5]


BAD_INPUT = {
    "non-scalar grad": (lambda lib, m: lib.grad(m.sin)(np.ones(3)), TypeError, "scalar-output functions"),
    "vmap sizes": (lambda lib, m: lib.vmap(lambda x, y: x)(np.ones(3), np.ones(4)), ValueError,
                   "inconsistent sizes"),
    "vmap axis": (lambda lib, m: lib.vmap(m.sin, in_axes=1)(np.ones(3)), ValueError,
                  "rank should be at least 2"),
    "python if": (lambda lib, m: lib.jit(lambda x: x if x > 0 else -x)(1.0), TypeError, "boolean conversion"),
    "numpy on a tracer": (lambda lib, m: lib.jit(lambda x: np.sin(x))(np.ones(2)), TypeError, "__array__()"),
}


@pytest.mark.parametrize("case", BAD_INPUT)
def test_bad_input_fails_the_same_way(case):
    bad_call, error, words = BAD_INPUT[case]
    for lib, m in ((st, tnp), (jax, jnp)):
        with pytest.raises(error, match=re.escape(words)):
            bad_call(lib, m)
