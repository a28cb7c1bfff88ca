"""A fused row softmax in Pallas: one read and one write of each row.

`softmax(x)` over the last axis. XLA computes it as max, subtract, exp, sum, divide; even
fused, that is a reduction, then an elementwise pass, then another reduction. In a kernel
the whole row sits in VMEM, so all of it happens on one block:

    m = rowmax(x);  e = exp(x - m);  out = e / rowsum(e)

The grid walks blocks of `block_rows` rows; each block holds complete rows (block shape
(block_rows, D)), so a row never spans two grid steps and no running statistics are needed
(flash attention needs them because its rows are too long to hold at once).

Rows that do not fill the last block are zero-padded and sliced away; arrays of any rank
are viewed as [rows, D]. Block parameter: `block_rows`, a multiple of 8; the footprint
2 * 2 * block_rows * D * itemsize (input and output, double-buffered) must fit VMEM, which
bounds the row length this kernel handles.

Differences from `jax.nn.softmax`: last axis only; no `where=`; float32 and bfloat16
(computed in float32).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from stacklib.kernels.backend import check_block, check_dtype, pallas_call, round_up
from stacklib.kernels.blocks import check_fits_vmem, vmem_footprint

SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16)


def softmax_kernel(x_ref, o_ref):
    """One block of whole rows: max, exp, sum and divide without leaving VMEM."""
    x = x_ref[...].astype(jnp.float32)
    e = jnp.exp(x - x.max(axis=-1, keepdims=True))
    o_ref[...] = (e / e.sum(axis=-1, keepdims=True)).astype(o_ref.dtype)


def softmax(x: jax.Array, *, block_rows: int = 256, interpret: Any = None) -> jax.Array:
    """Softmax over the last axis of `x`, `block_rows` rows per grid step.

    Raises:
      ValueError: a scalar input, a bad dtype, a bad block, or rows too long for VMEM.
    """
    if getattr(x, "ndim", 0) < 1:
        raise ValueError(f"x must have at least one axis, got shape {getattr(x, 'shape', None)}.")
    check_dtype("x", x, SUPPORTED_DTYPES)
    D = x.shape[-1]
    rows = x.reshape(-1, D)  # [..., D] -> [R, D]
    R = rows.shape[0]
    br = min(check_block("block_rows", block_rows), round_up(R, 8))
    check_fits_vmem(f"block_rows={br} with rows of {D}", vmem_footprint([((br, D), x.dtype)] * 2))
    Rp = round_up(R, br)
    spec = pl.BlockSpec((br, D), lambda i: (i, 0))
    out = pallas_call(
        softmax_kernel, name="softmax",
        out_shape=jax.ShapeDtypeStruct((Rp, D), x.dtype), grid=(Rp // br,),
        in_specs=[spec], out_specs=spec, dimension_semantics=("parallel",), interpret=interpret,
    )(jnp.pad(rows, ((0, Rp - R), (0, 0))))
    return out[:R].reshape(x.shape)


def softmax_reference(x: jax.Array) -> jax.Array:
    """XLA's softmax over the last axis, in float32."""
    return jax.nn.softmax(x.astype(jnp.float32), axis=-1).astype(x.dtype)
