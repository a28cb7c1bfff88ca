"""Shard a model's state: logical names on its arrays, rules to mesh axes, then placement.

Mirrors `flax.nnx.get_partition_spec(state)` and `flax.nnx.get_named_sharding(state,
mesh)`, followed by the usual `jax.device_put(state, shardings)`. A state is any
pytree whose leaves are arrays or Variables, of `stacklib.nn` or of `flax.nnx` (a
`State` from `nnx.split`, or the plain dict of `nnx.to_pure_dict`). Each leaf's
logical axis names come from, in order:

  1. the Variable's `out_sharding` metadata, which `nnx.with_partitioning(init, names)`
     sets when the model is built (both libraries store it under that name);
  2. the first `(pattern, names)` pair of `annotations` whose regular expression
     matches the leaf's '/'-joined path in full (e.g. `("fc1/kernel", ("features",
     "hidden"))`), for pytrees that carry no metadata;
  3. otherwise the leaf is replicated.

`rules` (see `stacklib.parallel.rules`) turn the names into a PartitionSpec.

Differences from Flax NNX:
  * `rules` is an argument, not the `nnx.logical_axis_rules` context, and names
    without a rule are replicated (NNX keeps them and fails at placement).
  * Path annotations for plain pytrees; NNX reads only Variable metadata.
  * `shard_state` checks that every spec divides its array and says which leaf does
    not, before moving data; `jax.device_put` reports the shape but not the leaf.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx as flax_nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import stacklib.nn as nnx
from stacklib.parallel.layout import normalize_spec
from stacklib.parallel.rules import LogicalRules, logical_to_mesh_axes

Annotations = Sequence[tuple[str, tuple[str | None, ...]]]

# Our Variables and flax's offer what this module needs under the same names:
# `get_metadata()`, `get_value()` and `replace(value)`. Flax's are accepted so that the
# chapter can check these functions against flax's own on a flax model.
_VARIABLE_TYPES = (nnx.Variable, flax_nnx.Variable)


def _is_variable(x: Any) -> bool:
    return isinstance(x, _VARIABLE_TYPES)


def path_name(path) -> str:
    """'fc1/kernel' for the key path of `state['fc1']['kernel']`."""
    return jax.tree_util.keystr(tuple(path), simple=True, separator="/")


def _logical_names(path: str, leaf: Any, annotations: Annotations) -> tuple | None:
    if _is_variable(leaf):
        names = leaf.get_metadata().get("out_sharding")
        if names:
            return tuple(names)
    for pattern, names in annotations:
        if re.fullmatch(pattern, path):
            return tuple(names)
    return None


def logical_axes(tree: Any, *, annotations: Annotations = ()) -> Any:
    """The logical names of every leaf, as a pytree of PartitionSpecs of names.

    Variables are replaced by their names (like `nnx.get_partition_spec` does), so the
    result has the structure of `tree`. A leaf with no names gets `PartitionSpec()`.
    """

    def names_of(path, leaf):
        names = _logical_names(path_name(path), leaf, annotations)
        spec = PartitionSpec() if names is None else PartitionSpec(*names)
        return leaf.replace(spec) if _is_variable(leaf) else spec

    return jax.tree_util.tree_map_with_path(names_of, tree, is_leaf=_is_variable)


def _shape(leaf: Any) -> tuple[int, ...]:
    value = leaf.get_value() if _is_variable(leaf) else leaf
    return tuple(value.shape) if hasattr(value, "shape") else tuple(np.shape(value))


def _spec_of(path: str, leaf: Any, rules: LogicalRules, annotations: Annotations) -> PartitionSpec:
    names = _logical_names(path, leaf, annotations)
    if names is None:
        return PartitionSpec()
    if len(names) != len(_shape(leaf)):
        raise ValueError(
            f"{path}: logical names {names} have {len(names)} entries but the array has "
            f"shape {_shape(leaf)}; give one name per dimension."
        )
    return logical_to_mesh_axes(names, rules)


def get_partition_spec(tree: Any, rules: LogicalRules, *, annotations: Annotations = ()) -> Any:
    """The PartitionSpec of every leaf of a state: logical names mapped through `rules`.

    Args:
      tree: a pytree of arrays and/or Variables (e.g. an `nnx.State`).
      rules: (logical name, mesh axes) pairs, as for `logical_to_mesh_axes`.
      annotations: (path regex, logical names) pairs for leaves without metadata.

    Returns:
      A pytree of the structure of `tree` with PartitionSpec leaves (inside the
      Variables, for Variable leaves).

    Raises:
      ValueError: a leaf's logical names do not match its number of dimensions.
    """

    def spec_of(path, leaf):
        spec = _spec_of(path_name(path), leaf, rules, annotations)
        return leaf.replace(spec) if _is_variable(leaf) else spec

    return jax.tree_util.tree_map_with_path(spec_of, tree, is_leaf=_is_variable)


def get_named_sharding(
    tree: Any, mesh: Mesh, rules: LogicalRules, *, annotations: Annotations = ()
) -> Any:
    """Like `get_partition_spec`, with `NamedSharding(mesh, spec)` leaves, checked to fit.

    Raises:
      stacklib.parallel.ShardingError: a spec does not fit its leaf (see `shard_state`).
    """

    def sharding_of(path, leaf):
        where = path_name(path) or "the array"
        spec = _spec_of(where, leaf, rules, annotations)
        normalize_spec(_shape(leaf), spec, mesh, what=where)
        sharding = NamedSharding(mesh, spec)
        return leaf.replace(sharding) if _is_variable(leaf) else sharding

    return jax.tree_util.tree_map_with_path(sharding_of, tree, is_leaf=_is_variable)


def shard_state(tree: Any, mesh: Mesh, rules: LogicalRules, *, annotations: Annotations = ()) -> Any:
    """Place every leaf of `tree` on `mesh` as the rules say; returns the sharded pytree.

    Raises:
      stacklib.parallel.ShardingError: a spec does not divide its leaf; the message
        names the leaf's path, the dimension, the mesh axes and the sizes.
    """
    return jax.device_put(tree, get_named_sharding(tree, mesh, rules, annotations=annotations))
