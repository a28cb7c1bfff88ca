"""Lowering our jaxprs to StableHLO and running them with XLA: `jit`'s default path.

Every primitive has a rule; each rule, compiled, computes what the NumPy interpreter
computes (float64: 1e-12 relative, since both evaluate the same formulas and differ by
rounding only, ~1e-15; XLA's tanh/exp/log are not NumPy's libm, hence not exact) and
what `jax.jit` computes; dtypes survive; bad input fails early and says where.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_transforms_parity import FUNCTIONS

import stacklib.transforms as st
import stacklib.transforms.numpy as tnp
from stacklib.transforms import caching, lax, lowering

RTOL, ATOL = 1e-12, 1e-14


def _compiled_and_interpreted(f, *args):
    return st.jit(f)(*args), st.jit(f, interpret=True)(*args)


def _assert_trees_close(got, expected, rtol=RTOL, atol=ATOL):
    got_leaves, expected_leaves = jax.tree.leaves(got), jax.tree.leaves(expected)
    assert len(got_leaves) == len(expected_leaves)
    for a, b in zip(got_leaves, expected_leaves, strict=True):
        assert np.asarray(a).dtype == np.asarray(b).dtype
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)


# --------------------------------------------------------------------------- one rule per primitive


def test_every_primitive_has_a_lowering_rule_including_jit():
    primitives = [v for v in vars(lax).values() if isinstance(v, st.Primitive)]
    missing = [p.name for p in [*primitives, caching.jit_p] if p not in lowering.lowering_rules]
    assert not missing


x_ = np.random.default_rng(0).normal(size=(3, 4))
y_ = np.random.default_rng(1).normal(size=(3, 4))
PRIMITIVE_CASES = {
    "neg sin cos exp tanh": lambda x, y: -tnp.sin(x) + tnp.cos(y) * tnp.exp(x) - tnp.tanh(y),
    "log": lambda x, y: tnp.log(x * x + 1.0),
    "add sub mul div": lambda x, y: (x + y) * (x - y) / (y * y + 2.0),
    "max min pow": lambda x, y: tnp.maximum(x, y) - tnp.minimum(x, 0.0) + tnp.power(x * x + 1.0, y),
    "integer_pow": lambda x, y: (x**3, x**-2, x**0, x**1),
    "comparisons": lambda x, y: (x > y, x < y, x >= 0.5, x <= y, x == x, x != y),
    "select_n": lambda x, y: tnp.where(x > y, x, y * 2.0),
    "convert_element_type": lambda x, y: (x.astype(np.float32), (x > 0).astype(np.float64),
                                          tnp.sum(x > y), x.astype(np.int64), x.astype(bool)),
    "reduce_sum reduce_max": lambda x, y: (tnp.sum(x, axis=0), tnp.max(x, axis=1), tnp.max(x)),
    "broadcast reshape transpose": lambda x, y: (tnp.broadcast_to(x, (2, 3, 4)), tnp.reshape(x, (2, 6)),
                                                 tnp.transpose(x)),
    "dot_general": lambda x, y: (x @ y.T, tnp.dot(x, tnp.sum(y, axis=0)),
                                 tnp.matmul(tnp.reshape(x, (3, 2, 2)), tnp.reshape(y, (3, 2, 2)))),
    "a closed-over array constant": lambda x, y: x * np.arange(4.0) + np.array([True, False, True, False]),
    "a nested jit, called twice": lambda x, y: st.jit(lambda a: (tnp.sin(a), a * 2.0))(x)[0]
    + st.jit(lambda a: (tnp.sin(a), a * 2.0))(y)[1],
}


@pytest.mark.parametrize("name", PRIMITIVE_CASES)
def test_each_rule_compiled_computes_what_the_interpreter_computes(name):
    compiled, interpreted = _compiled_and_interpreted(PRIMITIVE_CASES[name], x_, y_)
    _assert_trees_close(compiled, interpreted)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.int64])
def test_dtypes_survive_compilation_whatever_jax_enable_x64_says(dtype):
    x = np.arange(1, 7).reshape(2, 3).astype(dtype)
    before = jax.config.jax_enable_x64
    out = st.jit(lambda v: tnp.sum(v * v, axis=0))(x)
    assert out.dtype == dtype and jax.config.jax_enable_x64 == before
    np.testing.assert_array_equal(out, np.sum(x * x, axis=0))


def test_strided_and_fortran_ordered_inputs_are_read_correctly():
    x = np.arange(12.0).reshape(3, 4)
    f = st.jit(lambda a: a * 1.0)
    for view in [x.T, x[:, ::2], np.asfortranarray(x)]:
        np.testing.assert_array_equal(f(view), view)


@pytest.mark.parametrize("name", FUNCTIONS)
def test_the_parity_functions_and_their_gradients_agree_with_the_interpreter_and_jax_jit(name):
    loss_ours, inputs = FUNCTIONS[name](tnp)
    loss_jax, _ = FUNCTIONS[name](jnp)
    args = inputs(np.random.default_rng(0), 3, 2, 1.0)
    compiled, interpreted = _compiled_and_interpreted(st.value_and_grad(loss_ours), *args)
    _assert_trees_close(compiled, interpreted)
    with jax.enable_x64(True):
        theirs = jax.jit(jax.value_and_grad(loss_jax))(*args)
    _assert_trees_close(compiled, theirs, rtol=1e-10, atol=1e-12)  # different op orders in XLA's fusions


# --------------------------------------------------------------------------- the module we write


def test_the_module_of_a_small_function_reads_like_jax_s():
    text = lowering.lower_jaxpr_to_module(st.make_jaxpr(lambda x: tnp.sin(x) * 2.0)(np.ones(3)), "f")
    assert text.startswith("module @jit_f")
    assert "func.func public @main(%arg0: tensor<3xf64>) -> (tensor<3xf64>)" in text
    assert "stablehlo.sine %arg0 : tensor<3xf64>" in text
    assert "stablehlo.constant dense<2.0> : tensor<f64>" in text


def test_a_nested_jit_is_a_private_function_called_twice():
    inner = st.jit(lambda a: tnp.sin(a))
    outer = st.make_jaxpr(lambda x: inner(x) + inner(x * 2.0))(np.ones(2))
    text = lowering.lower_jaxpr_to_module(outer, "outer")
    assert text.count("func.func private") == 1 and text.count("func.call @_lambda__0") == 2


@pytest.mark.parametrize("value", [np.array(np.inf), np.array([-np.inf, np.nan, 1e-300, 0.1]),
                                   np.array([True, False]), np.zeros((0, 2)), np.array([3, -2], np.int32)])
def test_constants_round_trip_through_the_text(value):
    out = st.jit(lambda: value + np.zeros_like(value) if value.dtype != bool else value)()
    np.testing.assert_array_equal(out, value)


# --------------------------------------------------------------------------- jit compiles, once


def test_jit_compiles_once_per_signature_and_the_interpreter_never(monkeypatch):
    compiled = []
    real = lowering.compile_stablehlo
    monkeypatch.setattr(lowering, "compile_stablehlo",
                        lambda text, avals: compiled.append(text) or real(text, avals))
    jitted = st.jit(lambda x: x * 2.0)
    for x in [np.ones(3), np.zeros(3), np.ones(4)]:
        jitted(x)
    assert len(compiled) == 2 and jitted._cache_size() == 2
    st.jit(lambda x: x * 2.0, interpret=True)(np.ones(3))
    assert len(compiled) == 2


def test_the_interpreter_flag_does_not_change_how_jaxprs_print():
    f = lambda x: st.jit(tnp.sin)(x) * 2.0  # noqa: E731
    assert "interpret" not in str(st.make_jaxpr(f)(1.0))
    assert "interpret=True" in str(st.make_jaxpr(lambda x: st.jit(tnp.sin, interpret=True)(x))(1.0))


def test_the_composition_table_passes_with_the_compiled_jit():
    def per_example(m):
        loss = FUNCTIONS["tanh_mlp_loss"](m)[0]
        return lambda p, a, b: loss(p, m.reshape(a, (1, -1)), m.reshape(b, (1, -1)))

    params, x, y = FUNCTIONS["tanh_mlp_loss"](tnp)[1](np.random.default_rng(0), 4, 2, 1.0)
    with jax.enable_x64(True):
        theirs = jax.vmap(jax.grad(per_example(jnp)), in_axes=(None, 0, 0))(params, x, y)
    g = st.grad(per_example(tnp))
    for name, composed in [("jit(vmap(grad))", st.jit(st.vmap(g, in_axes=(None, 0, 0)))),
                           ("vmap(jit(grad))", st.vmap(st.jit(g), in_axes=(None, 0, 0))),
                           ("jit(vmap(jit(grad)))", st.jit(st.vmap(st.jit(g), in_axes=(None, 0, 0))))]:
        ours = composed(params, x, y)
        _assert_trees_close(ours, theirs, rtol=1e-10, atol=1e-12), name


# --------------------------------------------------------------------------- bad input


def test_a_primitive_without_a_lowering_rule_fails_before_compiling(monkeypatch):
    mystery = st.Primitive("mystery")
    mystery.def_impl(np.sinh)
    mystery.def_abstract_eval(lambda x: x)
    monkeypatch.setattr(lowering, "compile_stablehlo", lambda text, avals: pytest.fail("compiled anyway"))
    with pytest.raises(st.MissingRuleError, match=r"'mystery' has no lowering rule.*"
                                                  r"stacklib/transforms/lowering\.py.*lowering_rules\[mystery_p\]"):
        st.jit(lambda x: mystery.bind(x) * 2.0)(np.ones(2))


def test_a_malformed_module_shows_the_offending_line_of_our_text(monkeypatch):
    monkeypatch.setitem(lowering.lowering_rules, lax.sin_p,
                        lambda ctx, x: ctx.emit(f"stablehlo.sinus {x} : tensor<3xf64>"))
    with pytest.raises(lowering.StableHLOCompileError, match=r"(?s)line 3, column \d+:\n.*stablehlo\.sinus"):
        st.jit(lambda x: tnp.sin(x) + 1.0)(np.ones(3))


def test_compile_stablehlo_uses_the_xla_client_we_expect():
    """The non-public calls (see compile_stablehlo's docstring): an upgrade that changes them fails here."""
    from jax.extend import backend
    from jaxlib import xla_client

    assert callable(getattr(backend.get_backend(), "compile_and_load", None)), "Client lost compile_and_load"
    assert callable(getattr(xla_client, "batched_device_put", None)), "jaxlib lost batched_device_put"
    assert callable(getattr(xla_client.LoadedExecutable, "execute_sharded", None)), "lost execute_sharded"
    text = ("module @m {\n  func.func public @main(%arg0: tensor<2xf64>) -> (tensor<2xf64>) {\n"
            "    %0 = stablehlo.add %arg0, %arg0 : tensor<2xf64>\n    return %0 : tensor<2xf64>\n  }\n}\n")
    avals = [st.ShapedArray((2,), np.float64)]
    program = lowering.CompiledProgram(text, avals, avals, lowering.compile_stablehlo(text, avals))
    with jax.enable_x64(False):  # float64 stays float64 even with JAX's default
        (out,) = program(np.array([1.0, 2.5]))
    assert isinstance(out, np.ndarray) and out.dtype == np.float64
    np.testing.assert_array_equal(out, [2.0, 5.0])
