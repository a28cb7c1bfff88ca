"""Automatic batching: `vmap`, with one batching rule per primitive.

Mirrors `jax.vmap(fun, in_axes=0, out_axes=0, axis_size=None)` and the rule table
`jax.interpreters.batching.primitive_batchers`. A `BatchTracer` holds a whole batch
of values, stored as one array with an extra axis at `batch_dim` (or `None` when the
value is the same for every example). Each primitive's rule takes the batched inputs
and their batch axes and returns the batched output and its batch axis, e.g. for
`reduce_sum(x, axes)` it shifts the reduced axes past the batch axis. The function
runs once, on whole batches: no Python loop over examples.

Differences from JAX:
  * no `spmd_axis_name`, `axis_name` or collectives (`psum` inside vmap);
  * batching rules often move the batch axis to the front (a `transpose` in the
    jaxpr) where JAX's rules avoid the move;
  * keyword arguments are mapped along axis 0, as in JAX, but cannot be given an axis.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from stacklib.transforms import core, errors, lax, tree_util
from stacklib.transforms.core import Primitive, ShapedArray, Trace, Tracer, get_aval
from stacklib.transforms.staging import function_name

BatchRule = Callable[..., tuple[Any, Any]]
primitive_batchers: dict[Primitive, BatchRule] = {}


@dataclasses.dataclass(frozen=True)
class _BatchInfo:
    axis_size: int
    context: str


def example_shape(x: Any, batch_dim: int | None) -> tuple[int, ...]:
    """The shape of one example of a batched value: its shape without the batch axis."""
    shape = get_aval(x).shape
    return shape if batch_dim is None else shape[:batch_dim] + shape[batch_dim + 1:]


class BatchTracer(Tracer):
    """A batch of values: `val` has the batch axis at `batch_dim` (None: not batched)."""

    __slots__ = ["val", "batch_dim"]

    def __init__(self, trace: Trace, val: Any, batch_dim: int | None):
        self._trace = trace
        self.val = val
        self.batch_dim = batch_dim

    @property
    def aval(self) -> ShapedArray:
        return ShapedArray(example_shape(self.val, self.batch_dim), get_aval(self.val).dtype)

    def full_lower(self) -> Any:
        return core.full_lower(self.val) if self.batch_dim is None else self

    def __repr__(self) -> str:
        return (f"BatchTracer(aval={self.aval.str_short()}, batched={get_aval(self.val).str_short()} "
                f"at axis {self.batch_dim})")


class BatchTrace(Trace):
    transform_name = "vmap"

    @property
    def axis_size(self) -> int:
        return self.main.global_data.axis_size

    def pure(self, value: Any) -> BatchTracer:
        return BatchTracer(self, value, None)

    lift = pure

    def process_primitive(self, primitive, tracers, params):
        rule = primitive_batchers.get(primitive)
        if rule is None:
            raise errors.MissingRuleError(
                f"Batching rule for '{primitive.name}' not implemented: add one with "
                f"stacklib.transforms.batching.primitive_batchers[{primitive.name}_p] = rule, where "
                "rule(batched_args, batch_dims, **params) returns (out, out_batch_dim)."
            )
        vals = [t.val for t in tracers]
        dims = [t.batch_dim for t in tracers]
        out, out_dim = rule(vals, dims, **params)
        if primitive.multiple_results:
            return [BatchTracer(self, o, d) for o, d in zip(out, out_dim, strict=True)]
        return [BatchTracer(self, out, out_dim)]


def vmap_flat(fun: Callable[..., Sequence[Any]], in_axes: Sequence[int | None], args: Sequence[Any],
              axis_size: int, context: str = "the function") -> tuple[list[Any], list[int | None]]:
    """Run a function of flat arrays on batches; return the outputs and their batch axes."""
    with core.new_main(BatchTrace, _BatchInfo(axis_size, context)) as main:
        trace = BatchTrace(main)
        tracers_in = [BatchTracer(trace, x, ax) if ax is not None else x
                      for x, ax in zip(args, in_axes, strict=True)]
        outs = fun(*tracers_in)
        tracers_out = [core.full_raise(trace, out) for out in outs]
        return [t.val for t in tracers_out], [t.batch_dim for t in tracers_out]


# --------------------------------------------------------------------------- vmap


def moveaxis(x: Any, source: int, destination: int) -> Any:
    """Move one axis, as a traced `transpose` (nothing happens if it is already there)."""
    ndim = get_aval(x).ndim
    source, destination = source % ndim, destination % ndim
    if source == destination:
        return x
    permutation = [d for d in range(ndim) if d != source]
    permutation.insert(destination, source)
    return lax.transpose(x, permutation)


def broadcast_batch(x: Any, size: int, axis: int) -> Any:
    """Give an unbatched value a batch axis of `size` at `axis` (every example the same)."""
    shape = get_aval(x).shape
    axis = axis % (len(shape) + 1)
    out_shape = shape[:axis] + (size,) + shape[axis:]
    return lax.broadcast_in_dim(x, out_shape, [d for d in range(len(out_shape)) if d != axis])


def _argument_names(fun: Callable, n_args: int) -> list[str]:
    try:
        names = [p.name for p in inspect.signature(fun).parameters.values()
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        names = []
    return [names[i] if i < len(names) else f"args[{i}]" for i in range(n_args)]


def _axis_size(fun, args, leaves, axes, leaf_owner) -> int:
    names = _argument_names(fun, len(args))
    sizes = []
    for leaf, axis, owner in zip(leaves, axes, leaf_owner, strict=True):
        if axis is None:
            continue
        aval = get_aval(leaf)
        where = "keyword argument" if owner is None else f"argument {names[owner]}"
        if not -aval.ndim <= axis < aval.ndim:
            raise ValueError(
                f"vmap was requested to map its {where} along axis {axis}, which implies that its "
                f"rank should be at least {max(axis + 1, -axis)}, but is only {aval.ndim} (its "
                f"shape is {aval.shape}).")
        sizes.append((aval.shape[axis], f"axis {axis} of {where} of type {aval.str_short()}"))
    if len({size for size, _ in sizes}) > 1:
        lines = "\n".join(f"  * one axis had size {size}: {what};" for size, what in sizes)
        raise ValueError(f"vmap got inconsistent sizes for array axes to be mapped:\n{lines}\n"
                         "Every mapped axis must have the same size (the batch size); use in_axes "
                         "to pick other axes, or None for arguments that are not batched.")
    return sizes[0][0]


def vmap(fun: Callable, in_axes: Any = 0, out_axes: Any = 0, axis_size: int | None = None) -> Callable:
    """Vectorize `fun` over an axis of its arguments, like `jax.vmap`.

    Args:
      fun: a function of arrays (or pytrees of arrays).
      in_axes: for each positional argument, the axis to map over, or None to pass the
        argument unbatched; an int or None applies to all. Entries may be pytrees that
        match the argument's structure (a prefix of it).
      out_axes: where the batch axis goes in each output (same forms as in_axes).
      axis_size: the batch size, needed only when no argument is mapped.

    Returns:
      The batched function. It calls `fun` once, on tracers that hold the whole batch.

    Raises:
      ValueError: mapped axes have different sizes (the message lists each one), an axis
        is out of range, or nothing is mapped and `axis_size` is missing.
    """

    def batched_fun(*args: Any, **kwargs: Any) -> Any:
        if isinstance(in_axes, tuple | list) and len(in_axes) != len(args):
            raise ValueError(f"vmap in_axes has {len(in_axes)} entries, but {function_name(fun)} was "
                             f"called with {len(args)} positional arguments; give one entry per argument.")
        per_arg = in_axes if isinstance(in_axes, tuple | list) else [in_axes] * len(args)
        leaves, in_tree = tree_util.tree_flatten((args, kwargs))
        axes, owners = [], []
        for i, (arg, axis) in enumerate(zip(args, per_arg, strict=True)):
            expanded = tree_util.broadcast_prefix(axis, arg, what=f"vmap in_axes entry {i}")
            axes += expanded
            owners += [i] * len(expanded)
        n_kwarg_leaves = len(leaves) - len(axes)
        axes += [0] * n_kwarg_leaves
        owners += [None] * n_kwarg_leaves
        if all(axis is None for axis in axes):
            if axis_size is None:
                raise ValueError("vmap must have at least one non-None value in in_axes or axis_size "
                                 "must be specified.")
            size = axis_size
        else:
            size = _axis_size(fun, args, leaves, axes, owners)
        axes = [None if a is None else a % get_aval(x).ndim for x, a in zip(leaves, axes, strict=True)]
        out_trees: list = []

        def flat_fun(*flat_args):
            call_args, call_kwargs = tree_util.tree_unflatten(in_tree, list(flat_args))
            out_leaves, out_tree = tree_util.tree_flatten(fun(*call_args, **call_kwargs))
            out_trees.append(out_tree)
            return out_leaves

        vals, dims = vmap_flat(flat_fun, axes, [_as_value(x) for x in leaves], size,
                               context=f"the function {function_name(fun)}")
        out_tree = out_trees[0]
        wanted = tree_util.broadcast_prefix(out_axes, tree_util.tree_unflatten(out_tree, vals),
                                            what="vmap out_axes")
        outs = [_move_to_out_axis(v, d, w, size) for v, d, w in zip(vals, dims, wanted, strict=True)]
        return tree_util.tree_unflatten(out_tree, outs)

    batched_fun.__name__ = f"vmap({function_name(fun)})"
    return batched_fun


def _as_value(x: Any) -> Any:
    return x if isinstance(x, Tracer) else np.asarray(x)


def _move_to_out_axis(val: Any, dim: int | None, out_axis: int | None, size: int) -> Any:
    if out_axis is None:
        if dim is not None:
            raise ValueError(f"at vmap out_axes, got axis spec None but output was batched on axis {dim}. "
                             "Use out_axes=None only for outputs that do not depend on a mapped input.")
        return val
    if dim is None:
        return broadcast_batch(val, size, out_axis)  # the same for every example
    return moveaxis(val, dim, out_axis)


# --------------------------------------------------------------------------- rules


def _batch_size(vals, dims) -> int:
    return next(get_aval(v).shape[d] for v, d in zip(vals, dims, strict=True) if d is not None)


def _to_front(x: Any, dim: int | None, size: int, shape: tuple[int, ...]) -> Any:
    """Batch axis first and per-example shape `shape`, materializing broadcasts if needed."""
    if dim is None:
        n = len(shape)
        return lax.broadcast_in_dim(x, (size, *shape), range(1 + n - get_aval(x).ndim, 1 + n))
    x = moveaxis(x, dim, 0)
    if get_aval(x).shape[1:] != shape:  # a batched scalar meeting arrays
        x = lax.broadcast_in_dim(x, (size, *shape), [0])
    return x


def _elementwise_batcher(primitive: Primitive) -> BatchRule:
    """Elementwise primitives: operands must agree, except that rank-0 ones broadcast."""
    def rule(vals, dims, **params):
        example_shapes = [example_shape(v, d) for v, d in zip(vals, dims, strict=True)]
        shape = max(example_shapes, key=len)
        first = next(d for d in dims if d is not None)
        aligned = all((d is None and not s) or (d == first and s == shape)
                      for d, s in zip(dims, example_shapes, strict=True))
        if aligned:
            return primitive.bind(*vals, **params), first
        size = _batch_size(vals, dims)
        moved = [v if d is None and not s else _to_front(v, d, size, shape)
                 for v, d, s in zip(vals, dims, example_shapes, strict=True)]
        return primitive.bind(*moved, **params), 0
    return rule


def _select_n_batcher(vals, dims):
    # The cases must end up with equal shapes; the predicate too, unless it is a shared scalar.
    shape = example_shape(vals[1], dims[1])
    size = _batch_size(vals, dims)
    predicate, *cases = vals
    if not (dims[0] is None and get_aval(predicate).ndim == 0):
        predicate = _to_front(predicate, dims[0], size, shape)
    cases = [_to_front(c, d, size, shape) for c, d in zip(cases, dims[1:], strict=True)]
    return lax.select_n(predicate, *cases), 0


def _reduce_batcher(primitive: Primitive) -> BatchRule:
    def rule(vals, dims, *, axes):
        (x,), (d,) = vals, dims
        # Example axis a is array axis a, or a + 1 once past the batch axis.
        out = primitive.bind(x, axes=tuple(a + (a >= d) for a in axes))
        return out, d - sum(1 for a in axes if a < d)
    return rule


def _broadcast_in_dim_batcher(vals, dims, *, shape, broadcast_dimensions):
    (x,), (d,) = vals, dims
    x = moveaxis(x, d, 0)
    size = get_aval(x).shape[0]
    return lax.broadcast_in_dim(x, (size, *shape), (0, *(b + 1 for b in broadcast_dimensions))), 0


def _reshape_batcher(vals, dims, *, new_sizes):
    (x,), (d,) = vals, dims
    x = moveaxis(x, d, 0)
    return lax.reshape(x, (get_aval(x).shape[0], *new_sizes)), 0


def _transpose_batcher(vals, dims, *, permutation):
    (x,), (d,) = vals, dims
    return lax.transpose(moveaxis(x, d, 0), (0, *(p + 1 for p in permutation))), 0


def _dot_general_batcher(vals, dims, *, dimension_numbers):
    (x, y), (xd, yd) = vals, dims
    (xc, yc), (xb, yb) = dimension_numbers
    shift = lambda axes: tuple(a + 1 for a in axes)  # noqa: E731
    if xd is not None and yd is not None:  # both batched: a new batch dimension of the product
        x, y = moveaxis(x, xd, 0), moveaxis(y, yd, 0)
        numbers = ((shift(xc), shift(yc)), ((0, *shift(xb)), (0, *shift(yb))))
        return lax.dot_general(x, y, numbers), 0
    if xd is not None:  # only x: its batch axis is one more free axis of x, the first one
        x = moveaxis(x, xd, 0)
        return lax.dot_general(x, y, ((shift(xc), yc), (shift(xb), yb))), len(xb)
    y = moveaxis(y, yd, 0)  # only y: the first free axis of y, after x's free axes
    n_x_free = get_aval(x).ndim - len(xc) - len(xb)
    return lax.dot_general(x, y, ((xc, shift(yc)), (xb, shift(yb)))), len(xb) + n_x_free


for _p in (lax.neg_p, lax.sin_p, lax.cos_p, lax.exp_p, lax.log_p, lax.tanh_p, lax.add_p, lax.sub_p,
           lax.mul_p, lax.div_p, lax.max_p, lax.min_p, lax.pow_p, lax.gt_p, lax.lt_p, lax.ge_p,
           lax.le_p, lax.eq_p, lax.ne_p, lax.integer_pow_p, lax.convert_element_type_p):
    primitive_batchers[_p] = _elementwise_batcher(_p)
primitive_batchers.update({
    lax.select_n_p: _select_n_batcher,
    lax.reduce_sum_p: _reduce_batcher(lax.reduce_sum_p),
    lax.reduce_max_p: _reduce_batcher(lax.reduce_max_p),
    lax.broadcast_in_dim_p: _broadcast_in_dim_batcher,
    lax.reshape_p: _reshape_batcher,
    lax.transpose_p: _transpose_batcher,
    lax.dot_general_p: _dot_general_batcher,
})
