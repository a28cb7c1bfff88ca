"""`jit`: stage a function once per abstract signature, cache the program, and run it.

Mirrors `jax.jit(fun, static_argnums=None, static_argnames=None)`, the jitted
function's `_cache_size()` and `trace(*args).jaxpr`, the `jit` primitive that
appears in jaxprs (`jit[name=f jaxpr={...}]`), and `config.update("jax_log_compiles",
True)`.

On a call, the arguments are reduced to their *abstract signature*: the tree structure,
each leaf's shape and dtype, and the values of the static arguments. The first call
with a signature stages the function to a jaxpr (`staging.trace_to_jaxpr`), removes
dead code, and stores it; every later call with the same signature skips Python
tracing and runs the stored program. A new shape, dtype, structure or static value
means a new entry: a *recompilation*, which `jax_log_compiles` reports together with
what changed.

Running the stored program has two implementations. By default the jaxpr is lowered to
StableHLO and compiled by XLA, once per entry (`lowering.compile_jaxpr`), as `jax.jit`
does. With `jit(f, interpret=True)` it is interpreted by `jaxpr.run_jaxpr`, one NumPy
call per equation: slower, but every step is Python you can read and step through
(the name follows Pallas's `interpret=True`).

Differences from jax.jit:
  * XLA compiles for the default device only, and calls block until the results are
    NumPy arrays: no asynchronous dispatch, no device-resident outputs;
  * no `donate_argnums`, shardings, `lower()`/`compile()`, or weak types in the cache
    key (a Python float and a float64 scalar share an entry; JAX keeps two);
  * under `jvp`, `vmap` or `grad` the inner jaxpr is inlined into the outer
    transformation instead of staying one `jit` equation with a transformed body;
  * a function that closes over a tracer of an outer transformation is staged afresh on
    every call (its jaxpr would hold that tracer, which must not outlive the call).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import weakref
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

import numpy as np

from stacklib.transforms import core, tree_util
from stacklib.transforms.batching import primitive_batchers, vmap_flat
from stacklib.transforms.core import Primitive, Tracer, get_aval
from stacklib.transforms.forward import jvp_flat, primitive_jvps
from stacklib.transforms.jaxpr import ClosedJaxpr, Jaxpr, dce_jaxpr, eval_jaxpr, run_jaxpr
from stacklib.transforms.lowering import CompiledProgram, LoweringRuleContext, compile_jaxpr, lowering_rules
from stacklib.transforms.staging import flatten_fun, trace_to_jaxpr

logger = logging.getLogger("stacklib.transforms")


class _Config:
    """`config.update(name, value)`, as `jax.config.update`, for the options we have."""

    def __init__(self):
        self.jax_log_compiles = False

    def update(self, name: str, value: Any) -> None:
        if name == "jax_enable_x64":
            return  # always on: we compute in whatever NumPy dtype the inputs have
        if name != "jax_log_compiles":
            raise ValueError(f"Unknown config option {name!r}; stacklib.transforms has "
                             "'jax_log_compiles' (and accepts 'jax_enable_x64', always on).")
        self.jax_log_compiles = bool(value)


config = _Config()

# --------------------------------------------------------------------------- the jit primitive

jit_p = Primitive("jit", multiple_results=True)


# One compiled program per staged jaxpr, keyed by the jaxpr's identity: `JittedFunction`
# keeps each jaxpr in its cache, so a cache hit finds its executable here too. The entry
# goes when the jaxpr does (before its id can be reused).
_compiled: dict[int, CompiledProgram] = {}


def _compiled_program(jaxpr: ClosedJaxpr, name: str) -> CompiledProgram:
    program = _compiled.get(id(jaxpr))
    if program is None:
        program = _compiled[id(jaxpr)] = compile_jaxpr(jaxpr, name)
        weakref.finalize(jaxpr, _compiled.pop, id(jaxpr), None)
    return program


@jit_p.def_impl
def _jit_impl(*args: Any, jaxpr: ClosedJaxpr, name: str, interpret: bool = False) -> list[Any]:
    if interpret:
        return run_jaxpr(jaxpr.jaxpr, jaxpr.consts, *args)
    return _compiled_program(jaxpr, name)(*args)


@jit_p.def_abstract_eval
def _jit_abstract_eval(*avals: Any, jaxpr: ClosedJaxpr, name: str, interpret: bool = False) -> list[Any]:
    return jaxpr.out_avals


def _jit_lowering(ctx: LoweringRuleContext, *args: str, jaxpr: ClosedJaxpr, name: str,
                  interpret: bool = False) -> list[str]:
    """A nested jit is a private function of the module and a `func.call` (as in JAX)."""
    return ctx.lower_call(jaxpr, name, args)


def _inline(jaxpr: ClosedJaxpr) -> Callable[..., list[Any]]:
    return lambda *args: eval_jaxpr(jaxpr.jaxpr, jaxpr.consts, *args)


def _jit_jvp(primals, tangents, *, jaxpr, name, interpret=False):
    return jvp_flat(_inline(jaxpr), primals, tangents)


def _jit_batcher(vals, dims, *, jaxpr, name, interpret=False):
    size = next(get_aval(v).shape[d] for v, d in zip(vals, dims, strict=True) if d is not None)
    return vmap_flat(_inline(jaxpr), dims, vals, size, context=f"the function {name}")


primitive_jvps[jit_p] = _jit_jvp
primitive_batchers[jit_p] = _jit_batcher
lowering_rules[jit_p] = _jit_lowering


# --------------------------------------------------------------------------- jit


def leaf_type(x: Any) -> tuple[tuple[int, ...], np.dtype]:
    """A leaf's shape and dtype: its part of the cache key (its abstract value, as a tuple)."""
    if isinstance(x, Tracer):
        x = x.aval
    elif not isinstance(x, np.ndarray | np.generic):
        x = np.asarray(x)  # a Python scalar: float64, int64 or bool, as `get_aval` says
    return x.shape, x.dtype


class _Signature(NamedTuple):
    """What a staged program depends on: structure, shapes and dtypes, static values.

    A tuple of tuples, because `jit` builds, hashes and compares one on every call: Python
    does that in C for tuples (and for `PyTreeDef`, whose comparison is one tuple's).
    """

    in_tree: tree_util.PyTreeDef
    leaf_types: tuple[tuple[tuple[int, ...], np.dtype], ...]  # (shape, dtype) per leaf
    statics: tuple[tuple[str, Hashable], ...]

    @property
    def avals(self) -> tuple[core.ShapedArray, ...]:
        return tuple(core.ShapedArray(shape, dtype) for shape, dtype in self.leaf_types)

    def describe(self) -> str:
        shown = ", ".join(aval.str_short() for aval in self.avals)
        statics = "".join(f", {name}={value!r}" for name, value in self.statics)
        return f"({shown}{statics})"


@dataclasses.dataclass(frozen=True)
class Traced:
    """What `jitted.trace(*args)` returns: the staged program for those arguments."""

    jaxpr: ClosedJaxpr
    out_tree: tree_util.PyTreeDef
    tracer_consts: tuple[Any, ...] = ()


def _outside_every_transformation(leaves: Sequence[Any]) -> bool:
    """True when `bind` would evaluate: nothing is staging and no argument is a tracer."""
    return (core.dynamic_trace is None and len(core.trace_stack) == 1
            and not any(isinstance(leaf, Tracer) for leaf in leaves))


def _differences(old: _Signature, new: _Signature) -> list[str]:
    if old.in_tree != new.in_tree:
        return [f"the argument structure changed from {old.in_tree} to {new.in_tree}"]
    changes = [f"leaf {i}: {a.str_short()} -> {b.str_short()}"
               for i, (a, b) in enumerate(zip(old.avals, new.avals, strict=True)) if a != b]
    changes += [f"static {name}: {a!r} -> {b!r}"
                for (name, a), (_, b) in zip(old.statics, new.statics, strict=True) if a != b]
    return changes


def _why_new(cached: Sequence[_Signature], new: _Signature) -> str:
    """Say how `new` differs from the closest signature already cached, for `jax_log_compiles`."""
    if not cached:
        return "first call"
    closest = min((_differences(old, new) for old in cached), key=len)
    return "; ".join(closest) or "a signature not cached (the function closes over a tracer)"


class JittedFunction:
    """A function staged per abstract signature, with the staged programs cached.

    A call that hits the cache does only what it must, in this order (chapter 01 times
    each step): flatten the arguments and build the signature (`signature`), look it up
    (`_cache`), and run the compiled program on the leaves (`lowering.CompiledProgram`:
    hand them to XLA, execute, read the outputs back as NumPy), then rebuild the output
    tree. Tracing, lowering and compiling happen only on a miss (`_stage`).
    """

    def __init__(self, fun: Callable, static_argnums: Sequence[int], static_argnames: Sequence[str],
                 interpret: bool = False):
        self.fun = fun
        self.interpret = interpret
        self.static_argnums = tuple(static_argnums)
        self.static_argnames = tuple(static_argnames)
        self._cache: dict[_Signature, Traced] = {}
        functools.update_wrapper(self, fun)

    def _static_positions(self, args: tuple) -> set[int]:
        return {n % len(args) for n in self.static_argnums if -len(args) <= n < len(args)}

    def signature(self, args: tuple, kwargs: dict) -> tuple[_Signature, list[Any]]:
        """The cache key of a call, and the dynamic arguments' leaves (what the program takes)."""
        if not self.static_argnums and not self.static_argnames:  # the common case, no statics
            leaves, in_tree = tree_util.tree_flatten((args, kwargs))
            return _Signature(in_tree, tuple([leaf_type(x) for x in leaves]), ()), leaves
        static_positions = self._static_positions(args)
        statics = [(f"args[{i}]", args[i]) for i in sorted(static_positions)]
        statics += [(name, kwargs[name]) for name in self.static_argnames if name in kwargs]
        for name, value in statics:
            try:
                hash(value)
            except TypeError as error:
                raise ValueError(
                    f"Non-hashable static arguments are not supported: {name} of {self.__name__} is "
                    f"a {type(value).__name__} ({error}). Pass a tuple instead of a list, or make "
                    "the argument dynamic (an array).") from None
        dynamic_args = tuple(a for i, a in enumerate(args) if i not in static_positions)
        dynamic_kwargs = {k: v for k, v in kwargs.items() if k not in self.static_argnames}
        leaves, in_tree = tree_util.tree_flatten((dynamic_args, dynamic_kwargs))
        return _Signature(in_tree, tuple([leaf_type(x) for x in leaves]), tuple(statics)), leaves

    def _stage(self, signature: _Signature, args: tuple, kwargs: dict) -> Traced:
        static_positions = self._static_positions(args)

        def with_statics(*dynamic_args, **dynamic_kwargs):
            it = iter(dynamic_args)
            full = [args[i] if i in static_positions else next(it) for i in range(len(args))]
            return self.fun(*full, **dynamic_kwargs, **{k: kwargs[k] for k in self.static_argnames
                                                         if k in kwargs})

        out_trees: list = []
        flat_fun = flatten_fun(with_statics, signature.in_tree, out_trees)
        closed = trace_to_jaxpr(flat_fun, signature.avals, context=f"the function {self.__name__}",
                                transform="jit")
        closed = dce_jaxpr(closed)
        # Constants that are tracers of an outer transformation become extra inputs.
        is_tracer = [isinstance(c, Tracer) for c in closed.consts]
        jaxpr = closed.jaxpr
        moved = [v for v, t in zip(jaxpr.constvars, is_tracer, strict=True) if t]
        kept = [v for v, t in zip(jaxpr.constvars, is_tracer, strict=True) if not t]
        tracer_consts = tuple(c for c, t in zip(closed.consts, is_tracer, strict=True) if t)
        closed = ClosedJaxpr(Jaxpr(kept, moved + jaxpr.invars, jaxpr.eqns, jaxpr.outvars),
                             [c for c, t in zip(closed.consts, is_tracer, strict=True) if not t])
        return Traced(closed, out_trees[0], tracer_consts)

    def trace(self, *args: Any, **kwargs: Any) -> Traced:
        """Stage for these arguments without running; `.jaxpr` is the program `jit` would run."""
        return self._stage(self.signature(args, kwargs)[0], args, kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        signature, leaves = self.signature(args, kwargs)
        traced = self._cache.get(signature)
        if traced is None:
            if config.jax_log_compiles:
                logger.warning("Compiling %s for %s: %s.", self.__name__, signature.describe(),
                               _why_new(list(self._cache), signature))
            traced = self._stage(signature, args, kwargs)
            if not traced.tracer_consts:
                self._cache[signature] = traced
        if not self.interpret and _outside_every_transformation(leaves):
            # What bind would reach anyway (EvalTrace, then _jit_impl), minus its per-call
            # Python: JAX has such a fast path too, in C++.
            outs = _compiled_program(traced.jaxpr, self.__name__)(*leaves)
        else:
            # `interpret` appears in the equation only when set, so jaxprs print as JAX's do.
            params = {"interpret": True} if self.interpret else {}
            outs = jit_p.bind(*traced.tracer_consts, *leaves, name=self.__name__, jaxpr=traced.jaxpr,
                              **params)
        return traced.out_tree.unflatten(outs)

    def _cache_size(self) -> int:
        """How many staged programs are cached: one per abstract signature seen (as in JAX)."""
        return len(self._cache)

    def clear_cache(self) -> None:
        self._cache.clear()


def jit(
    fun: Callable,
    static_argnums: int | Sequence[int] | None = None,
    static_argnames: str | Sequence[str] | None = None,
    *,
    interpret: bool = False,
) -> JittedFunction:
    """Stage `fun` to a jaxpr once per abstract signature, cache it, and run the cached program.

    Args:
      fun: a function of arrays (or pytrees of arrays).
      static_argnums: positions of arguments that are Python values, not arrays: they are
        part of the cache key (by value, so they must be hashable) and `fun` sees them
        as they are, so Python `if`s on them work.
      static_argnames: the same for keyword arguments.
      interpret: run the staged jaxpr with NumPy, one call per equation (`run_jaxpr`),
        instead of lowering it to StableHLO and compiling it with XLA (the default).

    Returns:
      A callable with `fun`'s signature; `_cache_size()` counts the programs staged so far.
    """
    nums = () if static_argnums is None else (
        (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums))
    names = () if static_argnames is None else (
        (static_argnames,) if isinstance(static_argnames, str) else tuple(static_argnames))
    return JittedFunction(fun, nums, names, interpret)
