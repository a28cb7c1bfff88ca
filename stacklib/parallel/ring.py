"""All-gather, reduce-scatter and all-reduce built from one primitive: a ring of ppermutes.

Mirrors `jax.lax.all_gather(x, axis_name, axis=0, tiled=False)`,
`jax.lax.psum_scatter(x, axis_name, scatter_dimension=0, tiled=False)` and
`jax.lax.psum(x, axis_name)`, called inside `jax.shard_map`. Each is written with
`jax.lax.ppermute`, which sends one block from every device to its right-hand
neighbour at once. With N devices on a ring:

  * all-gather: N - 1 steps; each step every device forwards the block it received
    last, so after N - 1 steps it has seen every block;
  * reduce-scatter: N - 1 steps; each step every device adds its own chunk to a
    running partial sum it received and forwards it; chunk i finishes on device i;
  * all-reduce = reduce-scatter, then all-gather of the N finished chunks.

Each step moves 1/N of the data over every link at the same time, which is why a
ring all-reduce of V bytes costs about 2 (N - 1) / N * V / bandwidth, nearly
independent of N (see `stacklib.parallel.costs`).

Differences from `jax.lax`:
  * One named mesh axis at a time; no `axis_index_groups`.
  * `ring_psum` works on any shape by flattening and padding to a multiple of N.
  * Results are typed as varying across the axis (they come from ppermute), so
    JAX cannot prove that a ring all-gather or all-reduce is replicated: return
    them with an out_spec that names the axis, or use `shard_map(..., check_vma=False)`.
  * XLA's own collectives pick algorithms per topology (rings, trees, hardware
    reductions); these always use a unidirectional ring.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def _ring(n: int) -> list[tuple[int, int]]:
    """The ppermute pairs that send from every device to its right-hand neighbour."""
    return [(i, (i + 1) % n) for i in range(n)]


def ring_all_gather(x: jax.Array, axis_name: str, *, axis: int = 0, tiled: bool = False) -> jax.Array:
    """Every device gets every device's `x`, in device order, with N - 1 ppermutes.

    Args:
      x: this device's block.
      axis_name: the mesh axis to gather over (inside `shard_map`).
      axis: where the new device dimension goes (or which dimension grows, if tiled).
      tiled: concatenate along `axis` instead of stacking a new dimension.

    Returns:
      Shape `x.shape` with N inserted at `axis`, or with `x.shape[axis] * N` if tiled.
    """
    n = lax.axis_size(axis_name)
    me = lax.axis_index(axis_name)
    blocks = jnp.zeros((n, *x.shape), x.dtype).at[me].set(x)
    travelling = x
    for step in range(1, n):
        travelling = lax.ppermute(travelling, axis_name, _ring(n))
        # After `step` hops, the block that arrives was sent by device me - step.
        blocks = blocks.at[(me - step) % n].set(travelling)
    gathered = jnp.moveaxis(blocks, 0, axis)  # (..., N, ...) with N at `axis`
    if tiled:
        shape = list(x.shape)
        shape[axis] *= n
        gathered = gathered.reshape(shape)  # merge N with the following dimension
    return gathered


def ring_psum_scatter(
    x: jax.Array, axis_name: str, *, scatter_dimension: int = 0, tiled: bool = False
) -> jax.Array:
    """Sum `x` over devices and give device i only chunk i of the sum, with N - 1 ppermutes.

    Args:
      x: this device's addend. Its `scatter_dimension` has size N (or a multiple of
        N if tiled).
      axis_name: the mesh axis to reduce over.
      scatter_dimension: the dimension split into N chunks.
      tiled: keep the chunk dimension (size / N) instead of removing it (size N).

    Returns:
      Chunk `axis_index` of the sum over devices.

    Raises:
      ValueError: the scatter dimension does not match the axis size.
    """
    n = lax.axis_size(axis_name)
    size = x.shape[scatter_dimension]
    if (tiled and size % n) or (not tiled and size != n):
        need = f"a multiple of {n}" if tiled else f"exactly {n}"
        raise ValueError(
            f"ring_psum_scatter: dimension {scatter_dimension} of x has size {size}; over "
            f"mesh axis {axis_name!r} of size {n} it must be {need} (tiled={tiled})."
        )
    me = lax.axis_index(axis_name)
    rest = x.shape[:scatter_dimension] + x.shape[scatter_dimension + 1:]
    chunks = jnp.moveaxis(x, scatter_dimension, 0).reshape(n, size // n, *rest)  # (N, size / N, *rest)
    # Device `me` starts the partial sum of chunk me - 1; each hop, the receiver adds
    # its own part of the chunk it received, so chunk c ends on device c after N - 1 hops.
    partial = chunks[(me - 1) % n]
    for step in range(1, n):
        partial = lax.ppermute(partial, axis_name, _ring(n)) + chunks[(me - 1 - step) % n]
    result = jnp.moveaxis(partial, 0, scatter_dimension)  # (size // n) back in place
    return result if tiled else jnp.squeeze(result, scatter_dimension)


def ring_psum(x: jax.Array, axis_name: str) -> jax.Array:
    """The sum of `x` over all devices of the axis: a ring reduce-scatter, then a ring all-gather.

    Takes 2 (N - 1) ppermutes of 1/N of `x` each, instead of N - 1 of all of it.
    """
    n = lax.axis_size(axis_name)
    flat = x.reshape(-1)
    padding = (-flat.size) % n
    flat = jnp.pad(flat, (0, padding))  # so that N equal chunks exist
    mine = ring_psum_scatter(flat, axis_name, tiled=True)  # (size / N,)
    total = ring_all_gather(mine, axis_name, tiled=True)  # (size,)
    return total[: x.size].reshape(x.shape)
