"""Forward-mode differentiation: `jvp`, with one JVP rule per primitive.

Mirrors `jax.jvp` and the rule table `jax.interpreters.ad.primitive_jvps`. A JVP
(Jacobian-vector product) pushes a tangent along with every value: for f at x in
direction v it returns f(x) and ∂f(x)·v in one pass. Each `JVPTracer` carries a
(primal, tangent) pair, and each primitive has a rule that maps input pairs to the
output pair, e.g. for sin: (x, t) ↦ (sin x, cos x · t). Rules are written with the
traced operations of `stacklib.transforms.lax`, not NumPy, so the tangent computation
can itself be differentiated (`grad(grad(f))`), batched or staged.

The tangent of a constant is a *symbolic zero* (`Zero`, JAX's `ad.Zero`): it has a
shape and dtype but no array, the rules of `add`, `mul`, `dot_general` and the other
multi-input primitives skip the terms it would contribute, and a tracer whose tangent is
`Zero` lowers back to its primal, so operations on constants are not differentiated at
all. Without this, `grad` of a loss would multiply every data array by a zero tangent.

Ties (`max` of equal values) follow JAX: the tangent is shared equally among the tied
inputs, so d/dx max(x, x) is 1 and the gradient of `jnp.max` at a tie averages.

Differences from JAX:
  * only our own multi-input rules understand `Zero`; a rule registered for a new
    primitive receives zero arrays instead (JAX lets each rule choose);
  * the tangent of a bool or int result is a zero array of the same dtype, not `float0`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from stacklib.transforms import core, errors, lax, tree_util
from stacklib.transforms import numpy as jnp
from stacklib.transforms.core import Primitive, Trace, Tracer, get_aval, zeros_like_aval

JVPRule = Callable[..., tuple[Any, Any]]
primitive_jvps: dict[Primitive, JVPRule] = {}


class Zero:
    """A tangent known to be zero: a shape and dtype, no array, no work (JAX's `ad.Zero`)."""

    __slots__ = ["aval"]

    def __init__(self, aval: core.ShapedArray):
        self.aval = aval

    def __repr__(self) -> str:
        return f"Zero({self.aval.str_short()})"


def is_zero(tangent: Any) -> bool:
    return isinstance(tangent, Zero)


def instantiate(tangent: Any) -> Any:
    """A concrete array for a tangent (zeros for a symbolic `Zero`)."""
    return zeros_like_aval(tangent.aval) if is_zero(tangent) else tangent


class JVPTracer(Tracer):
    """A value and its tangent (the directional derivative carried alongside it)."""

    __slots__ = ["primal", "tangent"]

    def __init__(self, trace: Trace, primal: Any, tangent: Any):
        self._trace = trace
        self.primal = primal
        self.tangent = tangent

    @property
    def aval(self):
        return get_aval(self.primal)

    def full_lower(self):
        # A value with a zero tangent is just its primal: later operations skip this trace.
        return core.full_lower(self.primal) if is_zero(self.tangent) else self

    def concrete_value(self):
        # The primal is an ordinary value (or a tracer that may know its own), which is
        # why `grad` of a function with a Python `if` on its input works, as in JAX.
        if isinstance(self.primal, Tracer):
            return self.primal.concrete_value()
        return np.asarray(self.primal)

    def abstract_source(self) -> Tracer:
        return self.primal.abstract_source() if isinstance(self.primal, Tracer) else self

    def __repr__(self) -> str:
        def show(v):
            return repr(v) if isinstance(v, Tracer | Zero) else np.array2string(np.asarray(v), precision=4)
        return f"JVPTracer(primal={show(self.primal)}, tangent={show(self.tangent)})"


class JVPTrace(Trace):
    transform_name = "jvp"

    def pure(self, value):
        return JVPTracer(self, value, Zero(get_aval(value)))

    lift = pure

    def process_primitive(self, primitive, tracers, params):
        primals_in = [t.primal for t in tracers]
        tangents_in = [t.tangent for t in tracers]
        if all(is_zero(t) for t in tangents_in):  # nothing here depends on the inputs' tangents
            outs = primitive.bind(*primals_in, **params)
            outs = outs if primitive.multiple_results else [outs]
            return [JVPTracer(self, out, Zero(get_aval(out))) for out in outs]
        rule = primitive_jvps.get(primitive)
        if rule is None:
            raise errors.MissingRuleError(
                f"Differentiation rule for '{primitive.name}' not implemented: add a JVP rule "
                f"with stacklib.transforms.forward.primitive_jvps[{primitive.name}_p] = rule, where "
                "rule(primals, tangents, **params) returns (primal_out, tangent_out)."
            )
        if primitive not in _ZERO_AWARE:
            tangents_in = [instantiate(t) for t in tangents_in]
        primal_out, tangent_out = rule(primals_in, tangents_in, **params)
        if primitive.multiple_results:
            return [JVPTracer(self, p, t) for p, t in zip(primal_out, tangent_out, strict=True)]
        return [JVPTracer(self, primal_out, tangent_out)]


def jvp_flat(fun: Callable[..., Sequence[Any]], primals: Sequence[Any], tangents: Sequence[Any]):
    """`jvp` of a function of a flat list of arrays that returns a list."""
    with core.new_main(JVPTrace) as main:
        trace = JVPTrace(main)
        tracers_in = [JVPTracer(trace, p, t) for p, t in zip(primals, tangents, strict=True)]
        outs = fun(*tracers_in)
        tracers_out = [core.full_raise(trace, out) for out in outs]
        return ([core.full_lower(t.primal) for t in tracers_out],
                [core.full_lower(instantiate(t.tangent)) for t in tracers_out])


def _as_value(x: Any) -> Any:
    return x if isinstance(x, Tracer) else np.asarray(x)


def jvp(fun: Callable, primals: Sequence[Any], tangents: Sequence[Any]) -> tuple[Any, Any]:
    """Evaluate `fun` and its derivative at `primals` in the direction `tangents`.

    Like `jax.jvp`: `primals` and `tangents` are tuples (one entry per argument of
    `fun`, each a pytree of arrays) of matching structure, shapes and dtypes.

    Returns:
      `(fun(*primals), tangent_out)`, where tangent_out = ∂fun(primals) · tangents has
      the structure of the output.

    Raises:
      TypeError: `primals` or `tangents` is not a tuple or list, or they differ in structure.
      ValueError: a tangent's shape or dtype differs from its primal's.
    """
    if not isinstance(primals, tuple | list) or not isinstance(tangents, tuple | list):
        raise TypeError("jvp expects primals and tangents as tuples, one entry per argument: "
                        f"jvp(f, (x,), (v,)); got {type(primals).__name__} and "
                        f"{type(tangents).__name__}.")
    primal_leaves, in_tree = tree_util.tree_flatten(tuple(primals))
    tangent_leaves, tangent_tree = tree_util.tree_flatten(tuple(tangents))
    if in_tree != tangent_tree:
        raise TypeError(f"jvp: primal and tangent arguments must have the same tree structure, "
                        f"got {in_tree} and {tangent_tree}.")
    primal_leaves = [_as_value(p) for p in primal_leaves]
    tangent_leaves = [_as_value(t) for t in tangent_leaves]
    for i, (p, t) in enumerate(zip(primal_leaves, tangent_leaves, strict=True)):
        p_aval, t_aval = get_aval(p), get_aval(t)
        if p_aval.shape != t_aval.shape:
            raise ValueError(f"jvp called with different primal and tangent shapes at leaf {i}: "
                             f"primal {p_aval.str_short()}, tangent {t_aval.str_short()}.")
        if core.is_float(p_aval.dtype) and p_aval.dtype != t_aval.dtype:
            raise ValueError(f"jvp: the tangent at leaf {i} has dtype {t_aval.dtype}, but its "
                             f"primal has {p_aval.dtype}; they must match.")
    out_trees: list = []

    def flat_fun(*leaves):
        out = fun(*tree_util.tree_unflatten(in_tree, list(leaves)))
        out_leaves, out_tree = tree_util.tree_flatten(out)
        out_trees.append(out_tree)
        return out_leaves

    primals_out, tangents_out = jvp_flat(flat_fun, primal_leaves, tangent_leaves)
    out_tree = out_trees[0]
    return tree_util.tree_unflatten(out_tree, primals_out), tree_util.tree_unflatten(out_tree, tangents_out)


# --------------------------------------------------------------------------- rules


def _zero_tangent(primal_out: Any) -> Zero:
    return Zero(get_aval(primal_out))


def _sum_terms(out: Any, *terms: Any) -> Any:
    """Add the tangent terms that exist (None marks a term skipped for a Zero input).

    A rank-0 term is broadcast to the output's shape, as the primitive broadcast its
    rank-0 operand; no terms at all make a symbolic zero.
    """
    terms = [t for t in terms if t is not None]
    if not terms:
        return _zero_tangent(out)
    total = terms[0]
    for term in terms[1:]:
        total = lax.add(total, term)
    shape = get_aval(out).shape
    return total if get_aval(total).shape == shape else lax.broadcast_in_dim(total, shape, ())


def _linear(primitive: Primitive) -> JVPRule:
    """For unary primitives that are linear: apply the same primitive to the tangent."""
    def rule(primals, tangents, **params):
        return primitive.bind(*primals, **params), primitive.bind(*tangents, **params)
    return rule


def _sin_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return lax.sin(x), lax.mul(lax.cos(x), t)


def _cos_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return lax.cos(x), lax.mul(lax.neg(lax.sin(x)), t)


def _exp_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    y = lax.exp(x)
    return y, lax.mul(y, t)


def _log_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return lax.log(x), lax.div(t, x)


def _tanh_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    y = lax.tanh(x)
    one = np.ones((), get_aval(y).dtype)
    return y, lax.mul(t, lax.sub(one, lax.integer_pow(y, 2)))


def _add_jvp(primals, tangents):
    (x, y), (tx, ty) = primals, tangents
    out = lax.add(x, y)
    return out, _sum_terms(out, None if is_zero(tx) else tx, None if is_zero(ty) else ty)


def _sub_jvp(primals, tangents):
    (x, y), (tx, ty) = primals, tangents
    out = lax.sub(x, y)
    if is_zero(tx) or is_zero(ty):
        return out, _sum_terms(out, None if is_zero(tx) else tx, None if is_zero(ty) else lax.neg(ty))
    return out, _sum_terms(out, lax.sub(tx, ty))


def _mul_jvp(primals, tangents):
    (x, y), (tx, ty) = primals, tangents
    out = lax.mul(x, y)
    return out, _sum_terms(out, None if is_zero(tx) else lax.mul(tx, y),
                           None if is_zero(ty) else lax.mul(x, ty))


def _div_jvp(primals, tangents):
    (x, y), (tx, ty) = primals, tangents
    out = lax.div(x, y)
    # d(x/y) = dx / y - dy * x / y^2
    from_x = None if is_zero(tx) else lax.div(tx, y)
    from_y = None if is_zero(ty) else lax.mul(ty, lax.div(out, y))
    if from_x is not None and from_y is not None:
        return out, _sum_terms(out, lax.sub(from_x, from_y))
    return out, _sum_terms(out, from_x, None if from_y is None else lax.neg(from_y))


def _integer_pow_jvp(primals, tangents, *, y):
    (x,), (t,) = primals, tangents
    out = lax.integer_pow(x, y)
    if y == 0:
        return out, _zero_tangent(out)
    scale = np.asarray(y, get_aval(x).dtype)
    slope = scale if y == 1 else lax.mul(scale, x if y == 2 else lax.integer_pow(x, y - 1))
    return out, lax.mul(t, slope)


def _pow_jvp(primals, tangents):
    (x, y), (tx, ty) = primals, tangents
    out = lax.pow(x, y)
    dtype = get_aval(out).dtype
    one, zero = np.ones((), dtype), np.zeros((), dtype)
    # d(x^y) = y x^(y-1) dx + log(x) x^y dy. As in JAX, y = 0 gives no dx term and x = 0
    # no dy term (log 0 is replaced by log 1).
    from_x = from_y = None
    if not is_zero(tx):
        from_x = lax.mul(tx, jnp.where(lax.eq(y, zero), zero, lax.mul(y, lax.pow(x, lax.sub(y, one)))))
    if not is_zero(ty):
        from_y = lax.mul(ty, lax.mul(lax.log(jnp.where(lax.eq(x, zero), one, x)), out))
    return out, _sum_terms(out, from_x, from_y)


def _balanced_eq(x, z, y):
    """1 where x alone attains the extremum z, 1/2 where x and y tie, 0 elsewhere (as JAX)."""
    dtype = get_aval(z).dtype
    one, half, zero = np.ones((), dtype), np.asarray(0.5, dtype), np.zeros((), dtype)
    return jnp.where(lax.eq(x, z), jnp.where(lax.eq(y, z), half, one), zero)


def _minmax_jvp(primitive: Primitive) -> JVPRule:
    def rule(primals, tangents):
        (x, y), (tx, ty) = primals, tangents
        out = primitive.bind(x, y)
        return out, _sum_terms(out, None if is_zero(tx) else lax.mul(tx, _balanced_eq(x, out, y)),
                               None if is_zero(ty) else lax.mul(ty, _balanced_eq(y, out, x)))
    return rule


def _comparison_jvp(primitive: Primitive) -> JVPRule:
    def rule(primals, tangents):
        out = primitive.bind(*primals)
        return out, _zero_tangent(out)
    return rule


def _select_n_jvp(primals, tangents):
    predicate, on_false, on_true = primals
    _, t_false, t_true = tangents
    out = lax.select_n(predicate, on_false, on_true)
    aval = get_aval(out)
    zeros = lax.broadcast_in_dim(np.zeros((), aval.dtype), aval.shape, ())
    return out, lax.select_n(predicate, zeros if is_zero(t_false) else t_false,
                             zeros if is_zero(t_true) else t_true)


def _convert_element_type_jvp(primals, tangents, *, new_dtype):
    (x,), (t,) = primals, tangents
    out = lax.convert_element_type(x, new_dtype)
    if not (core.is_float(get_aval(x).dtype) and core.is_float(new_dtype)):
        return out, _zero_tangent(out)  # ints and bools carry no derivative
    return out, lax.convert_element_type(t, new_dtype)


def _reduce_max_jvp(primals, tangents, *, axes):
    (x,), (t,) = primals, tangents
    out = lax.reduce_max(x, axes)
    shape = get_aval(x).shape
    kept = [d for d in range(len(shape)) if d not in axes]
    # Tangent = mean of t over the positions that attain the max (ties share equally).
    at_max = lax.convert_element_type(
        lax.eq(x, lax.broadcast_in_dim(out, shape, kept)), get_aval(t).dtype)
    return out, lax.div(lax.reduce_sum(lax.mul(t, at_max), axes), lax.reduce_sum(at_max, axes))


def _dot_general_jvp(primals, tangents, *, dimension_numbers):
    (x, y), (tx, ty) = primals, tangents
    out = lax.dot_general(x, y, dimension_numbers)
    return out, _sum_terms(out, None if is_zero(tx) else lax.dot_general(tx, y, dimension_numbers),
                           None if is_zero(ty) else lax.dot_general(x, ty, dimension_numbers))


for _p in (lax.neg_p, lax.reduce_sum_p, lax.broadcast_in_dim_p, lax.reshape_p, lax.transpose_p):
    primitive_jvps[_p] = _linear(_p)
for _p in (lax.gt_p, lax.lt_p, lax.ge_p, lax.le_p, lax.eq_p, lax.ne_p):
    primitive_jvps[_p] = _comparison_jvp(_p)
primitive_jvps.update({
    lax.sin_p: _sin_jvp,
    lax.cos_p: _cos_jvp,
    lax.exp_p: _exp_jvp,
    lax.log_p: _log_jvp,
    lax.tanh_p: _tanh_jvp,
    lax.add_p: _add_jvp,
    lax.sub_p: _sub_jvp,
    lax.mul_p: _mul_jvp,
    lax.div_p: _div_jvp,
    lax.integer_pow_p: _integer_pow_jvp,
    lax.pow_p: _pow_jvp,
    lax.max_p: _minmax_jvp(lax.max_p),
    lax.min_p: _minmax_jvp(lax.min_p),
    lax.select_n_p: _select_n_jvp,
    lax.convert_element_type_p: _convert_element_type_jvp,
    lax.reduce_max_p: _reduce_max_jvp,
    lax.dot_general_p: _dot_general_jvp,
})
# The rules above that take `Zero` tangents as they are; every other rule gets zero arrays.
_ZERO_AWARE = {lax.add_p, lax.sub_p, lax.mul_p, lax.div_p, lax.pow_p, lax.max_p, lax.min_p,
               lax.select_n_p, lax.dot_general_p, lax.gt_p, lax.lt_p, lax.ge_p, lax.le_p, lax.eq_p,
               lax.ne_p, lax.convert_element_type_p}
