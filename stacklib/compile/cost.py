"""FLOPs, transcendentals and bytes of a JAX program, counted from its jaxpr.

`cost_analysis(fn, *args)` walks the jaxpr of `fn` and applies one rule per primitive,
the same rules XLA's `HloCostAnalysis` applies to HLO instructions:

* a matmul (`dot_general`) costs 2 FLOPs per multiply-add: 2 · |output| · |contracted dims|;
* an elementwise arithmetic op costs 1 FLOP per output element (a compare, a select and
  a type conversion count too);
* `exp`, `log`, `tanh`, `sqrt`, ... cost 1 *transcendental* per element and no FLOPs;
* a reduction costs (|input| − |output|) FLOPs: combining k numbers takes k − 1 steps;
* moving data (reshape, transpose, broadcast, slice, gather, ...) costs no FLOPs.

Bytes are counted twice, because fusion decides which number is real:
`bytes accessed` assumes every primitive reads its operands from memory and writes its
results back (no fusion at all), and `bytes_min` counts only the program's arguments and
results (perfect fusion: every intermediate stays in registers or cache). What XLA's
compiled program moves lies between the two.

Mirrors `jax.jit(fn).lower(*args).cost_analysis()` (XLA's cost model on the unoptimized
program), and returns the same keys: `cost["flops"]`, `cost["transcendentals"]`,
`cost["bytes accessed"]`.

Differences from XLA's `HloCostAnalysis`:
  * A `scan` is counted `length` times; XLA counts a loop body once, since trip counts
    are not part of its cost model. A `while` loop, whose trip count only the running
    program knows, is counted once here too.
  * Cumulative reductions (`cumsum`, ...) cost n − 1 steps per row, what a sequential
    scan does; XLA counts the O(n²) `reduce_window` JAX lowers them to, and after
    optimization whatever the backend rewrote that into.
  * Special functions that JAX lowers to polynomials (`erf_inv`, `lgamma`, `asin`, ...)
    count as one transcendental; XLA counts the polynomial's FLOPs as well.
  * A convolution counts every kernel tap, also the ones that fall into the padding;
    XLA skips those, so for "SAME" padding ours is an upper bound.
  * Primitives without a rule (random bits, linear algebra, collectives) count zero and
    are listed in `Cost.uncounted`, instead of being silently dropped.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.extend import core as jex_core

# 1 FLOP per output element. Compares, selects and conversions count, as in XLA.
_ONE_FLOP = frozenset({
    "add", "add_any", "sub", "mul", "div", "rem", "max", "min", "neg", "abs", "sign",
    "floor", "ceil", "round", "nextafter", "select_n", "clamp", "square",
    "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not", "xor",
    "shift_left", "shift_right_arithmetic", "shift_right_logical", "population_count", "clz",
    "convert_element_type", "is_finite", "real", "imag", "conj", "complex",
    "reduce_precision", "mulhi",
})

# (FLOPs, transcendentals) per output element for the transcendental functions.
_TRANSCENDENTAL = {
    name: (0, 1) for name in (
        "exp", "log", "log1p", "expm1", "tanh", "sin", "cos", "tan", "atan2", "sqrt", "rsqrt",
        "cbrt", "pow", "erf",
        # NB: JAX lowers these to polynomials; XLA counts the polynomial's FLOPs too.
        "erfc", "erf_inv", "lgamma", "digamma", "igamma", "igammac", "asin", "acos", "atan",
        "sinh", "cosh", "asinh", "acosh", "atanh", "bessel_i0e", "bessel_i1e",
    )
}
_TRANSCENDENTAL["logistic"] = (3, 1)  # lowered as 1 / (1 + exp(-x)): neg, add, div + exp
_TRANSCENDENTAL["exp2"] = (1, 1)  # lowered as exp(x * ln 2)

# One combining step per input element beyond the first of each output.
_REDUCTIONS = frozenset({
    "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
    "reduce_xor",
})
# argmax/argmin reduce (value, index) pairs with a 9-instruction comparator that XLA
# counts in full (compare values, handle NaN, compare indices, two selects, ...).
_ARG_REDUCTION_FLOPS = 9
_CUMULATIVE = frozenset({"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"})
_SCATTER_COMBINING = frozenset({"scatter-add", "scatter-sub", "scatter-mul", "scatter-min",
                                "scatter-max"})
# Primitives whose jaxpr parameter is a combiner applied per element (not a function
# call): the walk must apply their rule rather than step into the combiner.
_HAS_COMBINER = _SCATTER_COMBINING | {"scatter", "reduce", "reduce_window", "select_and_scatter",
                                      "select_and_scatter_add"}

# No FLOPs, but the result is materialized (read the operand, write the result).
_DATA_MOVEMENT = frozenset({
    "broadcast_in_dim", "reshape", "squeeze", "transpose", "slice",
    "dynamic_slice", "dynamic_update_slice", "gather", "scatter", "concatenate", "pad", "rev",
    "iota", "copy", "tile", "split", "bitcast_convert_type", "device_put",
    "select_and_gather_add", "psum", "pmax", "pmin", "all_gather", "all_to_all",
    "reduce_scatter", "ppermute",
})
# Annotations that vanish when lowered: no FLOPs, no bytes.
_FREE = frozenset({"stop_gradient", "optimization_barrier", "sharding_constraint", "reshard",
                   "shard_alike", "layout_cast", "pvary", "axis_index", "name"})


@dataclasses.dataclass(frozen=True)
class Cost:
    """What a program costs: FLOPs, transcendentals and bytes, in total and by primitive.

    Attributes:
      flops: floating-point (and integer) operations, multiply-adds counted as 2.
      transcendentals: evaluations of exp, log, tanh, sqrt, ...
      bytes_accessed: bytes read and written if no two operations were fused.
      bytes_min: bytes of the arguments and results only: the traffic with perfect fusion.
      by_primitive: primitive name -> (flops, transcendentals, bytes_accessed), summed.
      uncounted: primitives that had no rule and were counted as zero.
    """

    flops: float = 0.0
    transcendentals: float = 0.0
    bytes_accessed: float = 0.0
    bytes_min: float = 0.0
    by_primitive: dict[str, tuple[float, float, float]] = dataclasses.field(default_factory=dict)
    uncounted: tuple[str, ...] = ()

    @property
    def arithmetic_intensity(self) -> float:
        """FLOPs per byte of unavoidable traffic (flops / bytes_min): the best case."""
        return self.flops / self.bytes_min if self.bytes_min else math.inf

    def as_dict(self) -> dict[str, float]:
        """The totals under the keys XLA's `cost_analysis()` uses."""
        return {"flops": self.flops, "transcendentals": self.transcendentals,
                "bytes accessed": self.bytes_accessed}

    def __getitem__(self, key: str) -> float:
        try:
            return self.as_dict()[key]
        except KeyError:
            raise KeyError(f"{key!r} is not a cost key; use one of {list(self.as_dict())} "
                           "(the keys of XLA's cost_analysis()).") from None


def _nbytes(aval: Any) -> int:
    """Bytes of one array value; tokens and other non-arrays hold none."""
    shape, dtype = getattr(aval, "shape", None), getattr(aval, "dtype", None)
    if shape is None or dtype is None:
        return 0
    # np.dtype() refuses JAX's extended dtypes (PRNG keys), which carry their own itemsize.
    itemsize = dtype.itemsize if hasattr(dtype, "itemsize") else np.dtype(dtype).itemsize
    return math.prod(shape) * itemsize


def _size(aval: Any) -> int:
    return math.prod(getattr(aval, "shape", ()))


def _integer_pow_flops(y: int) -> int:
    """Multiplies in JAX's lowering of x**y: square-and-multiply, plus 1 / x for y < 0."""
    if y == 0:
        return 0
    n = abs(y)
    multiplies = (n.bit_length() - 1) + (bin(n).count("1") - 1)
    return multiplies + (1 if y < 0 else 0)


def _dot_general_flops(eqn) -> int:
    (contracting, _), _ = eqn.params["dimension_numbers"]
    lhs_shape = eqn.invars[0].aval.shape
    contracted = math.prod(lhs_shape[d] for d in contracting)
    return 2 * _size(eqn.outvars[0].aval) * contracted


def _conv_flops(eqn) -> int:
    # 2 · |output| · (input features per group) · (kernel window), counting every tap.
    rhs_shape = eqn.invars[1].aval.shape
    rhs_spec = eqn.params["dimension_numbers"].rhs_spec  # (out feature, in feature, spatial...)
    in_features = rhs_shape[rhs_spec[1]]
    window = math.prod(rhs_shape[d] for d in rhs_spec[2:])
    return 2 * _size(eqn.outvars[0].aval) * in_features * window


def _sort_flops(eqn) -> int:
    # XLA's rule: n · ceil(log2 n) comparisons for n elements, whatever the sorted axis.
    n = _size(eqn.invars[0].aval)
    return n * math.ceil(math.log2(n)) if n > 1 else 0


def _reduce_window_flops(eqn) -> int:
    window = math.prod(eqn.params["window_dimensions"])
    return _size(eqn.outvars[0].aval) * (window - 1)


def _combiner_flops(eqn) -> int:
    """Equations in a reduction's combiner, e.g. 1 for `add`: the FLOPs of one step."""
    combiner = eqn.params["jaxpr"]
    return len(getattr(combiner, "jaxpr", combiner).eqns)


def _live_equations(jaxpr) -> list:
    """The equations whose results are used: XLA deletes dead code before counting.

    A backward pass from the outputs: an equation is live if one of its results is live
    (or it has side effects); then its operands are live too.
    """
    live = {v for v in jaxpr.outvars if isinstance(v, jex_core.Var)}
    kept = []
    for eqn in reversed(jaxpr.eqns):
        if eqn.effects or any(v in live for v in eqn.outvars if isinstance(v, jex_core.Var)):
            kept.append(eqn)
            live.update(v for v in eqn.invars if isinstance(v, jex_core.Var))
    return kept[::-1]


def _primitive_cost(eqn) -> tuple[float, float] | None:
    """(flops, transcendentals) of one equation without sub-jaxprs; None if no rule."""
    name = eqn.primitive.name
    out_elements = sum(_size(v.aval) for v in eqn.outvars)
    if name == "convert_element_type" and eqn.invars[0].aval.dtype == eqn.outvars[0].aval.dtype:
        return 0, 0  # only the weak type changes: XLA drops the no-op conversion
    if name in _ONE_FLOP:
        return out_elements, 0
    if name in _TRANSCENDENTAL:
        flops, transcendentals = _TRANSCENDENTAL[name]
        return flops * out_elements, transcendentals * out_elements
    if name == "integer_pow":
        return _integer_pow_flops(eqn.params["y"]) * out_elements, 0
    if name == "dot_general":
        return _dot_general_flops(eqn), 0
    if name == "conv_general_dilated":
        return _conv_flops(eqn), 0
    if name in _REDUCTIONS:
        return _size(eqn.invars[0].aval) - out_elements, 0
    if name in ("argmax", "argmin"):
        return _ARG_REDUCTION_FLOPS * (_size(eqn.invars[0].aval) - out_elements), 0
    if name in _CUMULATIVE:
        rows = out_elements // max(eqn.invars[0].aval.shape[eqn.params["axis"]], 1)
        steps = out_elements - rows
        return steps, (2 * out_elements if name == "cumlogsumexp" else 0)
    if name in ("reduce_window_sum", "reduce_window_max", "reduce_window_min"):
        return _reduce_window_flops(eqn), 0
    if name == "reduce":  # lax.reduce with a custom combiner: its equations, once per step
        steps = _size(eqn.invars[0].aval) - _size(eqn.outvars[0].aval)
        return steps * _combiner_flops(eqn), 0
    if name == "reduce_window":
        return _reduce_window_flops(eqn) * _combiner_flops(eqn), 0
    if name in _SCATTER_COMBINING:
        return _size(eqn.invars[2].aval), 0  # one combine per update element
    if name == "sort":
        return _sort_flops(eqn), 0
    if name in _DATA_MOVEMENT:
        return 0, 0
    return None


class _Counter:
    """Accumulates totals and the per-primitive table while walking nested jaxprs."""

    def __init__(self):
        self.flops = 0.0
        self.transcendentals = 0.0
        self.bytes_accessed = 0.0
        self.by_primitive: dict[str, list[float]] = {}
        self.uncounted: set[str] = set()

    def add(self, name: str, flops: float, transcendentals: float, nbytes: float, times: float):
        flops, transcendentals, nbytes = flops * times, transcendentals * times, nbytes * times
        self.flops += flops
        self.transcendentals += transcendentals
        self.bytes_accessed += nbytes
        row = self.by_primitive.setdefault(name, [0.0, 0.0, 0.0])
        row[0] += flops
        row[1] += transcendentals
        row[2] += nbytes

    def walk(self, jaxpr, times: float = 1.0) -> None:
        for eqn in _live_equations(jaxpr):
            name = eqn.primitive.name
            subs = [] if name in _HAS_COMBINER else [
                getattr(sub, "jaxpr", sub) for sub in jex_core.jaxprs_in_params(eqn.params)]
            if subs:
                self._walk_call(name, eqn, subs, times)
                continue
            if name in _FREE:
                continue
            cost = _primitive_cost(eqn)
            if cost is None:
                self.uncounted.add(name)
                cost = (0, 0)
            nbytes = sum(_nbytes(v.aval) for v in eqn.invars) + sum(_nbytes(v.aval) for v in eqn.outvars)
            self.add(name, cost[0], cost[1], nbytes, times)

    def _walk_call(self, name: str, eqn, subs: list, times: float) -> None:
        if name == "scan":
            self.walk(subs[0], times * eqn.params["length"])
        elif name == "cond":
            # Only one branch runs; like XLA, charge the most expensive one.
            costs = []
            for branch in subs:
                branch_counter = _Counter()
                branch_counter.walk(branch)
                costs.append(branch_counter)
            self._merge(max(costs, key=lambda c: (c.flops, c.transcendentals, c.bytes_accessed)), times)
        else:  # jit, custom_jvp_call, custom_vjp_call, remat, while (body and cond once), ...
            for sub in subs:
                self.walk(sub, times)

    def _merge(self, other: _Counter, times: float) -> None:
        for name, (flops, transcendentals, nbytes) in other.by_primitive.items():
            self.add(name, flops, transcendentals, nbytes, times)
        self.uncounted |= other.uncounted


def jaxpr_cost(closed_jaxpr) -> Cost:
    """The cost of a (closed) jaxpr, e.g. from `jax.make_jaxpr(fn)(*args)`.

    Returns:
      A `Cost`; `bytes_min` is the bytes of the jaxpr's inputs and outputs.
    """
    jaxpr = getattr(closed_jaxpr, "jaxpr", closed_jaxpr)
    counter = _Counter()
    counter.walk(jaxpr)
    # Constants captured by the closure are arguments of the compiled program too.
    boundary = [*jaxpr.invars, *jaxpr.constvars, *jaxpr.outvars]
    bytes_min = sum(_nbytes(v.aval) for v in boundary if hasattr(v, "aval"))
    return Cost(
        flops=counter.flops,
        transcendentals=counter.transcendentals,
        bytes_accessed=counter.bytes_accessed,
        bytes_min=float(bytes_min),
        by_primitive={name: tuple(row) for name, row in sorted(counter.by_primitive.items())},
        uncounted=tuple(sorted(counter.uncounted)),
    )


def cost_analysis(fn: Callable, *args, **kwargs) -> Cost:
    """Count the FLOPs, transcendentals and bytes of `fn(*args, **kwargs)` from its jaxpr.

    Tracing only: nothing is compiled or run, so it is cheap even for large models, and
    `args` may be `jax.ShapeDtypeStruct`s instead of arrays.

    Args:
      fn: a JAX-traceable function (jitted or not).
      *args, **kwargs: example arguments (arrays, or `jax.ShapeDtypeStruct`s).

    Returns:
      A `Cost`. `cost["flops"]` etc. read like `jax.jit(fn).lower(*args).cost_analysis()`.

    Raises:
      TypeError: `fn` is not callable.

    Reference: XLA's `HloCostAnalysis` (xla/service/hlo_cost_analysis.cc), whose rules
    these are.
    """
    if not callable(fn):
        raise TypeError(f"cost_analysis needs a function as its first argument, got {type(fn).__name__}.")
    return jaxpr_cost(jax.make_jaxpr(fn)(*args, **kwargs))
