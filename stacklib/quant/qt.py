"""Quantization-aware training: `QtProvider`.

Mirrors `qwix.QtProvider` (qwix/_src/providers/qt.py and core/dot_general_qt.py, qwix 0.1.8)
for forward-pass quantization.

QAT trains the float weights while the forward pass sees them quantized ("fake
quantization": quantize, then compute with the quantized values), so the network learns
weights that survive rounding. Rounding has zero derivative almost everywhere, so the
backward pass pretends it is not there: the *straight-through estimator* (STE),

    forward:  y = dot(q(x), q(w))
    backward: dx = g . w^T,   dw = x^T . g        (q replaced by the identity)

As in qwix, the backward products use the *original* float operands (qwix's
`use_original_residuals`), and the scale is a constant to the gradient (its calibration is
an input of the custom VJP whose cotangent is dropped). With 'absmax' or 'minmax' nothing is
clipped, so no gradient is masked. After training, `quantize_model(qat_model, PtqProvider(same
rules), x)` stores the weights as integers, and the PTQ model computes what the QAT model
computed.

Differences from qwix: no quantized backward pass (`bwd_qtype`), no static activation scales
in training (`act_static_scale` is rejected), no stochastic rounding.
"""

from __future__ import annotations

import functools

import jax

from stacklib.quant import dot_general as qdot
from stacklib.quant.interception import ORIGINALS, current_module, find_param
from stacklib.quant.qarray import (
    HowToQuantize,
    calibrate,
    compute_scale_zero_point,
    quantize_with_scale_zero_point,
)
from stacklib.quant.rules import QuantizationProvider


def _fake_quantized(array, how: HowToQuantize | None, calibration):
    if how is None:
        return array
    scale, zero_point = compute_scale_zero_point(calibration, how.qtype)
    return quantize_with_scale_zero_point(array, how.qtype, scale, zero_point)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def dot_general_qt(lhs, rhs, lhs_calibration, rhs_calibration, dimension_numbers, lhs_how, rhs_how):
    """Forward: the quantized product. Backward: the float product's VJP (the STE)."""
    return _forward(lhs, rhs, lhs_calibration, rhs_calibration, dimension_numbers, lhs_how, rhs_how)[0]


def _forward(lhs, rhs, lhs_calibration, rhs_calibration, dimension_numbers, lhs_how, rhs_how):
    out = qdot.dot_general(_fake_quantized(lhs, lhs_how, lhs_calibration),
                           _fake_quantized(rhs, rhs_how, rhs_calibration), dimension_numbers)
    return out, (lhs, rhs)


def _backward(dimension_numbers, lhs_how, rhs_how, residuals, g):
    lhs, rhs = residuals
    _, vjp = jax.vjp(lambda a, b: ORIGINALS["dot_general"](a, b, dimension_numbers), lhs, rhs)
    dlhs, drhs = vjp(g)
    return dlhs, drhs, None, None


dot_general_qt.defvjp(_forward, _backward)


class QtProvider(QuantizationProvider):
    """Quantization-aware training: fake-quantized forward, straight-through gradients."""

    def __init__(self, rules):
        super().__init__(rules)
        for rule in self._rules:
            if rule.act_static_scale:
                raise ValueError("QtProvider computes activation scales from each batch: "
                                 "set act_static_scale=False (use static scales with PtqProvider).")

    def dot_general(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kwargs):
        module, path = current_module()
        rule = self.match(path, "dot_general")
        if rule is None or rule.weight_qtype is None:
            return ORIGINALS["dot_general"](lhs, rhs, dimension_numbers, precision=precision,
                                            preferred_element_type=preferred_element_type, **kwargs)
        ndims = (len(lhs.shape), len(rhs.shape))
        hows, calibrations = [], []
        for for_lhs, operand in ((True, lhs), (False, rhs)):
            if find_param(module, operand):
                qtype, method = rule.weight_qtype, rule.weight_calibration_method
            else:
                qtype, method = rule.act_qtype, rule.act_calibration_method
            how = None if qtype is None else qdot.how_to_quantize(
                dimension_numbers, ndims, for_lhs=for_lhs, qtype=qtype, tile_size=rule.tile_size,
                calibration_method=method)
            hows.append(how)
            calibrations.append(None if how is None else calibrate(operand, how))
        return dot_general_qt(lhs, rhs, *calibrations, dimension_numbers, *hows)
