"""Logical axis rules: name an array's dimensions once, choose the parallelism with a table.

Mirrors `flax.linen.logical_to_mesh_axes`, `flax.linen.logical_to_mesh` and
`flax.linen.logical_to_mesh_sharding` (also used by MaxText). A model names the
dimensions of its arrays by meaning: a kernel is `("features", "hidden")`, a batch of
inputs `("batch", "features")`. A short table of rules then maps those logical names
to mesh axes:

    data parallel:      (("batch", "data"),)
    FSDP:               (("batch", "data"), ("hidden", "data"))
    tensor parallel:    (("hidden", "model"),)

so switching parallelism is editing the table, not the model.

The rule (as in Flax Linen): rules are tried in order; a rule `(name, mesh_axes)`
applies to the dimension called `name` if that dimension has no mesh axes yet and
none of `mesh_axes` is already used by another dimension of the same array. Names no
rule assigns stay unsharded (None).

Differences from Flax:
  * `rules` is always an argument; Flax also reads it from a context
    (`flax.linen.logical_axis_rules`, `flax.nnx.logical_axis_rules`).
  * `flax.nnx.get_partition_spec` applies context rules by renaming alone, so a
    logical name without a rule stays in the spec and is looked up as a mesh axis
    (a "not found in mesh" error at placement). We follow Linen: it becomes None.
  * No `PartitionSpec.UNCONSTRAINED` handling.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

# A rule maps one logical name to a mesh axis, a tuple of mesh axes, or None (replicate).
LogicalRules = Sequence[tuple[str, str | tuple[str, ...] | None]]


def _check_rules(rules: Any) -> None:
    if not isinstance(rules, list | tuple):
        raise ValueError(
            f"rules must be a sequence of (logical name, mesh axes) pairs, got "
            f"{type(rules).__name__}: {rules!r}. Example: (('batch', 'data'), ('hidden', 'model'))."
        )
    for index, rule in enumerate(rules):
        if not (isinstance(rule, list | tuple) and len(rule) == 2 and isinstance(rule[0], str)):
            raise ValueError(
                f"rules[{index}] is {rule!r}; each rule is a pair (logical name, mesh axes), "
                "e.g. ('hidden', 'model')."
            )


def _mesh_axes_of(assignment) -> set[str]:
    if assignment is None:
        return set()
    return {assignment} if isinstance(assignment, str) else set(assignment)


def logical_to_mesh_axes(
    array_dim_names: Sequence[str | None] | None, rules: LogicalRules
) -> PartitionSpec | None:
    """The PartitionSpec for an array whose dimensions have the given logical names.

    Example: names ("batch", "hidden") with rules (("batch", "data"), ("hidden",
    "model")) give PartitionSpec("data", "model").

    Args:
      array_dim_names: one logical name (or None) per dimension; None for "no names".
      rules: (logical name, mesh axes) pairs in order of precedence.

    Returns:
      A PartitionSpec with one entry per dimension, or None if `array_dim_names` is None.

    Raises:
      ValueError: a logical name appears twice, or `rules` is malformed.
    """
    if array_dim_names is None:
        return None
    _check_rules(rules)
    names = tuple(array_dim_names)
    counts = collections.Counter(name for name in names if isinstance(name, str))
    repeated = sorted(name for name, count in counts.items() if count > 1)
    if repeated:
        raise ValueError(
            f"Logical names {repeated} appear more than once in {names}; each dimension of "
            "an array needs its own name."
        )
    assigned: list = [None] * len(names)
    done = [not isinstance(name, str) for name in names]
    for logical, mesh_axes in rules:
        if logical not in names:
            continue
        dim = names.index(logical)
        used = set().union(*(_mesh_axes_of(a) for a in assigned))
        if not done[dim] and not (_mesh_axes_of(mesh_axes) & used):
            assigned[dim], done[dim] = mesh_axes, True
    return PartitionSpec(*assigned)


def _is_spec(x: Any) -> bool:
    return isinstance(x, PartitionSpec)


def logical_to_mesh(tree: Any, rules: LogicalRules) -> Any:
    """`logical_to_mesh_axes` on every PartitionSpec of logical names in a pytree."""
    return jax.tree.map(lambda spec: logical_to_mesh_axes(tuple(spec), rules), tree, is_leaf=_is_spec)


def logical_to_mesh_sharding(tree: Any, mesh: Mesh, rules: LogicalRules) -> Any:
    """Like `logical_to_mesh`, returning `NamedSharding(mesh, spec)` leaves."""
    specs = logical_to_mesh(tree, rules)
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs, is_leaf=_is_spec)
