"""Device meshes that work on a pod, a one-chip runtime and a laptop alike.

Mirrors `jax.make_mesh(axis_shapes, axis_names, axis_types=None, *, devices=None)`.
A mesh is an n-dimensional array of devices with a name for each axis; shardings
(`NamedSharding`) and `shard_map` refer to those names, never to devices, which is
what lets the same program run on 8 simulated CPU devices and on a 256-chip TPU slice.

Differences from `jax.make_mesh`:
  * When `devices` is not given and the default backend has fewer devices than the
    mesh needs (a one-chip Colab TPU, one GPU), the mesh is built from CPU devices
    instead, which `stacklib.hw.simulate_cpu_devices(n)` multiplies. JAX would raise.
  * The error for too few devices names the fix.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
from jax.sharding import AxisType, Mesh


def mesh_devices(count: int) -> list:
    """The first `count` devices of the default backend, or else of the CPU backend.

    Args:
      count: how many devices the mesh needs.

    Returns:
      A list of `count` devices, all of one backend.

    Raises:
      ValueError: `count` is not positive, or neither backend has `count` devices.
    """
    if count < 1:
        raise ValueError(f"A mesh needs at least one device, got count={count}.")
    default = jax.devices()
    if len(default) >= count:
        return default[:count]
    cpu = jax.devices("cpu")
    if len(cpu) >= count:
        return cpu[:count]
    raise ValueError(
        f"A mesh of {count} devices needs {count} devices, but the default backend "
        f"({jax.default_backend()}) has {len(default)} and the CPU backend {len(cpu)}. "
        f"Restart the kernel and call stacklib.hw.simulate_cpu_devices({count}) before any "
        "other JAX operation, or make a smaller mesh."
    )


def make_mesh(
    axis_shapes: Sequence[int],
    axis_names: Sequence[str],
    axis_types: tuple[AxisType, ...] | None = None,
    *,
    devices: Sequence | None = None,
) -> Mesh:
    """A mesh of `prod(axis_shapes)` devices with the given axis names.

    Example: `make_mesh((4, 2), ("data", "model"))` arranges 8 devices in 4 rows of 2;
    a dimension sharded over "data" is split in 4, one over "model" in 2.

    Args:
      axis_shapes: the size of each mesh axis.
      axis_names: one name per axis, e.g. ("data", "model").
      axis_types: one `jax.sharding.AxisType` per axis. None keeps JAX's default,
        which in the pinned JAX is `Explicit` for every axis (see the chapter).
      devices: the devices to use; default: `mesh_devices(prod(axis_shapes))`.

    Returns:
      A `jax.sharding.Mesh`.

    Raises:
      ValueError: the shapes and names disagree in length, or too few devices.
    """
    axis_shapes, axis_names = tuple(axis_shapes), tuple(axis_names)
    if len(axis_shapes) != len(axis_names):
        raise ValueError(
            f"make_mesh got {len(axis_shapes)} axis sizes {axis_shapes} but "
            f"{len(axis_names)} names {axis_names}; give one name per axis."
        )
    if devices is None:
        devices = mesh_devices(math.prod(axis_shapes))
    return jax.make_mesh(axis_shapes, axis_names, axis_types, devices=devices)
