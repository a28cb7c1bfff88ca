"""Quantized serving: the engine's model with chapter 11's weight-only int8 or int4 weights.

    LLM("grpo", quantization="int8")          # or: python -m stacklib.infer.serve --quantization int8

Decoding one token at a time is bound by reading the weights, not by arithmetic: every step
reads every weight once for a handful of tokens. Storing them in 8 or 4 bits instead of 32
cuts what each step reads by 4× or 8×. `quantize_weights` does it with `stacklib.quant`,
chapter 11's Qwix, by rule rather than by a hand-written path: one `QuantizationRule` that
matches every module, weight-only (activations stay float), one scale per output channel
(absmax / 127.5 for int8, / 7.5 for int4). PTQ runs the model once on a sample, which is
when each matched `Linear`'s kernel becomes a `QArray`; the copy's class intercepts its own
calls, so every later call, the engine's paged steps included, contracts with the QArrays.
The token embedding is a lookup, not a contraction, and stays float, as in qwix.

Mirrors vLLM's `quantization=` argument and its TPU backend's Qwix path (tpu-inference
quantizes a model with qwix rules at load time). Differences: weight-only PTQ of a float
model at load time only (vLLM also loads checkpoints already quantized: AWQ, GPTQ, fp8);
the QArray is dequantized before each matmul (XLA has no int4 matmul on CPU), so the gain
on this CPU is memory, not speed.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

import stacklib.quant as qwix

QTYPES = {"int8": jnp.int8, "int4": jnp.int4}


def quantize_weights(model: Any, quantization: str) -> Any:
    """A copy of the chapter-12 `model` whose matmul weights are `quantization` ('int8' or 'int4').

    Raises:
      ValueError: an unknown quantization (the message lists the known ones).
    """
    if quantization not in QTYPES:
        raise ValueError(f"quantization={quantization!r} is not one of {', '.join(QTYPES)}.")
    rules = [qwix.QuantizationRule(module_path=".*", weight_qtype=QTYPES[quantization])]
    sample = jnp.zeros((1, 8), jnp.int32)  # PTQ's one run: weight-only scales ignore the values
    return qwix.quantize_model(model, qwix.PtqProvider(rules), sample)


def weight_bytes(params: Any) -> int:
    """Bytes the model's parameters take: a QArray's values at their bit width, plus its scales."""
    leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, qwix.QArray))
    return sum(leaf.nbytes if isinstance(leaf, qwix.QArray) else leaf.size * leaf.dtype.itemsize
               for leaf in leaves)
