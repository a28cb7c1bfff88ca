"""The decoder as a pipeline: its layers cut into stages on the mesh's `pipeline` axis.

Mirrors MaxText's `ici_pipeline_parallelism` and `num_pipeline_microbatches`: with
`pipeline_parallelism=p` the decoder layers' weights are stacked on a leading layer axis
and cut into p stages of n_layers / p consecutive layers, and the stage axis is sharded
over the `pipeline` mesh axis, so each device holds and updates only its stage's layers
(and their optimizer moments). The embedding runs before the pipeline, the final norm,
head and loss after it, on the whole batch; chapter 07's `parallel.pipeline_apply` runs
the layers in between, microbatch by microbatch, handing activations to the next stage
with `ppermute`.

    staged = stage_layers(params, p)      # layers/{i}/... (L leaves)  ->  layers/... (p, L / p, ...)
    params = unstage_layers(staged)       # and back: checkpoints stay keyed per layer

A staged state is an ordinary pytree, so the optimizer updates it leaf by leaf as before;
only weight decay, which decides by a leaf's rank, needs `staged_decay_mask`. Because
checkpoints are written per layer, a pipelined run's checkpoint restores into a run
without a pipeline, or with another number of stages.

Differences from MaxText: GPipe's schedule only, without circular pipelines
(`num_pipeline_repeats`) or delayed activation forwarding; any number of microbatches that
divides each data shard's rows (MaxText asks for a multiple of the stage count); positions
are 0..T-1 in every row (no packed segments); MaxText's scanned layers stay stacked in its
checkpoints, ours are unstacked into model.py's names.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

import stacklib.nn as nnx
from stacklib import parallel
from stacklib.llm.config import Config
from stacklib.llm.model import rope_angles

PIPELINE_AXIS = "pipeline"

# Logical names of a staged leaf's two new leading axes: stages are spread over the pipeline
# axis; the layers of one stage stay together on its devices.
PIPELINE_RULES = (("stage", PIPELINE_AXIS),)


def _is_model_state(node: Any) -> bool:
    """The model's parameters, or a tree of their shape in the optimizer state (Adam's moments)."""
    return isinstance(node, Mapping) and "layers" in node


def _map_model_states(fn: Callable, tree: Any) -> Any:
    """`tree` with `fn` applied to each model-shaped state in it; other leaves as they are."""
    def apply(node):
        return fn(node) if _is_model_state(node) else node

    return jax.tree.map(apply, tree, is_leaf=_is_model_state)


def _is_staged(layers: Mapping) -> bool:
    return not all(isinstance(key, int) for key in layers)  # per layer, the keys are 0..L-1


def _with_layers(state: Mapping, layers: Any) -> Any:
    """A copy of `state` (a State or a dict) whose `layers` entry is `layers`."""
    return type(state)({**state, "layers": layers})


def _renamed(tree: Any, rename: Callable[[tuple], tuple]) -> Any:
    """`tree` with every Variable's logical axis names (its `out_sharding` metadata) renamed.

    A leaf without names stays without: it is replicated, staged or not.
    """

    def one(leaf):
        names = leaf.get_metadata().get("out_sharding") if isinstance(leaf, nnx.Variable) else None
        if names is None:
            return leaf
        return type(leaf)(leaf[...], **{**leaf.get_metadata(), "out_sharding": rename(tuple(names))})

    return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


def stage_layers(tree: Any, num_stages: int) -> Any:
    """Stack the decoder layers of every model-shaped state in `tree` into (stages, L / stages, ...) leaves.

    `tree` may be the parameters, the optimizer state or both; all but the layers stays as
    it is. Each layer leaf's logical names get "stage" and "layer" in front, so that
    `PIPELINE_RULES` shard the stage axis over the pipeline and the rest as before.

    Raises:
      ValueError: the layers do not split into `num_stages` equal stages.
    """

    def stage(state):
        layers = state["layers"]
        # L trees of (...) leaves -> one tree of (L, ...) leaves -> (stages, L / stages, ...)
        stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *(layers[i] for i in range(len(layers))))
        staged = parallel.stack_stages(stacked, num_stages)
        return _with_layers(state, _renamed(staged, lambda names: ("stage", "layer", *names)))

    return _map_model_states(stage, tree)


def unstage_layers(tree: Any) -> Any:
    """The inverse of `stage_layers`: per-layer entries layers/0, layers/1, ... again.

    Trees that are not staged come back as they are, so a checkpoint written through
    this function is keyed per layer whichever way the run was trained.
    """

    def unstage(state):
        layers = state["layers"]
        if not _is_staged(layers):
            return state
        # (stages, L / stages, ...) -> (L, ...) -> L trees of (...) leaves
        flat = _renamed(jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), layers), lambda names: names[2:])
        num_layers = jax.tree.leaves(flat)[0].shape[0]
        per_layer = {i: jax.tree.map(lambda a, i=i: a[i], flat) for i in range(num_layers)}
        return _with_layers(state, type(layers)(per_layer))

    return _map_model_states(unstage, tree)


def staged_decay_mask(params: Any) -> Any:
    """Weight decay on the model's matrices only (`train.decay_mask`), for staged parameters too.

    A staged layer leaf has two more leading axes: a norm's scale is (stages, L / stages,
    d_model), still a vector of the model, and must stay undecayed. Per-layer parameters
    get `train.decay_mask`'s answer.
    """

    def mask(state):
        leading = 2 if _is_staged(state["layers"]) else 0
        layers = jax.tree.map(lambda p: p.ndim - leading > 1, state["layers"])
        return _with_layers(jax.tree.map(lambda p: p.ndim > 1, state), layers)

    return _map_model_states(mask, params)


def make_forward(graphdef: nnx.GraphDef, params: Any, config: Config, mesh: Mesh) -> Callable:
    """`forward(staged_params, tokens) -> logits`: the model's own forward pass, its layers pipelined.

    Args:
      graphdef, params: the model as `nnx.split(model, nnx.Param)` gives it, per layer; only
        their structure is read.
      config: `pipeline_parallelism` stages, `num_microbatches` microbatches, `remat`.
      mesh: the training mesh, with a `pipeline` axis of `pipeline_parallelism` devices.

    Returns:
      A function of staged parameters (`stage_layers`) and tokens (B, T), returning the
      float32 logits (B, T, vocab) that `Transformer.__call__` returns for the same weights.
    """
    model = nnx.merge(graphdef, params)
    layer_def = nnx.graphdef(model.layers[0])
    model.layers = []  # what is left runs outside the pipeline: the embedding, final norm and head
    ends_def = nnx.graphdef(model)

    def layer(layer_params, x):
        """One decoder layer, as the model's loop runs it: (b, T, d_model) -> (b, T, d_model)."""
        b, T, _ = x.shape
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (b, T))  # (b, T): the model's default
        cos, sin = rope_angles(positions, config.head_dim, config.rope_theta,  # (b, T, head_dim / 2)
                               config.rope_scaling_params)
        return nnx.merge(layer_def, layer_params)(x, cos, sin, positions)[0]

    if config.remat:  # as the model's remat: keep each layer's input, recompute the rest backwards
        layer = jax.checkpoint(layer)

    def forward(params, tokens):
        ends = nnx.merge(ends_def, {key: value for key, value in params.items() if key != "layers"})
        x = ends.embed_tokens(tokens)  # (B, T, d_model)
        x = parallel.pipeline_apply(params["layers"], x, mesh=mesh, num_microbatches=config.num_microbatches,
                                    axis_name=PIPELINE_AXIS, layer=layer)
        return ends.head(x)  # (B, T, vocab)

    return forward
