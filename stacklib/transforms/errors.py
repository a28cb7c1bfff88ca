"""The errors a learner meets first, with messages that say what happened and how to fix it.

Mirrors the classes of `jax.errors` that tracing raises: `ConcretizationTypeError` and
its subclass `TracerBoolConversionError`, `TracerArrayConversionError`, and
`UnexpectedTracerError`. They all come from one fact: while a function is transformed,
its arguments are *tracers*, stand-ins that carry an abstract value (a shape and a
dtype) and sometimes, but not always, a concrete one.

Differences from jax.errors:
  * the messages are ours, longer, and name this package's functions;
  * `UnsupportedOperationError` (an operation this mini-JAX does not implement) and
    `MissingRuleError` (a primitive without a rule for some transformation) have no
    exact JAX counterpart: JAX raises `TypeError` or `NotImplementedError` there. Ours are
    both `TypeError`s, so that the exercise grader, which reads `NotImplementedError` as
    "not written yet", reports a missing rule as what it is.
"""

from __future__ import annotations

NUMPY_NAMESPACE = "stacklib.transforms.numpy"


class ConcretizationTypeError(TypeError):
    """Python needed the concrete value of a traced array, but only its shape and dtype exist."""


class TracerBoolConversionError(ConcretizationTypeError):
    """`if`, `while`, `and`, `or` or `bool()` on a traced array whose value is not known."""


class TracerArrayConversionError(TypeError):
    """A NumPy function (or `np.asarray`) was given a traced array."""


class UnexpectedTracerError(Exception):
    """A tracer escaped the transformation that created it and was used after it ended."""


class UnsupportedOperationError(TypeError):
    """An operation that stacklib.transforms does not implement was applied to a traced array."""


class MissingRuleError(TypeError):
    """A primitive has no rule for the transformation being applied to it."""


def _why_no_value(context: str, transform: str) -> str:
    if transform == "vmap":
        return (
            f"The error occurred while batching {context} with vmap. Inside vmap a traced array "
            "holds a whole batch of values at once, so it has no single concrete value to branch "
            "on or to hand to NumPy."
        )
    return (
        f"The error occurred while tracing {context} for {transform}. A traced array there is an "
        "abstract value: it stands for every array of its shape and dtype that the function "
        "could be called with, so its concrete value does not exist yet."
    )


def bool_conversion_message(aval: str, context: str, transform: str) -> str:
    """The message of `TracerBoolConversionError`: Python control flow on a traced array."""
    return (
        f"Attempted boolean conversion of traced array with shape {aval}.\n"
        f"{_why_no_value(context, transform)} Python's `if`, `while`, `and`/`or` and `bool()` "
        "need a concrete True or False.\n"
        "To fix it, either\n"
        f"  * compute both branches and choose elementwise with {NUMPY_NAMESPACE}.where("
        "condition, value_if_true, value_if_false), or\n"
        "  * if the condition depends only on an argument that takes few values (a size, a "
        "flag, a mode), mark that argument static: jit(f, static_argnums=...) or "
        "static_argnames=... (the function is then traced once per value)."
    )


def concretization_message(aval: str, context: str, transform: str, function: str) -> str:
    """The message of `ConcretizationTypeError`: `float()`, `int()` or `.item()` on a tracer."""
    return (
        f"Abstract tracer value encountered where a concrete value is expected: traced array "
        f"with shape {aval}, passed to `{function}`.\n"
        f"{_why_no_value(context, transform)}\n"
        "Keep the value as an array (use .astype(...) to change its dtype), or, if it must be "
        "a Python number at trace time, mark the argument it comes from static with "
        "jit(f, static_argnums=...)."
    )


def array_conversion_message(aval: str, context: str, transform: str) -> str:
    """The message of `TracerArrayConversionError`: NumPy was handed a traced array."""
    return (
        f"The numpy.ndarray conversion method __array__() was called on traced array with "
        f"shape {aval}.\n{_why_no_value(context, transform)}\n"
        "This happens when a NumPy function (np.sin, np.asarray, ...) is applied to a traced "
        f"value: NumPy only computes on concrete arrays. Use the same function from "
        f"{NUMPY_NAMESPACE} (import stacklib.transforms.numpy as jnp; jnp.sin(x)) so that "
        "the operation is traced too."
    )


def unsupported_operation_message(operation: str, aval: str, suggestion: str = "") -> str:
    """The message of `UnsupportedOperationError`, naming the operation."""
    hint = f" {suggestion}" if suggestion else ""
    return (
        f"The operation {operation} is not supported on traced arrays by stacklib.transforms "
        f"(got a traced array with shape {aval}).{hint}"
    )


def leaked_tracer_message(tracer_type: str, aval: str, transform: str) -> str:
    """The message of `UnexpectedTracerError`: a tracer outlived its transformation."""
    return (
        f"Encountered an unexpected tracer: a {tracer_type} with shape {aval} was created by "
        f"a {transform} transformation that has already finished. A tracer is only meaningful "
        "inside the call that created it; this one leaked out, typically by being stored in a "
        "global variable, a list or an attribute during tracing. Return the value from the "
        "transformed function instead of storing it."
    )
