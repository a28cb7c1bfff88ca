"""The same Hugging Face checkpoints in tunix's Qwen3 and Llama 3: the reference for `hf.py`'s parity.

Tunix (google-tunix 0.1.7, in the test extra) ships JAX implementations of both families,
written independently of ours (einsum kernels of shape `(d_model, heads, head_dim)`, its own
RoPE, RMSNorm and attention), with a loader from safetensors and a creator of models with
random weights. This module drives them the way a tunix user does, so that a test or the
chapter can ask "do our logits equal tunix's on this checkpoint?":

    hf_config = hf_tunix.dummy_checkpoint(folder, "qwen3", num_hidden_layers=2, ...)  # random weights
    theirs = hf_tunix.load(folder)                  # tunix's create_model_from_safe_tensors
    logits = hf_tunix.logits(theirs, tokens)        # (B, T, vocab), causal

`dummy_checkpoint` draws random weights for tunix's model and writes them in Hugging
Face's layout by running tunix's own name-and-layout table (its `params.py`) backwards, so
the file's names and layouts are tunix's reading of the format, not ours.

What tunix 0.1.7's models do not have, and the checkpoints here therefore avoid: both
apply RoPE with theta = 1,000,000 whatever the config says, and neither implements Llama
3.1's `rope_scaling` (our scaling is checked against Meta's formula instead, in
tests/test_llm_hf.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

TUNIX_ROPE_THETA = 1_000_000.0  # what tunix 0.1.7's Qwen3 and Llama3 apply, whatever their config says


def _family(model_type: str) -> tuple[Any, Any]:
    """tunix's model and params modules for a config.json's model_type (imported on first use)."""
    if model_type == "qwen3":
        from tunix.models.qwen3 import model, params
    elif model_type == "llama":
        from tunix.models.llama3 import model, params
    else:
        raise ValueError(f"tunix has no model here for model_type={model_type!r}; use 'qwen3' or 'llama'.")
    return model, params


def tunix_config(hf_config: dict[str, Any]) -> Any:
    """tunix's `ModelConfig` for a Hugging Face config.json (a named preset, resized)."""
    model, _ = _family(hf_config["model_type"])
    qwen = hf_config["model_type"] == "qwen3"
    preset = model.ModelConfig.qwen3_0p6b() if qwen else model.ModelConfig.llama3p2_1b()
    sizes = dict(num_layers=hf_config["num_hidden_layers"], vocab_size=hf_config["vocab_size"],
                 embed_dim=hf_config["hidden_size"], hidden_dim=hf_config["intermediate_size"],
                 num_heads=hf_config["num_attention_heads"], head_dim=hf_config["head_dim"],
                 num_kv_heads=hf_config["num_key_value_heads"], norm_eps=hf_config["rms_norm_eps"],
                 rope_theta=int(hf_config["rope_theta"]))
    tied = {"use_tied_embedding" if qwen else "weight_tying": hf_config["tie_word_embeddings"]}
    return dataclasses.replace(preset, **sizes, **tied)


def hf_config_for(model_type: str, *, vocab_size: int, hidden_size: int, intermediate_size: int,
                  num_hidden_layers: int, num_attention_heads: int, num_key_value_heads: int, head_dim: int,
                  max_position_embeddings: int, tie_word_embeddings: bool,
                  rms_norm_eps: float = 1e-6) -> dict[str, Any]:
    """A config.json of the given sizes, in the form the Hub's Qwen3 and Llama 3 checkpoints have."""
    architecture = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}[model_type]
    return {"architectures": [architecture], "model_type": model_type, "vocab_size": vocab_size,
            "hidden_size": hidden_size, "intermediate_size": intermediate_size,
            "num_hidden_layers": num_hidden_layers, "num_attention_heads": num_attention_heads,
            "num_key_value_heads": num_key_value_heads, "head_dim": head_dim,
            "max_position_embeddings": max_position_embeddings, "rms_norm_eps": rms_norm_eps,
            "rope_theta": TUNIX_ROPE_THETA, "rope_scaling": None, "tie_word_embeddings": tie_word_embeddings,
            "hidden_act": "silu", "attention_bias": False, "torch_dtype": "float32"}


def _hf_tensors(model: Any, key_mapping: dict[str, tuple[str, Any]]) -> dict[str, np.ndarray]:
    """A tunix model's weights under Hugging Face's names and layouts: tunix's loading table, inverted.

    Loading, tunix matches a file's name against a regex, transposes (`permute`) and reshapes to its
    own layout; here each of its parameters is matched against the target, reshaped back to 2-D
    and transposed back.
    """
    from flax import nnx as flax_nnx

    state = flax_nnx.state(model, flax_nnx.Param).flat_state()
    ours = {".".join(str(part) for part in path): np.asarray(variable[...]) for path, variable in state}
    tensors = {}
    for hf_pattern, (tunix_template, transform) in key_mapping.items():
        tunix_pattern = re.sub(r"\\\\(\d)", r"([0-9]+)", re.escape(tunix_template))
        for name, value in ours.items():
            match = re.fullmatch(tunix_pattern, name)
            if match is None:
                continue
            hf_name = hf_pattern.replace(r"\.", ".")
            for group in match.groups():
                hf_name = hf_name.replace("([0-9]+)", group, 1)
            if transform is not None:
                permute, reshape = transform
                if reshape is not None:  # q, k, v: (d, heads, head_dim) -> (d, heads * head_dim);
                    heads_first = name.endswith("o_proj.w")  # o: (heads, head_dim, d) -> (heads*head_dim, d)
                    value = value.reshape((-1, value.shape[-1]) if heads_first else (value.shape[0], -1))
                value = value.transpose(np.argsort(permute))
            tensors[hf_name] = np.ascontiguousarray(value)
    return tensors


def dummy_checkpoint(path: str | os.PathLike, model_type: str, *, seed: int = 0, scale: float = 0.1,
                     **sizes: Any) -> dict[str, Any]:
    """Write a checkpoint of random weights for tunix's model into `path`; return its config.json.

    As tunix's `dummy_model_creator.create_dummy_model` does, every parameter of tunix's
    abstract model is drawn from `scale * N(0, 1)` (here with NumPy, which is much faster on
    a CPU than its per-shape compiled draws); the norm scales get 1 added, as trained models'
    are near 1. Then tunix's loading table, inverted, writes them under Hugging Face's names.

    Args:
      path: the folder to write (config.json and model.safetensors).
      model_type: "qwen3" or "llama".
      seed, scale: the draw.
      **sizes: `hf_config_for`'s keyword arguments.
    """
    from flax import nnx as flax_nnx
    from safetensors.numpy import save_file

    hf_config = hf_config_for(model_type, **sizes)
    model, params = _family(model_type)
    model_class = model.Qwen3 if model_type == "qwen3" else model.Llama3
    config = tunix_config(hf_config)
    abstract = flax_nnx.eval_shape(lambda: model_class(config, rngs=flax_nnx.Rngs(params=0)))
    graphdef, state = flax_nnx.split(abstract)
    rng = np.random.default_rng(seed)
    state = jax.tree.map(lambda leaf: jnp.asarray(scale * rng.standard_normal(leaf.shape), jnp.float32),
                         state)
    tensors = _hf_tensors(flax_nnx.merge(graphdef, state), params._get_key_and_transform_mapping(config))
    tensors = {name: value + 1 if name.endswith("norm.weight") else value for name, value in tensors.items()}
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    return hf_config


def load(path: str | os.PathLike) -> Any:
    """tunix's model of the checkpoint in `path`, loaded by tunix's `create_model_from_safe_tensors`."""
    hf_config = json.loads((pathlib.Path(path) / "config.json").read_text())
    _, params = _family(hf_config["model_type"])
    return params.create_model_from_safe_tensors(str(path), tunix_config(hf_config), dtype=jnp.float32)


def forward(model: Any) -> Callable[[Any], jax.Array]:
    """A compiled function: tokens (B, T) -> tunix's logits (B, T, vocab), causal from position 0."""
    from flax import nnx as flax_nnx

    graphdef, state = flax_nnx.split(model)  # tunix's configs are not hashable: close over the graphdef

    @jax.jit
    def run(state, tokens):
        B, T = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        mask = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))  # query t sees keys <= t
        out, _ = flax_nnx.merge(graphdef, state)(tokens, positions, None, mask)
        return out.astype(jnp.float32)

    return lambda tokens: run(state, jnp.asarray(tokens, jnp.int32))


def logits(model: Any, tokens: Any) -> jax.Array:
    """tunix's logits (B, T, vocab) for `tokens` (B, T), each row from position 0, causal."""
    return forward(model)(tokens)


def greedy(model: Any, prompt: Any, max_new_tokens: int) -> np.ndarray:
    """Greedy continuation of `prompt` (B, T0) by tunix's model, recomputing the sequence per token.

    The whole buffer of `T0 + max_new_tokens` runs every time (one compilation): the model is
    causal, so the slots not yet filled do not change the logits before them.
    """
    prompt = np.asarray(prompt, np.int32)
    B, T0 = prompt.shape
    tokens = np.zeros((B, T0 + max_new_tokens), np.int32)
    tokens[:, :T0] = prompt
    run = forward(model)
    for t in range(T0, T0 + max_new_tokens):
        tokens[:, t] = np.asarray(jnp.argmax(run(tokens)[:, t - 1], axis=-1))
    return tokens
