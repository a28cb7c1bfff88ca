"""Chapter 01: rules for the mini-JAX of `stacklib.transforms`, graded against JAX.

Each case installs the learner's rule in the rule table it belongs to for the duration of
the case, then runs whole transformations through it and compares with `jax` in float64
(`jax.enable_x64` inside the case, so the learner's session keeps JAX's defaults).
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np

import stacklib.transforms as st
import stacklib.transforms.numpy as tnp
from stacklib.grading import Exercise, expect, expect_close
from stacklib.transforms import batching, forward, lax, reverse

RNG_SEED = 1


def _rng():
    return np.random.default_rng(RNG_SEED)


@contextlib.contextmanager
def _installed(table: dict, primitive, rule):
    """Put `rule` in `table[primitive]` for a `with` block, then restore the original."""
    previous = table.get(primitive)
    table[primitive] = rule
    try:
        yield
    finally:
        if previous is None:
            table.pop(primitive, None)
        else:
            table[primitive] = previous


# --------------------------------------------------------------------------- 01.tanh_jvp

tanh_jvp = Exercise("01.tanh_jvp", "The JVP rule of tanh")


@tanh_jvp.case(points=2, hint="Return (tanh(x), (1 - tanh(x)**2) * t): the primal output, and the "
                              "tangent, which is linear in t.")
def jvp_matches_jax(rule):
    x, v = _rng().normal(size=(3, 4)), _rng().normal(size=(3, 4)) * 0.5
    with _installed(forward.primitive_jvps, lax.tanh_p, rule):
        got = st.jvp(tnp.tanh, (x,), (v,))
    with jax.enable_x64(True):
        expected = jax.jvp(jnp.tanh, (x,), (v,))
    expect_close(got, tuple(np.asarray(e) for e in expected), rtol=1e-10, atol=1e-12,
                 what="jvp(tanh, (x,), (v,))")


@tanh_jvp.case(hint="grad comes from your JVP rule by linearize and transpose: if jvp is right, "
                    "so is this. The tangent must be a product of t with something that does "
                    "not depend on t.")
def grad_of_a_tanh_layer_matches_jax(rule):
    x, w = _rng().normal(size=(5, 3)), _rng().normal(size=(3, 2))
    with _installed(forward.primitive_jvps, lax.tanh_p, rule):
        got = st.grad(lambda w: tnp.sum(tnp.tanh(x @ w) ** 2))(w)
    with jax.enable_x64(True):
        expected = jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w) ** 2))(w)
    expect_close(got, np.asarray(expected), rtol=1e-10, atol=1e-12, what="grad of the layer")


@tanh_jvp.case(hint="For grad(grad(...)) your rule runs on tracers: compute with lax.tanh, lax.mul, "
                    "lax.sub, lax.integer_pow (or stacklib.transforms.numpy), not with NumPy.")
def second_derivative_matches_jax(rule):
    xs = np.linspace(-2.0, 2.0, 7)
    with _installed(forward.primitive_jvps, lax.tanh_p, rule):
        got = st.vmap(st.grad(st.grad(tnp.tanh)))(xs)
    with jax.enable_x64(True):
        expected = jax.vmap(jax.grad(jax.grad(jnp.tanh)))(xs)
    expect_close(got, np.asarray(expected), rtol=1e-10, atol=1e-12, what="tanh''(x)")


# --------------------------------------------------------------------------- 01.reduce_sum_transpose

reduce_sum_transpose = Exercise("01.reduce_sum_transpose", "The transpose rule of reduce_sum")


def _grad_with(rule, f, x):
    with _installed(reverse.primitive_transposes, lax.reduce_sum_p, rule):
        return st.grad(f)(x)


@reduce_sum_transpose.case(hint="Summing everything gives a scalar cotangent; each input element "
                                "contributed once, so each gets that cotangent: broadcast it back "
                                "to operand.aval.shape.")
def sum_of_everything(rule):
    x = _rng().normal(size=(3, 4))
    got = _grad_with(rule, lambda x: tnp.sum(tnp.sin(x)), x)
    expect_close(got, np.cos(x), rtol=1e-12, what="grad of sum(sin(x))")


@reduce_sum_transpose.case(points=2, hint="The cotangent has the operand's shape without the summed "
                                          "axes: lax.broadcast_in_dim(ct, shape, kept_axes) puts "
                                          "them back, with kept_axes = the axes not in `axes`.")
def sum_over_one_axis(rule):
    x = _rng().normal(size=(3, 4))
    got = _grad_with(rule, lambda x: tnp.sum(tnp.sum(x, axis=0) ** 2), x)
    expect_close(got, np.broadcast_to(2 * x.sum(axis=0), x.shape), rtol=1e-12,
                 what="grad of sum(sum(x, axis=0) ** 2)")


@reduce_sum_transpose.case(hint="A middle axis: NumPy-style broadcast_to aligns trailing axes and "
                                "cannot put a (2, 4) cotangent back into (2, 3, 4); broadcast_in_dim "
                                "with the kept axes (0, 2) can.")
def sum_over_a_middle_axis_with_a_general_cotangent(rule):
    x, ct = _rng().normal(size=(2, 3, 4)), _rng().normal(size=(2, 4))
    with _installed(reverse.primitive_transposes, lax.reduce_sum_p, rule):
        _, f_vjp = st.vjp(lambda x: tnp.sum(x * 2.0, axis=1), x)
        (got,) = f_vjp(ct)
    expect_close(got, np.broadcast_to(2.0 * ct[:, None, :], x.shape), rtol=1e-12,
                 what="vjp of sum(2x, axis=1)")


# --------------------------------------------------------------------------- 01.reduce_sum_batch

reduce_sum_batch = Exercise("01.reduce_sum_batch", "The batching rule of reduce_sum")


def _vmap_with(rule, f, x, in_axes=0):
    with _installed(batching.primitive_batchers, lax.reduce_sum_p, rule):
        return st.vmap(f, in_axes=in_axes)(x)


@reduce_sum_batch.case(hint="`axes` counts the axes of one example; the batched array has one more "
                            "axis, at batch_dim, so example axis a is array axis a + 1 if a >= batch_dim.")
def batch_in_front(rule):
    x = _rng().normal(size=(5, 3, 4))
    got = _vmap_with(rule, lambda e: tnp.sum(e, axis=0), x)
    expect_close(got, x.sum(axis=1), rtol=1e-12, what="vmap(sum(axis=0)) over axis 0")


@reduce_sum_batch.case(points=2, hint="Return the axis where the batch is in the output: every summed "
                                      "axis before batch_dim moves it one to the left.")
def batch_at_the_end(rule):
    x = _rng().normal(size=(3, 4, 5))
    got = _vmap_with(rule, lambda e: tnp.sum(e, axis=1), x, in_axes=2)
    expect_close(got, x.sum(axis=1).T, rtol=1e-12, what="vmap(sum(axis=1), in_axes=2)")


@reduce_sum_batch.case(hint="Nested vmaps call your rule twice, with different batch axes; "
                            "sum(x) with no axis sums every example axis.")
def nested_vmaps_sum_each_matrix(rule):
    x = _rng().normal(size=(2, 3, 4, 5))
    with _installed(batching.primitive_batchers, lax.reduce_sum_p, rule):
        got = st.vmap(st.vmap(tnp.sum, in_axes=1), in_axes=3)(x)  # sums each (2, 4) matrix
    expect_close(got, x.sum(axis=(0, 2)).T, rtol=1e-12, what="vmap(vmap(sum, in_axes=1), in_axes=3)")


# --------------------------------------------------------------------------- 01.logistic

logistic = Exercise("01.logistic", "A new primitive, end to end: logistic")


@contextlib.contextmanager
def _defined(define_logistic):
    """A fresh `logistic` primitive with the learner's definitions, removed from the tables after."""
    primitive = st.Primitive("logistic")
    try:
        define_logistic(primitive)
        yield primitive
    finally:
        forward.primitive_jvps.pop(primitive, None)
        batching.primitive_batchers.pop(primitive, None)


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


@logistic.case(hint="def_impl takes a function of NumPy arrays: 1 / (1 + np.exp(-x)).")
def evaluates_like_the_formula(define_logistic):
    x = _rng().normal(size=(2, 3)) * 3
    with _defined(define_logistic) as logistic_p:
        expect_close(logistic_p.bind(x), _sigmoid(x), rtol=1e-12, what="logistic(x)")


@logistic.case(hint="def_abstract_eval maps the input ShapedArray to the output's: logistic is "
                    "elementwise, so the output has the input's shape and dtype.")
def stages_to_one_equation(define_logistic):
    x = np.ones((4, 2), np.float32)
    with _defined(define_logistic) as logistic_p:
        closed = st.make_jaxpr(logistic_p.bind)(x)
    expect([e.primitive.name for e in closed.eqns] == ["logistic"],
           f"expected one 'logistic' equation, got {[e.primitive.name for e in closed.eqns]}")
    expect(str(closed.out_avals[0]) == "f32[4,2]",
           f"expected the output type f32[4,2], got {closed.out_avals[0]}")


@logistic.case(points=2, hint="The JVP rule returns (y, t * y * (1 - y)) with y = logistic_p.bind(x); "
                              "reverse mode then needs no rule of its own.")
def jvp_and_grad_match_jax(define_logistic):
    x, v = _rng().normal(size=5), _rng().normal(size=5)
    with _defined(define_logistic) as logistic_p:
        got = st.jvp(logistic_p.bind, (x,), (v,)), st.grad(lambda x: tnp.sum(logistic_p.bind(x) ** 2))(x)
    with jax.enable_x64(True):
        expected = (jax.jvp(jax.nn.sigmoid, (x,), (v,)),
                    jax.grad(lambda x: jnp.sum(jax.nn.sigmoid(x) ** 2))(x))
    expect_close(got, jax.tree.map(np.asarray, expected), rtol=1e-10, atol=1e-12, what="(jvp, grad)")


@logistic.case(hint="logistic is elementwise: apply it to the batched array as it is and return the "
                    "batch axis you were given.")
def vmap_over_any_axis(define_logistic):
    x = _rng().normal(size=(3, 4))
    with _defined(define_logistic) as logistic_p:
        got = st.vmap(logistic_p.bind, in_axes=1)(x)
    expect_close(got, _sigmoid(x).T, rtol=1e-12, what="vmap(logistic, in_axes=1)")


@logistic.case(hint="Under jit every input is a tracer without a value: the rules must compute with "
                    "primitives (logistic_p.bind, lax.mul, ...), never with NumPy.")
def composes_under_jit_vmap_grad(define_logistic):
    x = _rng().normal(size=(4, 3))
    with _defined(define_logistic) as logistic_p:
        got = st.jit(st.vmap(st.grad(lambda r: tnp.sum(logistic_p.bind(r)))))(x)
    expect_close(got, _sigmoid(x) * (1 - _sigmoid(x)), rtol=1e-10, what="jit(vmap(grad(sum(logistic))))")


# --------------------------------------------------------------------------- 01.jacfwd

jacfwd = Exercise("01.jacfwd", "jacfwd from jvp and vmap")


def _sample_function(m):
    def f(x):  # R^3 -> R^2, a non-symmetric Jacobian
        return m.tanh(np.array([[1.0, 2.0, 0.0], [0.0, -1.0, 3.0]]) @ x) * m.sum(x**2)
    return f


def _square_function(m):
    def f(x):  # R^3 -> R^3, a non-symmetric Jacobian
        return m.sin(np.arange(9.0).reshape(3, 3) @ x) + x**3
    return f


@jacfwd.case(hint="Column j of the Jacobian is the JVP in the direction of the basis vector e_j.")
def an_elementwise_function_has_a_diagonal_jacobian(make_jacfwd):
    x = _rng().normal(size=4)
    expect_close(make_jacfwd(tnp.sin)(x), np.diag(np.cos(x)), rtol=1e-12, what="jacfwd(sin)(x)")


@jacfwd.case(points=2, hint="The result has shape (outputs, inputs): J[i, j] = d out_i / d x_j, so "
                            "the basis direction is the last axis (out_axes=-1).")
def matches_jax_jacfwd(make_jacfwd):
    x = _rng().normal(size=3)
    with jax.enable_x64(True):
        expected = np.asarray(jax.jacfwd(_sample_function(jnp))(x))
    expect_close(make_jacfwd(_sample_function(tnp))(x), expected, rtol=1e-10, what="jacfwd(f)(x)")


@jacfwd.case(hint="vmap the JVP over the rows of np.eye(n): f is then called once, on a batch of "
                  "directions, instead of n times in a Python loop.")
def calls_the_function_once(make_jacfwd):
    calls = []

    def counted(x):
        calls.append(1)
        return _sample_function(tnp)(x)

    make_jacfwd(counted)(_rng().normal(size=3))
    expect(len(calls) == 1, f"f was called {len(calls)} times; vmap over the directions calls it once")


@jacfwd.case(hint="Your jacfwd must itself be traceable: build it from st.vmap and st.jvp only "
                  "(np.stack of tracers fails under jit).")
def works_under_jit(make_jacfwd):
    x = _rng().normal(size=3)
    with jax.enable_x64(True):
        expected = np.asarray(jax.jacfwd(_square_function(jnp))(x))
    expect_close(st.jit(make_jacfwd(_square_function(tnp)))(x), expected, rtol=1e-10,
                 what="jit(jacfwd(f))(x)")
