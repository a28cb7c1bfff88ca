"""Staging: run a Python function on abstract values and record a jaxpr (`make_jaxpr`).

Mirrors `jax.make_jaxpr` and the tracing half of JAX's `pe.trace_to_jaxpr_dynamic`. The
function's inputs become `JaxprTracer`s that hold only an abstract value (shape and
dtype). Every primitive applied to them is not computed but written down as an
equation, and its result is a new tracer whose abstract value comes from the
primitive's shape rule. Values the function closes over become constants of the jaxpr.

A staging trace is normally *dynamic* (`core.new_dynamic`): it also records operations
on constants, so the jaxpr is the whole program. Reverse mode uses a non-dynamic one to
record only the operations that depend on the tangents (`reverse.linearize`).

Differences from JAX:
  * no partial evaluation with known and unknown values, no debug info, no effects;
  * the builder records equations in program order and never reorders or fuses them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from stacklib.transforms import core, tree_util
from stacklib.transforms.core import ShapedArray, Trace, Tracer, apply_abstract_eval
from stacklib.transforms.jaxpr import ClosedJaxpr, Jaxpr, JaxprEqn, Literal, Var


class JaxprTracer(Tracer):
    """A tracer that knows only its abstract value; its operations become equations."""

    __slots__ = ["_aval"]

    def __init__(self, trace: Trace, aval: ShapedArray):
        self._trace = trace
        self._aval = aval

    @property
    def aval(self) -> ShapedArray:
        return self._aval

    def __repr__(self) -> str:
        return f"JaxprTracer({self._aval.str_short()})"


class JaxprBuilder:
    """What one staging run accumulates: equations, variables and constants.

    Tracers are not hashable (their `==` is elementwise), so maps are keyed by `id`;
    the builder keeps every tracer and constant alive so that ids are never reused
    while it runs.
    """

    def __init__(self, context: str, transform: str):
        self.context = context  # "the function f", for error messages
        self.transform = transform  # "jit", "make_jaxpr", "linearize"
        self.eqns: list[JaxprEqn] = []
        self.tracer_to_var: dict[int, Var] = {}
        self.const_tracers: dict[int, JaxprTracer] = {}
        self.constvals: dict[int, Any] = {}  # id(constvar) -> value
        self.constvars: list[Var] = []
        self.alive: list[Any] = []

    def new_tracer(self, trace: Trace, aval: ShapedArray) -> JaxprTracer:
        tracer = JaxprTracer(trace, aval)
        self.alive.append(tracer)
        return tracer

    def add_var(self, tracer: JaxprTracer) -> Var:
        var = self.tracer_to_var[id(tracer)] = Var(tracer.aval)
        return var

    def get_var(self, tracer: JaxprTracer) -> Var:
        return self.tracer_to_var[id(tracer)]

    def add_const(self, tracer: JaxprTracer, value: Any) -> Var:
        var = self.add_var(tracer)
        self.constvals[id(var)] = value
        self.constvars.append(var)
        self.alive.append(value)
        return var

    def build(self, in_tracers: Sequence[JaxprTracer], out_tracers: Sequence[JaxprTracer]) -> ClosedJaxpr:
        """The recorded program, with scalar NumPy constants inlined as literals."""
        jaxpr = Jaxpr(
            constvars=list(self.constvars),
            invars=[self.get_var(t) for t in in_tracers],
            eqns=list(self.eqns),
            outvars=[self.get_var(t) for t in out_tracers],
        )
        return _inline_literals(jaxpr, [self.constvals[id(v)] for v in jaxpr.constvars])


def _inline_literals(jaxpr: Jaxpr, consts: list[Any]) -> ClosedJaxpr:
    """Rank-0 concrete constants become `Literal`s; the rest stay constant variables.

    Constants that are tracers of an outer transformation never become literals: their
    values are not known yet.
    """
    literals: dict[int, Literal] = {}
    constvars, constvals = [], []
    for var, value in zip(jaxpr.constvars, consts, strict=True):
        if not isinstance(value, Tracer) and np.ndim(value) == 0:
            literals[id(var)] = Literal(value)
        else:
            constvars.append(var)
            constvals.append(value)

    def replace(atom):
        return literals.get(id(atom), atom) if isinstance(atom, Var) else atom

    eqns = [JaxprEqn(e.primitive, [replace(a) for a in e.invars], e.params, e.outvars)
            for e in jaxpr.eqns]
    outvars = [replace(a) for a in jaxpr.outvars]
    return ClosedJaxpr(Jaxpr(constvars, jaxpr.invars, eqns, outvars), constvals)


class JaxprTrace(Trace):
    """Interpret primitives by recording them (the staging interpreter)."""

    @property
    def builder(self) -> JaxprBuilder:
        return self.main.global_data

    @property
    def transform_name(self) -> str:
        return self.builder.transform

    def new_arg(self, aval: ShapedArray) -> JaxprTracer:
        tracer = self.builder.new_tracer(self, aval)
        self.builder.add_var(tracer)
        return tracer

    def pure(self, value: Any) -> JaxprTracer:
        """A constant (or a tracer of an outer transformation) becomes a constant variable."""
        tracer = self.builder.const_tracers.get(id(value))
        if tracer is None:
            tracer = self.builder.new_tracer(self, core.get_aval(value))
            self.builder.add_const(tracer, value)
            self.builder.const_tracers[id(value)] = tracer
        return tracer

    lift = pure

    def process_primitive(self, primitive, tracers, params):
        avals_out = apply_abstract_eval(primitive, *[t.aval for t in tracers], **params)
        outs = [self.builder.new_tracer(self, aval) for aval in avals_out]
        self.builder.eqns.append(JaxprEqn(
            primitive, [self.builder.get_var(t) for t in tracers], dict(params),
            [self.builder.add_var(t) for t in outs]))
        return outs


def trace_to_jaxpr(
    flat_fun: Callable[..., Sequence[Any]],
    in_avals: Sequence[ShapedArray],
    *,
    context: str = "the function",
    transform: str = "make_jaxpr",
) -> ClosedJaxpr:
    """Stage `flat_fun` (a function of a flat list of arrays, returning a list) to a jaxpr."""
    builder = JaxprBuilder(context, transform)
    with core.new_main(JaxprTrace, builder) as main, core.new_dynamic(main):
        trace = JaxprTrace(main)
        tracers_in = [trace.new_arg(aval) for aval in in_avals]
        outs = flat_fun(*tracers_in)
        tracers_out = [core.full_raise(trace, out) for out in outs]
        return builder.build(tracers_in, tracers_out)


def function_name(fun: Callable) -> str:
    return getattr(fun, "__name__", type(fun).__name__)


def flatten_fun(fun: Callable, in_tree: tree_util.PyTreeDef, out_tree_store: list):
    """Wrap `fun` of pytrees as a function of flat leaves; the output structure goes to the store."""

    def flat_fun(*leaves):
        args, kwargs = tree_util.tree_unflatten(in_tree, list(leaves))
        out = fun(*args, **kwargs)
        out_leaves, out_tree = tree_util.tree_flatten(out)
        out_tree_store.append(out_tree)
        return out_leaves

    return flat_fun


def make_jaxpr(fun: Callable, static_argnums: int | Sequence[int] = ()) -> Callable[..., ClosedJaxpr]:
    """Return a function that stages `fun` for the given arguments and returns its jaxpr.

    Like `jax.make_jaxpr(fun)(*args)`: arguments may be pytrees of arrays (only their
    shapes and dtypes matter); the jaxpr's inputs are their flattened leaves.

    Args:
      fun: the function to stage.
      static_argnums: positions of arguments passed to `fun` as Python values, not traced.

    Returns:
      A function of the same arguments as `fun` that returns a `ClosedJaxpr`.
    """
    static = {static_argnums} if isinstance(static_argnums, int) else set(static_argnums)

    def staged(*args: Any, **kwargs: Any) -> ClosedJaxpr:
        dynamic = tuple(a for i, a in enumerate(args) if i not in static)

        def with_statics(*dynamic_args, **kw):
            it = iter(dynamic_args)
            full = [args[i] if i in static else next(it) for i in range(len(args))]
            return fun(*full, **kw)

        leaves, in_tree = tree_util.tree_flatten((dynamic, kwargs))
        flat_fun = flatten_fun(with_statics, in_tree, [])
        return trace_to_jaxpr(flat_fun, [core.get_aval(x) for x in leaves],
                              context=f"the function {function_name(fun)}", transform="make_jaxpr")

    return staged
