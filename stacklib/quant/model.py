"""`quantize_model`: a quantized copy of a `stacklib.nn` model, its code unchanged.

Mirrors `qwix.quantize_model` for NNX models (qwix/_src/model.py, qwix 0.1.8).

The copy (`nnx.clone`) gets a new class, a subclass of the model's own whose `__call__`
runs the original `__call__` inside `intercept(provider, self)`. Nothing else changes: the
copy is still a `stacklib.nn.Module`, so it splits, merges, jits and checkpoints like any
other, and `merge` rebuilds it with the same subclass, so it stays quantized. The copy is
then called once on the sample inputs, which is when PTQ replaces its weights by QArrays,
static activation scales are calibrated and LoRA adapters are created. The original model
is never touched.

Why interception rather than rewriting the model's jaxpr (chapter 01 interprets jaxprs)?
A jaxpr has no module paths: `dot_general` equations do not say which layer they came from,
so rules on paths could only match after we re-attached names, and the rewritten function
would be fixed to the sample's shapes. Interception sees the live module, keeps the model
an ordinary module, and quantizes its state in place. Its price is the same as in qwix:
only calls that go through the public `jax.lax.dot_general`/`jnp.einsum`/`jnp.dot` are seen,
so `x @ w` stays float (`get_unused_rules` and the warning below make that visible).

Only the root's `__call__` is intercepted, as in qwix 0.1.8 for NNX models ("only
intercepts the `call_method` of the nnx module for now"): calling a submodule of the
quantized copy directly (`qmodel.hidden(x)`) runs in float. Call the root.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

from stacklib.nn.graph import clone
from stacklib.nn.module import Module
from stacklib.quant.interception import intercept
from stacklib.quant.rules import QuantizationProvider


def _intercepted_call(provider: QuantizationProvider, call):
    @functools.wraps(call)
    def __call__(self, *args, **kwargs):
        with intercept(provider, self):
            return call(self, *args, **kwargs)

    return __call__


def quantize_model(model: Module, provider: QuantizationProvider, *sample_inputs: Any,
                   **sample_kwargs: Any) -> Module:
    """A quantized copy of `model`, run once on `sample_inputs`.

    Args:
      model: a `stacklib.nn.Module` (float, QAT-trained, or already quantized).
      provider: PtqProvider, QtProvider or LoraProvider, with its rules.
      *sample_inputs, **sample_kwargs: arguments for one call of the model. Their values
        matter only for static activation scales (they are the calibration data).

    Returns:
      The quantized copy. `provider.get_unused_rules()` then lists rules that matched nothing.

    Raises:
      TypeError: `model` is not a stacklib.nn.Module, or `provider` is not a provider.
      ValueError: no sample inputs were given.
    """
    if not isinstance(model, Module):
        raise TypeError(f"quantize_model takes a stacklib.nn.Module, got {type(model).__name__}. "
                        "(For a flax.nnx model use qwix.quantize_model.)")
    if not isinstance(provider, QuantizationProvider):
        raise TypeError("provider must be a PtqProvider, QtProvider or LoraProvider, "
                        f"got {type(provider).__name__}.")
    if not sample_inputs and not sample_kwargs:
        raise ValueError("quantize_model needs sample inputs: it runs the model once to find its "
                         "contractions. Call quantize_model(model, provider, x) with a batch like the ones "
                         "the model will see (for static activation scales, your calibration data).")
    quantized = clone(model)
    base = getattr(type(model), "_unquantized_type", type(model))
    quantized.__class__ = type(base.__name__, (base,), {
        "_unquantized_type": base,
        "__call__": _intercepted_call(provider, base.__call__),
    })
    quantized(*sample_inputs, **sample_kwargs)
    provider._initial_run_complete = True
    unused = provider.get_unused_rules()
    if unused:
        listed = "; ".join(f"module_path={r.module_path!r} op_names={tuple(r.op_names)}" for r in unused)
        warnings.warn(f"{len(unused)} rule(s) matched no contraction and quantized nothing: {listed}. "
                      f"Paths that ran a contraction: {provider.paths_seen()}. A layer that computes "
                      "with `@` or jnp.matmul is not intercepted.", stacklevel=2)
    return quantized
