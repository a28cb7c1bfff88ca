"""A registry of implementations: what each one supports, and the order in which they are tried.

Tokamax gives every op one function (`tokamax.dot_product_attention`, `layer_norm`, …) and
several implementations behind it (`'xla'`, `'xla_chunked'`, `'mosaic'`, `'triton'`, …).
The caller names one with `implementation=`, names a sequence ("the first that can serve
this call"), or passes `None` (the library's default order). This module is that
mechanism, made explicit:

* a `BoundCall` describes a call without its data: the op, each array argument's shape and
  dtype, the static options, the backend and device kind. It is what an implementation
  looks at to decide whether it can serve the call, and what the autotuning cache is
  keyed by;
* an `Implementation` *declares* what it supports — backends, dtypes, the optional
  features of the op it handles — and answers `why_not(call)` with a sentence, or None;
* a `Registry` holds the implementations of one op and a default order per backend, and
  turns the `implementation=` argument into the list to try (unknown names are an error
  that lists the known ones, before anything runs).

`stacklib.kernels.api` walks that list: the first implementation whose `why_not` is None
runs; the others' reasons are kept, and if none can serve the call the error lists them all.

Differences from tokamax: tokamax asks each implementation to *try* the call and catches
`NotImplementedError` (raised while binding or tracing); we ask the declaration first, so
the reasons are known before any kernel is traced (an implementation may still raise
`NotImplementedError` while tracing, and the dispatcher treats that as a reason too).
When every implementation fails tokamax raises an `ExceptionGroup`; we raise one
`NoImplementationError` whose message lists each reason.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class BoundCall:
    """One call of an op, without its data: shapes, dtypes, static options, where it runs.

    Attributes:
      op: the op's name, e.g. 'dot_product_attention'.
      arrays: each array argument's `jax.ShapeDtypeStruct` (None where not passed), in
        the op's argument order.
      static: the non-array arguments that change the computation (`is_causal`, `scale`, …).
      backend: 'cpu', 'gpu' or 'tpu'.
      device_kind: e.g. 'cpu', 'NVIDIA H100 80GB HBM3', 'TPU v5 lite'.
    """

    op: str
    arrays: tuple[tuple[str, jax.ShapeDtypeStruct | None], ...]
    static: tuple[tuple[str, Any], ...]
    backend: str
    device_kind: str

    def array(self, name: str) -> jax.ShapeDtypeStruct | None:
        return dict(self.arrays)[name]

    def option(self, name: str) -> Any:
        return dict(self.static)[name]

    @property
    def dtype(self) -> jnp.dtype:
        """The dtype of the first array argument (the op's compute dtype)."""
        return self.arrays[0][1].dtype

    def describe(self) -> dict[str, Any]:
        """A JSON-able description: the part of the autotuning cache key that is the call."""
        arrays = {name: None if spec is None else [list(spec.shape), spec.dtype.name]
                  for name, spec in self.arrays}
        static = {name: _jsonable(value) for name, value in self.static}
        return {"op": self.op, "arrays": arrays, "static": static}


def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple | list):
        return [_jsonable(v) for v in value]
    if callable(value):  # an activation function: its name identifies it
        return getattr(value, "__name__", repr(value))
    return value


def bind(op: str, arrays: Mapping[str, Any], static: Mapping[str, Any]) -> BoundCall:
    """Describe a call: abstract the arrays (tracers included) and note where it runs."""
    device = jax.devices()[0]
    specs = tuple((name, None if x is None else jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)))
                  for name, x in arrays.items())
    return BoundCall(op, specs, tuple(static.items()), device.platform, device.device_kind)


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One way to compute an op, with a declaration of what it can serve.

    Attributes:
      name: what callers pass as `implementation=`.
      run: `run(*arrays, config=..., **static)` computes the op (arrays in the op's order).
      backends: the backends it runs on.
      dtypes: the dtypes of the op's main input it accepts.
      options: the optional features of the op it supports (names of array arguments
        such as 'bias', or static options such as 'is_causal'); a call that uses any
        other optional feature is declined.
      check: further constraints, `check(call) -> reason or None` (e.g. equal head dims).
      heuristic_config: the config to use without tuning, `heuristic_config(call)`;
        None for an implementation with nothing to tune.
      candidate_configs: the configs the autotuner times, `candidate_configs(call)`.
    """

    name: str
    run: Callable[..., Any]
    backends: tuple[str, ...]
    dtypes: tuple[str, ...]
    options: frozenset[str] = frozenset()
    check: Callable[[BoundCall], str | None] | None = None
    heuristic_config: Callable[[BoundCall], Any] | None = None
    candidate_configs: Callable[[BoundCall], list[Any]] | None = None

    @property
    def tunable(self) -> bool:
        return self.candidate_configs is not None

    def why_not(self, call: BoundCall, used_options: Sequence[str]) -> str | None:
        """None if this implementation can serve `call`, else the reason in one sentence."""
        if call.backend not in self.backends:
            return f"runs on {' or '.join(self.backends)}, and this call is on {call.backend}"
        if call.dtype.name not in self.dtypes:
            first = call.arrays[0]
            return (f"does not support dtype {call.dtype.name} ({first[0]} of shape {first[1].shape}); "
                    f"it supports {', '.join(self.dtypes)}: cast the inputs, e.g. "
                    f"{first[0]}.astype(jnp.{self.dtypes[0]})")
        unsupported = [option for option in used_options if option not in self.options]
        if unsupported:
            return f"does not support {', '.join(unsupported)}"
        return self.check(call) if self.check is not None else None


class NoImplementationError(NotImplementedError):
    """No implementation could serve the call; `reasons` maps each one tried to why not."""

    def __init__(self, op: str, call: BoundCall, reasons: Mapping[str, str]):
        self.reasons = dict(reasons)
        shapes = ", ".join(f"{name} {tuple(spec.shape)} {spec.dtype.name}"
                           for name, spec in call.arrays if spec is not None)
        lines = "\n".join(f"  - {name!r} {reason}" for name, reason in self.reasons.items())
        super().__init__(f"{op}: no implementation can serve this call ({shapes}; on {call.backend}):\n"
                         f"{lines}\nPass an implementation that supports it, e.g. implementation='xla'.")


class Registry:
    """The implementations of one op, and the order to try them in when the caller names none."""

    def __init__(self, op: str, default_order: Mapping[str, tuple[str, ...]]):
        self.op = op
        self.implementations: dict[str, Implementation] = {}
        self._default_order = dict(default_order)

    def register(self, implementation: Implementation) -> Implementation:
        if implementation.name in self.implementations:
            raise ValueError(f"{self.op} already has an implementation named {implementation.name!r}")
        self.implementations[implementation.name] = implementation
        return implementation

    def default_order(self, backend: str) -> tuple[str, ...]:
        """The names tried for `implementation=None` on `backend` (registered ones only)."""
        return tuple(name for name in self._default_order[backend] if name in self.implementations)

    def resolve(self, implementation: str | Sequence[str] | None, backend: str) -> list[Implementation]:
        """The implementations to try, in order.

        Raises:
          ValueError: an empty sequence, or a name that is not registered (the message
            lists the registered names).
        """
        if implementation is None:
            names: Sequence[str] = self.default_order(backend)
        elif isinstance(implementation, str):
            names = (implementation,)
        else:
            names = tuple(implementation)
            if not names:
                raise ValueError(f"implementation must not be an empty sequence; pass None for "
                                 f"{self.op}'s default order {self.default_order(backend)}.")
        for name in names:
            if name not in self.implementations:
                raise ValueError(f"implementation={name!r} is not an implementation of {self.op}; "
                                 f"known: {', '.join(map(repr, self.implementations))}.")
        return [self.implementations[name] for name in names]

    def __repr__(self) -> str:
        rows = []
        for impl in self.implementations.values():
            rows.append(f"  {impl.name:12} backends={','.join(impl.backends):12} "
                        f"dtypes={','.join(impl.dtypes):26} options={','.join(sorted(impl.options)) or '-'}"
                        f"{'  (tunable)' if impl.tunable else ''}")
        return f"Registry({self.op!r}):\n" + "\n".join(rows)

