"""`State`: a module's Variables as a nested mapping, which is also a pytree.

Mirrors `flax.nnx.State` and `nnx.to_pure_dict` / `nnx.replace_by_pure_dict`
(flax/nnx/statelib.py, flax 0.12.8).

`split(model)` returns the model's Variables arranged by attribute path:

    State({'hidden': {'bias': Param(...), 'kernel': Param(...)}, 'out': {...}})

Because `State` and every Variable type are pytree nodes, `jax.tree.map`, `jax.grad`,
`jax.jit` and an optimizer's `init`/`update` all see a tree of plain arrays whose paths
are the attribute paths, e.g. `['hidden']['kernel'].value`.

A State is a mutable mapping, as in flax: `state.b.d = nnx.Param(5)` adds a nested
entry, `del state['b']['c']` removes one (nested States are live views, not copies).

Differences from flax.nnx: no `FlatState` class (`flat_state()` returns a list of
pairs), no `statelib.diff`, no `map_state`, `merge_state` or `split_state` functions
(`State.merge` and `State.split`/`filter` methods do the same). Iteration is in sorted key order (the
order of the flattened pytree); flax iterates in insertion order.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

import jax

from stacklib.nn.filters import Filter, to_predicate

PathParts = tuple[Any, ...]


def _sort_key(key: Any) -> tuple:
    # Integer keys (list indices) sort numerically and before string keys.
    return (isinstance(key, str), key)


def path_str(path: PathParts) -> str:
    """'hidden/kernel' for ('hidden', 'kernel'): how paths appear in messages."""
    return "/".join(str(part) for part in path) or "<root>"


class State(MutableMapping):
    """A nested mapping from attribute names to Variables (or nested States)."""

    _mapping: dict[Any, Any]

    def __init__(self, mapping: Mapping | None = None):
        object.__setattr__(self, "_mapping", {})
        for key, value in (mapping or {}).items():
            self[key] = value

    # -- MutableMapping ------------------------------------------------------------------
    def __getitem__(self, key: Any) -> Any:
        return self._mapping[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        self._mapping[key] = State(value) if isinstance(value, Mapping) else value

    def __delitem__(self, key: Any) -> None:
        del self._mapping[key]

    def __setattr__(self, name: str, value: Any) -> None:
        self[name] = value  # `state.b.d = Param(5)`, as in flax

    def __iter__(self) -> Iterator[Any]:
        return iter(sorted(self._mapping, key=_sort_key))

    def __len__(self) -> int:
        return len(self._mapping)

    def __getattr__(self, name: str) -> Any:
        mapping = self.__dict__.get("_mapping", {})
        if name in mapping:
            return mapping[name]
        raise AttributeError(f"State has no key {name!r}; its keys are {sorted(mapping, key=_sort_key)}")

    # -- flat views ----------------------------------------------------------------------
    def flat_state(self) -> list[tuple[PathParts, Any]]:
        """(path, Variable) pairs, depth first, keys in sorted order."""
        pairs = []
        for key in self:
            value = self._mapping[key]
            if isinstance(value, State):
                pairs += [((key, *path), leaf) for path, leaf in value.flat_state()]
            else:
                pairs.append(((key,), value))
        return pairs

    @classmethod
    def from_flat_path(cls, pairs: list[tuple[PathParts, Any]] | Mapping) -> State:
        """Build a nested State from (path, Variable) pairs."""
        root: dict = {}
        for path, value in dict(pairs).items():
            node = root
            for key in path[:-1]:
                node = node.setdefault(key, {})
            node[path[-1]] = value
        return cls(root)

    def filter(self, *filters: Filter) -> State | tuple[State, ...]:
        """The sub-State(s) selected by each filter, in order (a tuple for several)."""
        states = self.split(*filters, exhaustive=False)
        return states[0] if len(filters) == 1 else states

    def split(self, *filters: Filter, exhaustive: bool = True) -> tuple[State, ...]:
        """Partition into one State per filter; each Variable goes to the first that matches.

        Raises:
          ValueError: `exhaustive` and some Variable matches no filter (the message names it).
        """
        predicates = [to_predicate(f) for f in filters]
        groups: list[list] = [[] for _ in filters]
        for path, value in self.flat_state():
            for group, predicate in zip(groups, predicates, strict=True):
                if predicate(path, value):
                    group.append((path, value))
                    break
            else:
                if exhaustive:
                    raise ValueError(
                        f"The filters {filters} select no group for {path_str(path)} "
                        f"({type(value).__name__}). Add `...` as the last filter to collect the rest."
                    )
        return tuple(State.from_flat_path(group) for group in groups)

    @staticmethod
    def merge(*states: State) -> State:
        """One State with the Variables of all of `states` (later ones win on a clash)."""
        pairs: dict = {}
        for state in states:
            pairs.update(state.flat_state())
        return State.from_flat_path(pairs)

    def __repr__(self) -> str:
        return "State(" + _repr_nested(self, "") + ")"


def _repr_nested(state: State, indent: str) -> str:
    inner = indent + "  "
    lines = []
    for key in state:
        value = state[key]
        text = _repr_nested(value, inner) if isinstance(value, State) else repr(value)
        lines.append(f"{inner}{key!r}: {text},")
    return "{\n" + "\n".join(lines) + f"\n{indent}}}" if lines else "{}"


def _flatten_with_keys(state: State):
    keys = list(state)
    return [(jax.tree_util.DictKey(key), state._mapping[key]) for key in keys], tuple(keys)


def _unflatten(keys: tuple, children) -> State:
    state = object.__new__(State)
    object.__setattr__(state, "_mapping", dict(zip(keys, children, strict=True)))
    return state


jax.tree_util.register_pytree_with_keys(State, _flatten_with_keys, _unflatten)


def to_flat_state(state: State) -> list[tuple[PathParts, Any]]:
    """(path, Variable) pairs of `state`, depth first: `nnx.to_flat_state` in flax."""
    return state.flat_state()


def to_pure_dict(state: State) -> dict:
    """Nested plain dicts of arrays (Variables unwrapped): the form checkpoints store."""
    return {
        key: to_pure_dict(value) if isinstance(value, State) else value.get_value()
        for key, value in state.items()
    }


def replace_by_pure_dict(state: State, pure_dict: Mapping) -> None:
    """Write the arrays of `pure_dict` (as from `to_pure_dict`) into `state`'s Variables, in place.

    Raises:
      KeyError: `pure_dict` has a path that `state` lacks (the message names it).
    """
    current = dict(state.flat_state())
    for path, value in State.from_flat_path(_flatten_pure(pure_dict)).flat_state():
        if path not in current:
            raise KeyError(f"{path_str(path)} is in the dict but not in the state.")
        current[path].set_value(value)


def _flatten_pure(tree: Mapping, prefix: PathParts = ()) -> list[tuple[PathParts, Any]]:
    pairs = []
    for key, value in tree.items():
        if isinstance(value, Mapping):
            pairs += _flatten_pure(value, (*prefix, key))
        else:
            pairs.append(((*prefix, key), value))
    return pairs
