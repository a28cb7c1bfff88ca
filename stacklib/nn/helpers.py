"""`Sequential`, and a printed summary of a model's parameters.

`Sequential` mirrors `flax.nnx.Sequential` (flax/nnx/helpers.py, flax 0.12.8): it keeps
its callables in `self.layers`, so the state of `Sequential(Linear, relu, Linear)` has
paths `layers/0/kernel`, `layers/2/kernel` (the activation has no state).

`summary` is ours: flax's nearest equivalent, `nnx.tabulate`, runs the model on sample
inputs and renders a rich table; `summary` only reads the Variables, so it needs no
inputs and prints plain text.

Differences from flax.nnx: `Sequential` does not forward an `rngs=` call argument to its
layers; `summary` is not `nnx.tabulate` (no output shapes, no FLOPs).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from stacklib.nn.graph import state
from stacklib.nn.module import Module
from stacklib.nn.state import path_str


class Sequential(Module):
    """Apply callables in order: `Sequential(f, g, h)(x) == h(g(f(x)))`.

    A tuple output is unpacked into the next call's positional arguments and a dict
    output into its keyword arguments, as in flax.
    """

    def __init__(self, *fns: Callable[..., Any]):
        self.layers = list(fns)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.layers:
            return args[0] if len(args) == 1 else (args or kwargs or None)
        output: Any = None
        for i, f in enumerate(self.layers):
            if not callable(f):
                raise TypeError(f"Sequential.layers[{i}] is not callable: {f!r}")
            if i > 0:
                if isinstance(output, tuple):
                    args, kwargs = output, {}
                elif isinstance(output, dict):
                    args, kwargs = (), output
                else:
                    args, kwargs = (output,), {}
            output = f(*args, **kwargs)
        return output


def summary(module: Module) -> str:
    """A table of every Variable in `module`: path, type, shape, dtype and size, with totals.

    Example output:

        path          type   shape    dtype    count
        hidden/bias   Param  (32,)    float32     32
        ...
        total: Param 2,410 (9.4 KiB)
    """
    rows = []
    totals: dict[str, list[int]] = {}
    for path, variable in state(module).flat_state():
        value = variable.get_value()
        shape = tuple(np.shape(value))
        size = int(np.prod(shape))
        dtype = str(value.dtype) if not jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key) else "key"
        nbytes = size * (np.dtype(value.dtype).itemsize if dtype != "key" else 8)
        kind = type(variable).__name__
        rows.append((path_str(path), kind, str(shape), dtype, f"{size:,}"))
        count, memory = totals.setdefault(kind, [0, 0])
        totals[kind] = [count + size, memory + nbytes]
    header = ("path", "type", "shape", "dtype", "count")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(5)]
    lines = [
        "  ".join(row[i].rjust(w) if i == 4 else row[i].ljust(w) for i, w in enumerate(widths))
        for row in [header, *rows]
    ]
    order = sorted(totals, key=lambda kind: (kind != "Param", kind))  # parameters first
    kinds = [f"{kind} {totals[kind][0]:,} ({totals[kind][1] / 1024:.1f} KiB)" for kind in order]
    lines.append("total: " + ", ".join(kinds))
    return "\n".join(lines)
