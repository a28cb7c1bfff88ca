"""Scaling out (chapter 07): meshes, shardings, collectives, multi-process JAX.

The real APIs are `jax.sharding` (Mesh, NamedSharding, PartitionSpec), `jax.jit`
with shardings, `jax.shard_map` with `jax.lax` collectives, and `jax.distributed`.
This package adds the pieces a training codebase builds on top of them, small
enough to read:

  mesh        `make_mesh` that falls back to simulated CPU devices on a one-chip runtime
  layout      which block of an array each device holds; divisibility errors that say where
  rules       logical axis names -> mesh axes (Flax Linen / MaxText style)
  state       PartitionSpecs and shardings for a model's state (stacklib.nn or flax State, any pytree)
  ring        all-gather, reduce-scatter and all-reduce built from `ppermute`
  hlo         the collectives a compiled program runs, and their bytes
  costs       the alpha-beta ring model of collective time (scaling-book style)
  mlp         an MLP classifier built with stacklib.nn, with named axes, and its SGD step
  pipeline    layers cut into stages on a `pipeline` axis: GPipe and 1F1B schedules, the bubble,
              pipelined steps with ppermute (MaxText's pipeline layer)
  launch      several JAX processes on one machine (`jax.distributed`, gloo)
  multihost_step   the program those processes run together
"""

from stacklib.parallel.costs import (
    Link,
    all_gather_time,
    all_reduce_time,
    all_to_all_time,
    collective_time,
    fit_link,
    ppermute_time,
    reduce_scatter_time,
)
from stacklib.parallel.hlo import Collective, bytes_by_kind, collectives
from stacklib.parallel.launch import LaunchError, ProcessResult, initialize_from_env, launch_local
from stacklib.parallel.layout import (
    ShardingError,
    check_divisible,
    device_slices,
    normalize_spec,
    shard_shape,
)
from stacklib.parallel.mesh import make_mesh, mesh_devices
from stacklib.parallel.pipeline import (
    Action,
    bubble_fraction,
    check_schedule,
    gpipe_schedule,
    one_f_one_b_schedule,
    peak_live_microbatches,
    pipeline_apply,
    pipeline_loss,
    pipeline_value_and_grad,
    schedule_from_orders,
    stack_stages,
)
from stacklib.parallel.ring import ring_all_gather, ring_psum, ring_psum_scatter
from stacklib.parallel.rules import (
    LogicalRules,
    logical_to_mesh,
    logical_to_mesh_axes,
    logical_to_mesh_sharding,
)
from stacklib.parallel.state import (
    get_named_sharding,
    get_partition_spec,
    logical_axes,
    path_name,
    shard_state,
)

__all__ = [
    "Action",
    "Collective",
    "LaunchError",
    "Link",
    "LogicalRules",
    "ProcessResult",
    "ShardingError",
    "all_gather_time",
    "all_reduce_time",
    "all_to_all_time",
    "bubble_fraction",
    "bytes_by_kind",
    "check_divisible",
    "check_schedule",
    "collective_time",
    "collectives",
    "device_slices",
    "fit_link",
    "get_named_sharding",
    "get_partition_spec",
    "gpipe_schedule",
    "initialize_from_env",
    "launch_local",
    "logical_axes",
    "logical_to_mesh",
    "logical_to_mesh_axes",
    "logical_to_mesh_sharding",
    "make_mesh",
    "mesh_devices",
    "normalize_spec",
    "one_f_one_b_schedule",
    "path_name",
    "peak_live_microbatches",
    "pipeline_apply",
    "pipeline_loss",
    "pipeline_value_and_grad",
    "ppermute_time",
    "reduce_scatter_time",
    "ring_all_gather",
    "ring_psum",
    "ring_psum_scatter",
    "schedule_from_orders",
    "shard_shape",
    "shard_state",
    "stack_stages",
]
