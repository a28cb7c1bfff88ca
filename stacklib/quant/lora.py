"""LoRA and QLoRA: `LoraRule`, `LoraProvider`, `apply_lora_to_model`.

Mirrors `qwix.LoraRule`, `qwix.LoraProvider` and `qwix.apply_lora_to_model`
(qwix/_src/providers/lora.py, qwix 0.1.8).

LoRA freezes a weight W (in, out) and learns a low-rank correction beside it:

    y = x W + (alpha / rank) * (x A) B,    A: (in, rank), B: (rank, out)

A starts random (He-uniform), B starts at zero, so the adapted model starts out computing
exactly what the base model computes. Only A and B train: rank * (in + out) numbers instead
of in * out. A `LoraRule` with a `weight_qtype` is QLoRA: the provider is a `PtqProvider`,
so the frozen base is stored as int8/int4 and only the small float adapters are trained.

The adapters are `LoRAParam`s named '<weight>_lora_a' / '<weight>_lora_b' on the module
that owns the weight (qwix's names), created on the first call; train them alone with
`nnx.split(model, LoRAParam, ...)`.

Differences from qwix: `dot_general` only (no einsum or conv adapters), no batch axes on
the weight, no `dropout` on the adapter's input.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax

from stacklib.nn.variables import Param
from stacklib.quant.interception import ORIGINALS, current_module, current_session, find_param
from stacklib.quant.model import quantize_model
from stacklib.quant.ptq import PtqProvider
from stacklib.quant.rules import QuantizationRule


class LoRAParam(Param):
    """A LoRA adapter weight: a Param, so it trains; its own type, so it can be split off."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraRule(QuantizationRule):
    """A rule that adds rank-`rank` adapters, scaled by `alpha / rank`, to matched weights.

    With `weight_qtype` set, the frozen base weight is also quantized (QLoRA).
    """

    rank: int
    alpha: float
    lora_a_initializer: Callable[..., jax.Array] = jax.nn.initializers.he_uniform()
    lora_b_initializer: Callable[..., jax.Array] = jax.nn.initializers.zeros

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.rank, int) or self.rank <= 0:
            raise ValueError(f"LoraRule(rank={self.rank!r}): the rank must be a positive integer, "
                             "e.g. rank=8 (the adapters are (in, rank) and (rank, out)).")


class LoraProvider(PtqProvider):
    """(Q)LoRA: the base contraction as in PTQ (float if the rule has no weight_qtype), plus
    the adapters' low-rank product.

    `LoraProvider(module_path=".*", rank=4, alpha=8.0)` builds the one rule for you.
    """

    def __init__(self, rules=None, **rule_fields: Any):
        if rules is None:
            rules = [LoraRule(**rule_fields)]
        elif rule_fields:
            raise ValueError("Give either `rules` or the fields of one LoraRule, not both.")
        super().__init__(rules)
        self.rngs = None

    def dot_general(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kwargs):
        module, path = current_module()
        rule = self.match(path, "dot_general")
        op_id = current_session().next_op_id(module, "dot_general") if module is not None else None
        weight_name = find_param(module, rhs)
        out = self._quantized_dot_general(module, rule, op_id, lhs, rhs, dimension_numbers, precision,
                                          preferred_element_type, **kwargs)
        if not isinstance(rule, LoraRule) or weight_name is None:
            return out
        (lhs_ca, rhs_ca), (lhs_ba, rhs_ba) = dimension_numbers
        if lhs_ba or rhs_ba:
            raise NotImplementedError(f"LoRA on {path}: contractions with batch axes are not supported.")
        rhs_shape = getattr(module, weight_name).shape
        contract_shape = tuple(rhs_shape[a] for a in rhs_ca)
        remain_shape = tuple(d for a, d in enumerate(rhs_shape) if a not in rhs_ca)
        lora_a, lora_b = self._adapters(module, weight_name, rule, math.prod(contract_shape),
                                        math.prod(remain_shape))
        # (..., contract) x (contract..., rank) -> (..., rank); then (..., rank) x (rank, remain...)
        a = lora_a.reshape(*contract_shape, rule.rank)
        hidden = ORIGINALS["dot_general"](lhs, a, ((lhs_ca, tuple(range(len(rhs_ca)))), ((), ())),
                                           precision=precision)
        b = lora_b.reshape(rule.rank, *remain_shape)
        delta = ORIGINALS["dot_general"](hidden, b, (((hidden.ndim - 1,), (0,)), ((), ())),
                                         precision=precision)
        return out + delta * (rule.alpha / rule.rank)

    def _adapters(self, module, name: str, rule: LoraRule, fan_in: int, fan_out: int):
        if not hasattr(module, name + "_lora_a"):
            if self.rngs is None:
                raise ValueError("LoRA adapters need random keys: "
                                 "pass rngs=nnx.Rngs(0) to apply_lora_to_model.")
            base = getattr(module, name)[...]
            dtype = base.dtype  # a QArray's dtype is its scale's: the float type
            setattr(module, name + "_lora_a",
                    LoRAParam(rule.lora_a_initializer(self.rngs.params(), (fan_in, rule.rank), dtype)))
            setattr(module, name + "_lora_b",
                    LoRAParam(rule.lora_b_initializer(self.rngs.params(), (rule.rank, fan_out), dtype)))
        return getattr(module, name + "_lora_a")[...], getattr(module, name + "_lora_b")[...]


def apply_lora_to_model(model, provider: LoraProvider, *sample_inputs, rngs=None, **sample_kwargs):
    """Add (Q)LoRA adapters to a copy of `model`: `quantize_model` with keys for the adapters.

    Raises:
      ValueError: `rngs` is missing (the adapters' A matrices are random).
    """
    if rngs is None:
        raise ValueError("apply_lora_to_model needs rngs for the adapters' initial A: "
                         "apply_lora_to_model(model, provider, x, rngs=nnx.Rngs(0)).")
    provider.rngs = rngs
    try:
        return quantize_model(model, provider, *sample_inputs, **sample_kwargs)
    finally:
        provider.rngs = None


__all__ = ["LoRAParam", "LoraProvider", "LoraRule", "apply_lora_to_model"]
