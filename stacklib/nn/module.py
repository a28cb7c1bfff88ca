"""Modules: ordinary Python objects whose attributes hold Variables and other modules.

Mirrors `flax.nnx.Module` and `nnx.iter_graph` (flax/nnx/module.py, pytreelib.py and
graphlib.py, flax 0.12.8).

You write a module the way you write any class: build the weights in `__init__`, use
them in `__call__`. There is no separate "init" pass and no parameter dictionary to
thread around; `Linear(3, 4, rngs=rngs)` is a layer with its weights already in it.

What makes this work with JAX's pure functions is that a module's attributes can be
read as a *graph*: each attribute is either a Variable (state), another graph node (a
submodule, an `Rngs`), a list/tuple/dict of those, or a static Python value (a size, a
dtype, a function). `graph.split` walks that graph to pull the state out as pytrees;
`graph.merge` builds the object back. This file defines the node types and the walk.

A module is also a JAX pytree, as in flax 0.12: its children are the attributes that
hold state, its static attributes are the tree's auxiliary data. So `jax.tree.leaves(model)`
lists its arrays and `jax.jit(lambda m, x: m(x))(model, x)` works. What JAX hands the
function is a rebuilt copy, though: a mutation inside (a dropout counter that advances)
stays inside. `split`/`merge`/`update` (graph.py) carry it out, and they handle a graph
that shares a submodule, which a pytree cannot express.

Differences from flax.nnx:
- Lists, tuples and dicts of submodules are traversed automatically; flax 0.12 asks
  for `nnx.List` / `nnx.data` (both exist here as plain aliases, so that code runs).
  So our `List` is a plain list, and `iter_graph` yields no `_length` entry for it.
  `Dict` is a graph node as in flax (attribute access, identity kept by merge), but a
  module like the others: an array stored in it directly is refused (see below), and
  `iter_graph` yields no `_pytree__*` entries for it.
- A jax or NumPy array stored directly on a module (not in a Variable) is an error
  here, with the fix in the message; flax 0.12 keeps it as an anonymous state leaf.
- Whether an attribute is pytree data or static is decided each time the module is
  flattened (data = holds a Variable or a graph node), not recorded when it is first
  assigned; there are no `nnx.static` / `nnx.data` annotations and no `_pytree__state`
  or `_pytree__nodes` attributes (which flax's `iter_graph` also yields).
- No `sow`, `perturb`, `view` or `capture`; `set_attributes` has no `filters` argument;
  `iter_graph` has no `graph=False` (tree mode).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, MutableMapping
from typing import Any

import jax
import numpy as np

from stacklib.nn.variables import Variable

PathParts = tuple[Any, ...]


class Object:
    """A graph node: an object whose attributes `split` and `merge` traverse.

    `Module`, `Rngs` and `RngStream` are Objects. Every subclass is registered as a JAX
    pytree (see the module docstring); `class M(nnx.Module, pytree=False)` opts out, as
    in flax.
    """

    def __init_subclass__(cls, *, pytree: bool = True, **kwargs: Any):
        super().__init_subclass__(**kwargs)
        if pytree:
            jax.tree_util.register_pytree_with_keys(
                cls, _flatten_with_keys, functools.partial(_unflatten, cls)
            )


def is_graph_node(value: Any) -> bool:
    return isinstance(value, Object)


def is_array(value: Any) -> bool:
    return isinstance(value, jax.Array | np.ndarray) and not isinstance(value, np.generic)


def holds_state(value: Any) -> bool:
    """True if `value` is, or is a list/tuple/dict containing, a Variable or graph node."""
    if isinstance(value, Variable | Object):
        return True
    if isinstance(value, list | tuple):
        return any(holds_state(item) for item in value)
    if isinstance(value, dict):
        return any(holds_state(item) for item in value.values())
    return False


def check_attribute(owner: str, path: str, value: Any) -> None:
    """Reject values that would silently fall out of the state, with the fix.

    `owner` names the module (e.g. "MLP") and `path` the attribute, e.g. "hidden/kernel".
    """
    if is_array(value):
        raise TypeError(
            f"{owner} attribute {path!r} holds an array of shape "
            f"{np.shape(value)} outside a Variable, so split() would treat it as a constant "
            f"and training would never update it. Wrap it: `self.{path.split('/')[-1]} = "
            "nnx.Param(array)` to train it, or `nnx.Variable(array)` to keep it as state."
        )


def graph_attributes(node: Object) -> list[tuple[str, Any]]:
    """The (name, value) pairs of a node, sorted by name (the order state trees use)."""
    return sorted(vars(node).items())


def container_items(container: list | tuple | dict) -> list[tuple[Any, Any]]:
    """(key, item) pairs of a container: indices for sequences, keys (sorted) for dicts."""
    if isinstance(container, dict):
        return sorted(container.items(), key=lambda kv: (isinstance(kv[0], str), kv[0]))
    return list(enumerate(container))


def _is_visited_once(value: Any) -> bool:
    # What flax's iter_graph visits once, by identity: graph nodes, Variables, and JAX's
    # built-in pytree containers (list, tuple, dict and None, an empty pytree; there is
    # only one None, so only the first None attribute is yielded, as in flax).
    return isinstance(value, Object | Variable | list | tuple | dict) or value is None


def _iter_graph(value: Any, path: PathParts, seen: set[int]) -> Iterator[tuple[PathParts, Any]]:
    if _is_visited_once(value):
        if id(value) in seen:
            return
        seen.add(id(value))
    if isinstance(value, Object):
        for name, child in graph_attributes(value):
            yield from _iter_graph(child, (*path, name), seen)
    elif isinstance(value, list | tuple | dict):
        for key, item in container_items(value):
            yield from _iter_graph(item, (*path, key), seen)
    yield path, value  # after its children: the root comes last


def iter_graph(node: Any) -> Iterator[tuple[PathParts, Any]]:
    """Every value in `node`'s graph with its path: nodes, Variables and static attributes.

    Depth first, attributes in sorted order, each node *after* its children, so the root
    comes last with path `()`. A node, Variable or container reached twice (shared) is
    yielded once, at its first path; plain values (ints, strings, functions) every time.

        for path, value in nnx.iter_graph(model):
            if isinstance(value, nnx.Param): ...

    Works on any value: a module, a Variable, a list or dict of them, or a leaf.
    """
    yield from _iter_graph(node, (), set())


class _StaticItem:
    """A static value inside a container that holds state (`relu` in `[Linear, relu]`).

    A pytree node with no children: the value rides in the tree's structure, as a
    static attribute of flax's `nnx.List` does, instead of becoming a leaf.
    """

    def __init__(self, value: Any):
        self.value = value


jax.tree_util.register_pytree_node(
    _StaticItem, lambda item: ((), item.value), lambda value, _: _StaticItem(value)
)


def _rebuild(container: list | tuple | dict, items: list) -> list | tuple | dict:
    if isinstance(container, dict):
        return type(container)(items)
    values = [item for _, item in items]
    if hasattr(container, "_fields"):  # a NamedTuple takes its fields positionally
        return type(container)(*values)
    return type(container)(values)


def _wrap_static_items(value: Any) -> Any:
    if isinstance(value, list | tuple | dict):
        return _rebuild(value, [(key, _wrap_static_items(item)) for key, item in container_items(value)])
    return value if holds_state(value) else _StaticItem(value)


def _unwrap_static_items(value: Any) -> Any:
    if isinstance(value, _StaticItem):
        return value.value
    if isinstance(value, list | tuple | dict):
        return _rebuild(value, [(key, _unwrap_static_items(item)) for key, item in container_items(value)])
    return value


def _flatten_with_keys(node: Object):
    children, data_names, static = [], [], []
    for name, value in graph_attributes(node):
        if holds_state(value):  # Variables, submodules, containers of them: pytree children
            children.append((jax.tree_util.GetAttrKey(name), _wrap_static_items(value)))
            data_names.append(name)
        else:  # sizes, flags, functions: part of the tree's structure, so jit treats them as static
            static.append((name, value))
    return children, (tuple(data_names), tuple(static))


def _unflatten(cls: type, aux: tuple, children) -> Object:
    data_names, static = aux
    node = object.__new__(cls)  # no __init__: the attributes are restored as they were
    for name, value in zip(data_names, children, strict=True):
        object.__setattr__(node, name, _unwrap_static_items(value))
    for name, value in static:
        object.__setattr__(node, name, value)
    return node


class Module(Object):
    """Base class for layers and models.

    Subclass it, create Variables and submodules in `__init__`, compute in `__call__`:

        class MLP(nnx.Module):
            def __init__(self, din, dhidden, dout, *, rngs):
                self.hidden = nnx.Linear(din, dhidden, rngs=rngs)
                self.out = nnx.Linear(dhidden, dout, rngs=rngs)

            def __call__(self, x):
                return self.out(nnx.relu(self.hidden(x)))

    Reference: the Flax NNX guide, "Modules" (flax.readthedocs.io).
    """

    def __setattr__(self, name: str, value: Any) -> None:
        check_attribute(type(self).__name__, name, value)
        super().__setattr__(name, value)

    def iter_modules(self) -> Iterator[tuple[PathParts, Module]]:
        """Every module in this one's graph, in `iter_graph`'s order (itself last, path `()`)."""
        for path, node in iter_graph(self):
            if isinstance(node, Module):
                yield path, node

    def iter_children(self) -> Iterator[tuple[str, Module]]:
        """The modules held directly in this module's attributes."""
        for name, value in graph_attributes(self):
            if isinstance(value, Module):
                yield name, value

    def set_attributes(self, *, raise_if_not_found: bool = True, **attributes: Any) -> None:
        """Set attributes on every submodule that has them (e.g. `deterministic=True`).

        Raises:
          ValueError: `raise_if_not_found` and no module in the graph has one of them.
        """
        remaining = set(attributes)
        for _, module in self.iter_modules():
            for name, value in attributes.items():
                if hasattr(module, name):
                    setattr(module, name, value)
                    remaining.discard(name)
        if remaining and raise_if_not_found:
            raise ValueError(
                f"No module in {type(self).__name__}'s graph has the attribute(s) {sorted(remaining)}."
            )

    def train(self, **attributes: Any) -> None:
        """Training mode: dropout on (`deterministic=False`), batch statistics updated."""
        self.set_attributes(
            deterministic=False, use_running_average=False, **attributes, raise_if_not_found=False
        )

    def eval(self, **attributes: Any) -> None:
        """Evaluation mode: dropout off (`deterministic=True`), running statistics used."""
        self.set_attributes(
            deterministic=True, use_running_average=True, **attributes, raise_if_not_found=False
        )

    def __repr__(self) -> str:
        return _repr(self, indent="", seen=set())


def _repr(value: Any, indent: str, seen: set[int]) -> str:
    if not isinstance(value, Object):
        if isinstance(value, Variable):
            return repr(value)
        if isinstance(value, list | tuple | dict) and holds_state(value):
            inner = indent + "  "
            items = "".join(
                f"\n{inner}{key!r}: {_repr(item, inner, seen)}," for key, item in container_items(value)
            )
            return f"{type(value).__name__}({items}\n{indent})"
        return repr(value) if not callable(value) else getattr(value, "__name__", repr(value))
    if id(value) in seen:
        return f"{type(value).__name__}(...)  # shared, shown above"
    seen.add(id(value))
    inner = indent + "  "
    fields = "".join(
        f"\n{inner}{name}={_repr(child, inner, seen)}," for name, child in graph_attributes(value)
    )
    return f"{type(value).__name__}({fields}\n{indent})"


List = list  # flax 0.12's nnx.List marks a list as data; here every list of modules is.


class Dict(Module, MutableMapping):
    """A dict whose entries are attributes, `d['a']` is `d.a`: flax's `nnx.Dict`.

    Being a module, it is a graph node: two references to one Dict stay one through
    `split`/`merge`, its entries keep their attribute access after `clone`, `merge` or
    `jax.jit`, and `update` can add an entry. A plain dict in a module is traversed too
    (see the module docstring), but it is a container, not a node: no attribute access,
    and a shared one comes back as two copies. Keys are attribute names, so strings.

        layers = nnx.Dict(encoder=nnx.Linear(2, 3, rngs=rngs))
        layers.decoder = nnx.Linear(3, 2, rngs=rngs)     # the same as layers['decoder'] = ...
    """

    def __init__(self, *args: Any, **kwargs: Any):
        for key, value in dict(*args, **kwargs).items():
            setattr(self, key, value)

    def __getitem__(self, key: str) -> Any:
        try:
            return vars(self)[key]
        except KeyError:
            raise KeyError(key) from None

    def __setitem__(self, key: str, value: Any) -> None:
        setattr(self, key, value)

    def __delitem__(self, key: str) -> None:
        if key not in vars(self):
            raise KeyError(key)
        delattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(vars(self))  # insertion order, as a dict (and flax's Dict)

    def __len__(self) -> int:
        return len(vars(self))

    # Equal when the entries are (Mapping's ==), hashed by identity like any graph node: as flax's.
    __hash__ = object.__hash__


def data(value: Any) -> Any:
    """Mark a value as data (flax 0.12's `nnx.data`); here containers are detected anyway."""
    return value
