"""A tiled matmul in Pallas with an f32 accumulator in VMEM scratch.

`x @ y` for x [M, K] and y [K, N], on a 3-D grid (M/block_m, N/block_n, K/block_k). Step
(i, j, k) receives the blocks x[i, k] (block_m x block_k) and y[k, j] (block_k x block_n)
and adds their product to an f32 accumulator in scratch. The reduction axis k is the last
grid axis, so for a fixed output block (i, j) its steps run one after another:

    k == 0:          acc = 0                         (pl.when: init)
    every k:         acc += x[i, k] @ y[k, j]
    k == K/block_k - 1:  out[i, j] = acc             (pl.when: finalize)

The output's index map ignores k, so the output block stays in VMEM across the reduction
and is written back to HBM once. Marking (i, j) "parallel" and k "arbitrary" tells Mosaic
which axes it may split across the two TensorCores of a megacore chip.

Shapes that do not divide the blocks are zero-padded: zeros in K add nothing to the sum,
and padded rows and columns of the output are sliced away.

Block parameters: `block_m`, `block_k` multiples of 8 and `block_n` of 128 when compiling for
a TPU (the (8, 128) tile); in the interpreter any multiple of 8 runs. The VMEM footprint,
2 * (block_m*block_k + block_k*block_n + block_m*block_n) * itemsize + block_m*block_n*4
(double-buffered blocks and the scratch), must fit the core's VMEM.

Differences from `jax.experimental.pallas.ops.tpu.matmul`: padding for ragged shapes, and
the block sizes are checked against VMEM before Mosaic sees them.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from stacklib.kernels.backend import check_block, check_dtype, pallas_call, round_up
from stacklib.kernels.blocks import check_fits_vmem, vmem_footprint

SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16)


def matmul_kernel(x_ref, y_ref, o_ref, acc_ref):
    """One grid step: accumulate x_block @ y_block; init on the first k, write on the last."""
    k = pl.program_id(2)

    @pl.when(k == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    acc_ref[...] += jnp.dot(x_ref[...], y_ref[...], precision=jax.lax.Precision.HIGHEST,
                            preferred_element_type=jnp.float32)

    @pl.when(k == pl.num_programs(2) - 1)
    def _finalize():
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def matmul(x: jax.Array, y: jax.Array, *, block_m: int = 128, block_n: int = 128, block_k: int = 128,
           interpret: Any = None) -> jax.Array:
    """`x @ y` for x [M, K], y [K, N] as a tiled Pallas kernel; the result has x's dtype.

    Blocks larger than the (8-rounded) array shrink to it.

    Raises:
      ValueError: ranks other than 2, mismatched K, bad dtypes, bad or oversized blocks.
    """
    for name, a in (("x", x), ("y", y)):
        if getattr(a, "ndim", None) != 2:
            raise ValueError(f"{name} must be a matrix (rank 2), got shape {getattr(a, 'shape', None)}. "
                             f"Reshape it, e.g. {name}.reshape(-1, {name}.shape[-1]).")
        check_dtype(name, a, SUPPORTED_DTYPES)
    (M, K), (K2, N) = x.shape, y.shape
    if K != K2:
        raise ValueError(f"x {x.shape} @ y {y.shape}: x's columns ({K}) must equal y's rows ({K2}).")
    bm = min(check_block("block_m", block_m), round_up(M, 8))
    bn = min(check_block("block_n", block_n), round_up(N, 8))
    bk = min(check_block("block_k", block_k), round_up(K, 8))
    footprint = vmem_footprint([((bm, bk), x.dtype), ((bk, bn), y.dtype), ((bm, bn), x.dtype)],
                               [((bm, bn), jnp.float32)])
    check_fits_vmem(f"block_m={bm}, block_n={bn}, block_k={bk}", footprint)
    Mp, Np, Kp = round_up(M, bm), round_up(N, bn), round_up(K, bk)
    x = jnp.pad(x, ((0, Mp - M), (0, Kp - K)))
    y = jnp.pad(y, ((0, Kp - K), (0, Np - N)))
    out = pallas_call(
        matmul_kernel,
        name="matmul",
        out_shape=jax.ShapeDtypeStruct((Mp, Np), x.dtype),
        grid=(Mp // bm, Np // bn, Kp // bk),
        in_specs=[pl.BlockSpec((bm, bk), lambda i, j, k: (i, k)),
                  pl.BlockSpec((bk, bn), lambda i, j, k: (k, j))],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j, k: (i, j)),  # k ignored: stays resident
        scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)],
        dimension_semantics=("parallel", "parallel", "arbitrary"),
        interpret=interpret,
    )(x, y)
    return out[:M, :N]


matmul_reference = functools.partial(jnp.matmul, precision=jax.lax.Precision.HIGHEST)
