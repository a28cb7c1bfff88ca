"""stacklib.transforms on its own: NumPy semantics, derivatives against finite differences,
batching against Python loops, staging, the jit cache, composition, and the errors."""

import logging
import re

import numpy as np
import pytest

import stacklib.transforms as st
import stacklib.transforms.numpy as tnp
from stacklib.grading import numerical_gradient
from stacklib.transforms import lax, tree_util
from stacklib.transforms.batching import primitive_batchers
from stacklib.transforms.forward import primitive_jvps
from stacklib.transforms.reverse import linearize_flat, primitive_transposes

RNG = np.random.default_rng(0)


def rand(*shape, dtype=np.float64):
    return RNG.normal(size=shape).astype(dtype)


def mlp_loss(params, x, y):
    hidden = tnp.tanh(x @ params["w1"] + params["b1"])
    prediction = hidden @ params["w2"]
    return tnp.mean((prediction - y) ** 2)


def mlp_params():
    return {"w1": rand(3, 5), "b1": rand(5), "w2": rand(5, 2)}


# --------------------------------------------------------------------------- evaluation

EAGER_CASES = [
    ("sin", lambda m, x: m.sin(x)),
    ("exp of cos", lambda m, x: m.exp(m.cos(x))),
    ("log of squares", lambda m, x: m.log(x**2 + 1.0)),
    ("tanh", lambda m, x: m.tanh(x)),
    ("sum over an axis, keepdims", lambda m, x: m.sum(x, axis=1, keepdims=True)),
    ("max over negative axis", lambda m, x: m.max(x, axis=-1)),
    ("mean over all", lambda m, x: m.mean(x)),
    ("where", lambda m, x: m.where(x > 0, x, -2.0 * x)),
    ("maximum with a scalar", lambda m, x: m.maximum(x, 0.1)),
    ("dot of matrices", lambda m, x: m.dot(x, x.T)),
    ("batched matmul", lambda m, x: m.matmul(m.reshape(x, (2, 3, 2)), m.reshape(x, (2, 2, 3)))),
    ("reshape with -1", lambda m, x: m.reshape(x, (-1, 2))),
    ("transpose", lambda m, x: m.transpose(m.reshape(x, (3, 2, 2)), (1, 2, 0))),
    ("broadcast_to", lambda m, x: m.broadcast_to(m.sum(x, axis=0), (2, 4, 3))),
    ("power with a float exponent", lambda m, x: m.power(m.exp(x), 1.5)),
    ("division by a broadcast row", lambda m, x: x / (m.sum(x**2, axis=0) + 1.0)),
]


@pytest.mark.parametrize("name, fn", EAGER_CASES, ids=[c[0] for c in EAGER_CASES])
def test_numpy_functions_match_numpy_when_nothing_is_traced(name, fn):
    x = rand(4, 3)
    np.testing.assert_allclose(fn(tnp, x), fn(np, x), rtol=1e-12)


@pytest.mark.parametrize("name, fn", EAGER_CASES, ids=[c[0] for c in EAGER_CASES])
def test_a_staged_function_computes_what_the_eager_one_does(name, fn):
    x = rand(4, 3)
    np.testing.assert_allclose(st.jit(lambda v: fn(tnp, v))(x), fn(np, x), rtol=1e-12)


def test_python_scalars_are_weak_and_keep_the_array_dtype():
    x = np.ones(3, np.float32)
    assert (tnp.multiply(x, 2.0)).dtype == np.float32
    assert tnp.add(np.arange(3), 0.5).dtype == np.float64  # int + float -> float, as in NumPy
    assert tnp.sin(1).dtype == np.float64  # integers become floats for transcendental functions


def test_operators_on_tracers_match_numpy():
    x, y, w = rand(3), rand(3), rand(3, 2)

    def all_operators(x, y, w):
        return (x + 1, 1 - x, x * y, x / 2, 2.0**x, x**3, -x, x @ w, x > y, x < y, x >= y,
                x <= y, x == y, x != y, x.T, x.reshape(3, 1), x.sum(), x.max(), x.mean())

    for got, expected in zip(st.jit(all_operators)(x, y, w), all_operators(x, y, w), strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-12)


# --------------------------------------------------------------------------- pytrees


def test_tree_flatten_sorts_dict_keys_and_round_trips():
    tree = {"b": [1.0, (2.0, None)], "a": np.zeros(2)}
    leaves, treedef = tree_util.tree_flatten(tree)
    assert [np.ndim(leaf) for leaf in leaves] == [1, 0, 0]  # "a" first, then b's leaves in order
    rebuilt = tree_util.tree_unflatten(treedef, leaves)
    assert list(rebuilt) == ["a", "b"] and rebuilt["b"][1][1] is None
    assert treedef.num_leaves == 3


def test_tree_defs_of_the_same_structure_are_equal_and_hash_alike_and_others_differ():
    from collections import namedtuple

    pair = namedtuple("pair", "a b")
    same = [tree_util.tree_structure(({"w": np.ones(2), "b": 1.0}, [None])) for _ in range(2)]
    assert same[0] == same[1] and hash(same[0]) == hash(same[1]) and same[0] is not same[1]
    others = [tree_util.tree_structure(t) for t in
              [({"w": 1.0, "c": 1.0}, [None]), ({"w": 1.0, "b": 1.0}, (None,)), ({"w": 1.0, "b": 1.0}, [1.0]),
               ((1.0, 2.0), [None]), (pair(1.0, 2.0), [None])]]
    assert all(other != same[0] for other in others) and len(set(others)) == len(others)


def test_tree_map_rejects_trees_of_different_structure():
    with pytest.raises(ValueError, match="tree structures differ"):
        tree_util.tree_map(lambda a, b: a + b, [1.0, 2.0], (1.0, 2.0))


def test_gradients_come_back_in_the_structure_of_the_parameters():
    params = mlp_params()
    grads = st.grad(mlp_loss)(params, rand(4, 3), rand(4, 2))
    assert set(grads) == set(params)
    assert all(grads[k].shape == params[k].shape for k in params)


# --------------------------------------------------------------------------- staging


def test_make_jaxpr_prints_like_jax():
    jaxpr = st.make_jaxpr(lambda x, y: tnp.sum(tnp.sin(x) * 2.0 + y**2))(np.ones(3), np.ones(3))
    assert str(jaxpr) == (
        "{ lambda ; a:f64[3] b:f64[3]. let\n"
        "    c:f64[3] = sin a\n"
        "    d:f64[3] = mul c 2.0:f64[]\n"
        "    e:f64[3] = integer_pow[y=2] b\n"
        "    f:f64[3] = add d e\n"
        "    g:f64[] = reduce_sum[axes=(0,)] f\n"
        "  in (g,) }"
    )


def test_array_constants_become_constvars_and_scalars_literals():
    table = np.arange(3.0)
    jaxpr = st.make_jaxpr(lambda x: x * table + 1.0)(np.ones(3))
    assert str(jaxpr).startswith("{ lambda a:f64[3]; b:f64[3]. let")
    assert "add c 1.0:f64[]" in str(jaxpr)
    assert jaxpr.consts[0] is table


def test_staging_records_operations_on_constants_too():
    jaxpr = st.make_jaxpr(lambda x: x + tnp.sin(np.ones(2)))(np.ones(2))
    assert [e.primitive.name for e in jaxpr.eqns] == ["sin", "add"]


def test_eval_jaxpr_runs_a_staged_program_like_the_function():
    params, x, y = mlp_params(), rand(4, 3), rand(4, 2)
    closed = st.make_jaxpr(mlp_loss)(params, x, y)
    leaves = tree_util.tree_leaves((params, x, y))
    (out,) = st.eval_jaxpr(closed.jaxpr, closed.consts, *leaves)
    np.testing.assert_allclose(out, mlp_loss(params, x, y), rtol=1e-12)


def test_unused_results_print_as_underscore_and_jit_removes_them():
    def loss(x):
        tnp.exp(x)  # computed, never used
        return tnp.sum(x**2)

    assert re.search(r"_:f64\[3\] = exp a", str(st.make_jaxpr(loss)(np.ones(3))))
    staged = st.jit(loss).trace(np.ones(3)).jaxpr
    assert [e.primitive.name for e in staged.eqns] == ["integer_pow", "reduce_sum"]


# --------------------------------------------------------------------------- jvp


SMOOTH_FUNCTIONS = {
    "polynomial": lambda x: tnp.sum(3 * x**4 - 2 * x**3 + x**2 / 7 - x),
    "tanh of a matrix product": lambda x: tnp.sum(tnp.tanh(tnp.reshape(x, (2, 3)) @ np.ones((3, 2)))),
    "log-sum-exp": lambda x: tnp.log(tnp.sum(tnp.exp(x - tnp.max(x)))) + tnp.max(x),
    "trigonometry and division": lambda x: tnp.sum(tnp.sin(x) * tnp.cos(2.0 * x) / (1.0 + x**2)),
}


@pytest.mark.parametrize("name", SMOOTH_FUNCTIONS)
def test_jvp_matches_central_differences(name):
    f, x, v = SMOOTH_FUNCTIONS[name], rand(6), rand(6)
    _, tangent = st.jvp(f, (x,), (v,))
    eps = 1e-6
    np.testing.assert_allclose(tangent, (f(x + eps * v) - f(x - eps * v)) / (2 * eps), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", SMOOTH_FUNCTIONS)
def test_grad_matches_central_differences(name):
    f, x = SMOOTH_FUNCTIONS[name], rand(6)
    np.testing.assert_allclose(st.grad(f)(x), numerical_gradient(f, x), rtol=1e-6, atol=1e-7)


def test_grad_of_the_mlp_loss_matches_central_differences_for_every_parameter():
    params, x, y = mlp_params(), rand(4, 3), rand(4, 2)
    grads = st.grad(mlp_loss)(params, x, y)
    for key in params:
        def along(value, key=key):
            return mlp_loss({**params, key: value}, x, y)

        np.testing.assert_allclose(grads[key], numerical_gradient(along, params[key]), rtol=1e-6, atol=1e-8)


def test_the_tangent_is_linear_in_the_direction():
    f, x, v, w = SMOOTH_FUNCTIONS["trigonometry and division"], rand(6), rand(6), rand(6)
    tangent = lambda d: st.jvp(f, (x,), (d,))[1]  # noqa: E731
    np.testing.assert_allclose(tangent(2.0 * v - 3.0 * w), 2.0 * tangent(v) - 3.0 * tangent(w), rtol=1e-10)


def test_jvp_rejects_a_tangent_of_the_wrong_shape():
    with pytest.raises(ValueError, match="different primal and tangent shapes"):
        st.jvp(tnp.sin, (np.ones(3),), (np.ones(2),))


# --------------------------------------------------------------------------- reverse mode


def test_vjp_and_jvp_satisfy_the_transpose_identity():
    # <ct, J v> == <J^T ct, v> for every linear map J: the definition of the transpose.
    def f(a, b):
        return tnp.tanh(a @ b) * tnp.sum(a, axis=1, keepdims=True) + tnp.max(b)

    a, b = rand(3, 4), rand(4, 2)
    va, vb, ct = rand(3, 4), rand(4, 2), rand(3, 2)
    _, jv = st.jvp(f, (a, b), (va, vb))
    _, f_vjp = st.vjp(f, a, b)
    cta, ctb = f_vjp(ct)
    np.testing.assert_allclose(np.sum(ct * jv), np.sum(cta * va) + np.sum(ctb * vb), rtol=1e-10)


def test_the_linearized_jaxpr_uses_only_primitives_with_transpose_rules():
    _, linear = linearize_flat(lambda x: [mlp_loss(mlp_params(), x, np.ones((4, 2)))], [rand(4, 3)])
    assert linear.eqns, "the linear jaxpr is empty"
    assert all(eqn.primitive in primitive_transposes for eqn in linear.eqns)
    assert not any(eqn.primitive.name in ("tanh", "integer_pow") for eqn in linear.eqns)


def test_linearize_gives_the_same_tangents_as_jvp():
    f, x, v = SMOOTH_FUNCTIONS["log-sum-exp"], rand(5), rand(5)
    out, f_jvp = st.linearize(f, x)
    np.testing.assert_allclose(out, f(x))
    np.testing.assert_allclose(f_jvp(v), st.jvp(f, (x,), (v,))[1], rtol=1e-12)


def test_gradient_descent_on_least_squares_converges_to_the_solution():
    a, w_true = rand(20, 3), np.array([1.0, -2.0, 0.5])
    b = a @ w_true
    loss = lambda w: tnp.mean((a @ w - b) ** 2)  # noqa: E731
    step = st.jit(lambda w: w - 0.1 * st.grad(loss)(w))
    w = np.zeros(3)
    for _ in range(300):
        w = step(w)
    np.testing.assert_allclose(w, w_true, atol=1e-6)
    assert step._cache_size() == 1


def test_value_and_grad_argnums_and_has_aux():
    def f(x, y, scale=1.0):
        return scale * tnp.sum(x * y), {"norm": tnp.sum(x**2)}

    x, y = rand(3), rand(3)
    (value, aux), (gx, gy) = st.value_and_grad(f, argnums=(0, 1), has_aux=True)(x, y, scale=2.0)
    np.testing.assert_allclose(value, 2 * np.sum(x * y))
    np.testing.assert_allclose(aux["norm"], np.sum(x**2))
    np.testing.assert_allclose(gx, 2 * y)
    np.testing.assert_allclose(gy, 2 * x)


def test_grad_follows_python_control_flow_on_concrete_values_like_jax():
    def relu_ish(x):
        return x**2 if x > 0 else -x

    assert st.grad(relu_ish)(3.0) == 6.0 and st.grad(relu_ish)(-3.0) == -1.0


def test_grad_explains_non_scalar_outputs_and_integer_inputs():
    with pytest.raises(TypeError, match=r"scalar-output functions. Output had shape: \(3,\)"):
        st.grad(tnp.sin)(np.ones(3))
    with pytest.raises(TypeError, match="real-valued floating-point inputs.*int64"):
        st.grad(tnp.sin)(1)


@pytest.mark.parametrize("transform", ["grad", "jit", "vmap"])
def test_float32_stays_float32(transform):
    x = np.ones((2, 3), np.float32)
    f = lambda v: tnp.sum(tnp.tanh(v) * 2.0 + 1)  # noqa: E731
    out = {"grad": st.grad(f), "jit": st.jit(f), "vmap": st.vmap(f)}[transform](x)
    assert out.dtype == np.float32


def test_higher_derivatives_of_sin_cycle():
    derivatives = [tnp.sin]
    for _ in range(4):
        derivatives.append(st.grad(derivatives[-1]))
    x = 0.7
    expected = [np.sin(x), np.cos(x), -np.sin(x), -np.cos(x), np.sin(x)]
    np.testing.assert_allclose([float(d(x)) for d in derivatives], expected, rtol=1e-12)


# --------------------------------------------------------------------------- vmap


@pytest.mark.parametrize("in_axes, out_axes", [(0, 0), ((1, None), 0), ((0, 1), 1), ((None, 0), -1)])
def test_vmap_matches_a_python_loop(in_axes, out_axes):
    def f(x, w):
        return tnp.tanh(x @ w) * tnp.max(x)

    x_example, w_example = rand(4), rand(4, 3)
    axes = in_axes if isinstance(in_axes, tuple) else (in_axes, in_axes)
    batch = 5
    args = [np.stack([e + i for i in range(batch)], axis=ax) if ax is not None else e
            for e, ax in zip((x_example, w_example), axes, strict=True)]
    expected = np.stack([f(*[np.take(a, i, axis=ax) if ax is not None else a
                             for a, ax in zip(args, axes, strict=True)]) for i in range(batch)],
                        axis=out_axes)
    np.testing.assert_allclose(st.vmap(f, in_axes=in_axes, out_axes=out_axes)(*args), expected, rtol=1e-12)


def test_vmap_takes_pytree_in_axes_and_returns_pytrees():
    params, xs = mlp_params(), rand(7, 4, 3)
    unbatched = {"w1": None, "b1": None, "w2": None}  # a prefix tree: one entry per parameter
    per_batch = st.vmap(lambda p, x: {"loss": mlp_loss(p, x, np.zeros((4, 2)))}, in_axes=(unbatched, 0))
    out = per_batch(params, xs)
    np.testing.assert_allclose(out["loss"], [mlp_loss(params, x, np.zeros((4, 2))) for x in xs], rtol=1e-12)


def test_vmap_broadcasts_unbatched_outputs_and_respects_out_axes_none():
    out = st.vmap(lambda x: (x * 2, 1.0), out_axes=(0, None))(np.arange(3.0))
    np.testing.assert_allclose(out[0], [0, 2, 4])
    assert out[1] == 1.0
    np.testing.assert_allclose(st.vmap(lambda x: 1.0)(np.arange(3.0)), np.ones(3))
    np.testing.assert_allclose(st.vmap(lambda: np.ones(2), axis_size=3)(), np.ones((3, 2)))


def test_vmap_names_every_mismatched_axis_size():
    with pytest.raises(ValueError, match="inconsistent sizes") as error:
        st.vmap(lambda x, y: x + tnp.sum(y))(np.ones(3), np.ones((4, 2)))
    assert "size 3: axis 0 of argument x of type f64[3]" in str(error.value)
    assert "size 4: axis 0 of argument y of type f64[4,2]" in str(error.value)


def test_vmap_rejects_bad_axes_with_the_fix():
    with pytest.raises(ValueError, match="rank should be at least 2"):
        st.vmap(tnp.sin, in_axes=1)(np.ones(3))
    with pytest.raises(ValueError, match="at least one non-None value in in_axes"):
        st.vmap(tnp.sin, in_axes=None)(np.ones(3))
    with pytest.raises(ValueError, match="got axis spec None but output was batched"):
        st.vmap(tnp.sin, out_axes=None)(np.ones(3))
    with pytest.raises(ValueError, match="2 entries.*1 positional"):
        st.vmap(tnp.sin, in_axes=(0, 0))(np.ones(3))


# --------------------------------------------------------------------------- jit


def test_jit_traces_once_per_signature_and_not_on_repeat_calls():
    traces = []

    def f(x):
        traces.append(x.shape)
        return tnp.sin(x) * 2.0

    jitted = st.jit(f)
    for _ in range(3):
        np.testing.assert_allclose(jitted(np.ones(3)), 2 * np.sin(np.ones(3)))
    assert traces == [(3,)] and jitted._cache_size() == 1


@pytest.mark.parametrize("second_call, recompiles", [
    ((np.ones(3), 2), False),
    ((np.zeros(3), 2), False),  # new values, same abstract signature
    ((np.ones(4), 2), True),  # new shape
    ((np.ones(3, np.float32), 2), True),  # new dtype
    ((np.ones(3), 3), True),  # new static value
])
def test_jit_recompiles_exactly_when_the_abstract_signature_changes(second_call, recompiles):
    jitted = st.jit(lambda x, n: x * n, static_argnums=1)
    jitted(np.ones(3), 2)
    jitted(*second_call)
    assert jitted._cache_size() == (2 if recompiles else 1)


def test_a_cache_hit_runs_only_the_hit_path_and_its_steps_compose_to_the_call(monkeypatch):
    """What chapter 01 times step by step is what a call does; a hit never stages again."""
    from stacklib.transforms import caching, lowering

    jitted = st.jit(lambda p, x: {"y": tnp.sin(p["w"] * x), "n": tnp.sum(x)})
    args = ({"w": np.full(3, 2.0)}, np.arange(3.0))
    first = jitted(*args)
    monkeypatch.setattr(jitted, "_stage", lambda *a: pytest.fail("a cache hit staged the function again"))
    monkeypatch.setattr(caching, "compile_jaxpr", lambda *a: pytest.fail("a cache hit compiled again"))
    signature, leaves = jitted.signature(args, {})  # 1. flatten, shapes and dtypes
    traced = jitted._cache[signature]  # 2. look up
    program = caching._compiled_program(traced.jaxpr, jitted.__name__)
    outputs = program.run.execute(program.run.put(leaves))  # 3. hand to XLA, 4. run
    by_steps = traced.out_tree.unflatten(lowering.to_numpy(outputs))  # 5. read back, 6. rebuild
    again = jitted(*args)
    for result in (by_steps, again):
        assert result.keys() == first.keys() and all(isinstance(v, np.ndarray) for v in result.values())
        np.testing.assert_array_equal(result["y"], first["y"])
        np.testing.assert_array_equal(result["n"], first["n"])
    assert jitted._cache_size() == 1


def test_a_python_float_and_a_float64_scalar_share_a_cache_entry():
    jitted = st.jit(lambda x: x * 2.0)
    jitted(1.0), jitted(np.float64(3.0)), jitted(np.array(2.0))
    assert jitted._cache_size() == 1


def test_jit_recompiles_when_the_tree_structure_changes():
    jitted = st.jit(lambda tree: tnp.sum(tree["a"]) + tnp.sum(tree.get("b", 0.0)))
    jitted({"a": np.ones(2)})
    jitted({"a": np.ones(2), "b": np.ones(2)})
    assert jitted._cache_size() == 2


def test_jax_log_compiles_says_what_changed(caplog):
    jitted = st.jit(lambda x, n: x * n, static_argnames="n")
    st.config.update("jax_log_compiles", True)
    try:
        with caplog.at_level(logging.WARNING, logger="stacklib.transforms"):
            jitted(np.ones(3), n=2)
            jitted(np.ones(3), n=2)
            jitted(np.ones(4), n=2)
            jitted(np.ones(4), n=5)
    finally:
        st.config.update("jax_log_compiles", False)
    messages = [record.getMessage() for record in caplog.records]
    assert len(messages) == 3
    assert "first call" in messages[0]
    assert "leaf 0: f64[3] -> f64[4]" in messages[1]
    assert "static n: 2 -> 5" in messages[2]


def test_static_arguments_allow_python_control_flow_and_must_be_hashable():
    jitted = st.jit(lambda x, square: x**2 if square else x, static_argnums=1)
    np.testing.assert_allclose(jitted(np.full(2, 3.0), True), [9.0, 9.0])
    np.testing.assert_allclose(jitted(np.full(2, 3.0), False), [3.0, 3.0])
    with pytest.raises(ValueError, match="Non-hashable static arguments"):
        jitted(np.ones(2), [True])


def test_jit_inside_other_transformations_is_inlined_and_correct():
    inner = st.jit(lambda x: tnp.sin(x) * x)
    x = rand(4)
    np.testing.assert_allclose(st.grad(lambda v: tnp.sum(inner(v)))(x), np.cos(x) * x + np.sin(x), rtol=1e-12)
    np.testing.assert_allclose(st.vmap(inner)(rand(3, 4) * 0 + x), np.tile(np.sin(x) * x, (3, 1)), rtol=1e-12)
    nested = st.make_jaxpr(lambda v: inner(v) + 1.0)(x)
    assert [e.primitive.name for e in nested.eqns] == ["jit", "add"]


def test_a_jitted_closure_over_a_tracer_is_not_cached():
    def outer(y):
        return tnp.sum(st.jit(lambda x: x * y)(np.ones(3)))  # the inner jit closes over y

    np.testing.assert_allclose(st.grad(outer)(2.0), 3.0)
    np.testing.assert_allclose(st.grad(outer)(5.0), 3.0)


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("transform, words", [
    (st.jit, "for jit"), (st.make_jaxpr, "for make_jaxpr"), (st.vmap, "with vmap"),
])
def test_python_if_on_a_traced_value_explains_abstract_values_and_the_fixes(transform, words):
    def f(x):
        return x if x > 0 else -x

    with pytest.raises(st.TracerBoolConversionError) as error:
        transform(f)(np.ones(()) if transform is not st.vmap else np.ones(3))
    message = str(error.value)
    assert words in message and "where(" in message and "static_argnums" in message


def test_numpy_functions_on_tracers_point_to_our_numpy():
    with pytest.raises(st.TracerArrayConversionError, match="stacklib.transforms.numpy"):
        st.jit(np.sin)(np.ones(3))
    with pytest.raises(st.ConcretizationTypeError, match="`float`"):
        st.jit(float)(np.ones(()))


def test_unsupported_operations_are_named():
    with pytest.raises(st.UnsupportedOperationError, match="'%' \\(mod\\)"):
        st.jit(lambda x: x % 2)(np.ones(3))
    with pytest.raises(st.UnsupportedOperationError, match="indexing"):
        st.jit(lambda x: x[0])(np.ones(3))
    with pytest.raises(AttributeError, match="no 'sort'.*implements only"):
        tnp.sort  # noqa: B018


def test_a_primitive_without_rules_names_the_primitive_and_the_missing_rule():
    mystery = st.Primitive("mystery")
    mystery.def_impl(np.sinh)
    mystery.def_abstract_eval(lambda x: x)
    np.testing.assert_allclose(st.jit(mystery.bind, interpret=True)(np.ones(2)), np.sinh(np.ones(2)))
    with pytest.raises(st.MissingRuleError, match="'mystery' has no lowering rule.*transforms/lowering.py"):
        st.jit(mystery.bind)(np.ones(2))
    with pytest.raises(st.MissingRuleError, match="Differentiation rule for 'mystery'"):
        st.grad(mystery.bind)(1.0)
    with pytest.raises(st.MissingRuleError, match="Batching rule for 'mystery'"):
        st.vmap(mystery.bind)(np.ones(2))


def test_a_leaked_tracer_is_reported_when_used():
    leaked = []
    st.jit(lambda x: leaked.append(x) or x)(1.0)
    with pytest.raises(st.UnexpectedTracerError, match="leaked out"):
        leaked[0] + 1  # noqa: B018


def test_every_primitive_has_all_its_rules():
    elementwise_nonlinear = {"sin", "cos", "exp", "log", "tanh", "max", "min", "pow", "integer_pow",
                             "gt", "lt", "ge", "le", "eq", "ne", "reduce_max"}
    for primitive in [v for v in vars(lax).values() if isinstance(v, st.Primitive)]:
        assert primitive.impl and primitive.abstract_eval, primitive
        assert primitive in primitive_jvps, primitive
        assert primitive in primitive_batchers, primitive
        if primitive.name not in elementwise_nonlinear:
            assert primitive in primitive_transposes, primitive


def test_lax_python_scalars_take_the_dtype_of_the_other_operand():
    x = np.ones(3, np.float32)
    assert lax.sub(1.0, x).dtype == np.float32
    assert st.make_jaxpr(lambda v: lax.mul(v, 2))(x).eqns[0].invars[1].aval.dtype == np.float32


def test_a_transpose_rule_that_returns_the_wrong_shape_is_reported():
    wrong = {**primitive_transposes, lax.reduce_sum_p: lambda ct, x, *, axes: [ct]}
    original = dict(primitive_transposes)
    primitive_transposes.update(wrong)
    try:
        with pytest.raises(ValueError, match="transpose rule of 'reduce_sum' returned a cotangent of type "
                                             r"f64\[\] for an input of type f64\[3\]"):
            st.grad(lambda v: tnp.sum(tnp.sin(v)))(np.ones(3))
    finally:
        primitive_transposes.clear()
        primitive_transposes.update(original)
