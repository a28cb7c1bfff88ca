"""Rules, and the provider that matches them against module paths.

Mirrors `qwix.QuantizationRule` and `qwix.QuantizationProvider` (qwix/_src/qconfig.py,
qwix 0.1.8).

A rule is a key plus a config. The key is `module_path`, a regular expression that must
match the *whole* '/'-joined path of the module doing a contraction (`re.fullmatch`:
'hidden' matches the module at path 'hidden', not 'hidden2' nor 'block/hidden'), and
`op_names`, the operations it applies to (empty: all). The config says what to quantize:
`weight_qtype`, `act_qtype`, `tile_size` and the calibration methods. Rules are tried in
order and the *first* match wins, so put specific rules before a catch-all '.*'.

A provider counts how often each rule matched while the model ran; `get_unused_rules()`
lists those that never did, which is how a typo in a regex becomes visible instead of
silently leaving a layer in float.

Differences from qwix:
- `QuantizationRule` validates its fields when it is built (an unknown qtype, a tile size
  <= 0, static activation scales without `act_qtype`) and says how to fix them; qwix
  checks some of this later, inside the provider.
- No `act_batch_axes` beyond the default (0,) and no ODML providers.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Collection, Sequence
from typing import Any

from stacklib.quant.interception import ORIGINALS
from stacklib.quant.qarray import CALIBRATION_METHODS, canonical_qtype

OP_NAMES = ("dot_general", "einsum")


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantizationRule:
    """Which contractions to quantize (`module_path`, `op_names`) and how.

    Attributes:
      module_path: regex, full-matched against the module's '/'-joined path ('' is the root).
      op_names: ops the rule applies to ('dot_general', 'einsum'); empty means all.
        `jnp.dot` counts as 'dot_general', as in qwix.
      weight_qtype: quantize the weight operand (a Param of the module) to this type.
      act_qtype: also quantize the activation operand (w8a8: both int8).
      tile_size: one scale per `tile_size` elements of the last contracting axis (sub-channel
        quantization); None means one scale per output channel.
      act_static_scale: compute the activation scale once, from the sample inputs given to
        `quantize_model` (calibration data), instead of from each batch.
      weight_calibration_method, act_calibration_method: 'absmax' or 'minmax' (optionally
        ',factor').
    """

    module_path: str = ".*"
    op_names: Collection[str] = ()
    weight_qtype: Any = None
    act_qtype: Any = None
    tile_size: int | float | None = None
    act_static_scale: bool = False
    weight_calibration_method: str = "absmax"
    act_calibration_method: str = "absmax"
    act_batch_axes: tuple[int, ...] = (0,)

    def __post_init__(self):
        try:
            re.compile(self.module_path)
        except re.error as error:
            raise ValueError(f"module_path={self.module_path!r} is not a valid regex: {error}.") from None
        if isinstance(self.op_names, str):
            raise ValueError(f"op_names={self.op_names!r} must be a collection, "
                             f"e.g. op_names=({self.op_names!r},).")
        unknown = set(self.op_names) - set(OP_NAMES)
        if unknown:
            raise ValueError(f"op_names has unknown ops {sorted(unknown)}; known ops are {OP_NAMES}.")
        object.__setattr__(self, "op_names", tuple(self.op_names))
        if self.weight_qtype is not None:
            qtype = canonical_qtype(self.weight_qtype, argument="weight_qtype")
            object.__setattr__(self, "weight_qtype", qtype)
        if self.act_qtype is not None:
            object.__setattr__(self, "act_qtype", canonical_qtype(self.act_qtype, argument="act_qtype"))
        if self.tile_size is not None and not self.tile_size > 0:
            raise ValueError(
                f"tile_size={self.tile_size!r} must be positive: a number of elements per scale "
                "(e.g. 32) or a fraction of the axis (0.25 for four tiles); None for per-channel."
            )
        if self.act_static_scale and self.act_qtype is None:
            raise ValueError("act_static_scale=True needs act_qtype (e.g. act_qtype=jnp.int8): "
                             "there is no activation quantization to calibrate.")
        for name in ("weight_calibration_method", "act_calibration_method"):
            method = getattr(self, name)
            if method.lower().split(",")[0] not in CALIBRATION_METHODS:
                raise ValueError(f"{name}={method!r} is not supported; use one of {CALIBRATION_METHODS}.")


class QuantizationProvider:
    """Matches rules against the module paths of the contractions a model runs.

    Subclasses (PtqProvider, QtProvider, LoraProvider) override `dot_general`/`einsum`,
    which the interception (interception.py) calls instead of `jax.lax.dot_general` and
    `jnp.einsum` while a quantized model runs. The base class computes in float.
    """

    def __init__(self, rules: Sequence[QuantizationRule]):
        if isinstance(rules, QuantizationRule):
            rules = [rules]
        for index, rule in enumerate(rules):
            if not isinstance(rule, QuantizationRule):
                raise TypeError(f"rules[{index}] is a {type(rule).__name__}, not a QuantizationRule.")
        self._rules = list(rules)
        self._rule_matches = [0] * len(self._rules)
        self._paths_seen: set[str] = set()
        self._initial_run_complete = False

    @property
    def rules(self) -> list[QuantizationRule]:
        return list(self._rules)

    def match(self, module_path: str | None, op_name: str) -> QuantizationRule | None:
        """The first rule whose regex full-matches `module_path` and whose ops include `op_name`."""
        if module_path is None:
            return None
        self._paths_seen.add(module_path)
        for index, rule in enumerate(self._rules):
            op_matches = not rule.op_names or op_name in rule.op_names
            if op_matches and re.fullmatch(rule.module_path, module_path):
                self._rule_matches[index] += 1
                return rule
        return None

    def get_unused_rules(self) -> list[QuantizationRule]:
        """Rules that matched no contraction while the model ran.

        Raises:
          ValueError: the model has not run yet (call `quantize_model` first).
        """
        if not self._initial_run_complete:
            raise ValueError("The model has not run with this provider yet: call "
                             "quantize_model(model, provider, *sample_inputs) first.")
        return [rule for rule, count in zip(self._rules, self._rule_matches, strict=True) if count == 0]

    def paths_seen(self) -> list[str]:
        """Module paths that ran a contraction (to write a regex that matches them)."""
        return sorted(self._paths_seen)

    # -- the intercepted operations (float by default) -------------------------------------
    def dot_general(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kwargs):
        return ORIGINALS["dot_general"](lhs, rhs, dimension_numbers, precision=precision,
                                        preferred_element_type=preferred_element_type, **kwargs)

    def einsum(self, subscripts, *operands, **kwargs):
        return ORIGINALS["einsum"](subscripts, *operands, **kwargs)
