"""Fused RMSNorm and LayerNorm in Pallas: statistics, normalisation and scale in one pass.

Both normalise each row of x [..., D] over its last axis, in float32:

    RMSNorm:    y = x / sqrt(mean(x**2) + eps) * scale
    LayerNorm:  y = (x - mean(x)) / sqrt(var(x) + eps) * scale + offset

One grid step takes `block_rows` whole rows (block (block_rows, D)) plus the parameters.
The parameters' block is the whole [1, D] vector with an index map that always returns
(0, 0): Pallas sees the same block index on every step and does not copy it again, so
`scale` and `offset` are read from HBM once and stay in VMEM.

Rows are zero-padded to a multiple of the block and sliced away (a zero row normalises to
0 * rsqrt(eps): finite). Block parameter: `block_rows`, a multiple of 8.

Differences from `flax.nnx.RMSNorm` / `LayerNorm`: functions of arrays, not modules; the
last axis only; `eps` defaults to 1e-6 as in flax.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from stacklib.kernels.backend import check_block, check_dtype, pallas_call, round_up
from stacklib.kernels.blocks import check_fits_vmem, vmem_footprint

SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16)


def rms_norm_kernel(x_ref, scale_ref, o_ref, *, eps: float):
    x = x_ref[...].astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    o_ref[...] = (x * inv * scale_ref[...].astype(jnp.float32)).astype(o_ref.dtype)


def layer_norm_kernel(x_ref, scale_ref, offset_ref, o_ref, *, eps: float):
    x = x_ref[...].astype(jnp.float32)
    mean = jnp.mean(x, axis=-1, keepdims=True)
    centred = x - mean
    inv = jax.lax.rsqrt(jnp.mean(centred * centred, axis=-1, keepdims=True) + eps)
    y = centred * inv * scale_ref[...].astype(jnp.float32) + offset_ref[...].astype(jnp.float32)
    o_ref[...] = y.astype(o_ref.dtype)


def _row_norm(kernel, name: str, x: jax.Array, params: dict[str, jax.Array], block_rows: int,
              interpret: Any) -> jax.Array:
    """Run a row kernel on x viewed as [R, D], each parameter as a resident [1, D] block."""
    if getattr(x, "ndim", 0) < 1:
        raise ValueError(f"x must have at least one axis, got shape {getattr(x, 'shape', None)}.")
    check_dtype("x", x, SUPPORTED_DTYPES)
    D = x.shape[-1]
    for pname, p in params.items():
        if tuple(p.shape) != (D,):
            raise ValueError(f"{pname} must have shape ({D},) to match x {tuple(x.shape)}'s last axis, "
                             f"got {tuple(p.shape)}.")
    rows = x.reshape(-1, D)  # [..., D] -> [R, D]
    R = rows.shape[0]
    br = min(check_block("block_rows", block_rows), round_up(R, 8))
    blocks = [((br, D), x.dtype)] * 2 + [((1, D), p.dtype) for p in params.values()]
    check_fits_vmem(f"block_rows={br} with rows of {D}", vmem_footprint(blocks))
    Rp = round_up(R, br)
    row_spec = pl.BlockSpec((br, D), lambda i: (i, 0))
    param_spec = pl.BlockSpec((1, D), lambda i: (0, 0))  # same block every step: fetched once
    out = pallas_call(
        kernel, name=name,
        out_shape=jax.ShapeDtypeStruct((Rp, D), x.dtype), grid=(Rp // br,),
        in_specs=[row_spec] + [param_spec] * len(params), out_specs=row_spec,
        dimension_semantics=("parallel",), interpret=interpret,
    )(jnp.pad(rows, ((0, Rp - R), (0, 0))), *(p.reshape(1, D) for p in params.values()))
    return out[:R].reshape(x.shape)


def rms_norm(x: jax.Array, scale: jax.Array, *, eps: float = 1e-6, block_rows: int = 256,
             interpret: Any = None) -> jax.Array:
    """RMSNorm over the last axis: x / sqrt(mean(x**2) + eps) * scale, computed in float32."""
    kernel = functools.partial(rms_norm_kernel, eps=eps)
    return _row_norm(kernel, "rms_norm", x, {"scale": scale}, block_rows, interpret)


def layer_norm(x: jax.Array, scale: jax.Array, offset: jax.Array, *, eps: float = 1e-6,
               block_rows: int = 256, interpret: Any = None) -> jax.Array:
    """LayerNorm over the last axis: (x - mean) / sqrt(var + eps) * scale + offset, in float32."""
    kernel = functools.partial(layer_norm_kernel, eps=eps)
    return _row_norm(kernel, "layer_norm", x, {"scale": scale, "offset": offset}, block_rows, interpret)


def rms_norm_reference(x, scale, *, eps: float = 1e-6):
    """XLA's RMSNorm in float32."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps) * scale
    return y.astype(x.dtype)


def layer_norm_reference(x, scale, offset, *, eps: float = 1e-6):
    """XLA's LayerNorm in float32."""
    x32 = x.astype(jnp.float32)
    mean = x32.mean(axis=-1, keepdims=True)
    var = jnp.mean((x32 - mean) ** 2, axis=-1, keepdims=True)
    return ((x32 - mean) * jax.lax.rsqrt(var + eps) * scale + offset).astype(x.dtype)
