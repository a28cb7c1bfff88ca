"""The IR: jaxprs, how they print, how they run, and dead-code elimination.

Mirrors `jax.core.Jaxpr`, `ClosedJaxpr`, `JaxprEqn`, `Var`, `Literal` and
`jax.core.eval_jaxpr`. A jaxpr is a function in A-normal form: typed input variables,
a list of equations `outvars = primitive[params] invars`, and output variables. It
prints like JAX's:

    { lambda ; a:f64[3]. let
        b:f64[3] = sin a
        c:f64[3] = mul b 2.0:f64[]
      in (c,) }

`ClosedJaxpr` pairs a jaxpr with the values of its constant variables (the arrays the
traced function closed over). Scalar constants print inline as literals (`2.0:f64[]`).

Two ways to run a jaxpr: `eval_jaxpr` binds each equation's primitive, so whatever
transformation is active (jvp, vmap, staging) interprets it, exactly as if the
original Python function ran again; `run_jaxpr` calls the NumPy implementations
directly, which is what `jit(f, interpret=True)` does with a staged program.

Differences from jax.core:
  * no effects, source info, debug info or `Jaxpr` type checking;
  * printing lists every parameter (JAX hides some, e.g. `broadcast_in_dim`'s shape);
  * an inner jaxpr (a `jit` parameter) names its variables afresh from `a`.
"""

from __future__ import annotations

import dataclasses
import itertools
import string
from collections.abc import Iterator
from typing import Any

import numpy as np

from stacklib.transforms.core import Primitive, ShapedArray, apply_impl, get_aval


class Var:
    """A variable of a jaxpr: an abstract value and an identity (names come at print time)."""

    __slots__ = ["aval"]

    def __init__(self, aval: ShapedArray):
        self.aval = aval

    def __repr__(self) -> str:
        return f"Var({self.aval.str_short()})"


class Literal:
    """A scalar constant written inline in an equation, like `2.0:f64[]`."""

    __slots__ = ["val", "aval"]

    def __init__(self, val: Any):
        self.val = np.asarray(val)
        self.aval = get_aval(self.val)

    def __repr__(self) -> str:
        return f"{self.val.item()!r}:{self.aval.str_short()}"


Atom = Var | Literal


@dataclasses.dataclass
class JaxprEqn:
    """One equation: `outvars = primitive[params] invars`."""

    primitive: Primitive
    invars: list[Atom]
    params: dict[str, Any]
    outvars: list[Var]


@dataclasses.dataclass
class Jaxpr:
    """A typed program: constant variables, inputs, equations, outputs."""

    constvars: list[Var]
    invars: list[Var]
    eqns: list[JaxprEqn]
    outvars: list[Atom]

    def __str__(self) -> str:
        return pp_jaxpr(self)


@dataclasses.dataclass
class ClosedJaxpr:
    """A jaxpr with the values of its constants: what `make_jaxpr` returns."""

    jaxpr: Jaxpr
    consts: list[Any]

    @property
    def eqns(self) -> list[JaxprEqn]:
        return self.jaxpr.eqns

    @property
    def in_avals(self) -> list[ShapedArray]:
        return [v.aval for v in self.jaxpr.invars]

    @property
    def out_avals(self) -> list[ShapedArray]:
        return [v.aval for v in self.jaxpr.outvars]

    def __str__(self) -> str:
        return pp_jaxpr(self.jaxpr)

    def __repr__(self) -> str:
        return str(self)


# --------------------------------------------------------------------------- printing


def _names() -> Iterator[str]:
    """a, b, ..., z, ba, bb, ...: JAX's variable names (base 26, no leading 'a')."""
    letters = string.ascii_lowercase
    for n in itertools.count():
        digits = letters[n % 26]
        n //= 26
        while n:
            digits = letters[n % 26] + digits
            n //= 26
        yield digits


def _format_param(value: Any, indent: int) -> str:
    if isinstance(value, ClosedJaxpr | Jaxpr):
        jaxpr = value.jaxpr if isinstance(value, ClosedJaxpr) else value
        return pp_jaxpr(jaxpr, indent=indent)
    if isinstance(value, np.dtype):
        return value.name
    return str(value)


def pp_jaxpr(jaxpr: Jaxpr, indent: int = 0) -> str:
    """Print a jaxpr the way `jax.make_jaxpr` does."""
    names = _names()
    name_of: dict[int, str] = {}
    used = {id(v) for eqn in jaxpr.eqns for v in eqn.invars if isinstance(v, Var)}
    used |= {id(v) for v in jaxpr.outvars if isinstance(v, Var)}

    def name(atom: Atom) -> str:
        if isinstance(atom, Literal):
            return repr(atom)
        if id(atom) not in name_of:
            name_of[id(atom)] = next(names)
        return name_of[id(atom)]

    def binder(var: Var) -> str:
        return f"{name(var) if id(var) in used else '_'}:{var.aval.str_short()}"

    constvars = " ".join(binder(v) for v in jaxpr.constvars)
    invars = " ".join(binder(v) for v in jaxpr.invars)
    pad = " " * indent
    lines = []
    for eqn in jaxpr.eqns:
        lhs = " ".join(binder(v) for v in eqn.outvars)
        args = " ".join(name(v) for v in eqn.invars)
        params = [f"{key}={_format_param(value, indent + 6)}" for key, value in eqn.params.items()]
        one_line = f"[{' '.join(params)}]" if params else ""
        if len(one_line) > 60 or "\n" in one_line:
            inner = "".join(f"\n{pad}      {p}" for p in params)
            one_line = f"[{inner}\n{pad}    ]"
        lines.append(f"{lhs} = {eqn.primitive.name}{one_line} {args}".rstrip())
    outs = ", ".join(name(v) for v in jaxpr.outvars)
    head = f"{{ lambda {constvars}; {invars}. let"
    tail = f"in ({outs}{',' if len(jaxpr.outvars) == 1 else ''}) }}"
    flat = f"{head} {'; '.join(lines)} {tail}"
    if len(flat) <= 80 and "\n" not in flat:
        return flat
    body = "".join(f"\n{pad}    {line}" for line in lines)
    return f"{head}{body}\n{pad}  {tail}"


# --------------------------------------------------------------------------- evaluation


def _read(env: dict[int, Any], atom: Atom) -> Any:
    return atom.val if isinstance(atom, Literal) else env[id(atom)]


def eval_jaxpr(jaxpr: Jaxpr, consts: list[Any], *args: Any) -> list[Any]:
    """Run `jaxpr` by binding each primitive: transformations active now see every operation.

    This makes a jaxpr behave like the Python function it came from, so `jvp`, `vmap`
    or staging can be applied to a staged program too.
    """
    env: dict[int, Any] = {}
    for var, value in zip(jaxpr.constvars + jaxpr.invars, list(consts) + list(args), strict=True):
        env[id(var)] = value
    for eqn in jaxpr.eqns:
        outs = eqn.primitive.bind(*[_read(env, v) for v in eqn.invars], **eqn.params)
        outs = outs if eqn.primitive.multiple_results else [outs]
        for var, value in zip(eqn.outvars, outs, strict=True):
            env[id(var)] = value
    return [_read(env, v) for v in jaxpr.outvars]


def run_jaxpr(jaxpr: Jaxpr, consts: list[Any], *args: Any) -> list[Any]:
    """Run `jaxpr` on NumPy arrays by calling each primitive's implementation directly.

    No tracing machinery is involved, so this is the fast path that `jit` takes once a
    function is staged: one dictionary lookup and one NumPy call per equation.
    """
    env: dict[int, Any] = {}
    for var, value in zip(jaxpr.constvars + jaxpr.invars, list(consts) + list(args), strict=True):
        env[id(var)] = value
    for eqn in jaxpr.eqns:
        outs = apply_impl(eqn.primitive, *[_read(env, v) for v in eqn.invars], **eqn.params)
        for var, value in zip(eqn.outvars, outs, strict=True):
            env[id(var)] = value
    return [_read(env, v) for v in jaxpr.outvars]


def dce_jaxpr(closed: ClosedJaxpr) -> ClosedJaxpr:
    """Remove equations and constants that no output needs (dead-code elimination).

    Walk the equations backwards, keeping one only if some output, or an equation kept
    already, reads one of its results. Our primitives have no side effects, so this is
    safe: `jit` does it before running a staged program.
    """
    jaxpr = closed.jaxpr
    live = {id(v) for v in jaxpr.outvars if isinstance(v, Var)}
    kept: list[JaxprEqn] = []
    for eqn in reversed(jaxpr.eqns):
        if any(id(v) in live for v in eqn.outvars):
            kept.append(eqn)
            live |= {id(v) for v in eqn.invars if isinstance(v, Var)}
    used = [(v, c) for v, c in zip(jaxpr.constvars, closed.consts, strict=True) if id(v) in live]
    return ClosedJaxpr(Jaxpr([v for v, _ in used], jaxpr.invars, kept[::-1], jaxpr.outvars),
                       [c for _, c in used])
