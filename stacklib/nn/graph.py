"""`split`, `merge`, `state`, `update`: between stateful modules and pure pytrees.

Mirrors `flax.nnx.split`, `merge`, `state`, `update`, `graphdef` and `clone`
(flax/nnx/graphlib.py, flax 0.12.8).

JAX transformations want pure functions of arrays; NNX modules are Python objects that
mutate. The bridge is to take a module apart into

* a `GraphDef`: everything static, i.e. the classes, the attribute names, the sizes,
  and which attribute holds which Variable; hashable, so `jax.jit` can use it as part
  of its cache key and compile once;
* one or more `State`s: the Variables, arranged by attribute path; pytrees of arrays.

`merge(graphdef, *states)` puts a module back together from the two. Inside a jitted
function you `merge`, call the module as usual (it may mutate, e.g. advance a dropout
counter), `split` again and return the new state. Outside, `update(model, new_state)`
writes it back. That is the whole trick, and flax's `nnx.jit`/`nnx.grad` are this
pattern wrapped in a decorator.

A module graph may share a submodule or a Variable between two attributes (e.g. tied
embeddings). `split` records the second occurrence as a reference to the first, the
state holds the Variable once, and `merge` rebuilds the sharing.

Like flax, the functions take more than modules: a list, tuple or dict of modules
(`split({'encoder': enc, 'decoder': dec})`, paths start with the key), a Variable, or a
bare leaf. Outside any module, a container's arrays are state like Variables and its
other values are static; a Variable or leaf passed as the whole graph is its own state
(`split(param)` returns `(graphdef, param)`).

Differences from flax.nnx:
- The GraphDef is a tree of small frozen dataclasses (`NodeDef`, `VariableDef`,
  `LeafDef`, `ContainerDef`, `NodeRef`, `Static`), not flax's flat node list; it is
  printable and hashable, but not interchangeable with flax's.
- `update` adds a new path as flax does, but a bare array added to a module is refused
  (as on any module, see module.py). `state(variable)` returns the Variable and
  `update(variable, state)` sets its value, where flax 0.12.8 raises IndexError.
- No graph-update context (`update_context`), no `pop`, `map`, `flatten`/`unflatten`,
  or tree mode (`graph=False`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax

from stacklib.nn.filters import Filter, to_predicate
from stacklib.nn.module import (
    Object,
    check_attribute,
    container_items,
    graph_attributes,
    holds_state,
    is_array,
)
from stacklib.nn.state import PathParts, State, path_str
from stacklib.nn.variables import Variable

_MISSING = object()


@dataclasses.dataclass(frozen=True)
class Static:
    """A static attribute value. Compared by value when hashable, else by identity."""

    value: Any

    def _key(self) -> tuple:
        try:
            hash(self.value)
        except TypeError:
            return ("id", id(self.value))
        return ("value", type(self.value), self.value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Static) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())


@dataclasses.dataclass(frozen=True)
class VariableDef:
    """A Variable's place in the graph; its value is in the State, at the same path."""

    type: type
    index: int


@dataclasses.dataclass(frozen=True)
class LeafDef:
    """A value kept in the State as it is: an array in a container that no module holds,
    or a whole graph that is a leaf (`split(3)`)."""


@dataclasses.dataclass(frozen=True)
class NodeRef:
    """A second reference to the node or Variable numbered `index` (sharing)."""

    index: int


@dataclasses.dataclass(frozen=True)
class ContainerDef:
    """A list, tuple or dict that holds Variables or nodes."""

    type: type
    items: tuple[tuple[Any, Any], ...]


@dataclasses.dataclass(frozen=True)
class NodeDef:
    """A graph node (a Module, Rngs, ...): its class and its attributes' definitions."""

    type: type
    index: int
    attributes: tuple[tuple[str, Any], ...]


@dataclasses.dataclass(frozen=True)
class GraphDef:
    """The static half of a split module. A pytree with no leaves, so `jit` treats it as static."""

    root: Any  # a NodeDef for a module, else a ContainerDef, VariableDef or LeafDef

    def __repr__(self) -> str:
        return f"GraphDef({_describe(self.root, '')})"


def _describe(definition: Any, indent: str) -> str:
    inner = indent + "  "
    if isinstance(definition, NodeDef):
        fields = "".join(f"\n{inner}{name}={_describe(d, inner)}," for name, d in definition.attributes)
        return f"{definition.type.__name__}({fields}\n{indent})"
    if isinstance(definition, ContainerDef):
        items = "".join(f"\n{inner}{key!r}: {_describe(d, inner)}," for key, d in definition.items)
        return f"{definition.type.__name__}({items}\n{indent})"
    if isinstance(definition, VariableDef):
        return f"<{definition.type.__name__}>"
    if isinstance(definition, NodeRef):
        return f"<shared #{definition.index}>"
    if isinstance(definition, LeafDef):
        return "<leaf>"
    value = definition.value
    return getattr(value, "__name__", None) or repr(value)


jax.tree_util.register_pytree_node(GraphDef, lambda g: ((), g), lambda g, _: g)


class _Flattener:
    """One walk over a graph: builds the GraphDef and lists each Variable once, by path."""

    def __init__(self, root_name: str):
        self.root_name = root_name  # names the model in error messages
        self.indices: dict[int, int] = {}  # id(node or Variable) -> index in the GraphDef
        self.variables: list[tuple[PathParts, Any]] = []  # (path, Variable or leaf)

    def definition(self, value: Any, path: PathParts, in_module: bool = False) -> Any:
        if isinstance(value, Variable | Object):
            if id(value) in self.indices:
                return NodeRef(self.indices[id(value)])
            index = self.indices[id(value)] = len(self.indices)
            if isinstance(value, Variable):
                self.variables.append((path, value))
                return VariableDef(type(value), index)
            attributes = tuple(
                (name, self.definition(child, (*path, name), in_module=True))
                for name, child in graph_attributes(value)
            )
            return NodeDef(type(value), index, attributes)
        # In a module, only containers that hold state are walked (a tuple of sizes is one
        # static value); outside modules every container is, as in flax.
        if isinstance(value, list | tuple | dict) and (holds_state(value) or not in_module):
            items = tuple(
                (key, self.definition(item, (*path, key), in_module))
                for key, item in container_items(value)
            )
            return ContainerDef(type(value), items)
        if in_module:
            check_attribute(self.root_name, path_str(path), value)  # a bare array: the fix
        elif is_array(value):
            self.variables.append((path, value))
            return LeafDef()
        return Static(value)


def _flatten(node: Any) -> tuple[GraphDef, list[tuple[PathParts, Any]]]:
    if not isinstance(node, Variable | Object | list | tuple | dict):  # split(3), split(array)
        return GraphDef(LeafDef()), [((), node)]
    flattener = _Flattener(type(node).__name__)
    root = flattener.definition(node, ())
    return GraphDef(root), flattener.variables


def _partition(pairs: list[tuple[PathParts, Any]], filters: tuple[Filter, ...], exhaustive: bool):
    if pairs and pairs[0][0] == ():
        # The graph is a single Variable or leaf: like flax, it is its own state, in the
        # slot of the first filter it matches; the other slots get empty States.
        [(path, value)] = pairs
        filters = filters or (...,)
        states: list[Any] = [State({}) for _ in filters]
        for i, predicate in enumerate(to_predicate(f) for f in filters):
            if predicate(path, value):
                states[i] = value
                break
        else:
            if exhaustive:
                raise ValueError(
                    f"The filters {filters} select no group for the {type(value).__name__} "
                    "being split. Add `...` as the last filter to collect the rest."
                )
        return tuple(states)
    if not filters:
        return (State.from_flat_path(pairs),)
    return State.from_flat_path(pairs).split(*filters, exhaustive=exhaustive)


def split(node: Any, *filters: Filter) -> tuple[Any, ...]:
    """Take a module apart into `(graphdef, state)` or `(graphdef, state_1, ..., state_n)`.

    With filters, each Variable goes to the State of the first filter it matches:
    `graphdef, params, rest = split(model, nnx.Param, ...)`. `node` may also be a list,
    tuple or dict of modules, a Variable or a leaf (see the module docstring).

    Raises:
      ValueError: some Variable matches none of the filters (end them with `...`).
      TypeError: a module attribute holds a bare array.
    """
    graphdef, pairs = _flatten(node)
    return (graphdef, *_partition(pairs, filters, exhaustive=True))


def graphdef(node: Any) -> GraphDef:
    """The GraphDef of `node` (what `split` returns first)."""
    return _flatten(node)[0]


def state(node: Any, *filters: Filter) -> Any:
    """The Variables of `node` as a State; with several filters, a tuple of States.

    Unlike `split`, Variables matched by no filter are simply left out.
    """
    states = _partition(_flatten(node)[1], filters, exhaustive=False)
    return states[0] if len(states) == 1 else states


def _flat_values(given: Any) -> list[tuple[PathParts, Any]]:
    """(path, value) pairs of one state argument: a State, a plain nested dict, or the
    Variable or leaf that `split` returned for a graph that is a single Variable or leaf."""
    if isinstance(given, State):
        return given.flat_state()
    if isinstance(given, Mapping):
        return State(given).flat_state()
    return [((), given)]


def _check_graphdef(definition: Any) -> GraphDef:
    if not isinstance(definition, GraphDef):
        raise TypeError(
            f"merge expects the GraphDef that split returned first, got {type(definition).__name__}. "
            "Call it as nnx.merge(graphdef, state) or nnx.merge(graphdef, params, rest)."
        )
    return definition


def merge(graphdef: GraphDef, state: Any = _MISSING, /, *states: Any, copy: bool = False) -> Any:
    """Build a module from a GraphDef and the State(s) that `split` gave with it.

    The module holds the Variables of `states` themselves, like flax, unless `copy=True`,
    which gives it new Variables. Inside `jax.grad` or `jax.jit`, merge a state that came
    from outside the transformation with `copy=True`: flax refuses to mutate a Variable
    that belongs to an outer trace (TraceContextError), and here such a mutation would
    leak a tracer into the outer object.

    Raises:
      TypeError: no state was given (as in flax), or `graphdef` is not a GraphDef.
      ValueError: a Variable the GraphDef needs is in none of the states, or a state has
        a path the GraphDef does not know; the message names the path.
    """
    root = _check_graphdef(graphdef).root
    if state is _MISSING:
        raise TypeError(
            "merge() missing 1 required positional argument: 'state'. Pass the State(s) that "
            "split returned with the GraphDef: nnx.merge(graphdef, state)."
        )
    variables: dict[PathParts, Any] = {}
    for given in (state, *states):
        variables.update(_flat_values(given))
    built: dict[int, Any] = {}
    used: set[PathParts] = set()

    def build(definition: Any, path: PathParts) -> Any:
        if isinstance(definition, NodeRef):
            return built[definition.index]
        if isinstance(definition, VariableDef):
            if path not in variables:
                raise ValueError(
                    f"merge: no value for {path_str(path)} ({definition.type.__name__}). Pass every "
                    "State that split returned, e.g. nnx.merge(graphdef, params, rest)."
                )
            used.add(path)
            variable = variables[path].copy() if copy else variables[path]
            built[definition.index] = variable
            return variable
        if isinstance(definition, LeafDef):
            if path not in variables:
                raise ValueError(f"merge: no value for {path_str(path)}. Pass every State split returned.")
            used.add(path)
            return variables[path]
        if isinstance(definition, NodeDef):
            node = object.__new__(definition.type)
            built[definition.index] = node
            for name, child in definition.attributes:
                object.__setattr__(node, name, build(child, (*path, name)))
            return node
        if isinstance(definition, ContainerDef):
            items = [(key, build(item, (*path, key))) for key, item in definition.items]
            if issubclass(definition.type, dict):
                return definition.type(items)
            values = [item for _, item in items]
            if hasattr(definition.type, "_fields"):  # a NamedTuple takes its fields positionally
                return definition.type(*values)
            return definition.type(values)
        return definition.value

    node = build(root, ())
    unknown = [path_str(path) for path in variables if path not in used]
    if unknown:
        raise ValueError(
            f"merge: the states hold {unknown[:5]}, which this GraphDef has no place for. "
            "Was the state split from a different model?"
        )
    return node


def update(node: Any, *states: Any) -> None:
    """Write the values of `states` into the matching Variables of `node`, in place.

    An array outside any module (in a dict or list given as `node`) is replaced in its
    container, as in flax. A path the graph does not have yet is added where its parent
    exists (a module or `nnx.Dict` gets a new attribute, a dict a new key), holding a copy
    of the given Variable, as in flax.

    Raises:
      ValueError: a state has a path whose parent `node` does not have (the message names it).
      TypeError: `node` is a leaf, which cannot change in place.
    """
    _, pairs = _flatten(node)
    if pairs and pairs[0][0] == () and not isinstance(node, Variable):
        raise TypeError(
            f"update cannot change a {type(node).__name__} in place: only Variables and "
            "containers can be updated. Use the value from the state instead."
        )
    current = dict(pairs)
    for given in states:
        for path, value in _flat_values(given):
            if path not in current:
                _add_entry(node, path, value)
                continue
            new_value = value.get_raw_value() if isinstance(value, Variable) else value
            if isinstance(current[path], Variable):
                current[path].set_raw_value(new_value)
            else:  # an array in a list or dict: replace it there
                _parent(node, path)[path[-1]] = new_value


def _parent(node: Any, path: PathParts) -> Any:
    """The node or container that holds `path`'s last part (None when a step is missing)."""
    for key in path[:-1]:
        if isinstance(node, Object):  # a Dict too: its entries are its attributes
            node = vars(node).get(key)
        elif isinstance(node, list | tuple | dict):
            try:
                node = node[key]
            except (KeyError, IndexError, TypeError):
                return None
        else:
            return None
    return node


def _add_entry(node: Any, path: PathParts, value: Any) -> None:
    parent, key = _parent(node, path), path[-1]
    value = value.copy() if isinstance(value, Variable) else value
    if isinstance(parent, Object) and isinstance(key, str):
        setattr(parent, key, value)  # a module refuses a bare array here, with the fix
    elif isinstance(parent, dict):
        parent[key] = value
    else:
        raise ValueError(
            f"update: {type(node).__name__} has nothing at {path_str(path[:-1])} to add "
            f"{path_str(path)} to. Was the state taken from a different model?"
        )


def clone(node: Any) -> Any:
    """A deep copy of a module (or of a container of them): same structure and values,
    new Variables."""
    definition, pairs = _flatten(node)
    copies = [(path, v.copy() if isinstance(v, Variable) else v) for path, v in pairs]
    if copies and copies[0][0] == ():  # a Variable or a leaf
        return copies[0][1]
    return merge(definition, State.from_flat_path(copies))
