"""stacklib.quant: non-intrusive quantization by rules on module paths, a subset of Qwix.

Use it where you would use `qwix` (0.1.8) on an NNX model: `import stacklib.quant as qwix`.

    rules = [qwix.QuantizationRule(module_path=".*", weight_qtype=jnp.int8)]
    ptq_model = qwix.quantize_model(model, qwix.PtqProvider(rules), x)   # a copy; weights int8

The subset, file by file:
  qarray.py        QArray, quantize, dequantize, calibrate (absmax/minmax), int8/int4/fp8,
                   per-tensor, per-channel and tiled scales, with qwix's rounding and bounds
  rules.py         QuantizationRule, QuantizationProvider (first match wins, get_unused_rules)
  interception.py  how a model's own contractions are routed to the provider
  dot_general.py   dot_general on QArrays (dequantize-first, or integer product + rescale)
  ptq.py           PtqProvider, QuantStat (static activation scales), quantize_params
  qt.py            QtProvider: QAT with fake quantization and straight-through gradients
  lora.py          LoraRule, LoraProvider, LoRAParam, apply_lora_to_model (QLoRA)
  model.py         quantize_model

It works on `stacklib.nn` models; the original model is never changed. Each file's
docstring lists its differences from qwix.
"""

from stacklib.quant.lora import LoRAParam, LoraProvider, LoraRule, apply_lora_to_model
from stacklib.quant.model import quantize_model
from stacklib.quant.ptq import PtqProvider, QuantStat, quantize_params
from stacklib.quant.qarray import HowToQuantize, QArray, calibrate, dequantize, quantize
from stacklib.quant.qt import QtProvider
from stacklib.quant.rules import QuantizationProvider, QuantizationRule

QtRule = QuantizationRule  # qwix's QtRule adds backward-pass options we do not have

__all__ = [
    "HowToQuantize", "LoRAParam", "LoraProvider", "LoraRule", "PtqProvider", "QArray", "QtProvider",
    "QtRule", "QuantStat", "QuantizationProvider", "QuantizationRule", "apply_lora_to_model", "calibrate",
    "dequantize", "quantize", "quantize_model", "quantize_params",
]
