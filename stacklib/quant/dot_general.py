"""`dot_general` with QArray operands, and how each operand of a contraction is quantized.

Mirrors `qwix.dot_general` and `dot_general.get_how_to_quantize`
(qwix/_src/core/dot_general.py, qwix 0.1.8).

*Granularity.* An operand gets one scale per index of every axis it does not contract
(per output channel for a `(in, out)` kernel, per row for an activation), and, with a
`tile_size`, one per tile of its last contracting axis. Scales never vary along a
contracted axis without tiling: that is what lets the integer product be rescaled after
the sum,

    sum_k (a_ik s_i)(b_kj t_j) = s_i t_j sum_k a_ik b_kj

*Two ways to compute.* If either operand is still float (weight-only quantization), the
quantized one is dequantized and the product runs in float: XLA fuses the dequantization
into the matmul, and nothing would be gained by an integer product ("slow path", qwix's
name, though it is not slower). If both are quantized without zero points and neither is
tiled along the contraction, the product runs on the integers with an int32 accumulator and
the scales are applied to the result ("fast path": what int8 hardware accelerates).

Differences from qwix: the fast path is taken only without tiling and without zero points
(qwix also tiles the integer product for tiles >= 128, and corrects zero points with an
extra product); those cases dequantize first, which agrees with qwix to float rounding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from stacklib.quant.interception import ORIGINALS
from stacklib.quant.qarray import HowToQuantize, QArray, dequantize, is_integer_qtype


def how_to_quantize(dimension_numbers, ndims: tuple[int, int], *, for_lhs: bool, qtype, tile_size=None,
                    calibration_method: str = "absmax") -> HowToQuantize:
    """Per-channel on the non-contracted axes; tiles on the last contracted axis if `tile_size`."""
    ndim = ndims[0] if for_lhs else ndims[1]
    contracting = dimension_numbers[0][0] if for_lhs else dimension_numbers[0][1]
    tiled = {contracting[-1]: tile_size} if tile_size else {}
    channelwise = sorted(set(range(ndim)) - set(contracting) - set(tiled))
    return HowToQuantize(qtype=qtype, channelwise_axes=tuple(channelwise), tiled_axes=tuple(tiled.items()),
                         calibration_method=calibration_method)


def _varies_along(array: QArray, axes) -> bool:
    return any(array.scale.shape[axis] > 1 for axis in axes)


def _scale_to_output(scale: jax.Array, batch, remaining, contracting, other_remaining: int,
                     lhs: bool) -> jax.Array:
    """Lay a scale (1 on contracted axes) out like the output: batch, lhs rest, rhs rest."""
    moved = jnp.transpose(scale, (*batch, *remaining, *contracting))
    kept = moved.shape[: len(batch) + len(remaining)]
    batch_part, rest = kept[: len(batch)], kept[len(batch):]
    if lhs:
        return moved.reshape(*batch_part, *rest, *(1,) * other_remaining)
    return moved.reshape(*batch_part, *(1,) * other_remaining, *rest)


def _integer_dot_general(lhs: QArray, rhs: QArray, dimension_numbers, result_type) -> jax.Array:
    (lhs_ca, rhs_ca), (lhs_ba, rhs_ba) = dimension_numbers
    lhs_ra = [a for a in range(lhs.ndim) if a not in lhs_ca and a not in lhs_ba]
    rhs_ra = [a for a in range(rhs.ndim) if a not in rhs_ca and a not in rhs_ba]
    both_int = is_integer_qtype(lhs.qvalue.dtype) and is_integer_qtype(rhs.qvalue.dtype)
    accumulator = jnp.int32 if both_int else result_type
    # XLA's CPU backend rejects an int4 x int4 product ("custom element sizes"); int8 holds the
    # same values, and the int32 sum is the same.
    lhs_values, rhs_values = (v.astype(jnp.int8) if v.dtype == jnp.int4 else v
                              for v in (lhs.qvalue, rhs.qvalue))
    out = ORIGINALS["dot_general"](lhs_values, rhs_values, dimension_numbers,
                                   preferred_element_type=accumulator)
    out = out * _scale_to_output(lhs.scale, lhs_ba, lhs_ra, lhs_ca, len(rhs_ra), lhs=True)
    out = out * _scale_to_output(rhs.scale, rhs_ba, rhs_ra, rhs_ca, len(lhs_ra), lhs=False)
    return out.astype(result_type)


def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None) -> jax.Array:
    """`jax.lax.dot_general` where either operand may be a QArray.

    Returns a float array of the operands' float dtype (the scales' dtype for QArrays).
    """
    (lhs_ca, rhs_ca), _ = dimension_numbers
    fast = (
        isinstance(lhs, QArray) and isinstance(rhs, QArray)
        and lhs.zero_point is None and rhs.zero_point is None
        and not _varies_along(lhs, lhs_ca) and not _varies_along(rhs, rhs_ca)
    )
    if fast:
        result_type = preferred_element_type or jnp.result_type(lhs.scale.dtype, rhs.scale.dtype)
        return _integer_dot_general(lhs, rhs, dimension_numbers, result_type)
    lhs = dequantize(lhs) if isinstance(lhs, QArray) else lhs
    rhs = dequantize(rhs) if isinstance(rhs, QArray) else rhs
    return ORIGINALS["dot_general"](lhs, rhs, dimension_numbers, precision=precision,
                                    preferred_element_type=preferred_element_type)
