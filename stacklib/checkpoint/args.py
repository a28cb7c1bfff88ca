"""What to save and how to restore it: `StandardSave`, `JsonSave`, `Composite` and their restores.

Mirrors `orbax.checkpoint.args` (`ocp.args.StandardSave`, `StandardRestore`, `JsonSave`,
`JsonRestore`, `Composite`). An args object names both the value and the format it is
written in, so one `save` call can write several items in different formats:

    manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave({"params": params, "opt_state": opt_state}),
        data=ocp.args.JsonSave(data_iterator.get_state()),
        config=ocp.args.JsonSave({"learning_rate": 1e-3}),
    ))

* `StandardSave(pytree)`: a pytree of arrays and scalars, one file per leaf.
* `JsonSave(value)`: anything `json.dumps` accepts: metadata, a data iterator's state.
* `Composite(**items)`: several named items in one checkpoint step; restoring returns
  a `Composite` of the restored items (`restored.state`, `restored["data"]`).

Differences from orbax: no `PyTreeSave`, `ArrayRestore` or handler registry; the
standard format is ours (one raw file per leaf with a checksum), not TensorStore/OCDBT.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any


class CheckpointArgs:
    """Base class of every save/restore argument."""


@dataclasses.dataclass(frozen=True)
class StandardSave(CheckpointArgs):
    """Save `item`, a pytree of arrays (jax or NumPy) and Python scalars."""

    item: Any


@dataclasses.dataclass(frozen=True)
class StandardRestore(CheckpointArgs):
    """Restore a pytree saved with `StandardSave`.

    Args:
      item: the target: a pytree of the same structure whose leaves are arrays or
        `jax.ShapeDtypeStruct`s. Each restored leaf takes the target leaf's dtype (a cast,
        as in orbax) and, for jax leaves, its sharding. None restores the saved
        structure as plain dicts and lists, with the saved dtypes, on the default device.
    """

    item: Any = None


@dataclasses.dataclass(frozen=True)
class JsonSave(CheckpointArgs):
    """Save `item` as JSON (it must be `json.dumps`-able)."""

    item: Any


@dataclasses.dataclass(frozen=True)
class JsonRestore(CheckpointArgs):
    """Restore an item saved with `JsonSave` (`item` is accepted for orbax compatibility, unused)."""

    item: Any = None


class Composite(CheckpointArgs, Mapping):
    """Several named items: `Composite(state=StandardSave(...), data=JsonSave(...))`.

    Also the type `restore` returns for composite checkpoints, with attribute and key access.
    """

    def __init__(self, **items: Any):
        for name in items:
            if not name.isidentifier() or name.startswith("_"):
                raise ValueError(
                    f"Composite item names must be identifiers not starting with '_', got {name!r}."
                )
        object.__setattr__(self, "_items", dict(items))

    def __getitem__(self, name: str) -> Any:
        return self._items[name]

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # e.g. `_items` itself, looked up before __init__ ran (copy, pickle)
            raise AttributeError(name)
        try:
            return self._items[name]
        except KeyError:
            known = sorted(self._items)
            raise AttributeError(f"this Composite has no item {name!r}; it has {known}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"Composite({', '.join(f'{k}={v!r}' for k, v in self._items.items())})"


def as_items(args: CheckpointArgs | Mapping[str, CheckpointArgs]) -> dict[str, CheckpointArgs]:
    """{item name: args}; a single, non-composite args object is the item "default", as in orbax."""
    if isinstance(args, Composite):
        return dict(args.items())
    if isinstance(args, CheckpointArgs):
        return {"default": args}
    raise TypeError(
        f"expected checkpoint args such as args.StandardSave(tree) or args.Composite(...), got "
        f"{type(args).__name__}. Wrap a pytree as args=StandardSave(tree)."
    )
