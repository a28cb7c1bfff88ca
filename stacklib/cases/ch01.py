"""Chapter 01: rules for the mini-JAX of `stacklib.transforms`, graded against JAX.

Each case installs the learner's rule in the rule table it belongs to for the duration of
the case, then runs whole transformations through it and compares with `jax` in float64
(`jax.enable_x64` inside the case, so the learner's session keeps JAX's defaults).

Expected values are computed before the learner's code runs. The installed rule is
wrapped so that a rule returning the wrong kind of value (a bare array where a list is
due, a tangent without its primal) is told so in the rule's own terms, instead of
failing later inside the machinery with a message about shapes; and NumPy applied to a
tracer inside the learner's code is reported as what it is, with the line.
"""

import contextlib
import inspect
import pathlib
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import stacklib.transforms as st
import stacklib.transforms.numpy as tnp
from stacklib.grading import CaseFailure, Exercise, call_on_copies, expect, expect_close
from stacklib.transforms import batching, errors, forward, lax, lowering, reverse

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


def _describe(value) -> str:
    """How a returned value looks, for messages: 'None', 'a tuple of length 3', 'an array of shape (4,)'."""
    if value is None:
        return "None"
    if isinstance(value, list | tuple):
        return f"a {type(value).__name__} of length {len(value)}"
    shape = getattr(value, "shape", None)
    if shape is not None:
        return f"a single array of shape {tuple(shape)}"
    return f"a {type(value).__name__}"


def _learner_line(error: BaseException, answer) -> str:
    """' (line N: `source`)' for the innermost frame of the traceback in the answer's file."""
    filename = getattr(getattr(inspect.unwrap(answer), "__code__", None), "co_filename", None)
    frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename == filename]
    if not frames:
        return ""
    frame = frames[-1]
    return f" (line {frame.lineno}: `{frame.line.strip()}`)" if frame.line else f" (line {frame.lineno})"


def _is_numpy_on_a_tracer(error: BaseException) -> bool:
    """A NumPy function was given a tracer: NumPy converted it (TracerArrayConversionError), or
    handed it to the tracer's own method (np.sum(t) calls t.sum(..., out=None): a TypeError)."""
    if isinstance(error, errors.TracerArrayConversionError):
        return True
    numpy_dir = str(pathlib.Path(np.__file__).parent)
    return isinstance(error, TypeError) and any(
        frame.filename.startswith(numpy_dir) for frame in traceback.extract_tb(error.__traceback__))


@contextlib.contextmanager
def _numpy_on_tracers_is_reported(answer, who: str, why: str, fix: str):
    """Turn a NumPy function applied to a tracer inside the learner's code into a CaseFailure.

    The library's own message is written for any user and guesses at the context (under
    vmap it talks about branching); here we know the cause, and the fix the exercise asks for.
    """
    try:
        yield
    except Exception as error:
        if not _is_numpy_on_a_tracer(error):
            raise
        raise CaseFailure(
            f"{who} applied a NumPy function to a traced value{_learner_line(error, answer)}. {why}, "
            f"not arrays, and NumPy computes only on arrays: {fix}"
        ) from None


def _checked_jvp_rule(rule):
    def checked(primals, tangents, **params):
        out = rule(primals, tangents, **params)
        expect(isinstance(out, list | tuple) and len(out) == 2,
               f"your JVP rule returned {_describe(out)}: a JVP rule returns a pair "
               "(primal_out, tangent_out), here (tanh(x), its tangent)")
        return out
    return checked


def _checked_transpose_rule(rule):
    def checked(ct, operand, **params):
        out = rule(ct, operand, **params)
        expect(isinstance(out, list | tuple) and len(out) == 1,
               f"your transpose rule returned {_describe(out)}: a transpose rule returns a list with "
               "one cotangent per input of the primitive, and reduce_sum has one input, so return "
               f"[cotangent], a list holding one array of the operand's shape {operand.aval.shape}")
        return out
    return checked


def _checked_batch_rule(rule):
    def checked(batched_args, batch_dims, **params):
        out = rule(batched_args, batch_dims, **params)
        expect(isinstance(out, list | tuple) and len(out) == 2,
               f"your batching rule returned {_describe(out)}: a batching rule returns a pair "
               "(batched output, the output's batch axis)")
        expect(isinstance(out[1], int | np.integer) and not isinstance(out[1], bool),
               f"your batching rule returned {out[1]!r} as the output's batch axis: it must be an int, "
               "the axis of the output where the batch lives")
        return out
    return checked


# --------------------------------------------------------------------------- 01.tanh_jvp

tanh_jvp = Exercise("01.tanh_jvp", "The JVP rule of tanh")

_USE_LAX = ("compute with stacklib.transforms.lax, whose functions are traced: lax.tanh, lax.mul, "
            "lax.sub, lax.integer_pow")


@contextlib.contextmanager
def _tanh_rule(rule):
    with (_installed(forward.primitive_jvps, lax.tanh_p, _checked_jvp_rule(rule)),
          _numpy_on_tracers_is_reported(rule, "Your rule", "Under grad(grad(...)), vmap and jit a "
                                        "rule receives tracers", _USE_LAX)):
        yield


@tanh_jvp.case(points=2, hint="A JVP rule returns the pair (primal output, tangent): tanh(x), and the "
                              "derivative of tanh at x times t, as in the exercise's formula.")
def jvp_matches_jax(rule):
    x, v = _rng().normal(size=(3, 4)), _rng().normal(size=(3, 4)) * 0.5
    with jax.enable_x64(True):
        expected = tuple(np.asarray(e) for e in jax.jvp(jnp.tanh, (x,), (v,)))
    with _tanh_rule(rule):
        got = call_on_copies(st.jvp, tnp.tanh, (x,), (v,), what="jvp with your rule")
    expect_close(got, expected, rtol=1e-10, atol=1e-12, what="jvp(tanh, (x,), (v,))")


@tanh_jvp.case(hint="grad comes from your JVP rule by linearize and transpose: if jvp is right, "
                    "so is this. The tangent must be a product of t with something that does "
                    "not depend on t.")
def grad_of_a_tanh_layer_matches_jax(rule):
    x, w = _rng().normal(size=(5, 3)), _rng().normal(size=(3, 2))
    with jax.enable_x64(True):
        expected = np.asarray(jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w) ** 2))(w))
    with _tanh_rule(rule):
        got = st.grad(lambda w: tnp.sum(tnp.tanh(x @ w) ** 2))(w)
    expect_close(got, expected, rtol=1e-10, atol=1e-12, what="grad of the layer")


# The second derivative of tanh alone cannot tell the sign of the tangent: a rule with
# tanh' = -(1 - tanh^2) gives tanh'' = d/dx[-(1 - tanh^2)] = 2 tanh * tanh' = -2 tanh (1 - tanh^2),
# the right answer, because the wrong sign enters twice. x * tanh(x) has the first
# derivative in its second, 2 tanh'(x) + x tanh''(x), where the sign enters once.
@tanh_jvp.case(hint="This runs your rule on tracers (grad of grad, under vmap) and checks the "
                    "tangent's sign: d^2/dx^2 [x tanh(x)] = 2 tanh'(x) + x tanh''(x), with "
                    "tanh'(x) = 1 - tanh(x)**2.")
def second_derivative_of_x_tanh_x_matches_jax(rule):
    xs = np.linspace(-2.0, 2.0, 7)
    with jax.enable_x64(True):
        expected = np.asarray(jax.vmap(jax.grad(jax.grad(lambda x: x * jnp.tanh(x))))(xs))
    with _tanh_rule(rule):
        got = st.vmap(st.grad(st.grad(lambda x: x * tnp.tanh(x))))(xs)
    expect_close(got, expected, rtol=1e-10, atol=1e-12, what="d^2/dx^2 [x tanh(x)]")


@tanh_jvp.case(hint="y = lax.tanh(x) is the primal output and appears in the tangent: compute it "
                    "once and use it twice.")
def computes_tanh_once(rule):
    x, v = _rng().normal(size=3), _rng().normal(size=3)
    with _tanh_rule(rule):
        staged = st.make_jaxpr(lambda x, v: st.jvp(tnp.tanh, (x,), (v,)))(x, v)
    count = [eqn.primitive.name for eqn in staged.eqns].count("tanh")
    expect(count <= 1, f"jvp(tanh) with your rule computes tanh {count} times")


# --------------------------------------------------------------------------- 01.reduce_sum_transpose

reduce_sum_transpose = Exercise("01.reduce_sum_transpose", "The transpose rule of reduce_sum")


@contextlib.contextmanager
def _transpose_rule(rule):
    with (_installed(reverse.primitive_transposes, lax.reduce_sum_p, _checked_transpose_rule(rule)),
          _numpy_on_tracers_is_reported(rule, "Your rule", "Under jit, and when grad is itself "
                                        "differentiated, a rule receives tracers",
                                        "compute with lax.broadcast_in_dim, which is traced")):
        yield


def _grad_with(rule, f, x):
    with _transpose_rule(rule):
        return call_on_copies(st.grad(f), x, what="grad with your rule")


@reduce_sum_transpose.case(hint="Summing everything gives a scalar cotangent; each input element "
                                "contributed once, so each gets that cotangent: broadcast it back "
                                "to operand.aval.shape.")
def sum_of_everything(rule):
    x = _rng().normal(size=(3, 4))
    expected = np.cos(x)
    expect_close(_grad_with(rule, lambda x: tnp.sum(tnp.sin(x)), x), expected, rtol=1e-12,
                 what="grad of sum(sin(x))")


@reduce_sum_transpose.case(points=2, hint="The cotangent has the operand's shape without the summed "
                                          "axes. The result has the operand's whole shape, with ct's "
                                          "axes at the positions of the axes that were not summed: "
                                          "that is what broadcast_dimensions says (exercise text).")
def sum_over_one_axis(rule):
    x = _rng().normal(size=(3, 4))
    expected = np.broadcast_to(2 * x.sum(axis=0), x.shape)
    expect_close(_grad_with(rule, lambda x: tnp.sum(tnp.sum(x, axis=0) ** 2), x), expected,
                 rtol=1e-12, what="grad of sum(sum(x, axis=0) ** 2)")


@reduce_sum_transpose.case(hint="A middle axis: NumPy-style broadcast_to aligns trailing axes and "
                                "cannot put a (2, 4) cotangent back into (2, 3, 4); broadcast_in_dim "
                                "with the kept axes (0, 2) can.")
def sum_over_a_middle_axis_with_a_general_cotangent(rule):
    x, ct = _rng().normal(size=(2, 3, 4)), _rng().normal(size=(2, 4))
    expected = np.broadcast_to(2.0 * ct[:, None, :], x.shape)
    with _transpose_rule(rule):
        _, f_vjp = st.vjp(lambda x: tnp.sum(x * 2.0, axis=1), x)
        (got,) = call_on_copies(f_vjp, ct, what="vjp with your rule")
    expect_close(got, expected, rtol=1e-12, what="vjp of sum(2x, axis=1)")


@reduce_sum_transpose.case(hint="Several summed axes, not next to each other: every summed axis is left "
                                "out of broadcast_dimensions, not only the first, and the kept axes keep "
                                "their order.")
def sum_over_two_separate_axes(rule):
    x, ct = _rng().normal(size=(2, 3, 4)), _rng().normal(size=3)
    expected = np.broadcast_to(ct[None, :, None], x.shape)
    with _transpose_rule(rule):
        _, f_vjp = st.vjp(lambda x: tnp.sum(x, axis=(0, 2)), x)
        (got,) = call_on_copies(f_vjp, ct, what="vjp with your rule")
    expect_close(got, expected, rtol=1e-12, what="vjp of sum(x, axis=(0, 2))")


@reduce_sum_transpose.case(points=2, hint="Under jit the cotangent is a tracer: build the result with "
                                          "lax.broadcast_in_dim, not NumPy. (If a case above fails too, fix "
                                          "it first: this one runs the same kind of input under jit.)")
def works_under_jit_and_grad(rule):
    x = _rng().normal(size=(3, 4))
    expected = np.broadcast_to(2 * x.sum(axis=1, keepdims=True), x.shape)
    with _transpose_rule(rule):
        got = call_on_copies(st.jit(st.grad(lambda x: tnp.sum(tnp.sum(x, axis=1) ** 2))), x,
                             what="jit(grad) with your rule")
    expect_close(got, expected, rtol=1e-12, what="jit(grad(sum(sum(x, axis=1) ** 2)))")


# --------------------------------------------------------------------------- 01.reduce_sum_batch

reduce_sum_batch = Exercise("01.reduce_sum_batch", "The batching rule of reduce_sum")


@contextlib.contextmanager
def _batch_rule(rule):
    with (_installed(batching.primitive_batchers, lax.reduce_sum_p, _checked_batch_rule(rule)),
          _numpy_on_tracers_is_reported(rule, "Your rule", "Under jit, and inside nested vmaps, a rule "
                                        "receives tracers",
                                        "compute with lax.reduce_sum, which is traced")):
        yield


def _vmap_with(rule, f, x, in_axes=0):
    with _batch_rule(rule):
        return call_on_copies(st.vmap(f, in_axes=in_axes), x, what="vmap with your rule")


@reduce_sum_batch.case(hint="`axes` counts the axes of one example; the batched array has one more "
                            "axis, at batch_dim, so example axis a is array axis a + 1 if a >= batch_dim.")
def batch_in_front(rule):
    x = _rng().normal(size=(5, 3, 4))
    expected = x.sum(axis=1)
    expect_close(_vmap_with(rule, lambda e: tnp.sum(e, axis=0), x), expected, rtol=1e-12,
                 what="vmap(sum(axis=0)) over axis 0")


@reduce_sum_batch.case(points=2, hint="Return the axis where the batch is in the output: every summed "
                                      "axis before batch_dim moves it one to the left.")
def batch_at_the_end(rule):
    x = _rng().normal(size=(3, 4, 5))
    expected = x.sum(axis=1).T
    expect_close(_vmap_with(rule, lambda e: tnp.sum(e, axis=1), x, in_axes=2), expected, rtol=1e-12,
                 what="vmap(sum(axis=1), in_axes=2)")


@reduce_sum_batch.case(hint="Nested vmaps call your rule twice, with different batch axes; "
                            "sum(x) with no axis sums every example axis.")
def nested_vmaps_sum_each_matrix(rule):
    x = _rng().normal(size=(2, 3, 4, 5))
    expected = x.sum(axis=(0, 2)).T
    got = _vmap_with(rule, st.vmap(tnp.sum, in_axes=1), x, in_axes=3)  # sums each (2, 4) matrix
    expect_close(got, expected, rtol=1e-12, what="vmap(vmap(sum, in_axes=1), in_axes=3)")


@reduce_sum_batch.case(hint="Only the summed axes in front of batch_dim move the output's batch axis: "
                            "here one summed axis lies before the batch axis and one after it.")
def batch_between_the_summed_axes(rule):
    x = _rng().normal(size=(3, 4, 5, 6))
    expected = x.sum(axis=(0, 3)).T
    expect_close(_vmap_with(rule, lambda e: tnp.sum(e, axis=(0, 2)), x, in_axes=2), expected, rtol=1e-12,
                 what="vmap(sum(axis=(0, 2)), in_axes=2)")


@reduce_sum_batch.case(hint="This is the case above under jit, where the batched operand is a tracer: sum it "
                            "with lax.reduce_sum, not NumPy. (If the case above fails too, fix it first.)")
def works_under_jit_and_vmap(rule):
    x = _rng().normal(size=(3, 4, 5, 6))
    expected = x.sum(axis=(0, 3)).T
    with _batch_rule(rule):
        got = call_on_copies(st.jit(st.vmap(lambda e: tnp.sum(e, axis=(0, 2)), in_axes=2)), x,
                             what="jit(vmap) with your rule")
    expect_close(got, expected, rtol=1e-12, what="jit(vmap(sum(axis=(0, 2)), in_axes=2))")


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


@contextlib.contextmanager
def _errors_name_the_definitions(define_logistic, what: str):
    """Report an error inside a transformation as coming from the learner's definitions.

    `define_logistic` returns None by design, and the rules it installs are called by the
    machinery, so an error there (or one the machinery raises about what a rule returned)
    is about the definitions: say so, with the line when it passed through them.
    """
    with _numpy_on_tracers_is_reported(
            define_logistic, "Your JVP or batching rule", "Under jit, vmap and grad the rules receive "
            "tracers", "compute with logistic_p.bind and lax (lax.mul, lax.sub) or tracers' operators "
            "(t * y); only the function given to def_impl works on NumPy arrays"):
        try:
            yield
        except (CaseFailure, NotImplementedError):
            raise  # already a clear message, or the stub
        except Exception as error:
            if _is_numpy_on_a_tracer(error):
                raise  # reported by the outer context, with its own message
            raise CaseFailure(f"{what} with your definitions raised {type(error).__name__}: "
                              f"{error}{_learner_line(error, define_logistic)}") from None


@logistic.case(hint="logistic_p.bind on NumPy arrays runs the function given to def_impl: it computes "
                    "sigma(x) = 1 / (1 + e^-x) with NumPy (item 1 of the exercise).")
def evaluates_like_the_formula(define_logistic):
    x = _rng().normal(size=(2, 3)) * 3
    expected = _sigmoid(x)
    with _defined(define_logistic) as logistic_p, _errors_name_the_definitions(define_logistic, "bind"):
        got = call_on_copies(logistic_p.bind, x, what="logistic_p.bind (your implementation)")
    expect_close(got, expected, rtol=1e-12, what="logistic(x)")


@logistic.case(hint="def_abstract_eval maps the input ShapedArray to the output's: logistic is "
                    "elementwise, so the output has the input's shape and dtype.")
def stages_to_one_equation(define_logistic):
    x = np.ones((4, 2), np.float32)
    with _defined(define_logistic) as logistic_p, _errors_name_the_definitions(define_logistic, "make_jaxpr"):
        closed = st.make_jaxpr(logistic_p.bind)(x)
    expect([e.primitive.name for e in closed.eqns] == ["logistic"],
           f"expected one 'logistic' equation, got {[e.primitive.name for e in closed.eqns]}")
    expect(str(closed.out_avals[0]) == "f32[4,2]",
           f"expected the output type f32[4,2], got {closed.out_avals[0]}")


@logistic.case(points=2, hint="The JVP rule returns (primal output, tangent), and the tangent is "
                              "sigma'(x) = sigma(x) (1 - sigma(x)) times the input's tangent (item 3); "
                              "reverse mode needs no rule of its own, so a right jvp makes grad right.")
def jvp_and_grad_match_jax(define_logistic):
    x, v = _rng().normal(size=5), _rng().normal(size=5)
    with jax.enable_x64(True):
        expected = jax.tree.map(np.asarray, (jax.jvp(jax.nn.sigmoid, (x,), (v,)),
                                             jax.grad(lambda x: jnp.sum(jax.nn.sigmoid(x) ** 2))(x)))
    with (_defined(define_logistic) as logistic_p,
          _errors_name_the_definitions(define_logistic, "jvp and grad")):
        got = (call_on_copies(lambda x, v: st.jvp(logistic_p.bind, (x,), (v,)), x, v,
                              what="jvp with your rule"),
               call_on_copies(st.grad(lambda x: tnp.sum(logistic_p.bind(x) ** 2)), x,
                              what="grad with your rule"))
    expect_close(got, expected, rtol=1e-10, atol=1e-12, what="(jvp, grad)")


@logistic.case(hint="The JVP rule's primal output must be logistic_p.bind(x), computed once (item 3): "
                    "a formula of other primitives bypasses the implementation, and the staged program "
                    "no longer shows logistic.")
def jvp_computes_its_primal_with_the_primitive(define_logistic):
    x, v = _rng().normal(size=3), _rng().normal(size=3)
    with (_defined(define_logistic) as logistic_p,
          _errors_name_the_definitions(define_logistic, "make_jaxpr of jvp")):
        staged = st.make_jaxpr(lambda x, v: st.jvp(logistic_p.bind, (x,), (v,)))(x, v)
    names = [eqn.primitive.name for eqn in staged.eqns]
    expect(names.count("logistic") == 1,
           f"jvp(logistic) with your rule stages the equations {names}: expected one 'logistic'")


@logistic.case(hint="logistic is elementwise: apply it to the batched array as it is and return the "
                    "batch axis you were given.")
def vmap_over_any_axis(define_logistic):
    x = _rng().normal(size=(3, 4))
    expected = _sigmoid(x).T
    with _defined(define_logistic) as logistic_p, _errors_name_the_definitions(define_logistic, "vmap"):
        got = call_on_copies(st.vmap(logistic_p.bind, in_axes=1), x, what="vmap with your rule")
    expect_close(got, expected, rtol=1e-12, what="vmap(logistic, in_axes=1)")


@logistic.case(hint="Your rules composed: jit, vmap over axis 1, grad. Under jit every input is a tracer "
                    "without a value, so the rules compute with primitives (logistic_p.bind, lax.mul, ...), "
                    "never NumPy; and the batching rule returns the batch axis it was given (as in the vmap "
                    "case).")
def composes_under_jit_vmap_grad(define_logistic):
    x = _rng().normal(size=(4, 3))
    expected = (_sigmoid(x) * (1 - _sigmoid(x))).T  # vmap over axis 1 puts the batch first
    with (_defined(define_logistic) as logistic_p,
          _errors_name_the_definitions(define_logistic, "jit(vmap(grad))")):
        # interpret=True: this primitive has no lowering rule (the lowering exercise is separate).
        per_column = st.vmap(st.grad(lambda r: tnp.sum(logistic_p.bind(r))), in_axes=1)
        got = call_on_copies(st.jit(per_column, interpret=True), x, what="jit(vmap(grad)) with your rules")
    expect_close(got, expected, rtol=1e-10, what="jit(vmap(grad(sum(logistic)), in_axes=1))")


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


def _expect_jacobian(got, expected: np.ndarray, what: str) -> None:
    """Like expect_close, but a Jacobian with its axes swapped is named as such."""
    try:
        got_array = np.asarray(got, dtype=np.float64)
    except Exception:  # not an array: let expect_close describe it
        got_array = None
    if got_array is not None and got_array.shape == expected.T.shape and expected.ndim == 2:
        close_to = lambda target: np.allclose(got_array, target, rtol=1e-10, atol=1e-12)  # noqa: E731
        swapped = expected.shape != expected.T.shape or (close_to(expected.T) and not close_to(expected))
        if swapped:
            raise CaseFailure(
                f"{what} is transposed: it has shape {got_array.shape} = (inputs, outputs) and "
                f"J[j, i] = d out_i / d x_j, but a Jacobian has shape (outputs, inputs) = {expected.shape}, "
                "J[i, j] = d out_i / d x_j. vmap stacks the directions along axis 0 unless you put "
                "them last with out_axes=-1")
    expect_close(got, expected, rtol=1e-10, atol=1e-12, what=what)


@contextlib.contextmanager
def _jacfwd_reports_numpy(make_jacfwd):
    with _numpy_on_tracers_is_reported(
            make_jacfwd, "Your jacfwd", "Under jit, x and f's outputs are tracers",
            "build the Jacobian with st.vmap and st.jvp only (np.stack or np.array of tracers fails)"):
        yield


@jacfwd.case(hint="Column j of the Jacobian is the JVP in the direction of the basis vector e_j.")
def an_elementwise_function_has_a_diagonal_jacobian(make_jacfwd):
    x = _rng().normal(size=4)
    expected = np.diag(np.cos(x))
    with _jacfwd_reports_numpy(make_jacfwd):
        got = call_on_copies(make_jacfwd(tnp.sin), x, what="jacfwd(sin)")
    _expect_jacobian(got, expected, what="jacfwd(sin)(x)")


@jacfwd.case(points=2, hint="The result has shape (outputs, inputs): J[i, j] = d out_i / d x_j, so "
                            "the basis direction is the last axis (out_axes=-1).")
def matches_jax_jacfwd(make_jacfwd):
    x = _rng().normal(size=3)
    with jax.enable_x64(True):
        expected = np.asarray(jax.jacfwd(_sample_function(jnp))(x))
    with _jacfwd_reports_numpy(make_jacfwd):
        got = call_on_copies(make_jacfwd(_sample_function(tnp)), x, what="jacfwd(f)")
    _expect_jacobian(got, expected, what="jacfwd(f)(x)")


@jacfwd.case(hint="vmap the JVP over the rows of np.eye(n): f is then called once, on a batch of "
                  "directions, instead of n times in a Python loop.")
def calls_the_function_once(make_jacfwd):
    calls = []

    def counted(x):
        calls.append(1)
        return _sample_function(tnp)(x)

    with _jacfwd_reports_numpy(make_jacfwd):
        call_on_copies(make_jacfwd(counted), _rng().normal(size=3), what="jacfwd(f)")
    expect(len(calls) == 1, f"f was called {len(calls)} times; vmap over the directions calls it once")


@jacfwd.case(hint="jit(jacfwd(f)) traces your jacfwd with x a tracer: build it from st.vmap and "
                  "st.jvp only, and it stages like any other function.")
def works_under_jit(make_jacfwd):
    x = _rng().normal(size=3)
    with jax.enable_x64(True):
        expected = np.asarray(jax.jacfwd(_square_function(jnp))(x))
    with _jacfwd_reports_numpy(make_jacfwd):
        got = call_on_copies(st.jit(make_jacfwd(_square_function(tnp))), x, what="jit(jacfwd(f))")
    _expect_jacobian(got, expected, what="jit(jacfwd(f))(x)")


# --------------------------------------------------------------------------- 01.reduce_max_lowering

reduce_max_lowering = Exercise("01.reduce_max_lowering", "The lowering rule of reduce_max")


def _checked_lowering_rule(rule):
    def checked(ctx, x, **params):
        try:
            out = rule(ctx, x, **params)
        except Exception as error:
            numpy_dir = str(pathlib.Path(np.__file__).parent)
            frames = traceback.extract_tb(error.__traceback__)
            if not any(f.filename.startswith(numpy_dir) for f in frames):
                raise
            raise CaseFailure(f"Your rule applied NumPy to an operand{_learner_line(error, rule)}: a "
                              f"lowering rule receives SSA names like {x!r}, not arrays, and writes "
                              "StableHLO text with ctx.emit(...) or lowering.reduce(...).") from None
        if not isinstance(out, str):
            raise CaseFailure(f"Your rule returned {_describe(out)}; a lowering rule returns the SSA "
                              "name of its result, the string that ctx.emit(...) or lowering.reduce(...) "
                              "gives back (like '%3'). It never sees arrays, only names and types.")
        return out
    return checked


def _compiled_max(rule, x, axis):
    """jit(max) with the learner's rule: lowered to StableHLO, compiled by XLA, run on x."""
    with _installed(lowering.lowering_rules, lax.reduce_max_p, _checked_lowering_rule(rule)):
        try:
            return call_on_copies(st.jit(lambda v: tnp.max(v, axis=axis)), x, what="jit(max) with your rule")
        except lowering.StableHLOCompileError as error:
            raise CaseFailure(f"{error}\nThe whole module, with your rule's line in it:\n"
                              f"{error.text}") from None


@reduce_max_lowering.case(hint="The result is not the maximum: check which stablehlo operation "
                               "lowering.reduce combines the elements with (its `op` argument).")
def max_of_positive_values(rule):
    x = _rng().uniform(1.0, 2.0, size=(3, 4))
    expected = np.max(x)
    expect_close(_compiled_max(rule, x, None), expected, rtol=0, atol=0, what="jit(max(x)) for x in [1, 2)")


@reduce_max_lowering.case(points=2, hint="The initial value is combined with every element, so it "
                                         "must never win: when every element is negative, 0 wins.")
def max_of_negative_values_over_one_axis(rule):
    x = -_rng().uniform(1.0, 2.0, size=(3, 4))
    expected = np.max(x, axis=1)
    expect_close(_compiled_max(rule, x, 1), expected, rtol=0, atol=0, what="jit(max(x, axis=1)) for x < 0")


@reduce_max_lowering.case(hint="The initial value must have the operand's dtype (float32 here, not "
                               "float64): ctx.avals_in holds the operand's abstract value.")
def a_middle_axis_of_float32(rule):
    x = (_rng().normal(size=(2, 3, 4)) - 3.0).astype(np.float32)
    expected = np.max(x, axis=1)
    got = _compiled_max(rule, x, 1)
    expect(np.asarray(got).dtype == np.float32, f"the result has dtype {np.asarray(got).dtype}, "
                                                "not float32: the rule must keep the operand's dtype")
    expect_close(got, expected, rtol=0, atol=0, what="jit(max(x, axis=1)) for float32 x of shape (2, 3, 4)")


# A fully masked row of attention scores is all -inf, and its maximum is -inf: an initial
# value of np.finfo(dtype).min, or any large negative number, wins there. The finite row
# below -1e30 catches "large" negative numbers that are not large enough.
@reduce_max_lowering.case(points=2, hint="A row of -inf (every score masked) must come out -inf, and a row "
                                         "whose largest value is -1e31 must come out -1e31: the initial "
                                         "value must lose to every float, which np.finfo(dtype).min or a "
                                         "number like -1e9 do not.")
def a_row_of_minus_infinity_stays_minus_infinity(rule):
    for dtype in (np.float32, np.float64):
        x = np.array([[-np.inf, -np.inf, -np.inf], [-np.inf, 2.0, 0.5], [-3e38, -np.inf, -1e31]], dtype)
        expected = np.max(x, axis=1)
        expect_close(_compiled_max(rule, x, 1), expected, rtol=0, atol=0,
                     what=f"jit(max(x, axis=1)) for {np.dtype(dtype).name} rows of -inf")


@reduce_max_lowering.case(points=2, hint="Integers have no -inf: the initial value must not win even against "
                                         "the smallest value of the operand's own dtype "
                                         "(np.iinfo(dtype).min, for int8 as for int32).")
def integers_down_to_the_smallest_value_of_their_dtype(rule):
    x = _rng().integers(-100, -1, size=(4, 3)).astype(np.int32)
    x[1] = np.iinfo(np.int32).min
    expect_close(_compiled_max(rule, x, 1), np.max(x, axis=1), rtol=0, atol=0,
                 what="jit(max(x, axis=1)) for int32 x < 0 with a row of int32's minimum")
    x8 = np.array([[-128, -128], [-128, -3], [7, -128]], np.int8)
    expect_close(_compiled_max(rule, x8, 1), np.max(x8, axis=1), rtol=0, atol=0,
                 what="jit(max(x, axis=1)) for int8 x with a row of int8's minimum, -128")

