"""Reverse-mode differentiation as JAX does it: linearize with jvp, then transpose.

Mirrors `jax.linearize`, `jax.vjp`, `jax.grad`, `jax.value_and_grad`, and the rule table
`jax.interpreters.ad.primitive_transposes` with `ad.UndefinedPrimal`.

1. *Linearize.* Run `jvp` with the tangent inputs being staging tracers of a
   non-dynamic `JaxprTrace`. Primal operations involve no tangent, so they run as usual
   (on NumPy, or staged by an outer `jit`); every tangent operation is recorded. The
   result is a jaxpr that is linear in the tangents, whose constants are the primal
   values it needs (the residuals).
2. *Transpose.* Walk that linear jaxpr backwards, sending the output cotangent to the
   inputs. Only the linear primitives need a transpose rule (`mul` by a constant,
   `add`, `reduce_sum`, `broadcast_in_dim`, `dot_general`, ...); `sin`, `exp`, `tanh`
   and every other nonlinear primitive get reverse mode from their JVP rule alone.

The rule for `ct` flowing back through `y = f(x)` with `f` linear is the transpose:
x̄ = fᵀ(ȳ), e.g. `reduce_sum` transposes to `broadcast_in_dim`, `mul(c, ·)` to itself.

Differences from JAX:
  * no symbolic zero cotangents: a zero tangent that reaches the linear jaxpr as a
    constant is added, not skipped;
  * `grad` has no `allow_int`, `holomorphic` or `reduce_axes`; complex numbers are not
    supported;
  * `jit` inside a differentiated function is inlined rather than kept as one `jit`
    equation with a transposed body.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from stacklib.transforms import core, errors, lax, tree_util
from stacklib.transforms import numpy as jnp
from stacklib.transforms.core import Primitive, ShapedArray, Tracer, get_aval
from stacklib.transforms.forward import jvp_flat
from stacklib.transforms.jaxpr import ClosedJaxpr, Literal, eval_jaxpr
from stacklib.transforms.staging import JaxprBuilder, JaxprTrace, flatten_fun, function_name


class UndefinedPrimal:
    """Marks the linear input of an equation during transposition: its value is what we solve for."""

    __slots__ = ["aval"]

    def __init__(self, aval: ShapedArray):
        self.aval = aval

    def __repr__(self) -> str:
        return f"UndefinedPrimal({self.aval.str_short()})"


def is_undefined_primal(x: Any) -> bool:
    return isinstance(x, UndefinedPrimal)


TransposeRule = Callable[..., list[Any]]
primitive_transposes: dict[Primitive, TransposeRule] = {}


# --------------------------------------------------------------------------- linearize


def linearize_flat(
    fun: Callable[..., Sequence[Any]], primals: Sequence[Any], *, context: str = "the function"
) -> tuple[list[Any], ClosedJaxpr]:
    """Evaluate `fun` at `primals` and stage its JVP's tangent part as a linear jaxpr.

    Returns:
      The primal outputs, and a `ClosedJaxpr` from input tangents to output tangents.
    """
    builder = JaxprBuilder(context, "linearize")
    # Not dynamic: only operations that touch a tangent tracer are recorded.
    with core.new_main(JaxprTrace, builder) as main:
        trace = JaxprTrace(main)
        tangents_in = [trace.new_arg(get_aval(p)) for p in primals]
        primals_out, tangents_out = jvp_flat(fun, primals, tangents_in)
        tangents_out = [core.full_raise(trace, t) for t in tangents_out]
        return primals_out, builder.build(tangents_in, tangents_out)


def linearize(fun: Callable, *primals: Any) -> tuple[Any, Callable[..., Any]]:
    """Like `jax.linearize`: `fun(*primals)` and the linear map `tangents ↦ ∂fun · tangents`.

    The linear map is a staged jaxpr, so calling it many times costs no re-tracing.
    """
    leaves, in_tree = tree_util.tree_flatten((primals, {}))
    out_trees: list = []
    flat_fun = flatten_fun(fun, in_tree, out_trees)
    primals_out, linear = linearize_flat(flat_fun, [_as_value(x) for x in leaves],
                                         context=f"the function {function_name(fun)}")
    out_tree = out_trees[0]

    def f_jvp(*tangents: Any) -> Any:
        tangent_leaves, tangent_tree = tree_util.tree_flatten((tangents, {}))
        if tangent_tree != in_tree:
            raise TypeError(f"linearize: the tangents must have the structure of the primals, "
                            f"{in_tree}; got {tangent_tree}.")
        return tree_util.tree_unflatten(out_tree, eval_jaxpr(linear.jaxpr, linear.consts, *tangent_leaves))

    return tree_util.tree_unflatten(out_tree, primals_out), f_jvp


# --------------------------------------------------------------------------- transpose


def backward_pass(linear: ClosedJaxpr, cotangents_out: Sequence[Any]) -> list[Any]:
    """Transpose a linear jaxpr: map output cotangents to input cotangents.

    Every equation of a jaxpr made by `linearize_flat` has at least one input that
    depends on the tangents (the *linear* inputs); its other inputs are constants. We
    visit the equations last to first and let each primitive's transpose rule turn the
    cotangent of its output into cotangents of its linear inputs, adding up where a
    variable is used more than once. A `None` cotangent means zero and is skipped.
    """
    jaxpr = linear.jaxpr
    known = {id(v): value for v, value in zip(jaxpr.constvars, linear.consts, strict=True)}
    linear_vars = {id(v) for v in jaxpr.invars}
    linear_vars |= {id(v) for eqn in jaxpr.eqns for v in eqn.outvars}
    cts: dict[int, Any] = {}

    def add_cotangent(var, ct):
        if ct is None or isinstance(var, Literal) or id(var) not in linear_vars:
            return  # a constant output or input: nothing to send back
        cts[id(var)] = ct if id(var) not in cts else lax.add(cts[id(var)], ct)

    for var, ct in zip(jaxpr.outvars, cotangents_out, strict=True):
        add_cotangent(var, ct)
    for eqn in reversed(jaxpr.eqns):
        (outvar,) = eqn.outvars
        ct = cts.pop(id(outvar), None)
        if ct is None:
            continue
        invals = [v.val if isinstance(v, Literal)
                  else UndefinedPrimal(v.aval) if id(v) in linear_vars else known[id(v)]
                  for v in eqn.invars]
        rule = primitive_transposes.get(eqn.primitive)
        if rule is None:
            raise errors.MissingRuleError(
                f"Transpose rule (for reverse-mode differentiation) for '{eqn.primitive.name}' not "
                f"implemented. Only linear primitives need one: add it with stacklib.transforms."
                f"reverse.primitive_transposes[{eqn.primitive.name}_p] = rule, where "
                "rule(ct, *inputs, **params) returns one cotangent per input (None for constants)."
            )
        for var, ct_in in zip(eqn.invars, rule(ct, *invals, **eqn.params), strict=True):
            if ct_in is not None and id(var) in linear_vars and get_aval(ct_in) != var.aval:
                raise ValueError(
                    f"The transpose rule of '{eqn.primitive.name}' returned a cotangent of type "
                    f"{get_aval(ct_in).str_short()} for an input of type {var.aval.str_short()}: a "
                    "cotangent must have exactly the shape and dtype of the input it belongs to.")
            add_cotangent(var, ct_in)
    return [cts[id(v)] if id(v) in cts else core.zeros_like_aval(v.aval) for v in jaxpr.invars]


# --------------------------------------------------------------------------- vjp and grad


def _as_value(x: Any) -> Any:
    return x if isinstance(x, Tracer) else np.asarray(x)


def vjp(fun: Callable, *primals: Any, has_aux: bool = False):
    """Like `jax.vjp`: `fun(*primals)` and the map from output cotangents to input cotangents.

    Returns:
      `(out, f_vjp)` or, with `has_aux=True` (`fun` returns `(out, aux)`), `(out, f_vjp, aux)`.
      `f_vjp(ct)` takes a cotangent shaped like `out` and returns a tuple with one
      cotangent per primal argument, each shaped like that argument.
    """
    leaves, in_tree = tree_util.tree_flatten((primals, {}))
    out_trees: list = []
    flat_fun = flatten_fun(fun, in_tree, out_trees)
    primals_out, linear = linearize_flat(flat_fun, [_as_value(x) for x in leaves],
                                         context=f"the function {function_name(fun)}")
    out = tree_util.tree_unflatten(out_trees[0], primals_out)
    if has_aux:
        if not (isinstance(out, tuple | list) and len(out) == 2):
            raise TypeError("with has_aux=True the function must return a pair (output, aux).")
        out, aux = out
        n_out = len(tree_util.tree_leaves(out))
    else:
        n_out = len(primals_out)
    out_tree = tree_util.tree_structure(out)

    def f_vjp(cotangent: Any) -> tuple[Any, ...]:
        ct_leaves, ct_tree = tree_util.tree_flatten(cotangent)
        if ct_tree != out_tree:
            raise TypeError(f"vjp: the cotangent must have the structure of the output, {out_tree}; "
                            f"got {ct_tree}.")
        for i, (ct, primal) in enumerate(zip(ct_leaves, primals_out, strict=False)):
            if get_aval(ct).shape != get_aval(primal).shape:
                raise ValueError(f"vjp: cotangent leaf {i} has shape {get_aval(ct).shape}, but the "
                                 f"output it pairs with has shape {get_aval(primal).shape}.")
        aux_cts = [None] * (len(primals_out) - n_out)
        cts_in = backward_pass(linear, [_as_value(ct) for ct in ct_leaves] + aux_cts)
        args, _ = tree_util.tree_unflatten(in_tree, cts_in)
        return args

    return (out, f_vjp, aux) if has_aux else (out, f_vjp)


def _check_argnums(argnums: int | Sequence[int], n_args: int) -> tuple[int, ...]:
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    for n in nums:
        if not -n_args <= n < n_args:
            raise ValueError(f"argnums={argnums} refers to argument {n}, but the function was "
                             f"called with {n_args} positional argument(s).")
    return tuple(n % n_args for n in nums)


def value_and_grad(fun: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False):
    """Like `jax.value_and_grad`: a function returning `fun`'s value and its gradient.

    Args:
      fun: a function with a scalar float output (or `(output, aux)` with `has_aux`).
      argnums: which positional argument(s) to differentiate; a tuple gives a tuple of
        gradients. Keyword arguments are never differentiated.
      has_aux: `fun` returns a pair whose second element is returned, not differentiated.

    Raises:
      TypeError: the output is not a scalar, or a differentiated input is not a float array.
    """

    def value_and_grad_fun(*args: Any, **kwargs: Any):
        nums = _check_argnums(argnums, len(args))
        for n in nums:
            for leaf in tree_util.tree_leaves(args[n]):
                dtype = get_aval(_as_value(leaf)).dtype
                if not core.is_float(dtype):
                    raise TypeError(
                        f"grad requires real-valued floating-point inputs, but argument {n} has a "
                        f"leaf of dtype {dtype}. Pass floats (e.g. 1.0, not 1), or differentiate "
                        "with respect to other arguments via argnums.")

        def partial_fun(*diff_args):
            full = list(args)
            for n, value in zip(nums, diff_args, strict=True):
                full[n] = value
            return fun(*full, **kwargs)

        outs = vjp(partial_fun, *[args[n] for n in nums], has_aux=has_aux)
        out, f_vjp = outs[0], outs[1]
        out_aval = get_aval(_as_value(out)) if not isinstance(out, tuple | list | dict) else None
        if out_aval is None or out_aval.shape != ():
            shape = out_aval.shape if out_aval is not None else f"a {type(out).__name__}"
            raise TypeError(f"Gradient only defined for scalar-output functions. Output had shape: "
                            f"{shape}.")
        if not core.is_float(out_aval.dtype):
            raise TypeError(f"grad requires a real-valued floating-point output, got {out_aval.dtype}.")
        grads = f_vjp(np.ones((), out_aval.dtype))
        grads = grads[0] if isinstance(argnums, int) else grads
        value = (out, outs[2]) if has_aux else out
        return value, grads

    value_and_grad_fun.__name__ = f"value_and_grad({function_name(fun)})"
    return value_and_grad_fun


def grad(fun: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False):
    """Like `jax.grad`: a function returning the gradient of scalar-valued `fun`.

    The gradient has the structure of the differentiated argument (a dict of arrays
    for a dict of parameters). With `has_aux=True` it returns `(gradient, aux)`.
    See `value_and_grad` for the arguments.
    """
    value_and_grad_fun = value_and_grad(fun, argnums, has_aux)

    def grad_fun(*args: Any, **kwargs: Any):
        value, grads = value_and_grad_fun(*args, **kwargs)
        return (grads, value[1]) if has_aux else grads

    grad_fun.__name__ = f"grad({function_name(fun)})"
    return grad_fun


# --------------------------------------------------------------------------- transpose rules


def _unbroadcast(aval: ShapedArray, ct: Any) -> Any:
    """Undo a rank-0 operand's implicit broadcast in a binary primitive: sum the cotangent."""
    ct_shape = get_aval(ct).shape
    if ct_shape == aval.shape:
        return ct
    return lax.reduce_sum(ct, tuple(range(len(ct_shape))))


def _neg_transpose(ct, x):
    return [lax.neg(ct)]


def _add_transpose(ct, x, y):
    return [_unbroadcast(v.aval, ct) if is_undefined_primal(v) else None for v in (x, y)]


def _sub_transpose(ct, x, y):
    return [_unbroadcast(x.aval, ct) if is_undefined_primal(x) else None,
            _unbroadcast(y.aval, lax.neg(ct)) if is_undefined_primal(y) else None]


def _mul_transpose(ct, x, y):
    if is_undefined_primal(x) and is_undefined_primal(y):
        raise ValueError("mul of two linear values is not linear: a JVP rule multiplied two tangents.")
    if is_undefined_primal(x):
        return [_unbroadcast(x.aval, lax.mul(ct, y)), None]
    return [None, _unbroadcast(y.aval, lax.mul(x, ct))]


def _div_transpose(ct, x, y):
    if is_undefined_primal(y):
        raise ValueError("div is linear in its numerator only; the denominator must be a constant.")
    return [_unbroadcast(x.aval, lax.div(ct, y)), None]


def _reduce_sum_transpose(ct, x, *, axes):
    shape = x.aval.shape
    return [lax.broadcast_in_dim(ct, shape, [d for d in range(len(shape)) if d not in axes])]


def _broadcast_in_dim_transpose(ct, x, *, shape, broadcast_dimensions):
    operand_shape = x.aval.shape
    # Sum over the output axes the operand did not have, and over those it had with size 1.
    new_axes = [d for d in range(len(shape)) if d not in broadcast_dimensions]
    expanded = [d for i, d in enumerate(broadcast_dimensions) if operand_shape[i] == 1 and shape[d] != 1]
    summed = lax.reduce_sum(ct, sorted(new_axes + expanded)) if new_axes or expanded else ct
    if get_aval(summed).shape != operand_shape:
        summed = lax.reshape(summed, operand_shape)  # put the size-1 axes back
    return [summed]


def _reshape_transpose(ct, x, *, new_sizes):
    return [lax.reshape(ct, x.aval.shape)]


def _transpose_transpose(ct, x, *, permutation):
    return [lax.transpose(ct, np.argsort(permutation))]


def _convert_element_type_transpose(ct, x, *, new_dtype):
    return [lax.convert_element_type(ct, x.aval.dtype)]


def _select_n_transpose(ct, predicate, on_false, on_true):
    if is_undefined_primal(predicate):
        raise ValueError("select_n is not linear in its predicate.")
    zeros = jnp.zeros_like(ct)
    return [None,
            lax.select_n(predicate, ct, zeros) if is_undefined_primal(on_false) else None,
            lax.select_n(predicate, zeros, ct) if is_undefined_primal(on_true) else None]


def _free_dims(ndim: int, contract: Sequence[int], batch: Sequence[int]) -> list[int]:
    return [d for d in range(ndim) if d not in contract and d not in batch]


def _dot_transpose_lhs(ct, y, x_aval: ShapedArray, dimension_numbers):
    """Cotangent of the left operand x of out = dot_general(x, y)."""
    (x_contract, y_contract), (x_batch, y_batch) = dimension_numbers
    y_ndim = get_aval(y).ndim
    x_free = _free_dims(x_aval.ndim, x_contract, x_batch)
    y_free = _free_dims(y_ndim, y_contract, y_batch)
    n_batch = len(x_batch)
    # ct's axes are [batch, x_free, y_free]; contract its y_free axes with y's free axes.
    ct_y_free = tuple(range(n_batch + len(x_free), n_batch + len(x_free) + len(y_free)))
    out = lax.dot_general(ct, y, ((ct_y_free, tuple(y_free)), (tuple(range(n_batch)), tuple(y_batch))))
    # out's axes are [batch, x_free, y's contracted axes in increasing order]: find x's order.
    position = {d: i for i, d in enumerate(x_batch)}
    position.update({d: n_batch + i for i, d in enumerate(x_free)})
    y_contract_sorted = sorted(y_contract)
    for dx, dy in zip(x_contract, y_contract, strict=True):
        position[dx] = n_batch + len(x_free) + y_contract_sorted.index(dy)
    permutation = [position[d] for d in range(x_aval.ndim)]
    return out if permutation == sorted(permutation) else lax.transpose(out, permutation)


def _dot_general_transpose(ct, x, y, *, dimension_numbers):
    if is_undefined_primal(x) and is_undefined_primal(y):
        raise ValueError("dot_general of two linear values is not linear.")
    if is_undefined_primal(x):
        return [_dot_transpose_lhs(ct, y, x.aval, dimension_numbers), None]
    # For y, swap the operands: dot_general(y, x) has axes [batch, y_free, x_free].
    (x_contract, y_contract), (x_batch, y_batch) = dimension_numbers
    n_batch = len(x_batch)
    n_x_free = len(_free_dims(get_aval(x).ndim, x_contract, x_batch))
    n_y_free = len(_free_dims(y.aval.ndim, y_contract, y_batch))
    swap = (list(range(n_batch)) + list(range(n_batch + n_x_free, n_batch + n_x_free + n_y_free))
            + list(range(n_batch, n_batch + n_x_free)))
    ct_swapped = ct if swap == sorted(swap) else lax.transpose(ct, swap)
    swapped_numbers = ((y_contract, x_contract), (y_batch, x_batch))
    return [None, _dot_transpose_lhs(ct_swapped, x, y.aval, swapped_numbers)]


primitive_transposes.update({
    lax.neg_p: _neg_transpose,
    lax.add_p: _add_transpose,
    lax.sub_p: _sub_transpose,
    lax.mul_p: _mul_transpose,
    lax.div_p: _div_transpose,
    lax.reduce_sum_p: _reduce_sum_transpose,
    lax.broadcast_in_dim_p: _broadcast_in_dim_transpose,
    lax.reshape_p: _reshape_transpose,
    lax.transpose_p: _transpose_transpose,
    lax.convert_element_type_p: _convert_element_type_transpose,
    lax.select_n_p: _select_n_transpose,
    lax.dot_general_p: _dot_general_transpose,
})
