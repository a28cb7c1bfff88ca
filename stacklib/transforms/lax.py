"""The primitives: each with a NumPy implementation and a shape-and-dtype rule.

Mirrors a subset of `jax.lax` and its primitives (`sin_p`, `add_p`, `reduce_sum_p`,
`broadcast_in_dim_p`, `dot_general_p`, ...), with the same names and parameters, so that
our jaxprs read like JAX's. Everything the user-facing `stacklib.transforms.numpy` does
is written in terms of these ~30 primitives; every transformation only needs rules for
them.

Like `jax.lax`, the primitives are strict where NumPy is lenient: binary operations
need equal dtypes and equal shapes (or a rank-0 operand, which broadcasts); broadcasting
and promotion are handled one level up, in `stacklib.transforms.numpy`. The one leniency,
as in JAX, is a Python scalar operand: it takes the other operand's dtype.

Differences from jax.lax:
  * ~30 primitives, no control flow (`cond`, `scan`, `while_loop`), no gather/scatter,
    convolutions or random numbers;
  * `select_n` takes a boolean predicate and exactly two cases;
  * `dot_general` has no `precision` or `preferred_element_type`; `reshape` has no
    `dimensions`; no primitive carries sharding parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from stacklib.transforms.core import Primitive, ShapedArray, get_aval

# --------------------------------------------------------------------------- elementwise


def _elementwise_aval(name: str, *avals: ShapedArray, out_dtype: Any = None) -> ShapedArray:
    """Equal dtypes, and equal shapes except for rank-0 operands, which broadcast."""
    shapes = {aval.shape for aval in avals if aval.shape}
    if len(shapes) > 1:
        shown = ", ".join(aval.str_short() for aval in avals)
        raise TypeError(
            f"{name} needs operands of equal shapes (or rank-0 ones), got {shown}. "
            "Use stacklib.transforms.numpy, which broadcasts first, or lax.broadcast_in_dim."
        )
    dtypes = {aval.dtype for aval in avals}
    if len(dtypes) > 1:
        shown = ", ".join(aval.str_short() for aval in avals)
        raise TypeError(
            f"{name} needs operands of equal dtypes, got {shown}. Convert one with "
            "lax.convert_element_type, or use stacklib.transforms.numpy, which promotes."
        )
    shape = shapes.pop() if shapes else ()
    return ShapedArray(shape, out_dtype if out_dtype is not None else avals[0].dtype)


def _unary(name: str, impl: Callable[[np.ndarray], np.ndarray]) -> Primitive:
    primitive = Primitive(name)
    primitive.def_impl(impl)
    primitive.def_abstract_eval(lambda x: _elementwise_aval(name, x))
    return primitive


def _binary(name: str, impl: Callable[..., np.ndarray], out_dtype: Any = None) -> Primitive:
    primitive = Primitive(name)
    primitive.def_impl(impl)
    primitive.def_abstract_eval(lambda x, y: _elementwise_aval(name, x, y, out_dtype=out_dtype))
    return primitive


neg_p = _unary("neg", np.negative)
sin_p = _unary("sin", np.sin)
cos_p = _unary("cos", np.cos)
exp_p = _unary("exp", np.exp)
log_p = _unary("log", np.log)
tanh_p = _unary("tanh", np.tanh)

add_p = _binary("add", np.add)
sub_p = _binary("sub", np.subtract)
mul_p = _binary("mul", np.multiply)
max_p = _binary("max", np.maximum)
min_p = _binary("min", np.minimum)
pow_p = _binary("pow", np.power)


def _div_impl(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    if np.issubdtype(np.result_type(x, y), np.integer):
        return np.asarray(np.fix(np.true_divide(x, y))).astype(np.result_type(x, y))  # rounds toward 0
    return np.true_divide(x, y)


div_p = _binary("div", _div_impl)

gt_p = _binary("gt", np.greater, out_dtype=np.bool_)
lt_p = _binary("lt", np.less, out_dtype=np.bool_)
ge_p = _binary("ge", np.greater_equal, out_dtype=np.bool_)
le_p = _binary("le", np.less_equal, out_dtype=np.bool_)
eq_p = _binary("eq", np.equal, out_dtype=np.bool_)
ne_p = _binary("ne", np.not_equal, out_dtype=np.bool_)

integer_pow_p = Primitive("integer_pow")
integer_pow_p.def_impl(lambda x, *, y: np.power(x, y) if y >= 0 else 1 / np.power(x, -y))
integer_pow_p.def_abstract_eval(lambda x, *, y: _elementwise_aval("integer_pow", x))

convert_element_type_p = Primitive("convert_element_type")
convert_element_type_p.def_impl(lambda x, *, new_dtype: np.asarray(x).astype(new_dtype))
convert_element_type_p.def_abstract_eval(lambda x, *, new_dtype: ShapedArray(x.shape, new_dtype))


select_n_p = Primitive("select_n")
select_n_p.def_impl(lambda predicate, on_false, on_true: np.where(predicate, on_true, on_false))


@select_n_p.def_abstract_eval
def _select_n_aval(predicate: ShapedArray, on_false: ShapedArray, on_true: ShapedArray) -> ShapedArray:
    if predicate.dtype != np.bool_:
        raise TypeError(f"select_n needs a bool predicate, got {predicate.str_short()}.")
    if predicate.shape and predicate.shape != on_true.shape:
        raise TypeError(f"select_n's predicate {predicate.str_short()} must be rank-0 or have the "
                        f"shape of the cases {on_true.str_short()}.")
    if on_false != on_true:
        raise TypeError(f"select_n's cases must have equal shapes and dtypes, got "
                        f"{on_false.str_short()} and {on_true.str_short()}.")
    return on_true


# --------------------------------------------------------------------------- reductions


def _reduce_aval(name: str) -> Callable[..., ShapedArray]:
    def rule(x: ShapedArray, *, axes: tuple[int, ...]) -> ShapedArray:
        if any(not 0 <= axis < x.ndim for axis in axes):
            raise ValueError(f"{name}: axes {axes} out of range for an operand of shape "
                             f"{x.str_short()}.")
        return ShapedArray(tuple(d for i, d in enumerate(x.shape) if i not in axes), x.dtype)

    return rule


reduce_sum_p = Primitive("reduce_sum")
reduce_sum_p.def_impl(lambda x, *, axes: np.sum(x, axis=axes))
reduce_sum_p.def_abstract_eval(_reduce_aval("reduce_sum"))

reduce_max_p = Primitive("reduce_max")
reduce_max_p.def_impl(lambda x, *, axes: np.max(x, axis=axes))
reduce_max_p.def_abstract_eval(_reduce_aval("reduce_max"))

# --------------------------------------------------------------------------- shapes


broadcast_in_dim_p = Primitive("broadcast_in_dim")


@broadcast_in_dim_p.def_impl
def _broadcast_in_dim_impl(x, *, shape, broadcast_dimensions):
    expanded = [1] * len(shape)  # operand dim i goes to output dim broadcast_dimensions[i]
    for operand_dim, out_dim in enumerate(broadcast_dimensions):
        expanded[out_dim] = np.shape(x)[operand_dim]
    return np.broadcast_to(np.reshape(x, expanded), shape)


@broadcast_in_dim_p.def_abstract_eval
def _broadcast_in_dim_aval(x: ShapedArray, *, shape, broadcast_dimensions) -> ShapedArray:
    ok = len(broadcast_dimensions) == x.ndim and list(broadcast_dimensions) == sorted(
        set(broadcast_dimensions)) and all(
        0 <= d < len(shape) and x.shape[i] in (1, shape[d]) for i, d in enumerate(broadcast_dimensions))
    if not ok:
        raise TypeError(f"broadcast_in_dim cannot broadcast {x.str_short()} to shape {shape} with "
                        f"broadcast_dimensions={broadcast_dimensions}: give one increasing output "
                        "dimension per operand dimension, of equal size or size 1 in the operand.")
    return ShapedArray(shape, x.dtype)


reshape_p = Primitive("reshape")
reshape_p.def_impl(lambda x, *, new_sizes: np.reshape(x, new_sizes))


@reshape_p.def_abstract_eval
def _reshape_aval(x: ShapedArray, *, new_sizes) -> ShapedArray:
    if int(np.prod(new_sizes, dtype=np.int64)) != x.size:
        raise TypeError(f"reshape cannot turn {x.str_short()} ({x.size} elements) into shape "
                        f"{tuple(new_sizes)}.")
    return ShapedArray(new_sizes, x.dtype)


transpose_p = Primitive("transpose")
transpose_p.def_impl(lambda x, *, permutation: np.transpose(x, permutation))


@transpose_p.def_abstract_eval
def _transpose_aval(x: ShapedArray, *, permutation) -> ShapedArray:
    if sorted(permutation) != list(range(x.ndim)):
        raise TypeError(f"transpose: permutation {permutation} is not a permutation of the "
                        f"{x.ndim} axes of {x.str_short()}.")
    return ShapedArray(tuple(x.shape[p] for p in permutation), x.dtype)


# --------------------------------------------------------------------------- dot_general

dot_general_p = Primitive("dot_general")


def _split_dims(ndim: int, contract: Sequence[int], batch: Sequence[int]) -> list[int]:
    return [d for d in range(ndim) if d not in contract and d not in batch]


@dot_general_p.def_impl
def _dot_general_impl(lhs, rhs, *, dimension_numbers):
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    lhs_free = _split_dims(lhs.ndim, lhs_contract, lhs_batch)
    rhs_free = _split_dims(rhs.ndim, rhs_contract, rhs_batch)
    batch_shape = [lhs.shape[d] for d in lhs_batch]
    lhs_free_shape = [lhs.shape[d] for d in lhs_free]
    rhs_free_shape = [rhs.shape[d] for d in rhs_free]
    contract_size = int(np.prod([lhs.shape[d] for d in lhs_contract], dtype=np.int64))
    # Group the axes into (batch, free, contracted) so one batched matmul does the work.
    lhs3 = np.transpose(lhs, [*lhs_batch, *lhs_free, *lhs_contract]).reshape(
        int(np.prod(batch_shape, dtype=np.int64)), -1, contract_size)  # (B, M, K)
    rhs3 = np.transpose(rhs, [*rhs_batch, *rhs_contract, *rhs_free]).reshape(
        lhs3.shape[0], contract_size, -1)  # (B, K, N)
    return np.matmul(lhs3, rhs3).reshape(batch_shape + lhs_free_shape + rhs_free_shape)


@dot_general_p.def_abstract_eval
def _dot_general_aval(lhs: ShapedArray, rhs: ShapedArray, *, dimension_numbers) -> ShapedArray:
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    pairs = list(zip(lhs_contract, rhs_contract, strict=True)) + list(zip(lhs_batch, rhs_batch,
                                                                          strict=True))
    if any(lhs.shape[i] != rhs.shape[j] for i, j in pairs):
        raise TypeError(f"dot_general: dimension_numbers={dimension_numbers} pair axes of "
                        f"different sizes in {lhs.str_short()} and {rhs.str_short()}.")
    if lhs.dtype != rhs.dtype:
        raise TypeError(f"dot_general needs equal dtypes, got {lhs.str_short()} and "
                        f"{rhs.str_short()}.")
    shape = ([lhs.shape[d] for d in lhs_batch]
             + [lhs.shape[d] for d in _split_dims(lhs.ndim, lhs_contract, lhs_batch)]
             + [rhs.shape[d] for d in _split_dims(rhs.ndim, rhs_contract, rhs_batch)])
    return ShapedArray(tuple(shape), lhs.dtype)


# --------------------------------------------------------------------------- wrappers


def _weak(x, y):
    """Python scalars take the dtype of the other operand, as JAX's weakly typed scalars do."""
    scalars = (bool, int, float)
    if isinstance(x, scalars) and not isinstance(y, scalars):
        x = np.asarray(x, dtype=get_aval(y).dtype)
    elif isinstance(y, scalars) and not isinstance(x, scalars):
        y = np.asarray(y, dtype=get_aval(x).dtype)
    return x, y


def neg(x): return neg_p.bind(x)
def sin(x): return sin_p.bind(x)
def cos(x): return cos_p.bind(x)
def exp(x): return exp_p.bind(x)
def log(x): return log_p.bind(x)
def tanh(x): return tanh_p.bind(x)
def add(x, y): return add_p.bind(*_weak(x, y))
def sub(x, y): return sub_p.bind(*_weak(x, y))
def mul(x, y): return mul_p.bind(*_weak(x, y))
def div(x, y): return div_p.bind(*_weak(x, y))
def max(x, y): return max_p.bind(*_weak(x, y))  # shadows the builtin, as jax.lax.max does
def min(x, y): return min_p.bind(*_weak(x, y))
def pow(x, y): return pow_p.bind(*_weak(x, y))
def gt(x, y): return gt_p.bind(*_weak(x, y))
def lt(x, y): return lt_p.bind(*_weak(x, y))
def ge(x, y): return ge_p.bind(*_weak(x, y))
def le(x, y): return le_p.bind(*_weak(x, y))
def eq(x, y): return eq_p.bind(*_weak(x, y))
def ne(x, y): return ne_p.bind(*_weak(x, y))
def integer_pow(x, y: int): return integer_pow_p.bind(x, y=int(y))
def select_n(predicate, on_false, on_true): return select_n_p.bind(predicate, on_false, on_true)
def convert_element_type(x, new_dtype): return convert_element_type_p.bind(x, new_dtype=np.dtype(new_dtype))


def reduce_sum(x, axes: Sequence[int]):
    return reduce_sum_p.bind(x, axes=tuple(sorted(int(a) for a in axes)))


def reduce_max(x, axes: Sequence[int]):
    return reduce_max_p.bind(x, axes=tuple(sorted(int(a) for a in axes)))


def broadcast_in_dim(x, shape: Sequence[int], broadcast_dimensions: Sequence[int]):
    return broadcast_in_dim_p.bind(x, shape=tuple(int(d) for d in shape),
                                   broadcast_dimensions=tuple(int(d) for d in broadcast_dimensions))


def reshape(x, new_sizes: Sequence[int]):
    return reshape_p.bind(x, new_sizes=tuple(int(d) for d in new_sizes))


def transpose(x, permutation: Sequence[int]):
    return transpose_p.bind(x, permutation=tuple(int(p) for p in permutation))


def dot_general(lhs, rhs, dimension_numbers):
    (lc, rc), (lb, rb) = dimension_numbers
    as_tuple = lambda dims: tuple(int(d) for d in dims)  # noqa: E731
    return dot_general_p.bind(lhs, rhs, dimension_numbers=(
        (as_tuple(lc), as_tuple(rc)), (as_tuple(lb), as_tuple(rb))))
