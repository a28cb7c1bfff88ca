"""Where each piece of a sharded array lives: shard shapes, per-device slices, divisibility.

Mirrors the geometry behind `jax.sharding.NamedSharding(mesh, spec)`: its
`shard_shape(global_shape)` and `devices_indices_map(global_shape)`. A
`PartitionSpec` has one entry per array dimension (missing trailing entries mean
None):

  * `None`: the dimension is not split; every device holds all of it;
  * `"data"`: the dimension is split into `mesh.shape["data"]` equal blocks, and the
    device at coordinate i along mesh axis "data" holds block i;
  * `("data", "model")`: split over both axes, "data" major: the device at
    (d, m) holds block `d * mesh.shape["model"] + m`.

Mesh axes that no dimension names are replicated: devices that differ only along
them hold the same block.

Differences from `jax.sharding`:
  * Only `NamedSharding` geometry; no `PartitionSpec.UNCONSTRAINED`, memory kinds or
    layouts.
  * Every dimension must divide evenly. JAX also requires this when it places data
    (`device_put`, `jit` arguments) and raises a ValueError; `check_divisible` raises
    `ShardingError` before any data moves, naming the array, the dimension, the mesh
    axes and the sizes, with a fix.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from jax.sharding import Mesh, PartitionSpec


class ShardingError(ValueError):
    """A PartitionSpec does not fit an array or a mesh; the message says where and why."""


def _entry_axes(entry) -> tuple[str, ...]:
    """The mesh axes one PartitionSpec entry splits a dimension over, major first."""
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    return tuple(entry)


def normalize_spec(
    shape: Sequence[int], spec: PartitionSpec, mesh: Mesh, *, what: str = "the array"
) -> tuple[tuple[str, ...], ...]:
    """The mesh axes of every dimension of `shape`, after checking that `spec` fits.

    Returns:
      One tuple of mesh axis names per array dimension (empty: not split).

    Raises:
      ShardingError: `spec` has more entries than `shape` has dimensions, names an
        axis the mesh lacks, uses one mesh axis twice, or does not divide a dimension.
    """
    shape = tuple(shape)
    entries = tuple(spec)
    if len(entries) > len(shape):
        raise ShardingError(
            f"{what} has {len(shape)} dimension(s) (shape {shape}) but the PartitionSpec "
            f"{spec} has {len(entries)} entries; give at most one entry per dimension."
        )
    axes = [_entry_axes(entry) for entry in entries] + [()] * (len(shape) - len(entries))
    seen: dict[str, int] = {}
    for dim, dim_axes in enumerate(axes):
        for axis in dim_axes:
            if axis not in mesh.shape:
                raise ShardingError(
                    f"{what}: PartitionSpec {spec} names mesh axis {axis!r} for dimension "
                    f"{dim}, but the mesh has axes {tuple(mesh.axis_names)}."
                )
            if axis in seen:
                raise ShardingError(
                    f"{what}: PartitionSpec {spec} uses mesh axis {axis!r} for dimensions "
                    f"{seen[axis]} and {dim}; a mesh axis can split only one dimension."
                )
            seen[axis] = dim
    check_divisible(shape, axes, mesh, spec=spec, what=what)
    return tuple(axes)


def check_divisible(
    shape: Sequence[int],
    axes: Sequence[tuple[str, ...]],
    mesh: Mesh,
    *,
    spec: PartitionSpec | None = None,
    what: str = "the array",
) -> None:
    """Raise `ShardingError` unless each dimension divides by the mesh axes splitting it.

    Rule: dimension d of size n, split over mesh axes a1..ak, needs
    n % (|a1| * ... * |ak|) == 0, so that every device gets a block of the same shape.
    """
    for dim, dim_axes in enumerate(axes):
        parts = math.prod(mesh.shape[axis] for axis in dim_axes)
        if shape[dim] % parts:
            over = " x ".join(f"{axis!r} ({mesh.shape[axis]})" for axis in dim_axes)
            raise ShardingError(
                f"{what}: dimension {dim} has size {shape[dim]}, which mesh axis {over} "
                f"cannot split into {parts} equal parts (shape {tuple(shape)}, "
                f"PartitionSpec {spec if spec is not None else axes}). Fix: make the size a "
                f"multiple of {parts} (pad it), shard this dimension over a smaller axis, "
                "or replicate it (None in the PartitionSpec)."
            )


def shard_shape(shape: Sequence[int], spec: PartitionSpec, mesh: Mesh) -> tuple[int, ...]:
    """The shape of the block each device holds (`NamedSharding.shard_shape`)."""
    axes = normalize_spec(shape, spec, mesh)
    parts = [math.prod(mesh.shape[axis] for axis in dim_axes) for dim_axes in axes]
    return tuple(size // count for size, count in zip(shape, parts, strict=True))


def device_slices(shape: Sequence[int], spec: PartitionSpec, mesh: Mesh) -> dict:
    """For every device of `mesh`, the slice of the global array it holds.

    Mirrors `NamedSharding(mesh, spec).devices_indices_map(shape)`, except that an
    unsplit dimension is `slice(0, size)` rather than `slice(None)`.

    Returns:
      A dict from device to a tuple of slices, one per dimension.
    """
    axes = normalize_spec(shape, spec, mesh)
    block = shard_shape(shape, spec, mesh)
    names = tuple(mesh.axis_names)
    slices = {}
    for coordinate in itertools.product(*(range(mesh.shape[name]) for name in names)):
        where = dict(zip(names, coordinate, strict=True))
        index = []
        for dim_axes, size in zip(axes, block, strict=True):
            shard = 0
            for axis in dim_axes:  # mixed radix, the first axis is the most significant
                shard = shard * mesh.shape[axis] + where[axis]
            index.append(slice(shard * size, (shard + 1) * size))
        slices[mesh.devices[coordinate]] = tuple(index)
    return slices

