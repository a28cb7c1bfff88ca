"""A fused elementwise kernel in Pallas: any function of same-shaped arrays, one pass over memory.

`elementwise(fn, *arrays)` evaluates `fn` on corresponding blocks of its inputs inside one
kernel, so a chain like `gelu(x * w + b)` reads each input once and writes the result once,
however many operations `fn` contains. (XLA usually fuses such chains itself; writing the
kernel by hand is the smallest complete Pallas program, and the start of fusions XLA will
not make.)

The arrays are viewed as [rows, D] (D their last axis) and walked in (block_rows, block_cols)
blocks on a 2-D grid whose index maps are the identity: step (i, j) gets block (i, j) of
every operand and of the output. Ragged shapes are zero-padded and sliced back, so `fn`
must be safe on zeros (its padded results are discarded). Block parameters: `block_rows`
a multiple of 8 and `block_cols` a multiple of 128 (one (8, 128) tile at least).

Differences from XLA's fusion: `fn` must be elementwise (a reduction inside it would see a
block, not the array), and the output dtype is the first input's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from stacklib.kernels.backend import check_block, check_dtype, pallas_call, round_up
from stacklib.kernels.blocks import check_fits_vmem, vmem_footprint

SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16)


def elementwise(fn: Callable[..., jax.Array], *arrays: jax.Array, block_rows: int = 256,
                block_cols: int = 512, interpret: Any = None) -> jax.Array:
    """`fn(*arrays)` as one fused Pallas kernel over (block_rows, block_cols) blocks.

    Raises:
      ValueError: no arrays, different shapes, a bad dtype or bad blocks.
    """
    if not arrays:
        raise ValueError("elementwise needs at least one array after fn.")
    shape = tuple(arrays[0].shape)
    for index, a in enumerate(arrays):
        check_dtype(f"arrays[{index}]", a, SUPPORTED_DTYPES)
        if tuple(a.shape) != shape:
            raise ValueError(f"arrays[{index}] has shape {tuple(a.shape)} but arrays[0] has {shape}; "
                             "broadcast them first, e.g. jnp.broadcast_to(b, x.shape).")
    D = shape[-1] if shape else 1
    R = max(1, int(jnp.size(arrays[0])) // D)
    br = min(check_block("block_rows", block_rows), round_up(R, 8))
    bc = min(check_block("block_cols", block_cols, multiple_of=128), round_up(D, 128))
    dtype = arrays[0].dtype
    check_fits_vmem(f"block_rows={br}, block_cols={bc}",
                    vmem_footprint([((br, bc), a.dtype) for a in arrays] + [((br, bc), dtype)]))
    Rp, Dp = round_up(R, br), round_up(D, bc)
    padded = [jnp.pad(a.reshape(R, D), ((0, Rp - R), (0, Dp - D))) for a in arrays]  # [R, D] -> [Rp, Dp]

    def kernel(*refs):
        *in_refs, o_ref = refs
        o_ref[...] = fn(*(r[...] for r in in_refs)).astype(o_ref.dtype)

    spec = pl.BlockSpec((br, bc), lambda i, j: (i, j))
    out = pallas_call(
        kernel, name="elementwise",
        out_shape=jax.ShapeDtypeStruct((Rp, Dp), dtype), grid=(Rp // br, Dp // bc),
        in_specs=[spec] * len(arrays), out_specs=spec,
        dimension_semantics=("parallel", "parallel"), interpret=interpret,
    )(*padded)
    return out[:R, :D].reshape(shape)
