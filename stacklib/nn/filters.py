"""Filters: which Variables a call to `split`, `state` or `update` selects.

Mirrors `flax.nnx.filterlib` (flax 0.12.8). A filter is turned into a predicate
`(path, variable) -> bool` by `to_predicate`:

    a Variable type   Param            isinstance(variable, Param)
    Ellipsis          ...              everything (written last: "and the rest")
    True / False                       everything / nothing
    a string          "dropout"        variables whose `tag` metadata equals it
    a tuple           (Param, BatchStat)   any of them
    a callable        lambda path, v: ...  itself
    Not(f), All(f, g), Any(f, g), PathContains("attention"), OfType(Param)

Differences from flax.nnx: no `WithTag` class (a plain string does it), no `Everything`
/`Nothing` classes (use `...` and `False`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any as AnyType

Filter = AnyType
Predicate = Callable[[tuple, AnyType], bool]


class OfType:
    """Select variables that are instances of `type_`."""

    def __init__(self, type_: type):
        self.type = type_

    def __call__(self, path: tuple, value: AnyType) -> bool:
        return isinstance(value, self.type)

    def __repr__(self) -> str:
        return f"OfType({self.type.__name__})"


class PathContains:
    """Select variables whose path contains `key` (e.g. a submodule's attribute name)."""

    def __init__(self, key: AnyType):
        self.key = key

    def __call__(self, path: tuple, value: AnyType) -> bool:
        return self.key in path

    def __repr__(self) -> str:
        return f"PathContains({self.key!r})"


class Not:
    """Select what `filter` does not."""

    def __init__(self, filter: Filter):  # noqa: A002 - flax's argument name
        self.predicate = to_predicate(filter)

    def __call__(self, path: tuple, value: AnyType) -> bool:
        return not self.predicate(path, value)


class Any:
    """Select what any of `filters` selects."""

    def __init__(self, *filters: Filter):
        self.predicates = [to_predicate(f) for f in filters]

    def __call__(self, path: tuple, value: AnyType) -> bool:
        return any(p(path, value) for p in self.predicates)


class All:
    """Select what all of `filters` select."""

    def __init__(self, *filters: Filter):
        self.predicates = [to_predicate(f) for f in filters]

    def __call__(self, path: tuple, value: AnyType) -> bool:
        return all(p(path, value) for p in self.predicates)


def to_predicate(filter: Filter) -> Predicate:  # noqa: A002 - flax's argument name
    """Turn any of the filter forms in this module's docstring into a predicate.

    Raises:
      TypeError: `filter` is none of them.
    """
    if filter is Ellipsis or filter is True:
        return lambda path, value: True
    if filter is False or filter is None:
        return lambda path, value: False
    if isinstance(filter, type):
        return OfType(filter)
    if isinstance(filter, str):
        return lambda path, value: getattr(value, "metadata", {}).get("tag") == filter
    if isinstance(filter, tuple | list):
        return Any(*filter)
    if callable(filter):
        return filter
    raise TypeError(
        f"{filter!r} is not a filter. Use a Variable type (nnx.Param), ..., a tag string, "
        "a tuple of filters, or a function (path, variable) -> bool."
    )
