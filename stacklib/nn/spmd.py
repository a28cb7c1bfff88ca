"""Sharding names on parameters: `with_partitioning`.

Mirrors `flax.nnx.with_partitioning` (flax/nnx/spmd.py, flax 0.12.8). A model says
what each dimension of each parameter *means*, with logical axis names, at the place
where the parameter is made:

    nnx.Linear(64, 256, rngs=rngs,
               kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp")),
               bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), ("mlp",)))

The kernel then carries `out_sharding=("embed", "mlp")` metadata, readable as
`layer.kernel.out_sharding`. The names say nothing about devices: a separate table of
rules maps them to the axes of a device mesh (chapter 07, `stacklib.parallel`), so one
model definition serves data parallelism, FSDP and tensor parallelism alike. The
metadata is static pytree data, so it survives `split`, `merge`, `jax.jit` and
`jax.grad`, and a State's shardings can be computed from the State alone.

Differences from flax.nnx:
- Only records the names. Flax, by default, also shards each array as it is created
  ("eager sharding", which needs a mesh in context at construction) and reads rules
  from `nnx.logical_axis_rules`; here a model is built whole on one device and placed
  afterwards with `stacklib.parallel.shard_state(state, mesh, rules)`.
- `mesh` is stored as metadata (as flax stores it) but not used.
- No `get_partition_spec`/`get_named_sharding` here: they need rules and a mesh, which
  belong to `stacklib.parallel` (layer 2); `stacklib.nn` does not depend on it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from stacklib.nn.variables import with_metadata


def with_partitioning(
    initializer: Callable,
    sharding: tuple[str | None, ...],
    mesh: jax.sharding.Mesh | None = None,
    **metadata: Any,
) -> Callable:
    """Wrap `initializer` so that its Variable carries the logical axis names `sharding`.

    Args:
      initializer: `(key, shape, dtype) -> array`.
      sharding: one logical name (or None, for "never sharded") per dimension of the
        array, stored as the Variable's `out_sharding` metadata.
      mesh: stored as `mesh` metadata, as flax does; not used here.
      **metadata: more metadata for the Variable.

    Returns:
      An initializer that returns a `VariableMetadata`; `Param(...)` unpacks it.
    """
    return with_metadata(initializer, out_sharding=sharding, mesh=mesh, **metadata)
