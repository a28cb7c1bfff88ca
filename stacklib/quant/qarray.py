"""Quantized arrays: `QArray`, `quantize`, `dequantize`, and the calibration behind them.

Mirrors `qwix.QArray`, `qwix.quantize` and `qwix.dequantize` (qwix/_src/core/qarray.py and
numerics.py, qwix 0.1.8), with the same rounding and bounds, so that the same float array
gives the same integers and the same scales in both libraries, element for element.

A quantized array stores integers and the scale that maps them back:

    x  ~  (qvalue - zero_point) * scale

* symmetric (`calibration_method='absmax'`): `scale = max|x| / B` with `B = qmax + 0.5`
  (127.5 for int8, 7.5 for int4): the largest value lands on the *edge* of the top bucket,
  so every bucket is used; `qvalue = round(x / scale)` (half to even), saturated by the
  cast, so a value exactly on the edge, 127.5, becomes 127 and -127.5 becomes -128.
  There is no zero point.
* asymmetric (`'minmax'`): the range `[min(x, 0), max(x, 0)]` is spread over
  `[qmin, qmax]` = [-128, 127] (int8) or [-8, 7] (int4): `scale = (max - min) / (qmax - qmin)`,
  `zero_point = round(qmin - min / scale)`, `qvalue = round(x / scale + zero_point)`.
* float8 (`jnp.float8_e4m3fn`, `jnp.float8_e5m2`): `B` is the format's largest finite value
  and the cast itself rounds (no `round`).

Which elements share a scale is the array's *granularity*: one scale for the whole tensor
(the default), one per index of each `channelwise_axes` axis, or one per tile of
`tile_size` consecutive elements along each `tiled_axes` axis. The scale keeps the array's
rank, so it broadcasts "generically": a scale of shape (2, 1) over a (256, 4) array means
tiles of 128 rows.

Differences from qwix:
- `QArray` is a frozen dataclass registered as a pytree (qwix uses `flax.struct`), with no
  reshape/transpose/indexing methods.
- qtypes: int8, int4, float8_e4m3fn and float8_e5m2 (qwix adds nf4, int2-int7, mxfp*).
- Calibration methods: 'absmax' and 'minmax', each with an optional clipping factor
  ('absmax,0.9'); qwix adds 'rms' and 'fixed'. No stochastic rounding, no `scale_dtype`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping
from typing import Any

import jax
import jax.numpy as jnp

INTEGER_QTYPES = {"int8": jnp.int8, "int4": jnp.int4}
FLOAT_QTYPES = {"float8_e4m3fn": jnp.float8_e4m3fn, "float8_e5m2": jnp.float8_e5m2}
CALIBRATION_METHODS = ("absmax", "minmax")


def canonical_qtype(qtype: Any, *, argument: str = "qtype") -> Any:
    """`qtype` as a JAX dtype class (`jnp.int8`, ...), or a ValueError naming `argument`."""
    known = {**INTEGER_QTYPES, **FLOAT_QTYPES}
    try:
        name = jnp.dtype(qtype).name
    except TypeError:
        name = None
    if name not in known:
        raise ValueError(
            f"{argument}={qtype!r} is not a quantized type we support. Use one of: "
            + ", ".join(f"jnp.{n}" for n in known)
            + " (a float type such as jnp.bfloat16 is not a quantized type)."
        )
    return known[name]


def is_integer_qtype(qtype: Any) -> bool:
    return jnp.dtype(qtype).name in INTEGER_QTYPES


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QArray:
    """A quantized array: `qvalue` (int8/int4/fp8), `scale` (float, same rank), an optional
    `zero_point` (same dtype as `qvalue`, asymmetric only) and the logical `qtype` (static).

    `dtype` is the scale's dtype: the type `dequantize` gives back.
    """

    qvalue: jax.Array
    scale: jax.Array
    zero_point: jax.Array | None = None
    qtype: Any = dataclasses.field(default=None, metadata=dict(static=True))

    shape = property(lambda self: self.qvalue.shape)
    ndim = property(lambda self: self.qvalue.ndim)
    dtype = property(lambda self: self.scale.dtype)

    @property
    def nbytes(self) -> int:
        """Bytes of storage: int4 counts half a byte per element, as it packs two per byte."""
        qbits = jnp.iinfo(self.qvalue.dtype).bits if is_integer_qtype(self.qvalue.dtype) else 8
        total = math.ceil(self.qvalue.size * qbits / 8) + self.scale.size * self.scale.dtype.itemsize
        if self.zero_point is not None:
            total += math.ceil(self.zero_point.size * qbits / 8)
        return total


@dataclasses.dataclass(frozen=True, kw_only=True)
class HowToQuantize:
    """How to quantize one array: its qtype, granularity and calibration method.

    `tiled_axes` is a tuple of `(axis, tile_size)` pairs (hashable, so a HowToQuantize can
    sit in a Variable's static metadata); `quantize` accepts a dict.
    """

    qtype: Any
    channelwise_axes: tuple[int, ...] = ()
    tiled_axes: tuple[tuple[int, int | float], ...] = ()
    calibration_method: str = "absmax"

    def __post_init__(self):
        object.__setattr__(self, "qtype", canonical_qtype(self.qtype))
        object.__setattr__(self, "channelwise_axes", tuple(sorted(self.channelwise_axes)))
        tiled = self.tiled_axes.items() if isinstance(self.tiled_axes, Mapping) else self.tiled_axes
        object.__setattr__(self, "tiled_axes", tuple(sorted(tiled)))
        method = self.calibration_method.lower().split(",")[0]
        if method not in CALIBRATION_METHODS:
            raise ValueError(
                f"calibration_method={self.calibration_method!r} is not supported. Use "
                "'absmax' (symmetric) or 'minmax' (asymmetric, with a zero point), optionally "
                "with a clipping factor such as 'absmax,0.9'."
            )
        if method == "minmax" and not is_integer_qtype(self.qtype):
            raise ValueError(
                f"calibration_method='minmax' needs an integer qtype, got {self.qtype.__name__}: "
                "a zero point is an integer. Use 'absmax' for float8."
            )
        both = set(self.channelwise_axes) & {axis for axis, _ in self.tiled_axes}
        if both:
            raise ValueError(f"axis {sorted(both)} is both channelwise and tiled; pick one.")


def tile_sizes(shape: tuple[int, ...], how: HowToQuantize) -> dict[int, int]:
    """`{axis: tile size}` for the tiled axes of an array of `shape`.

    A float tile size is a fraction, `1 / tile_count`, as in qwix: 0.25 means four tiles.

    Raises:
      ValueError: a tile size does not divide its axis (the message suggests divisors).
    """
    sizes = {}
    for axis, tile in how.tiled_axes:
        dim = shape[axis]
        size = round(dim * tile) if isinstance(tile, float) else tile
        if size <= 0 or dim % size:
            divisors = [d for d in range(1, dim + 1) if dim % d == 0]
            raise ValueError(
                f"tile_size={tile!r} does not divide axis {axis} of an array of shape {shape} "
                f"(length {dim}). Use a tile size that divides {dim}, e.g. one of {divisors[-6:]}."
            )
        sizes[axis] = size
    return sizes


def scale_shape(shape: tuple[int, ...], how: HowToQuantize) -> tuple[int, ...]:
    """The scale's shape: full length on channelwise axes, tile counts on tiled ones, 1 elsewhere."""
    tiles = tile_sizes(shape, how)
    return tuple(
        dim if axis in how.channelwise_axes else dim // tiles[axis] if axis in tiles else 1
        for axis, dim in enumerate(shape)
    )


def _split_tiled_axes(array: jax.Array, tiles: Mapping[int, int]) -> jax.Array:
    """Reshape so each tiled axis becomes (tile_count, tile_size)."""
    new_shape = []
    for axis, dim in enumerate(array.shape):
        new_shape += [dim // tiles[axis], tiles[axis]] if axis in tiles else [dim]
    return array.reshape(new_shape)


def calibrate(array: jax.Array, how: HowToQuantize) -> dict[str, jax.Array]:
    """The statistics a scale is computed from, each shaped like the scale.

    {'absmax': ...} for 'absmax'; {'min': ..., 'max': ...} for 'minmax', with min <= 0 <= max
    so that zero stays exactly representable.
    """
    tiles = tile_sizes(array.shape, how)
    reduce_axes, offset = [], 0
    for axis in range(array.ndim):
        if axis in how.channelwise_axes:
            continue
        if axis in tiles:
            offset += 1  # reduce over the tile, keep the tile count
        reduce_axes.append(axis + offset)
    target = scale_shape(array.shape, how)
    split = _split_tiled_axes(array, tiles)
    method, *factor = how.calibration_method.lower().split(",")
    if method == "absmax":
        absmax = jnp.max(jnp.abs(split), axis=reduce_axes, keepdims=True)
        if factor:
            absmax = absmax * float(factor[0])
        return {"absmax": absmax.reshape(target)}
    low = jnp.clip(jnp.min(split, axis=reduce_axes, keepdims=True), max=0)
    high = jnp.clip(jnp.max(split, axis=reduce_axes, keepdims=True), min=0)
    if factor:
        low, high = low * float(factor[0]), high * float(factor[0])
    return {"min": low.reshape(target), "max": high.reshape(target)}


def symmetric_bound(qtype: Any) -> float:
    """B, the magnitude mapped to the edge of the range: qmax + 0.5 for ints, max for floats."""
    if is_integer_qtype(qtype):
        return jnp.iinfo(qtype).max + 0.5
    return float(jnp.finfo(qtype).max)


def asymmetric_bounds(qtype: Any) -> tuple[float, float]:
    info = jnp.iinfo(qtype)
    return float(info.min), float(info.max)


def compute_scale_zero_point(calibration: Mapping[str, jax.Array],
                             qtype: Any) -> tuple[jax.Array, jax.Array | None]:
    """Scale (and zero point, for min/max statistics) from `calibrate`'s statistics.

    A scale below sqrt(tiny) (an all-zero channel) becomes 1, so division stays finite.
    """
    if "absmax" in calibration:
        scale = calibration["absmax"] / symmetric_bound(qtype)
        zero_point = None
    else:
        qmin, qmax = asymmetric_bounds(qtype)
        scale = (calibration["max"] - calibration["min"]) / (qmax - qmin)
    tiny_sqrt = jnp.sqrt(jnp.finfo(scale.dtype).tiny)
    scale = jnp.where(scale < tiny_sqrt, jnp.ones_like(scale), scale)
    if "absmax" not in calibration:
        zero_point = _convert(qmin - calibration["min"] / scale, qtype)
    return scale, zero_point


def _convert(x: jax.Array, qtype: Any) -> jax.Array:
    """Round half to even and cast; the cast saturates (200 -> 127 in int8)."""
    if is_integer_qtype(qtype):
        return jnp.round(x).astype(qtype)
    info = jnp.finfo(qtype)
    return x.clip(info.min.astype(x.dtype), info.max.astype(x.dtype)).astype(qtype)


def broadcast_scale(op, x: jax.Array, scale: jax.Array) -> jax.Array:
    """`op(x, scale)` where each scale entry covers a tile of x (a "generic" broadcast)."""
    x_shape, s_shape = [], []
    for a, b in zip(x.shape, scale.shape, strict=True):
        if a == b or b == 1 or a == 1:
            x_shape.append(a)
            s_shape.append(b)
        else:  # b tiles of a // b elements each
            x_shape += [b, a // b]
            s_shape += [b, 1]
    out_shape = tuple(max(a, b) for a, b in zip(x.shape, scale.shape, strict=True))
    return op(x.reshape(x_shape), scale.reshape(s_shape)).reshape(out_shape)


def quantize_with_scale_zero_point(array: jax.Array, qtype: Any, scale: jax.Array,
                                   zero_point: jax.Array | None) -> QArray:
    """Quantize with a given scale (a static activation scale, or one just calibrated)."""
    scale = scale.astype(array.dtype)
    scaled = broadcast_scale(jnp.divide, array, scale)
    if zero_point is not None:
        scaled = broadcast_scale(jnp.add, scaled, zero_point.astype(scaled.dtype))
    return QArray(_convert(scaled, qtype), scale, zero_point, qtype)


def quantize_how(array: jax.Array, how: HowToQuantize) -> QArray:
    """Calibrate, compute the scale, quantize: `quantize` with a prepared HowToQuantize."""
    if jnp.dtype(array.dtype) not in (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64):
        raise ValueError(f"only float arrays can be quantized, got dtype {array.dtype}.")
    scale, zero_point = compute_scale_zero_point(calibrate(array, how), how.qtype)
    return quantize_with_scale_zero_point(array, how.qtype, scale, zero_point)


def quantize(
    array: jax.Array,
    qtype: Any,
    *,
    channelwise_axes: Collection[int] = (),
    tiled_axes: Mapping[int, int | float] | None = None,
    calibration_method: str = "absmax",
) -> QArray:
    """Quantize a float array to `qtype`, with a scale per tensor, channel or tile.

    Args:
      array: a float array.
      qtype: jnp.int8, jnp.int4, jnp.float8_e4m3fn or jnp.float8_e5m2.
      channelwise_axes: axes that get one scale per index (e.g. a kernel's output axis).
      tiled_axes: `{axis: tile_size}`: one scale per `tile_size` consecutive elements
        (a float is a fraction of the axis: 0.5 is two tiles).
      calibration_method: 'absmax' (symmetric) or 'minmax' (asymmetric, with a zero point),
        optionally with a clipping factor: 'absmax,0.9'.

    Returns:
      A QArray with `dequantize(q) ~ array`.

    Raises:
      ValueError: an unknown qtype or calibration method, or a tile size that does not divide
        its axis; each message names the argument and a fix.
    """
    how = HowToQuantize(
        qtype=qtype,
        channelwise_axes=tuple(channelwise_axes),
        tiled_axes=tuple((tiled_axes or {}).items()),
        calibration_method=calibration_method,
    )
    return quantize_how(jnp.asarray(array), how)


def dequantize(array: QArray) -> jax.Array:
    """`(qvalue - zero_point) * scale`, in the scale's dtype: the reverse of `quantize`."""
    values = array.qvalue.astype(array.scale.dtype)
    if array.zero_point is not None:
        values = broadcast_scale(jnp.subtract, values, array.zero_point.astype(values.dtype))
    return broadcast_scale(jnp.multiply, values, array.scale)
