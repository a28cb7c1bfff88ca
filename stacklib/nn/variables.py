"""Variables: typed boxes that hold a module's arrays.

Mirrors `flax.nnx.Variable`, `nnx.Param` and `nnx.BatchStat` (flax/nnx/variablelib.py,
flax 0.12.8).

A module keeps each array it owns inside a `Variable`. The box does two jobs:

* its *type* says what the array is for: `Param` is trained, `BatchStat` is updated by
  the forward pass, `RngKey`/`RngCount` (in rngs.py) are random state. The types double
  as filters: `split(model, Param, ...)` separates what the optimizer should see from
  the rest;
* its *identity* is the slot that a module mutates in place (`v[...] = new`), which is
  what lets NNX modules look like ordinary stateful Python objects.

Each Variable type is a pytree node with one child, the array (path `.value`), and its
metadata as static data, so a `State` of Variables flattens to plain arrays for
`jax.jit` and `jax.grad`, and comes back as Variables of the same types.

An initializer can hand metadata to the Variable that will hold its array: wrapped by
`with_metadata(init, name=value)`, it returns a `VariableMetadata` (array plus metadata),
which the Variable unpacks. `with_partitioning` (spmd.py) uses this to attach logical
axis names for sharding as `out_sharding` metadata.

Differences from flax.nnx:
- `.value` is a plain property here; flax 0.12 deprecates it in favour of `v[...]`
  (arrays) and `v.get_value()`/`v.set_value()`, which work on both and are what the
  chapters use.
- No arithmetic on Variables (`v + 1`); write `v[...] + 1`. No hooks (`with_metadata`
  takes metadata only), `Ref`/hijax modes, `set_metadata`, or the required metadata
  (`hijax`, `ref`, `eager_sharding`) that flax adds to every Variable, so our
  `get_metadata()` is flax's `get_metadata(exclude_required=True)`.
- Sharding metadata is recorded, never applied: there is no eager sharding, a Variable
  holds its array where it was created. Placing a model on a mesh is a separate step
  (`stacklib.parallel.shard_state`, chapter 07).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax

_MISSING = object()


def _flatten_with_keys(variable):
    return ((jax.tree_util.GetAttrKey("value"), variable._value),), tuple(sorted(variable._metadata.items()))


def _unflatten(cls, metadata, children):
    variable = object.__new__(cls)
    variable._value = children[0]
    variable._metadata = dict(metadata)
    return variable


def _register_pytree(cls: type) -> None:
    jax.tree_util.register_pytree_with_keys(
        cls,
        _flatten_with_keys,
        lambda metadata, children: _unflatten(cls, metadata, children),
    )


class Variable:
    """A mutable box around one value (usually a `jax.Array`), plus metadata.

    Read it with `v[...]` (or `v.value`, `v.get_value()`), write it with `v[...] = x`
    (or `v.value = x`, `v.set_value(x)`). Metadata given as keyword arguments is readable
    as attributes: `RngKey(key, tag="dropout").tag`.

    Subclass it to make a new kind of state; the subclass is registered as a pytree
    node and can be used as a filter.
    """

    def __init__(self, value: Any, **metadata: Any):
        if isinstance(value, VariableMetadata):
            # As in flax, what the initializer attached wins over the keyword arguments.
            metadata = {**metadata, **value.metadata}
            value = value.raw_value
        self._value = value
        self._metadata = dict(metadata)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        _register_pytree(cls)

    # -- reading and writing -------------------------------------------------------------
    # `[...]` and `.value` go through `get_value`/`set_value`, so a subclass that overrides
    # them (to transform what is read or written) is honoured, as in flax; `split`, `merge`,
    # `update` and the pytree see the raw value (`get_raw_value`), as flax's do.
    @property
    def value(self) -> Any:
        return self.get_value()

    @value.setter
    def value(self, new_value: Any) -> None:
        self.set_value(new_value)

    def get_value(self, **kwargs: Any) -> Any:
        return self._value

    def set_value(self, new_value: Any, **kwargs: Any) -> None:
        self._value = new_value

    def get_raw_value(self) -> Any:
        """The stored value, bypassing a subclass's `get_value`."""
        return self._value

    def set_raw_value(self, new_value: Any) -> None:
        """Store `new_value` as it is, bypassing a subclass's `set_value`."""
        self._value = new_value

    def __getitem__(self, index: Any) -> Any:
        value = self.get_value()
        return value if index is Ellipsis else value[index]

    def __setitem__(self, index: Any, new_value: Any) -> None:
        # Arrays are immutable: `v[i] = x` builds a new array with `.at[i].set(x)`.
        self.set_value(new_value if index is Ellipsis else self.get_value().at[index].set(new_value))

    def replace(self, value: Any) -> Variable:
        """A new Variable of the same type and metadata holding `value`."""
        return type(self)(value, **self._metadata)

    def copy(self) -> Variable:
        """A new box with the same value and metadata (the array itself is not copied)."""
        return self.replace(self._value)

    # -- metadata and array-like properties ---------------------------------------------
    @property
    def metadata(self) -> dict[str, Any]:
        return dict(self._metadata)

    def get_metadata(self, name: str | None = None, default: Any = _MISSING) -> Any:
        """All metadata as a new dict, or the entry `name` (`default` if it is absent).

        Raises:
          KeyError: `name` is not in the metadata and no `default` was given.
        """
        if name is None:
            return dict(self._metadata)
        if name not in self._metadata and default is not _MISSING:
            return default
        return self._metadata[name]

    def __getattr__(self, name: str) -> Any:
        metadata = self.__dict__.get("_metadata", {})
        if name in metadata:
            return metadata[name]
        raise AttributeError(f"{type(self).__name__} has no attribute or metadata {name!r}")

    @property
    def shape(self) -> tuple[int, ...]:
        return self._value.shape

    @property
    def dtype(self) -> Any:
        return self._value.dtype

    @property
    def size(self) -> int:
        return self._value.size

    @property
    def ndim(self) -> int:
        return self._value.ndim

    def __repr__(self) -> str:
        value = self._value
        if hasattr(value, "shape") and hasattr(value, "dtype"):
            value = f"Array(shape={tuple(value.shape)}, dtype={value.dtype})"
        extras = "".join(f", {key}={val!r}" for key, val in sorted(self._metadata.items()))
        return f"{type(self).__name__}(value={value}{extras})"


_register_pytree(Variable)


class Param(Variable):
    """A trainable parameter: what `split(model, Param, ...)` hands to the optimizer."""


class BatchStat(Variable):
    """A statistic the forward pass updates (e.g. BatchNorm's running mean); not trained."""


@dataclasses.dataclass
class VariableMetadata:
    """An initializer's array with metadata for the Variable that will hold it.

    `Variable(VariableMetadata(array, metadata={...}))` holds `array` and has the metadata.
    Layers that reshape an initializer's output (e.g. `LinearGeneral`) reshape `raw_value`.
    """

    raw_value: Any
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def with_metadata(initializer: Callable, **metadata: Any) -> Callable:
    """Wrap `initializer` so that the Variable built from its output carries `metadata`.

    Example: `Linear(3, 4, kernel_init=with_metadata(lecun_normal(), role="kernel"),
    rngs=rngs).kernel.role == "kernel"`.

    Returns:
      A function with the initializer's arguments that returns a `VariableMetadata`.
    """

    @functools.wraps(initializer)
    def wrapper(*args):
        return VariableMetadata(initializer(*args), metadata=metadata)

    return wrapper
