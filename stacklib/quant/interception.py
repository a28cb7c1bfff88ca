"""Interception: run a model's own code, but with our contractions in place of JAX's.

This is the mechanism qwix calls "interception" (qwix/_src/interception.py, qwix 0.1.8): while
a quantized model's `__call__` runs, the public functions `jax.lax.dot_general`,
`jnp.einsum` and `jnp.dot` are replaced by the provider's versions, which look up the
module doing the contraction, match a rule against its path, and quantize. The model's
code is not changed; a layer that calls `jax.lax.dot_general` (as `nnx.Linear` does, in
Flax and in `stacklib.nn`) is quantized without knowing it.

Three questions every interception has to answer, and our answers:

* *Which module is calling?* We walk up the Python call stack to the nearest frame whose
  `self` is a `stacklib.nn.Module` (qwix does the same for NNX), and name it by its path in
  the root model, '/'.join of `iter_modules()`'s path: 'hidden', 'blocks/0/mlp'.
* *Is this operand a weight?* An operand is a weight if it *is* (by identity) the value of
  one of the module's `Param`s, or the result of `promote_dtype` casting one (we record the
  casts while intercepting). So a weight must reach the contraction unchanged, as in
  `Linear` and `LinearGeneral`; a transposed kernel (`x @ W.T`) is treated as an activation.
* *What is not intercepted?* `x @ w` and `jnp.matmul` call JAX's internal `dot_general`,
  not the public attribute, so they run in float, in qwix and here.

Patching module attributes is global: do not run two quantized models in different threads
at once. And a function that was jitted *outside* the interception keeps its float trace.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

import jax
import jax.numpy as jnp

import stacklib.nn.linear
from stacklib.nn.module import Module
from stacklib.nn.variables import Param

# What we call to compute: captured before anything is patched.
ORIGINALS = {
    "dot_general": jax.lax.dot_general,
    "einsum": jnp.einsum,
    "dot": jnp.dot,
    "promote_dtype": stacklib.nn.linear.promote_dtype,
}

# (module object, attribute name) for each patched function.
_TARGETS = {
    "dot_general": (jax.lax, "dot_general"),
    "einsum": (jnp, "einsum"),
    "dot": (jnp, "dot"),
    "promote_dtype": (stacklib.nn.linear, "promote_dtype"),
}


class _Session:
    """One intercepted call of a root model: its module paths, op counters, weight casts."""

    def __init__(self, provider: Any, root: Module):
        self.provider = provider
        self.paths = {id(module): "/".join(map(str, path)) for path, module in root.iter_modules()}
        self.modules = {id(module): module for _, module in root.iter_modules()}
        self.op_counts: dict[tuple[int, str], int] = {}
        self.casts: dict[int, tuple[Any, Any]] = {}  # id(cast) -> (cast, original)

    def next_op_id(self, module: Module, op_name: str) -> str:
        """'dot_general0', 'dot_general1', ...: the n-th such op of this module in this call."""
        key = (id(module), op_name)
        count = self.op_counts.get(key, 0)
        self.op_counts[key] = count + 1
        return f"{op_name}{count}"


_SESSIONS: list[_Session] = []


def current_session() -> _Session | None:
    return _SESSIONS[-1] if _SESSIONS else None


def current_module() -> tuple[Module | None, str | None]:
    """The innermost module of the running model on the call stack, and its path."""
    session = current_session()
    frame = inspect.currentframe()
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Module) and id(candidate) in session.paths:
            return candidate, session.paths[id(candidate)]
        frame = frame.f_back
    return None, None


def find_param(module: Module | None, array: Any) -> str | None:
    """The name of the `Param` of `module` whose value is `array` (or was cast to it)."""
    if module is None:
        return None
    session = current_session()
    original = session.casts.get(id(array), (None, array))[1]
    for name, value in vars(module).items():
        if isinstance(value, Param) and (value.get_value() is array or value.get_value() is original):
            return name
    return None


def _dispatch(name: str):
    def intercepted(*args, **kwargs):
        session = current_session()
        if session is None:  # a nested original call after the session ended
            return ORIGINALS[name](*args, **kwargs)
        return getattr(_Dispatcher, name)(session, *args, **kwargs)

    intercepted.__name__ = f"intercepted_{name}"
    return intercepted


class _Dispatcher:
    """Routes each patched function to the active provider."""

    @staticmethod
    def dot_general(session, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
                    **kwargs):
        return session.provider.dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type,
                                            **kwargs)

    @staticmethod
    def einsum(session, subscripts, *operands, **kwargs):
        return session.provider.einsum(subscripts, *operands, **kwargs)

    @staticmethod
    def dot(session, a, b, *, precision=None, preferred_element_type=None):
        """`jnp.dot` as the `dot_general` it is, so rules for 'dot_general' apply (as in qwix)."""
        if jnp.ndim(a) == 0 or jnp.ndim(b) == 0 or jnp.ndim(b) > 2:
            return ORIGINALS["dot"](a, b, precision=precision, preferred_element_type=preferred_element_type)
        contract_b = 0 if jnp.ndim(b) == 1 else jnp.ndim(b) - 2
        numbers = (((jnp.ndim(a) - 1,), (contract_b,)), ((), ()))
        return session.provider.dot_general(a, b, numbers, precision, preferred_element_type)

    @staticmethod
    def promote_dtype(session, arrays, dtype=None):
        """Let quantized weights through untouched; remember which cast came from which weight."""
        from stacklib.quant.qarray import QArray

        floats = tuple(None if isinstance(a, QArray) else a for a in arrays)
        promoted = ORIGINALS["promote_dtype"](floats, dtype) if any(a is not None for a in floats) else floats
        result = []
        for before, after in zip(arrays, promoted, strict=True):
            if isinstance(before, QArray):
                result.append(before)
                continue
            if after is not None and after is not before:
                session.casts[id(after)] = (after, before)  # keep `after` alive: ids stay unique
            result.append(after)
        return tuple(result)


@contextlib.contextmanager
def intercept(provider: Any, root: Module):
    """Within this block, contractions run by `root`'s modules go through `provider`."""
    outermost = not _SESSIONS
    _SESSIONS.append(_Session(provider, root))
    saved = {}
    if outermost:
        for name, (owner, attribute) in _TARGETS.items():
            saved[name] = getattr(owner, attribute)
            setattr(owner, attribute, _dispatch(name))
    try:
        yield _SESSIONS[-1]
    finally:
        _SESSIONS.pop()
        for name, function in saved.items():
            owner, attribute = _TARGETS[name]
            setattr(owner, attribute, function)
