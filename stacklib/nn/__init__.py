"""stacklib.nn: modules whose state is a pytree, a documented subset of Flax NNX.

Use it where you would use `flax.nnx` (flax 0.12.8): `import stacklib.nn as nnx`.

    class MLP(nnx.Module):
        def __init__(self, din, dout, *, rngs: nnx.Rngs):
            self.linear = nnx.Linear(din, dout, rngs=rngs)

        def __call__(self, x):
            return nnx.relu(self.linear(x))

    model = MLP(3, 4, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)   # pure pytrees for jax.jit/grad
    model = nnx.merge(graphdef, params, rest)                    # and back

The subset, file by file:
  variables.py      Variable, Param, BatchStat (boxes with `[...]`, `.value`, metadata),
                    VariableMetadata, with_metadata
  module.py         Module (a pytree; train/eval, iter_modules, set_attributes), iter_graph,
                    List, Dict, data
  rngs.py           Rngs, RngStream, RngState, RngKey, RngCount
  filters.py        filters for split/state: types, ..., tags, Not, Any, All, PathContains
  state.py          State, to_pure_dict, replace_by_pure_dict
  graph.py          split, merge, state, graphdef, update, clone, GraphDef (for a module, a
                    list or dict of them, a Variable or a leaf)
  linear.py         Linear, LinearGeneral, Embed
  normalization.py  LayerNorm, RMSNorm
  stochastic.py     Dropout
  attention.py      MultiHeadAttention, dot_product_attention, make_causal_mask
  helpers.py        Sequential, summary (ours: a plain-text parameter table)
  spmd.py           with_partitioning (logical axis names as `out_sharding` metadata)
  initializers.py   jax.nn.initializers, as flax re-exports them
  digits_classifier.py  ours, not flax's, and not imported here: chapter 02's digits MLP,
                    its data and its training loop, for every layer above to share

Training uses the functional path: `split` outside `jax.jit`, `merge` inside, `split`
again on the way out, `update` to write back. A module is also a pytree, as in flax 0.12,
so `jax.jit(lambda m, x: m(x))(model, x)` runs, but what the module changes inside (a
dropout counter) stays inside. The lifted transforms `nnx.jit`/`nnx.grad` are not
included; chapter 02 explains why and shows the pattern they wrap.
Each file's docstring lists its differences from flax.nnx.
"""

from jax.nn import gelu, log_softmax, one_hot, relu, sigmoid, silu, softmax, tanh

from stacklib.nn import initializers
from stacklib.nn.attention import MultiHeadAttention, dot_product_attention, make_causal_mask
from stacklib.nn.filters import All, Any, Not, OfType, PathContains
from stacklib.nn.graph import GraphDef, clone, graphdef, merge, split, state, update
from stacklib.nn.helpers import Sequential, summary
from stacklib.nn.linear import Embed, Linear, LinearGeneral
from stacklib.nn.module import Dict, List, Module, Object, data, iter_graph
from stacklib.nn.normalization import LayerNorm, RMSNorm
from stacklib.nn.rngs import RngCount, RngKey, Rngs, RngState, RngStream
from stacklib.nn.spmd import with_partitioning
from stacklib.nn.state import State, replace_by_pure_dict, to_flat_state, to_pure_dict
from stacklib.nn.stochastic import Dropout
from stacklib.nn.variables import BatchStat, Param, Variable, VariableMetadata, with_metadata

__all__ = [
    "All", "Any", "BatchStat", "Dict", "Dropout", "Embed", "GraphDef", "LayerNorm", "Linear",
    "LinearGeneral", "List", "Module", "MultiHeadAttention", "Not", "Object", "OfType", "Param",
    "PathContains", "RMSNorm", "RngCount", "RngKey", "RngState", "RngStream", "Rngs", "Sequential",
    "State", "Variable", "VariableMetadata", "clone", "data", "dot_product_attention", "gelu",
    "graphdef", "initializers", "iter_graph", "log_softmax", "make_causal_mask", "merge", "one_hot",
    "relu", "replace_by_pure_dict", "sigmoid", "silu", "softmax", "split", "state", "summary",
    "tanh", "to_flat_state", "to_pure_dict", "update", "with_metadata", "with_partitioning",
]
