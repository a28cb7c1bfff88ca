"""`stacklib.transforms.numpy`: the NumPy-like functions users write, built on our primitives.

Mirrors a subset of `jax.numpy` with the same names, signatures and defaults:

    import stacklib.transforms.numpy as jnp
    jnp.sum(jnp.tanh(x @ w + b) ** 2, axis=-1)

Each function does what NumPy users expect (dtype promotion with weak Python scalars,
broadcasting, negative axes, `keepdims`) and then calls the strict primitives of
`stacklib.transforms.lax`, inserting `convert_element_type` and `broadcast_in_dim` where
NumPy would broadcast or promote implicitly. That split is JAX's: transformations
only ever see the ~30 primitives. Importing this module also gives tracers their
operators (`+ - * / ** @`, comparisons) and methods (`.sum()`, `.T`, `.reshape()`).

Differences from jax.numpy:
  * about thirty functions; no indexing (`x[i]`), no `jnp.linalg`, no random numbers;
  * dtype promotion is NumPy 2's (NEP 50), which treats Python scalars as weak like
    JAX does, but tracers carry no `weak_type` flag;
  * `matmul` needs both operands at least 2-D once either has more than two dimensions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from stacklib.transforms import errors, lax
from stacklib.transforms.core import Tracer, get_aval

float16, float32, float64 = np.float16, np.float32, np.float64
int32, int64, bool_ = np.int32, np.int64, np.bool_

_PYTHON_SCALARS = (bool, int, float)


def _dtype_of(x: Any) -> Any:
    """Python scalars stay Python scalars so that promotion treats them as weak (NEP 50)."""
    if isinstance(x, _PYTHON_SCALARS):
        return x
    return get_aval(x).dtype


def _convert(x: Any, dtype: np.dtype) -> Any:
    if isinstance(x, Tracer):
        return x if x.dtype == dtype else lax.convert_element_type(x, dtype)
    return np.asarray(x, dtype=dtype)


def _promote(*args: Any) -> list[Any]:
    """Bring operands to one dtype: `np.result_type`'s rules, Python scalars weak."""
    dtype = np.result_type(*[_dtype_of(x) for x in args])
    return [_convert(x, dtype) for x in args]


def _to_inexact(x: Any) -> Any:
    """Integers and bools become float64 before sin, exp or division (as in NumPy)."""
    x = asarray(x)
    if np.issubdtype(get_aval(x).dtype, np.inexact):
        return x
    return _convert(x, np.dtype(np.float64))


def _broadcast_shapes(name: str, *args: Any) -> tuple[int, ...]:
    shapes = [get_aval(x).shape for x in args]
    try:
        return tuple(np.broadcast_shapes(*shapes))
    except ValueError:
        raise ValueError(f"{name}: shapes {', '.join(map(str, shapes))} cannot be broadcast "
                         "together (NumPy's rules: align trailing axes; each pair equal or 1).") from None


def _broadcast_to_shape(x: Any, shape: tuple[int, ...]) -> Any:
    x_shape = get_aval(x).shape
    if x_shape == shape:
        return x
    leading = len(shape) - len(x_shape)  # NumPy aligns trailing axes
    return lax.broadcast_in_dim(x, shape, tuple(range(leading, len(shape))))


def _elementwise(name: str, *args: Any) -> list[Any]:
    """Promote, then broadcast; rank-0 operands stay rank-0 (the primitives accept them)."""
    args = _promote(*args)
    shape = _broadcast_shapes(name, *args)
    return [x if get_aval(x).ndim == 0 else _broadcast_to_shape(x, shape) for x in args]


def _normalize_axes(axis: int | Sequence[int] | None, ndim: int, name: str) -> tuple[int, ...]:
    if axis is None:
        return tuple(range(ndim))
    axes = (axis,) if isinstance(axis, int | np.integer) else tuple(axis)
    normalized = []
    for a in axes:
        if not -ndim <= a < ndim:
            raise ValueError(f"{name}: axis {a} is out of bounds for an array of rank {ndim}.")
        normalized.append(int(a) % ndim if ndim else 0)
    return tuple(sorted(set(normalized)))


# --------------------------------------------------------------------------- creation


def asarray(x: Any, dtype: Any = None) -> Any:
    """Like `jnp.asarray`: tracers pass through (converted if `dtype` is given)."""
    if isinstance(x, Tracer):
        return x if dtype is None else _convert(x, np.dtype(dtype))
    return np.asarray(x, dtype=dtype)


array = asarray


def full(shape: Sequence[int] | int, fill_value: Any, dtype: Any = None) -> Any:
    """An array filled with one value, staged as a `broadcast_in_dim` of a scalar."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    value = np.asarray(fill_value, dtype=dtype)
    return lax.broadcast_in_dim(value, shape, ())


def zeros_like(x: Any, dtype: Any = None) -> Any:
    aval = get_aval(x)
    return full(aval.shape, 0, dtype or aval.dtype)


def ones_like(x: Any, dtype: Any = None) -> Any:
    aval = get_aval(x)
    return full(aval.shape, 1, dtype or aval.dtype)


def astype(x: Any, dtype: Any) -> Any:
    return _convert(x, np.dtype(dtype))


# --------------------------------------------------------------------------- elementwise


def negative(x): return lax.neg(asarray(x))
def sin(x): return lax.sin(_to_inexact(x))
def cos(x): return lax.cos(_to_inexact(x))
def exp(x): return lax.exp(_to_inexact(x))
def log(x): return lax.log(_to_inexact(x))
def tanh(x): return lax.tanh(_to_inexact(x))
def add(x, y): return lax.add(*_elementwise("add", x, y))
def subtract(x, y): return lax.sub(*_elementwise("subtract", x, y))
def multiply(x, y): return lax.mul(*_elementwise("multiply", x, y))
def maximum(x, y): return lax.max(*_elementwise("maximum", x, y))
def minimum(x, y): return lax.min(*_elementwise("minimum", x, y))
def greater(x, y): return lax.gt(*_elementwise("greater", x, y))
def less(x, y): return lax.lt(*_elementwise("less", x, y))
def greater_equal(x, y): return lax.ge(*_elementwise("greater_equal", x, y))
def less_equal(x, y): return lax.le(*_elementwise("less_equal", x, y))
def equal(x, y): return lax.eq(*_elementwise("equal", x, y))
def not_equal(x, y): return lax.ne(*_elementwise("not_equal", x, y))


def divide(x, y):
    """True division; integers are converted to floats first, as in NumPy."""
    x, y = _promote(x, y)
    return lax.div(*_elementwise("divide", _to_inexact(x), _to_inexact(y)))


true_divide = divide


def power(x, y):
    """`x ** y`; a Python int exponent becomes `integer_pow`, as in JAX."""
    if isinstance(y, int) and not isinstance(y, bool):
        return lax.integer_pow(asarray(x), y)
    return lax.pow(*_elementwise("power", x, y))


def square(x): return lax.integer_pow(asarray(x), 2)


def where(condition, x, y):
    """Elementwise `x if condition else y`, with both sides computed (`select_n`)."""
    if get_aval(condition).dtype != np.bool_:
        condition = not_equal(condition, 0)
    x, y = _promote(x, y)
    shape = _broadcast_shapes("where", condition, x, y)
    condition, x, y = (_broadcast_to_shape(v, shape) for v in (condition, x, y))
    return lax.select_n(condition, y, x)


# --------------------------------------------------------------------------- reductions


def _keep_dims(reduced: Any, shape: tuple[int, ...], axes: tuple[int, ...]) -> Any:
    kept = tuple(1 if i in axes else d for i, d in enumerate(shape))
    return lax.broadcast_in_dim(reduced, kept, [i for i in range(len(shape)) if i not in axes])


def sum(a, axis=None, keepdims=False):  # shadows the builtin, as jax.numpy.sum does
    a = asarray(a)
    if get_aval(a).dtype == np.bool_:
        a = _convert(a, np.dtype(np.int64))
    shape = get_aval(a).shape
    axes = _normalize_axes(axis, len(shape), "sum")
    out = lax.reduce_sum(a, axes)
    return _keep_dims(out, shape, axes) if keepdims else out


def max(a, axis=None, keepdims=False):
    a = asarray(a)
    shape = get_aval(a).shape
    axes = _normalize_axes(axis, len(shape), "max")
    if any(shape[i] == 0 for i in axes):
        raise ValueError("max: zero-size array to reduction operation max, which has no identity.")
    out = lax.reduce_max(a, axes)
    return _keep_dims(out, shape, axes) if keepdims else out


def mean(a, axis=None, keepdims=False):
    a = _to_inexact(asarray(a))
    shape = get_aval(a).shape
    count = int(np.prod([shape[i] for i in _normalize_axes(axis, len(shape), "mean")], dtype=np.int64))
    return divide(sum(a, axis=axis, keepdims=keepdims), np.asarray(count, get_aval(a).dtype))


# --------------------------------------------------------------------------- linear algebra


def dot(a, b):
    """`np.dot`: contract the last axis of `a` with the second-to-last of `b` (or its only one)."""
    a, b = _promote(a, b)
    a_nd, b_nd = get_aval(a).ndim, get_aval(b).ndim
    if a_nd == 0 or b_nd == 0:
        return multiply(a, b)
    b_contract = 0 if b_nd == 1 else b_nd - 2
    return lax.dot_general(a, b, (((a_nd - 1,), (b_contract,)), ((), ())))


def matmul(a, b):
    """`a @ b`: matrix products over the last two axes, with shared leading (batch) axes."""
    a, b = _promote(a, b)
    a_shape, b_shape = get_aval(a).shape, get_aval(b).shape
    if not a_shape or not b_shape:
        raise ValueError("matmul: operands must be at least 1-D (use multiply for scalars).")
    if len(a_shape) <= 2 and len(b_shape) <= 2:
        return dot(a, b)
    if len(a_shape) == 1 or len(b_shape) == 1:
        raise errors.UnsupportedOperationError(errors.unsupported_operation_message(
            "matmul of a 1-D array with an array of more than two dimensions",
            f"{get_aval(a).str_short()} @ {get_aval(b).str_short()}",
            "Reshape the 1-D operand to a matrix first."))
    batch = _broadcast_shapes("matmul", np.empty(a_shape[:-2]), np.empty(b_shape[:-2]))
    a = _broadcast_to_shape(a, batch + a_shape[-2:])
    b = _broadcast_to_shape(b, batch + b_shape[-2:])
    k = len(batch)
    batch_dims = tuple(range(k))
    return lax.dot_general(a, b, (((k + 1,), (k,)), (batch_dims, batch_dims)))


# --------------------------------------------------------------------------- shapes


def reshape(a, shape):
    """Like `jnp.reshape`; one entry of `shape` may be -1 (inferred)."""
    a = asarray(a)
    shape = (shape,) if isinstance(shape, int) else tuple(int(d) for d in shape)
    size = get_aval(a).size
    if shape.count(-1) == 1:
        known = int(np.prod([d for d in shape if d != -1], dtype=np.int64))
        if known == 0 or size % known:
            raise ValueError(f"reshape: cannot reshape an array of size {size} into {shape}.")
        shape = tuple(size // known if d == -1 else d for d in shape)
    return lax.reshape(a, shape)


def transpose(a, axes=None):
    """Permute the axes (reverse them by default)."""
    a = asarray(a)
    ndim = get_aval(a).ndim
    axes = tuple(reversed(range(ndim))) if axes is None else tuple(int(x) % ndim for x in axes)
    return lax.transpose(a, axes)


def broadcast_to(a, shape):
    """Broadcast `a` to `shape` with NumPy's rules (trailing axes aligned)."""
    a = asarray(a)
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    a_shape = get_aval(a).shape
    leading = len(shape) - len(a_shape)
    if leading < 0 or any(d not in (1, s) for d, s in zip(a_shape, shape[leading:], strict=True)):
        raise ValueError(f"broadcast_to: cannot broadcast an array of shape {a_shape} to {shape}.")
    return _broadcast_to_shape(a, shape)


# --------------------------------------------------------------------------- tracer methods


def _unsupported(operation: str, suggestion: str = ""):
    def method(self, *args, **kwargs):
        raise errors.UnsupportedOperationError(
            errors.unsupported_operation_message(operation, self.aval.str_short(), suggestion))

    return method


def _install_tracer_methods() -> None:
    """Give tracers the operators and methods of arrays, as JAX's tracers have."""
    def reflected(fn):
        return lambda self, other: fn(other, self)

    Tracer.__neg__ = negative
    Tracer.__pos__ = lambda self: self
    for name, fn in [("add", add), ("sub", subtract), ("mul", multiply), ("truediv", divide),
                     ("pow", power), ("matmul", matmul)]:
        setattr(Tracer, f"__{name}__", fn)
        setattr(Tracer, f"__r{name}__", reflected(fn))
    Tracer.__gt__, Tracer.__lt__ = greater, less
    Tracer.__ge__, Tracer.__le__ = greater_equal, less_equal
    Tracer.__eq__, Tracer.__ne__ = equal, not_equal
    Tracer.sum, Tracer.max, Tracer.mean = sum, max, mean
    Tracer.astype = astype
    Tracer.reshape = lambda self, *shape: reshape(self, shape[0] if len(shape) == 1 else shape)
    Tracer.transpose = lambda self, *axes: transpose(self, axes or None)
    Tracer.T = property(lambda self: transpose(self))
    Tracer.__getitem__ = _unsupported(
        "indexing (x[...])", "JAX lowers indexing to slice/gather primitives, which this mini-JAX "
        "does not have: use reshape, sum, where or dot with a one-hot array instead.")
    for dunder, symbol in [("mod", "%"), ("floordiv", "//"), ("and", "&"), ("or", "|"),
                           ("xor", "^"), ("lshift", "<<"), ("rshift", ">>")]:
        setattr(Tracer, f"__{dunder}__", _unsupported(f"'{symbol}' ({dunder})"))
        setattr(Tracer, f"__r{dunder}__", _unsupported(f"'{symbol}' ({dunder})"))
    Tracer.__abs__ = _unsupported("abs()", "Use jnp.maximum(x, -x) or jnp.where(x > 0, x, -x).")
    Tracer.__invert__ = _unsupported("'~' (invert)")


_install_tracer_methods()

_FUNCTIONS = [
    "add", "array", "asarray", "astype", "broadcast_to", "cos", "divide", "dot", "equal", "exp",
    "full", "greater", "greater_equal", "less", "less_equal", "log", "matmul", "max", "maximum",
    "mean", "minimum", "multiply", "negative", "not_equal", "ones_like", "power", "reshape", "sin",
    "square", "subtract", "sum", "tanh", "transpose", "true_divide", "where", "zeros_like",
]
__all__ = [*_FUNCTIONS, "bool_", "float16", "float32", "float64", "int32", "int64"]


def __getattr__(name: str) -> Any:
    """Name the missing function instead of a bare AttributeError (`jnp.sort`, `jnp.linalg`)."""
    if name.startswith("__"):
        raise AttributeError(name)
    raise AttributeError(
        f"stacklib.transforms.numpy has no {name!r}. This mini-JAX implements only "
        f"{', '.join(_FUNCTIONS)}. "
        "Write it from these, or add a primitive (see chapter 01's last exercise)."
    )
