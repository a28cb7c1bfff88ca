"""Pytrees: nested tuples, lists and dicts with arrays at the leaves.

Mirrors a subset of `jax.tree_util`: `tree_flatten`, `tree_unflatten`, `tree_leaves`,
`tree_structure`, `tree_map`, and the `PyTreeDef` that remembers a tree's shape. Every
transformation in this package flattens its inputs to a list of leaves, works on the
list, and unflattens the results, so users can pass parameters as dicts and get
gradients back as dicts of the same shape.

Differences from jax.tree_util:
  * only tuple, list, dict, named tuples and None are containers; there is no
    `register_pytree_node` for custom classes;
  * no key paths (`tree_flatten_with_path`) and no `is_leaf` argument.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(x, "_fields")


class PyTreeDef:
    """The structure of a pytree with its leaves taken out.

    `node_type` is the container type (None for a leaf, `type(None)` for an empty
    subtree), `node_data` what is needed to rebuild it (a dict's sorted keys, a named
    tuple's class), and `children` the structures below. Two trees with equal
    `PyTreeDef`s differ only in their leaves; `jit` uses this as part of its cache key.

    Why not a dataclass: `jit` hashes and compares a fresh `PyTreeDef` on every call.
    `_key` holds the same information as nested tuples, which Python hashes and compares
    in C; a dataclass would compare field by field in Python, node by node.
    """

    __slots__ = ("node_type", "node_data", "children", "num_leaves", "_key")

    def __init__(self, node_type: type | None, node_data: Hashable, children: tuple[PyTreeDef, ...]):
        self.node_type = node_type
        self.node_data = node_data
        self.children = children
        self.num_leaves: int = 1 if node_type is None else sum([child.num_leaves for child in children])
        self._key = (node_type, node_data, tuple([child._key for child in children]))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PyTreeDef) and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)

    def unflatten(self, leaves: list[Any]) -> Any:
        return tree_unflatten(self, leaves)

    def __str__(self) -> str:
        if self.node_type is None:
            return "*"
        if self.node_type is type(None):
            return "None"
        inner = ", ".join(str(child) for child in self.children)
        if self.node_type is dict:
            inner = ", ".join(f"{key!r}: {child}" for key, child in zip(self.node_data, self.children,
                                                                         strict=True))
            return "{" + inner + "}"
        if self.node_type is list:
            return f"[{inner}]"
        if self.node_type is tuple:
            return f"({inner}{',' if len(self.children) == 1 else ''})"
        return f"{self.node_type.__name__}({inner})"

    def __repr__(self) -> str:
        return f"PyTreeDef({self})"


LEAF = PyTreeDef(None, None, ())
_NONE = PyTreeDef(type(None), None, ())


def _flatten_into(tree: Any, leaves: list[Any]) -> PyTreeDef:
    kind = type(tree)
    if kind is tuple or kind is list:  # the common case first: `jit` flattens on every call
        return PyTreeDef(kind, None, tuple([_flatten_into(child, leaves) for child in tree]))
    if tree is None:
        return _NONE
    if isinstance(tree, dict):
        # Sorted keys, as JAX does, so {"b":, "a":} and {"a":, "b":} flatten alike.
        keys = tuple(sorted(tree))
        return PyTreeDef(dict, keys, tuple([_flatten_into(tree[key], leaves) for key in keys]))
    if _is_namedtuple(tree):
        return PyTreeDef(kind, kind, tuple([_flatten_into(child, leaves) for child in tree]))
    if isinstance(tree, tuple | list):
        return PyTreeDef(kind, None, tuple([_flatten_into(child, leaves) for child in tree]))
    leaves.append(tree)
    return LEAF


def tree_flatten(tree: Any) -> tuple[list[Any], PyTreeDef]:
    """Return the leaves of `tree` (depth first, dict keys sorted) and its structure."""
    leaves: list[Any] = []
    treedef = _flatten_into(tree, leaves)
    return leaves, treedef


def _build(treedef: PyTreeDef, leaves_iter) -> Any:
    if treedef.node_type is None:
        return next(leaves_iter)
    if treedef.node_type is type(None):
        return None
    children = [_build(child, leaves_iter) for child in treedef.children]
    if treedef.node_type is dict:
        return dict(zip(treedef.node_data, children, strict=True))
    if treedef.node_type in (tuple, list):
        return treedef.node_type(children)
    return treedef.node_type(*children)  # a named tuple


def tree_unflatten(treedef: PyTreeDef, leaves: list[Any]) -> Any:
    """Rebuild a tree of structure `treedef` from a list of leaves.

    Raises:
      ValueError: the number of leaves does not match the structure.
    """
    leaves = list(leaves)
    if len(leaves) != treedef.num_leaves:
        raise ValueError(
            f"tree_unflatten: the structure {treedef} has {treedef.num_leaves} leaves, "
            f"but {len(leaves)} were given."
        )
    return _build(treedef, iter(leaves))


def tree_leaves(tree: Any) -> list[Any]:
    """The leaves of `tree`, in `tree_flatten` order."""
    return tree_flatten(tree)[0]


def tree_structure(tree: Any) -> PyTreeDef:
    """The structure of `tree` without its leaves."""
    return tree_flatten(tree)[1]


def tree_map(f: Callable[..., Any], tree: Any, *rest: Any) -> Any:
    """Apply `f` to matching leaves of `tree` and `rest`, keeping the structure of `tree`.

    Raises:
      ValueError: a tree in `rest` has a different structure; the message shows both.
    """
    leaves, treedef = tree_flatten(tree)
    all_leaves = [leaves]
    for other in rest:
        other_leaves, other_def = tree_flatten(other)
        if other_def != treedef:
            raise ValueError(f"tree_map: tree structures differ: {treedef} and {other_def}.")
        all_leaves.append(other_leaves)
    return tree_unflatten(treedef, [f(*xs) for xs in zip(*all_leaves, strict=True)])


def broadcast_prefix(prefix: Any, tree: Any, *, what: str = "prefix") -> list[Any]:
    """Expand a prefix tree to one entry per leaf of `tree`.

    `vmap(f, in_axes=(0, None))` gives one axis per argument, though each argument may
    be a whole tree: a leaf of the prefix (an int or None) applies to every leaf of the
    subtree at the same place. This returns that per-leaf list.

    Raises:
      ValueError: `prefix` is not a prefix of `tree`; the message names `what` and both
        structures.
    """
    out: list[Any] = []

    def expand(p: Any, t: Any) -> None:
        if p is None or not isinstance(p, tuple | list | dict):
            out.extend([p] * len(tree_leaves(t)))
            return
        p_def, t_def = tree_structure(p), tree_structure(t)
        same_node = type(p) is type(t) and (
            not isinstance(p, dict) or sorted(p) == sorted(t)
        ) and len(p) == len(t)
        if not same_node:
            raise ValueError(
                f"{what} {p_def} is not a prefix of the argument structure {t_def}: "
                "give one entry per element of the container, or a single int/None for all."
            )
        children_p = [p[k] for k in sorted(p)] if isinstance(p, dict) else list(p)
        children_t = [t[k] for k in sorted(t)] if isinstance(t, dict) else list(t)
        for child_p, child_t in zip(children_p, children_t, strict=True):
            expand(child_p, child_t)

    expand(prefix, tree)
    return out
