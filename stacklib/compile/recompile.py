"""Count XLA compilations, and say why a jitted function compiled again.

`jax.jit` compiles once per *signature* of its arguments: the pytree structure, each
array's shape and dtype (and weak type), and the value of each static argument. A call
with a signature it has seen reuses the compiled program; anything new compiles again,
which on a real model costs seconds to minutes. Two tools make this visible:

* `CompileWatcher`, a context manager that records every backend compilation JAX
  reports through `jax.monitoring` (the event `/jax/core/compile/backend_compile_duration`),
  with the function's name and how long XLA took;
* `track_compiles(fn, **jit_kwargs)`, a drop-in for `jax.jit(fn, **jit_kwargs)` that keeps
  a history of its compilations, each with the reason: the arguments whose type or static
  value differs from the closest signature compiled before.

Mirrors: `jax.jit(fn)._cache_size()` (how many programs a jitted function holds) and the
log messages of `jax.config.update("jax_explain_cache_misses", True)`.

Differences from JAX:
  * JAX explains tracing-cache misses in log messages; we return them as data
    (`Compilation.reason`), worded like JAX's ("at x: now f32[4], before f32[3]").
  * The compile count comes from JAX's own monitoring events, so it is exact; the reason
    is our reconstruction from the arguments, which names the same argument as JAX.
  * Static arguments are compared by `==` and shown by `repr`, as JAX hashes them; a
    static argument that is not hashable fails in `jax.jit` itself, with its message.
  * Each tracked function starts with an empty cache. JAX shares compiled programs
    between `jax.jit` wrappers of one function, so `jax.jit(f)` may reuse a program an
    earlier `jax.jit(f)` compiled; `track_compiles(f)` compiles its own.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any

import jax

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@dataclasses.dataclass(frozen=True)
class CompileEvent:
    """One backend compilation: which function (as JAX names it, e.g. 'jit(f)') and how long."""

    function: str
    seconds: float


class CompileWatcher:
    """Record every XLA compilation while the `with` block runs.

    Example:
        with CompileWatcher() as watcher:
            f(x)
        watcher.count("jit(f)")  # 1 the first time, 0 when f's cache already had x's signature
    """

    def __init__(self):
        self.events: list[CompileEvent] = []
        self._listener = self._record  # one bound method, so unregistering finds it again

    def _record(self, event: str, duration_secs: float, **kwargs: str | int) -> None:
        if event == BACKEND_COMPILE_EVENT:
            self.events.append(CompileEvent(str(kwargs.get("fun_name", "")), float(duration_secs)))

    def __enter__(self) -> CompileWatcher:
        jax.monitoring.register_event_duration_secs_listener(self._listener)
        return self

    def __exit__(self, *exc_info) -> None:
        jax.monitoring.unregister_event_duration_listener(self._listener)

    def count(self, function: str | None = None) -> int:
        """Compilations seen, of `function` only (e.g. 'jit(f)') if given."""
        return sum(1 for event in self.events if function is None or event.function == function)


@dataclasses.dataclass(frozen=True)
class Compilation:
    """One compilation of a tracked function.

    Attributes:
      call: index of the call that compiled (0 for the first call).
      reason: why the compiled programs did not fit, e.g. "at x: now f32[4], before f32[3]".
      seconds: time XLA spent compiling.
    """

    call: int
    reason: str
    seconds: float


def _type_string(leaf: Any) -> str:
    """How JAX types an argument leaf: 'f32[3]', with '{weak_type=True}' for Python scalars."""
    aval = jax.typeof(leaf)
    text = aval.str_short(short_dtypes=True)
    return text + "{weak_type=True}" if getattr(aval, "weak_type", False) else text


def _function_name(fn: Callable) -> str:
    """The name JAX gives `fn` in its events: `__name__`, looking through functools.partial."""
    while getattr(fn, "__name__", None) is None and isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__name__", "<unnamed function>")


class TrackedFunction:
    """`jax.jit(fn, **jit_kwargs)` that remembers each compilation and why it happened."""

    def __init__(self, fn: Callable, **jit_kwargs: Any):
        if not callable(fn):
            raise TypeError(f"track_compiles needs a function, got {type(fn).__name__}.")
        # JAX shares compiled programs between jax.jit wrappers of the same function, so
        # a signature compiled elsewhere would not compile here and the count would say
        # nothing about this function's own cache. A fresh function object starts empty.
        @functools.wraps(fn)
        def fresh(*args, **kwargs):
            return fn(*args, **kwargs)

        fresh.__name__ = _function_name(fn)  # wraps() finds no __name__ on a functools.partial
        self._jitted = jax.jit(fresh, **jit_kwargs)
        self.__wrapped__ = fn
        self.name = f"jit({fresh.__name__})"  # how JAX's compile events name it
        self._parameters = inspect.signature(fn)
        static = set(jit_kwargs.get("static_argnames") or ())
        static_argnums = jit_kwargs.get("static_argnums") or ()
        static_argnums = (static_argnums,) if isinstance(static_argnums, int) else static_argnums
        names = list(self._parameters.parameters)
        static |= {names[i] for i in static_argnums if i < len(names)}
        self._static = static
        self._seen: list[dict[str, str]] = []
        self.calls = 0
        self.compilations: list[Compilation] = []

    @property
    def compile_count(self) -> int:
        return len(self.compilations)

    def signature(self, *args, **kwargs) -> dict[str, str]:
        """Argument path -> its type ('f32[3]') or, for a static argument, 'static <repr>'."""
        bound = self._parameters.bind(*args, **kwargs)
        described = {}
        for name, value in bound.arguments.items():
            if name in self._static:
                described[name] = f"static {value!r}"
                continue
            leaves, _ = jax.tree_util.tree_flatten_with_path(value)
            if not leaves:
                described[name] = f"empty {type(value).__name__}"
            for path, leaf in leaves:
                described[name + jax.tree_util.keystr(path)] = _type_string(leaf)
        return described

    def _explain(self, signature: dict[str, str]) -> str:
        """Differences from the closest previously compiled signature, in JAX's wording."""
        if not self._seen:
            return "first call"

        def differences(before: dict[str, str]) -> list[str]:
            found = []
            for path in sorted(signature.keys() | before.keys()):
                # An argument left to its default is not part of the call: JAX keys on what
                # was passed, so f(x) and f(x, n=2) are different signatures.
                now, then = signature.get(path, "not passed"), before.get(path, "not passed")
                if now != then:
                    found.append(f"at {path}: now {now}, before {then}")
            return found

        # The fewest differences; among equals the most recent, the likeliest to be meant.
        closest = min((differences(before) for before in reversed(self._seen)), key=len)
        return "; ".join(closest) or "same signature (the compiled program was evicted from the cache)"

    def __call__(self, *args, **kwargs):
        signature = self.signature(*args, **kwargs)
        with CompileWatcher() as watcher:
            out = self._jitted(*args, **kwargs)
        mine = [event for event in watcher.events if event.function == self.name]
        if mine:
            self.compilations.append(
                Compilation(self.calls, self._explain(signature), sum(e.seconds for e in mine)))
            self._seen.append(signature)
        self.calls += 1
        return out

    def lower(self, *args, **kwargs):
        return self._jitted.lower(*args, **kwargs)


def track_compiles(fn: Callable, **jit_kwargs: Any) -> TrackedFunction:
    """Jit `fn` like `jax.jit(fn, **jit_kwargs)` and record every compilation with its reason.

    Args:
      fn: the function to compile.
      **jit_kwargs: passed to `jax.jit` (`static_argnums`, `static_argnames`,
        `donate_argnums`, ...).

    Returns:
      A `TrackedFunction`: call it like the jitted function; read `compile_count` and
      `compilations` (each with `call`, `reason`, `seconds`).

    Example:
        f = track_compiles(lambda x: x * 2)
        f(jnp.ones(3)); f(jnp.ones(3)); f(jnp.ones(4))
        f.compile_count            # 2
        f.compilations[1].reason   # 'at x: now f32[4], before f32[3]'
    """
    return TrackedFunction(fn, **jit_kwargs)
