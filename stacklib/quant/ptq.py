"""Post-training quantization: `PtqProvider` and `quantize_params`.

Mirrors `qwix.PtqProvider` and `qwix.quantize_params` (qwix/_src/providers/ptq.py, qwix 0.1.8).

PTQ takes a trained float model and stores its weights as integers. Which weights, and how,
is only known when a contraction runs (its dimension numbers decide the per-channel axes),
so, as in qwix, the first call of the model (inside `quantize_model`) quantizes each
matched weight and *replaces* the module's `Param` with one holding a `QArray`. Later calls
find the QArray and skip the float weight entirely. The `HowToQuantize` is kept in the
Param's metadata (qwix wraps it in a `WithAux`), so `quantize_params` can later quantize a
float checkpoint for this model without running it.

Activations (`act_qtype`) are quantized on every call: per row from the batch itself
(dynamic), or, with `act_static_scale=True`, with one scale computed from the sample inputs
given to `quantize_model` (static: calibration data), stored as a `QuantStat` named
'<op>_lhs_scale' on the module.

Differences from qwix: static scales are calibrated only from the sample inputs of
`quantize_model` (qwix can also take running statistics collected by QAT); no linen, no
convolutions.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from stacklib.nn.graph import state as nn_state
from stacklib.nn.state import State, to_pure_dict
from stacklib.nn.variables import Param, Variable
from stacklib.quant import dot_general as qdot
from stacklib.quant.interception import ORIGINALS, current_module, current_session, find_param
from stacklib.quant.qarray import (
    HowToQuantize,
    QArray,
    calibrate,
    compute_scale_zero_point,
    dequantize,
    quantize_how,
    quantize_with_scale_zero_point,
)
from stacklib.quant.rules import QuantizationProvider, QuantizationRule


class QuantStat(Variable):
    """A statistic computed from calibration data (a static activation scale); not trained."""


def replace_with_quantized(module, name: str, array: jax.Array, how: HowToQuantize) -> QArray:
    """Quantize `module.<name>` and put the QArray in a new Param, keeping the metadata."""
    quantized = quantize_how(array, how)
    old = getattr(module, name)
    setattr(module, name, type(old)(quantized, **{**old.metadata, "quantization": how}))
    return quantized


def quantize_activation(module, array: jax.Array, how: HowToQuantize, rule: QuantizationRule,
                        name: str) -> QArray:
    """Dynamic scales from `array` itself, or static ones calibrated on the first call."""
    if not rule.act_static_scale:
        return quantize_how(array, how)
    if not hasattr(module, name + "_scale"):
        calibration = {key: value.mean(axis=rule.act_batch_axes, keepdims=True)
                       for key, value in calibrate(array, how).items()}
        scale, zero_point = compute_scale_zero_point(calibration, how.qtype)
        setattr(module, name + "_scale", QuantStat(scale, quantization=how))
        if zero_point is not None:
            setattr(module, name + "_zero_point", QuantStat(zero_point))
    scale = getattr(module, name + "_scale")[...]
    zero_point = getattr(module, name + "_zero_point")[...] if hasattr(module, name + "_zero_point") else None
    return quantize_with_scale_zero_point(array, how.qtype, scale, zero_point)


class PtqProvider(QuantizationProvider):
    """Post-training quantization: matched weights become QArrays on the first call.

    Usage (as in qwix):

        rules = [QuantizationRule(module_path=".*", weight_qtype=jnp.int8)]
        ptq_model = quantize_model(model, PtqProvider(rules), sample_x)
    """

    def dot_general(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kwargs):
        module, path = current_module()
        rule = self.match(path, "dot_general")
        op_id = current_session().next_op_id(module, "dot_general") if module is not None else None
        return self._quantized_dot_general(module, rule, op_id, lhs, rhs, dimension_numbers, precision,
                                           preferred_element_type, **kwargs)

    def _quantized_dot_general(self, module, rule, op_id, lhs, rhs, dimension_numbers, precision,
                               preferred_element_type, **kwargs):
        if rule is None or rule.weight_qtype is None:
            return ORIGINALS["dot_general"](lhs, rhs, dimension_numbers, precision=precision,
                                            preferred_element_type=preferred_element_type, **kwargs)
        ndims = (len(lhs.shape), len(rhs.shape))

        def how(for_lhs, qtype, method):
            return qdot.how_to_quantize(dimension_numbers, ndims, for_lhs=for_lhs, qtype=qtype,
                                        tile_size=rule.tile_size, calibration_method=method)

        if not isinstance(rhs, QArray):
            if name := find_param(module, rhs):
                rhs = replace_with_quantized(module, name, rhs, how(False, rule.weight_qtype,
                                                                    rule.weight_calibration_method))
            elif rule.act_qtype is not None:
                act_how = how(False, rule.act_qtype, rule.act_calibration_method)
                rhs = quantize_activation(module, rhs, act_how, rule, op_id + "_rhs")
        if rule.act_qtype is not None and not isinstance(lhs, QArray):
            lhs = quantize_activation(module, lhs, how(True, rule.act_qtype, rule.act_calibration_method),
                                      rule, op_id + "_lhs")
        return qdot.dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type)

    def einsum(self, subscripts, *operands, **kwargs):
        """Two-operand einsums with a weight: quantize it per kept axis, then compute in float."""
        module, path = current_module()
        rule = self.match(path, "einsum")
        if rule is None or rule.weight_qtype is None or len(operands) != 2:
            return ORIGINALS["einsum"](subscripts, *operands, **kwargs)
        inputs, output = subscripts.replace(" ", "").split("->")
        specs = inputs.split(",")
        quantized = []
        for spec, operand in zip(specs, operands, strict=True):
            kept = tuple(axis for axis, letter in enumerate(spec) if letter in output)
            if isinstance(operand, QArray):
                quantized.append(operand)
            elif name := find_param(module, operand):
                how = HowToQuantize(qtype=rule.weight_qtype, channelwise_axes=kept,
                                    calibration_method=rule.weight_calibration_method)
                quantized.append(replace_with_quantized(module, name, operand, how))
            elif rule.act_qtype is not None:
                how = HowToQuantize(qtype=rule.act_qtype, channelwise_axes=kept,
                                    calibration_method=rule.act_calibration_method)
                quantized.append(quantize_how(operand, how))
            else:
                quantized.append(operand)
        floats = [dequantize(q) if isinstance(q, QArray) else q for q in quantized]
        return ORIGINALS["einsum"](subscripts, *floats, **kwargs)


def quantize_params(params: Mapping | State, abstract_quantized_model: Any) -> dict:
    """Quantize a float checkpoint into the parameters of a PTQ model, without running it.

    Args:
      params: the float parameters, as `nnx.to_pure_dict(nnx.state(float_model))` (or a State),
        e.g. restored from a checkpoint. May be a subtree of the model's state.
      abstract_quantized_model: a model returned by `quantize_model(..., PtqProvider(...))`:
        its Params carry how each weight is quantized.

    Returns:
      A pure dict with QArrays where the model has them, ready for `nnx.update(model, ...)`.

    Raises:
      ValueError: `params` has a path the quantized model does not have.
    """
    if isinstance(params, State):
        params = to_pure_dict(params)
    targets = dict(nn_state(abstract_quantized_model).flat_state())
    result: dict = {}

    def walk(tree: Mapping, prefix: tuple, out: dict):
        for key, value in tree.items():
            path = (*prefix, key)
            if isinstance(value, Mapping):
                walk(value, path, out.setdefault(key, {}))
                continue
            if path not in targets:
                raise ValueError(f"quantize_params: the quantized model has no parameter at "
                                 f"{'/'.join(map(str, path))}. Pass the float state of the same model.")
            target = targets[path]
            how = target.get_metadata("quantization", None) if isinstance(target, Param) else None
            out[key] = quantize_how(jnp.asarray(value), how) if how is not None else value

    walk(params, (), result)
    return result
