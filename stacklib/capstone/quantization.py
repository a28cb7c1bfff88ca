"""Stage 5: int8 post-training quantization with `stacklib.quant`, scored before and after.

Every linear layer's kernel becomes int8 with one scale per output channel (qwix's PTQ,
chapter 11, by the rule the inference engine applies for `quantization="int8"`, so stage 6
serves exactly this model); the embedding, the norms and the activations stay float. The quantized
model is the same `stacklib.nn` module with QArrays where the kernels were, so it splits,
merges and jits like any other; its score on the same held-out data is compared with
the float model's, and the weight memory before and after is counted.

The margin is stated in `LOSS_MARGIN` (held-out loss, nats per byte) and
`ACCURACY_MARGIN` (task accuracy, points): quantization may cost at most that much.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

import stacklib.nn as nnx
import stacklib.optim as optax
from stacklib.infer.quantization import quantize_weights, weight_bytes

LOSS_MARGIN = 0.01  # nats per byte: the int8 model's held-out loss may be at most this much higher
ACCURACY_MARGIN = 2.0  # points of task accuracy the int8 model may lose (chapter 16 shows what it lost)


def loss_function(model: nnx.Module) -> Callable[[np.ndarray], float]:
    """A jitted `loss(batch)`: mean next-token cross-entropy of `model` on (B, T + 1) records."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def loss(state, batch):
        logits = nnx.merge(graphdef, state)(batch[:, :-1])  # (B, T, vocab)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

    return lambda batch: float(loss(state, batch))


def heldout_loss(model: nnx.Module, batches: list[np.ndarray]) -> float:
    """Mean loss over `batches` (nats per byte)."""
    loss = loss_function(model)
    return float(np.mean([loss(b) for b in batches]))


@dataclasses.dataclass
class QuantResult:
    """What stage 5 measured."""

    quantized: Any  # the int8 model
    float_loss: float
    int8_loss: float
    float_bytes: int
    int8_bytes: int
    float_accuracy: float | None = None  # task accuracy, when a task is given
    int8_accuracy: float | None = None

    @property
    def loss_increase(self) -> float:
        return self.int8_loss - self.float_loss

    @property
    def within_margin(self) -> bool:
        ok = self.loss_increase <= LOSS_MARGIN
        if self.float_accuracy is not None:
            ok = ok and self.float_accuracy - self.int8_accuracy <= ACCURACY_MARGIN
        return ok


def quantize_and_score(model: nnx.Module, batches: list[np.ndarray],
                       accuracy: Callable[[nnx.Module], float] | None = None) -> QuantResult:
    """Stage 5: quantize `model`, score both on held-out `batches` (and on a task, if given).

    Args:
      model: the float model.
      batches: held-out (B, T + 1) token records.
      accuracy: optional `accuracy(model) -> percent` on a held-out task.
    """
    quantized = quantize_weights(model, "int8")  # the rules the engine serves with (stage 6)
    result = QuantResult(quantized, heldout_loss(model, batches), heldout_loss(quantized, batches),
                         weight_bytes(nnx.state(model, nnx.Param)),
                         weight_bytes(nnx.state(quantized, nnx.Param)))
    if accuracy is not None:
        result.float_accuracy, result.int8_accuracy = accuracy(model), accuracy(quantized)
    return result
