"""The core of the mini-JAX: abstract values, primitives, tracers and the interpreter stack.

Mirrors the ideas (and most names) of `jax.core` / `jax.extend.core`: `ShapedArray`,
`Primitive` with `def_impl`/`def_abstract_eval`/`bind`, `Tracer`, `Trace`, and a stack of
active transformations. Every array operation in `stacklib.transforms.numpy` ends in
`primitive.bind(*args, **params)`. `bind` looks at the arguments, finds the innermost
active transformation that owns one of them (the *top trace*), and lets that trace
interpret the primitive. With nothing active, the bottom of the stack, `EvalTrace`,
runs the primitive's NumPy implementation. `jvp`, `vmap` and staging (`make_jaxpr`,
`jit`) are each one more kind of `Trace`.

The design follows Autodidax (JAX's "JAX core from scratch" notes): a global stack of
`MainTrace`s with increasing levels, plus one *dynamic* trace that receives every
operation, even on constants, so that staging records the whole program
("omnistaging").

Differences from jax.core:
  * abstract values carry shape and dtype only: no weak types, shardings or memory
    spaces;
  * the trace stack is a module-level list (JAX keeps it per thread);
  * only `ShapedArray` exists as an abstract value; concrete values are NumPy arrays.
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from stacklib.transforms import errors

# --------------------------------------------------------------------------- abstract values

_DTYPE_SHORT = {
    "float16": "f16", "float32": "f32", "float64": "f64", "int8": "i8", "int16": "i16",
    "int32": "i32", "int64": "i64", "uint8": "u8", "uint32": "u32", "uint64": "u64",
    "bool": "bool", "complex64": "c64", "complex128": "c128",
}


@dataclasses.dataclass(frozen=True)
class ShapedArray:
    """An abstract value: everything about an array except its numbers.

    Staging traces a function on these instead of arrays, which is why one staged
    program serves every input with the same shape and dtype.
    """

    shape: tuple[int, ...]
    dtype: np.dtype

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        object.__setattr__(self, "dtype", np.dtype(self.dtype))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def str_short(self) -> str:
        """'f64[3,4]', the way jaxprs print types."""
        name = _DTYPE_SHORT.get(self.dtype.name, self.dtype.name)
        return f"{name}[{','.join(map(str, self.shape))}]"

    def __str__(self) -> str:
        return self.str_short()


def is_float(dtype: Any) -> bool:
    """True for real floating dtypes: the ones that have tangents and gradients."""
    return np.issubdtype(np.dtype(dtype), np.floating)


def get_aval(x: Any) -> ShapedArray:
    """The abstract value of a tracer, NumPy array or Python scalar."""
    if isinstance(x, Tracer):
        return x.aval
    array = np.asarray(x)
    return ShapedArray(array.shape, array.dtype)


def zeros_like_aval(aval: ShapedArray) -> np.ndarray:
    """A concrete zero of the given abstract value (the tangent of a constant)."""
    return np.zeros(aval.shape, aval.dtype)


# --------------------------------------------------------------------------- primitives


class Primitive:
    """A named operation that transformations know how to interpret.

    A primitive has an implementation on NumPy arrays (`def_impl`) and an abstract
    evaluation rule that maps input `ShapedArray`s to output ones (`def_abstract_eval`).
    Rules for the transformations live in dicts keyed by the primitive, one dict per
    transformation (`jvp.primitive_jvps`, `reverse.primitive_transposes`,
    `vmap.primitive_batchers`), so adding a primitive never edits the interpreters.

    Example:
        sin_p = Primitive("sin")
        sin_p.def_impl(np.sin)
        sin_p.def_abstract_eval(lambda x: x)
        sin_p.bind(np.ones(3))  # -> np.sin(np.ones(3)) when no transformation is active
    """

    def __init__(self, name: str, *, multiple_results: bool = False):
        self.name = name
        self.multiple_results = multiple_results
        self.impl: Callable[..., Any] | None = None
        self.abstract_eval: Callable[..., Any] | None = None

    def def_impl(self, impl: Callable[..., Any]) -> Callable[..., Any]:
        self.impl = impl
        return impl

    def def_abstract_eval(self, rule: Callable[..., Any]) -> Callable[..., Any]:
        self.abstract_eval = rule
        return rule

    def bind(self, *args: Any, **params: Any) -> Any:
        """Apply the primitive, letting the innermost active transformation interpret it."""
        top_trace = find_top_trace(args)
        tracers = [full_raise(top_trace, arg) for arg in args]
        outs = top_trace.process_primitive(self, tracers, params)
        if self.multiple_results:
            return [full_lower(out) for out in outs]
        (out,) = outs
        return full_lower(out)

    def __repr__(self) -> str:
        return self.name


def apply_impl(primitive: Primitive, *values: Any, **params: Any) -> list[Any]:
    """Run a primitive's NumPy implementation; always returns a list of NumPy arrays."""
    if primitive.impl is None:
        raise errors.MissingRuleError(
            f"The primitive '{primitive.name}' has no implementation: call "
            f"{primitive.name}_p.def_impl(fn) with a function of NumPy arrays."
        )
    out = primitive.impl(*values, **params)
    outs = out if primitive.multiple_results else [out]
    return [np.asarray(o) for o in outs]


def apply_abstract_eval(primitive: Primitive, *avals: ShapedArray, **params: Any) -> list[ShapedArray]:
    """Run a primitive's shape-and-dtype rule; always returns a list of `ShapedArray`s."""
    if primitive.abstract_eval is None:
        raise errors.MissingRuleError(
            f"The primitive '{primitive.name}' has no abstract evaluation rule, so it cannot be "
            f"staged (jit, make_jaxpr, grad): call {primitive.name}_p.def_abstract_eval(rule) "
            "with a function from input ShapedArrays to the output ShapedArray."
        )
    out = primitive.abstract_eval(*avals, **params)
    return list(out) if primitive.multiple_results else [out]


# --------------------------------------------------------------------------- the trace stack


class MainTrace:
    """One active transformation: its level on the stack and the `Trace` class that runs it.

    `global_data` holds what the whole transformation shares (the jaxpr being built for
    staging, the axis size for vmap). `active` turns False when the transformation ends;
    a tracer of an inactive main trace has leaked.
    """

    def __init__(self, level: int, trace_type: type[Trace], global_data: Any = None):
        self.level = level
        self.trace_type = trace_type
        self.global_data = global_data
        self.active = True

    def __repr__(self) -> str:
        return f"MainTrace(level={self.level}, {self.trace_type.__name__})"


trace_stack: list[MainTrace] = []
dynamic_trace: MainTrace | None = None


@contextlib.contextmanager
def new_main(trace_type: type[Trace], global_data: Any = None) -> Iterator[MainTrace]:
    """Push a transformation onto the stack for the duration of a `with` block."""
    main = MainTrace(len(trace_stack), trace_type, global_data)
    trace_stack.append(main)
    try:
        yield main
    finally:
        main.active = False
        trace_stack.pop()


@contextlib.contextmanager
def new_dynamic(main: MainTrace) -> Iterator[None]:
    """Make `main` receive every operation, including those on constants only.

    Staging needs this: in `make_jaxpr(lambda x: x + jnp.ones(3) * 2.0)` the product
    involves no tracer, yet it belongs to the program being recorded.
    """
    global dynamic_trace
    previous, dynamic_trace = dynamic_trace, main
    try:
        yield
    finally:
        dynamic_trace = previous


class Trace:
    """How one transformation interprets primitives.

    Subclasses implement `pure` (wrap a value from outside every transformation),
    `lift` (wrap a tracer of an outer transformation) and `process_primitive`.
    """

    transform_name = "a transformation"

    def __init__(self, main: MainTrace):
        self.main = main

    def pure(self, value: Any) -> Tracer:
        raise NotImplementedError

    def lift(self, tracer: Tracer) -> Tracer:
        raise NotImplementedError

    def process_primitive(self, primitive: Primitive, tracers: list[Any], params: dict) -> list[Any]:
        raise NotImplementedError

    def context(self) -> str:
        """What is being transformed, for error messages ('the function f')."""
        return getattr(self.main.global_data, "context", "the function")


class EvalTrace(Trace):
    """The bottom of the stack: run each primitive on NumPy arrays."""

    transform_name = "evaluation"

    def pure(self, value: Any) -> Any:
        return value

    lift = pure

    def process_primitive(self, primitive: Primitive, values: list[Any], params: dict) -> list[Any]:
        return apply_impl(primitive, *values, **params)


trace_stack.append(MainTrace(0, EvalTrace))


class Tracer:
    """A stand-in for an array while a function is transformed.

    A tracer belongs to one `Trace`, knows its abstract value (`aval`), and behaves like
    an array: the operators and methods are those of `stacklib.transforms.numpy`, which
    installs them when it is imported. What a tracer cannot do is reveal a value that
    does not exist yet: `bool()`, `float()` and NumPy conversion raise errors that say why.
    """

    __slots__ = ["_trace"]
    __array_priority__ = 100  # NumPy defers `ndarray * tracer` to the tracer's __rmul__
    __hash__ = None  # `==` is elementwise, so tracers cannot be dict keys (as in JAX)

    _trace: Trace

    @property
    def aval(self) -> ShapedArray:
        raise NotImplementedError

    def full_lower(self) -> Any:
        """This value in the simplest form its transformation allows (a tracer by default)."""
        return self

    def concrete_value(self) -> np.ndarray | None:
        """The concrete value, if this transformation knows one (jvp does; jit and vmap do not)."""
        return None

    @property
    def shape(self) -> tuple[int, ...]:
        return self.aval.shape

    @property
    def dtype(self) -> np.dtype:
        return self.aval.dtype

    @property
    def ndim(self) -> int:
        return self.aval.ndim

    @property
    def size(self) -> int:
        return self.aval.size

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of unsized object (a traced scalar)")
        return self.shape[0]

    def abstract_source(self) -> Tracer:
        """The tracer whose value is unknown, for error messages (jvp defers to its primal)."""
        return self

    def _where(self) -> tuple[str, str, str]:
        source = self.abstract_source()
        return self.aval.str_short(), source._trace.context(), source._trace.transform_name

    def __bool__(self) -> bool:
        value = self.concrete_value()
        if value is None:
            raise errors.TracerBoolConversionError(errors.bool_conversion_message(*self._where()))
        return bool(value)

    def _concrete(self, function: str) -> np.ndarray:
        value = self.concrete_value()
        if value is None:
            raise errors.ConcretizationTypeError(
                errors.concretization_message(*self._where(), function=function)
            )
        return value

    def __float__(self) -> float:
        return float(self._concrete("float"))

    def __int__(self) -> int:
        return int(self._concrete("int"))

    def __index__(self) -> int:
        return operator.index(self._concrete("an index (__index__)"))

    def item(self) -> Any:
        return self._concrete(".item()").item()

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        raise errors.TracerArrayConversionError(errors.array_conversion_message(*self._where()))

    def __iter__(self):
        # Without this, Python would iterate with __getitem__ and report a confusing error.
        raise errors.UnsupportedOperationError(errors.unsupported_operation_message(
            "iteration (for ... in x, or unpacking)", self.aval.str_short(),
            "Iterate over a Python list of arrays instead, or use vmap to map over an axis.",
        ))

    def __repr__(self) -> str:
        return f"Traced<{self.aval.str_short()}>with<{type(self._trace).__name__}>"


# --------------------------------------------------------------------------- bind's helpers


def _leaked(tracer: Tracer) -> errors.UnexpectedTracerError:
    return errors.UnexpectedTracerError(errors.leaked_tracer_message(
        type(tracer).__name__, tracer.aval.str_short(), tracer._trace.transform_name
    ))


def _check_active(tracer: Tracer) -> None:
    if not tracer._trace.main.active:
        raise _leaked(tracer)


def find_top_trace(values: Sequence[Any]) -> Trace:
    """The trace that interprets an operation on `values`: the highest level among them.

    The dynamic trace (staging) wins if it is higher, so that operations on constants
    are recorded too.
    """
    top_main = trace_stack[0]
    for value in values:
        if isinstance(value, Tracer):
            _check_active(value)
            if value._trace.main.level > top_main.level:
                top_main = value._trace.main
    if dynamic_trace is not None and dynamic_trace.level > top_main.level:
        top_main = dynamic_trace
    return top_main.trace_type(top_main)


def full_raise(trace: Trace, value: Any) -> Any:
    """Make `value` a tracer of `trace` (constants are wrapped, outer tracers lifted)."""
    if not isinstance(value, Tracer):
        return trace.pure(np.asarray(value))
    main = value._trace.main
    if main is trace.main:
        return value
    if main.level < trace.main.level:
        return trace.lift(value)
    # A tracer from a higher level can only get here if it outlived its transformation.
    raise _leaked(value)


def full_lower(value: Any) -> Any:
    return value.full_lower() if isinstance(value, Tracer) else value
