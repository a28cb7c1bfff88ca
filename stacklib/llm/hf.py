"""Hugging Face checkpoints of Llama 3 and Qwen3 in and out of `stacklib.llm`'s `Transformer`.

    config, model = hf.load_pretrained("Qwen3-0.6B/")   # a folder: config.json and *.safetensors
    hf.save_pretrained("out/", config, model)           # the same format back
    config = hf.config_from_hf(json.loads(pathlib.Path("Qwen3-0.6B/config.json").read_text()))

Public API (what the inference engine and `serve --model PATH` call):

    load_pretrained(path, *, dtype=jnp.float32) -> tuple[Config, Transformer]
    save_pretrained(path, config, model, *, max_shard_bytes=None) -> None
    config_from_hf(hf_config: dict) -> Config          config_to_hf(config) -> dict
    tensor_map(config) -> list[TensorMapping]            the name-and-layout map, as data

The format. A checkpoint on the Hugging Face Hub is a folder: `config.json` names the
architecture (`architectures`, `model_type`) and its sizes; the weights are in one
`model.safetensors` or in shards `model-00001-of-00004.safetensors`, ... with
`model.safetensors.index.json`, whose `weight_map` says which shard holds each tensor. A
safetensors file is an 8-byte header length, a JSON header (each tensor's name, dtype,
shape and byte range) and the raw bytes: it can be read tensor by tensor, without
executing anything (a pickle could).

The map (`tensor_map`). Our parameters are already named after Hugging Face's (model.py),
so the map is a rename plus one rule about layout:

* **Transposes.** PyTorch's `nn.Linear` stores `weight` as `(out, in)` and computes
  `x @ weight.T`; our `kernel` is `(in, out)`, computed `x @ kernel`. Every projection
  (q, k, v, o, gate, up, down, lm_head) is transposed; embeddings and norm scales are not
  (an embedding is a table `(vocab, d_model)` in both).
* **The head split.** `q_proj.weight` is `(n_heads * head_dim, d_model)`: row
  `h * head_dim + j` is feature j of head h, which is the order in which our attention's
  `reshape(B, T, n_heads, head_dim)` reads the transposed kernel's columns. So the heads
  need no reordering (k and v the same with `n_kv_heads`, o_proj's input columns too).
  The features inside a head are already in the "rotate half" order of our `apply_rope`:
  Hugging Face's conversion of Meta's weights permuted them once, for everyone.
* **Tied embeddings** (`tie_word_embeddings`, Qwen3-0.6B, Llama 3.2 1B): there is no
  `lm_head.weight`; the output projection is the embedding table, transposed on the fly
  (`tie_embeddings` in our config). A file that holds one anyway has it ignored.
* **Qwen3** adds `self_attn.q_norm.weight` and `k_norm.weight`, `(head_dim,)` each
  (`qk_norm`); **Llama 3.1+** adds no tensor, only `rope_scaling` in config.json.

What is refused, each with the name and the fix: a config.json of another architecture (a
bias, a sliding window, another RoPE type, another `model_type`), a tensor the
architecture needs that no file holds, a tensor of another shape, and a tensor left over
that the architecture has no place for.

Mirrors `transformers`' `from_pretrained`/`save_pretrained` for these two families and
tunix's `create_model_from_safe_tensors` (a regex table of names, permutes and reshapes).
Differences: a local folder only (no hub download: `huggingface_hub.snapshot_download`
gives one), two families, the whole model read into memory in `dtype` (no sharded loading
onto a mesh, no lazy loading), and no tokenizer (`stacklib.llm.hf_tokenizer` reads it).
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from safetensors import safe_open
from safetensors.flax import save_file

import stacklib.nn as nnx
from stacklib.llm.config import Config, ConfigError, load_config
from stacklib.llm.model import Transformer

# model_type -> (architectures entry, has Qwen3's q/k norms). Qwen2 (a bias on q, k, v), Mistral
# (a sliding window), Gemma (other norms and scaled embeddings) would each need more than a rename.
FAMILIES = {"llama": ("LlamaForCausalLM", False), "qwen3": ("Qwen3ForCausalLM", True)}

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class CheckpointFormatError(ValueError):
    """A checkpoint this loader cannot read into the configured model; the message names the tensor or key."""


class TensorMapping(NamedTuple):
    """One tensor: our parameter path, Hugging Face's name, and whether the layouts are transposes."""

    ours: tuple[str | int, ...]
    hf: str
    transposed: bool


# Inside decoder layer i: ours under ("layers", i), Hugging Face's under "model.layers.{i}.".
_LAYER_TENSORS = (
    (("input_layernorm", "scale"), "input_layernorm.weight", False),
    (("self_attn", "q_proj", "kernel"), "self_attn.q_proj.weight", True),
    (("self_attn", "k_proj", "kernel"), "self_attn.k_proj.weight", True),
    (("self_attn", "v_proj", "kernel"), "self_attn.v_proj.weight", True),
    (("self_attn", "o_proj", "kernel"), "self_attn.o_proj.weight", True),
    (("post_attention_layernorm", "scale"), "post_attention_layernorm.weight", False),
    (("mlp", "gate_proj", "kernel"), "mlp.gate_proj.weight", True),
    (("mlp", "up_proj", "kernel"), "mlp.up_proj.weight", True),
    (("mlp", "down_proj", "kernel"), "mlp.down_proj.weight", True),
)
_QK_NORM_TENSORS = (
    (("self_attn", "q_norm", "scale"), "self_attn.q_norm.weight", False),
    (("self_attn", "k_norm", "scale"), "self_attn.k_norm.weight", False),
)
# Tensors some files hold that carry nothing our model needs: RoPE's frequencies, which older
# Llama checkpoints saved as a buffer. (A tied model's copy of the embedding as lm_head.weight
# is ignored too: `_check_leftovers`.)
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def tensor_map(config: Config) -> list[TensorMapping]:
    """Every tensor of `config`'s model: our path, Hugging Face's name, transposed or not.

    A pure function of the config (no files), in the checkpoint's order: embedding, layers, norm, head.
    """
    layer_tensors = _LAYER_TENSORS + (_QK_NORM_TENSORS if config.qk_norm else ())
    mapping = [TensorMapping(("embed_tokens", "embedding"), "model.embed_tokens.weight", False)]
    for i in range(config.n_layers):
        mapping += [TensorMapping(("layers", i, *ours), f"model.layers.{i}.{hf}", transposed)
                    for ours, hf, transposed in layer_tensors]
    mapping.append(TensorMapping(("norm", "scale"), "model.norm.weight", False))
    if not config.tie_embeddings:
        mapping.append(TensorMapping(("lm_head", "kernel"), "lm_head.weight", True))
    return mapping


# ---------------------------------------------------------------------------------------------
# config.json


def config_from_hf(hf_config: dict[str, Any]) -> Config:
    """Our `Config` for a Hugging Face `config.json` of a Llama or Qwen3 model.

    Only the model's settings come from the file; the training settings keep their defaults
    (`seq_len` shortened to `max_seq_len` where that is shorter).

    Raises:
      CheckpointFormatError: another architecture, or a feature of these families that our
        model does not have (a bias, a sliding window, another RoPE type); the message
        names the key.
    """
    model_type = hf_config.get("model_type")
    architectures = hf_config.get("architectures") or []
    if model_type not in FAMILIES:
        raise CheckpointFormatError(
            f"config.json has model_type={model_type!r} (architectures {architectures}); this loader reads "
            f"{', '.join(FAMILIES)} checkpoints ({', '.join(a for a, _ in FAMILIES.values())}). Load another "
            "architecture with its own library (transformers, tunix).")
    architecture, qk_norm = FAMILIES[model_type]
    if architectures and architectures != [architecture]:
        raise CheckpointFormatError(
            f"config.json's architectures={architectures} is not [{architecture!r}], the causal LM of "
            f"model_type={model_type!r}: a checkpoint with another head (classification, vision) has other "
            "tensors. Use the base causal-LM checkpoint.")
    for key, allowed in (("attention_bias", False), ("mlp_bias", False), ("use_sliding_window", False),
                         ("hidden_act", "silu")):
        if hf_config.get(key, allowed) != allowed:
            raise CheckpointFormatError(
                f"config.json sets {key}={hf_config[key]!r}; the model here supports only {key}={allowed!r} "
                "(Llama 3's and Qwen3's released checkpoints). Load this one with transformers.")
    n_heads = hf_config["num_attention_heads"]
    max_seq_len = hf_config["max_position_embeddings"]
    values = dict(
        vocab_size=hf_config["vocab_size"], d_model=hf_config["hidden_size"],
        n_layers=hf_config["num_hidden_layers"], n_heads=n_heads,
        n_kv_heads=hf_config.get("num_key_value_heads") or n_heads,
        head_dim=hf_config.get("head_dim") or hf_config["hidden_size"] // n_heads,
        d_ff=hf_config["intermediate_size"], max_seq_len=max_seq_len,
        norm_eps=float(hf_config.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf_config.get("tie_word_embeddings", False)), qk_norm=qk_norm,
        seq_len=min(Config.seq_len, max_seq_len), **_rope_from_hf(hf_config))
    try:
        return load_config(None, **values)
    except ConfigError as error:
        raise CheckpointFormatError(f"config.json does not make a valid model: {error}") from None


def _rope_from_hf(hf_config: dict[str, Any]) -> dict[str, Any]:
    """RoPE's settings: `rope_theta` and `rope_scaling` (transformers 4), or `rope_parameters` (5)."""
    rope = hf_config.get("rope_scaling") or hf_config.get("rope_parameters") or {}
    theta = hf_config.get("rope_theta", rope.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise CheckpointFormatError("config.json rotates only part of each head (partial_rotary_factor="
                                    f"{rope['partial_rotary_factor']}); the model here rotates all of it.")
    if rope_type == "default":
        return dict(rope_theta=float(theta))
    if rope_type != "llama3":
        raise CheckpointFormatError(
            f"config.json's RoPE scaling has rope_type={rope_type!r}; the model here has the default and "
            "'llama3' (Llama 3.1's frequency scaling). Load this one with transformers.")
    try:
        return dict(rope_theta=float(theta), rope_scaling="llama3", rope_scaling_factor=float(rope["factor"]),
                    rope_low_freq_factor=float(rope["low_freq_factor"]),
                    rope_high_freq_factor=float(rope["high_freq_factor"]),
                    rope_original_max_len=int(rope["original_max_position_embeddings"]))
    except KeyError as error:
        raise CheckpointFormatError(f"config.json's llama3 rope_scaling lacks {error.args[0]!r} (it needs "
                                    "factor, low_freq_factor, high_freq_factor, "
                                    "original_max_position_embeddings).") from None


def config_to_hf(config: Config, dtype: Any = jnp.float32) -> dict[str, Any]:
    """The `config.json` of `config`'s model: Qwen3 with `qk_norm`, else Llama (the book's own models too)."""
    model_type = "qwen3" if config.qk_norm else "llama"
    scaling = config.rope_scaling_params
    return {
        "architectures": [FAMILIES[model_type][0]], "model_type": model_type,
        "vocab_size": config.vocab_size, "hidden_size": config.d_model,
        "intermediate_size": config.d_ff, "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads, "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim, "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps, "rope_theta": config.rope_theta,
        "rope_scaling": None if scaling is None else {
            "rope_type": "llama3", "factor": scaling.factor, "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_len},
        "tie_word_embeddings": config.tie_embeddings, "hidden_act": "silu", "attention_bias": False,
        "torch_dtype": jnp.dtype(dtype).name,
    }


# ---------------------------------------------------------------------------------------------
# Reading


def _tensor_files(path: pathlib.Path) -> dict[str, pathlib.Path]:
    """Tensor name -> the file that holds it: from the index if there is one, else every *.safetensors."""
    index = path / INDEX_FILE
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: path / file for name, file in weight_map.items()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} holds no *.safetensors file. A checkpoint folder has config.json "
                                f"and {SINGLE_FILE} (or shards with {INDEX_FILE}).")
    names = {}
    for file in files:
        with safe_open(file, framework="flax") as f:
            names.update(dict.fromkeys(f.keys(), file))
    return names


def _read(file: pathlib.Path, mapping: TensorMapping, expected: tuple[int, ...], dtype: Any) -> jax.Array:
    """One tensor from `file` in our layout and `dtype`, after checking its shape."""
    with safe_open(file, framework="flax") as f:
        if mapping.hf not in f.keys():
            raise CheckpointFormatError(
                f"{mapping.hf} is not in {file.name}, which {INDEX_FILE} says holds it: the download is "
                "incomplete or the index is stale. Download it again.")
        shape = tuple(f.get_slice(mapping.hf).get_shape())
        want = expected[::-1] if mapping.transposed else expected
        if shape != want:
            ours = "/".join(map(str, mapping.ours))
            if len(shape) == 2 and shape == want[::-1]:
                cause = ("it is stored transposed: a PyTorch checkpoint keeps nn.Linear's (out, in) "
                         "layout, so the file was written in (in, out) by a wrong conversion")
            else:
                cause = ("the weights and config.json are of different models: use the config.json of "
                         "the weights")
            raise CheckpointFormatError(
                f"{mapping.hf} in {file.name} has shape {shape}; config.json's sizes make it {want} "
                f"({'the transpose of' if mapping.transposed else 'as'} our {ours} {expected}): {cause}.")
        tensor = f.get_tensor(mapping.hf).astype(dtype)
    return tensor.T if mapping.transposed else tensor


def load_pretrained(path: str | os.PathLike, *, dtype: Any = jnp.float32) -> tuple[Config, Transformer]:
    """The model in a Hugging Face checkpoint folder, and its config.

    Args:
      path: a folder with config.json and model.safetensors, or shards and
        model.safetensors.index.json (what `huggingface_hub.snapshot_download` returns).
      dtype: the parameters' dtype (bfloat16 checkpoints are widened exactly to float32).

    Returns:
      `(config, model)`: `config_from_hf` of config.json, and a `Transformer` holding the weights.

    Raises:
      FileNotFoundError: no config.json or no safetensors file.
      CheckpointFormatError: another architecture, or a tensor missing, misshapen or left over
        (the message names it).
    """
    path = pathlib.Path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} has no config.json: give the checkpoint's folder (the one holding "
                                f"config.json and {SINGLE_FILE}).")
    config = config_from_hf(json.loads((path / "config.json").read_text()))
    files = _tensor_files(path)
    abstract = jax.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract, nnx.Param)
    variables = dict(state.flat_state())  # path -> Param holding a shape; each gets its tensor
    for mapping in tensor_map(config):
        if mapping.hf not in files:
            raise CheckpointFormatError(
                f"{mapping.hf} is missing from {path}: the {config_to_hf(config)['architectures'][0]} that "
                "config.json describes needs it. The download may be incomplete, or the weights are of "
                "another architecture than config.json says.")
        variable = variables[mapping.ours]
        variable.set_value(_read(files[mapping.hf], mapping, variable.shape, dtype))
    _check_leftovers(files, config, path)
    return config, nnx.merge(graphdef, state)


def _check_leftovers(files: dict[str, pathlib.Path], config: Config, path: pathlib.Path) -> None:
    """Refuse tensors the architecture has no place for (a bias, a norm of another family)."""
    known = {mapping.hf for mapping in tensor_map(config)}
    if config.tie_embeddings:
        known.add("lm_head.weight")  # a tied model's copy of the embedding: ignored
    leftover = sorted(name for name in files if name not in known and not name.endswith(_IGNORED_SUFFIXES))
    if leftover:
        raise CheckpointFormatError(
            f"{path} holds {len(leftover)} tensor(s) that config.json's architecture has no place for, first "
            f"{leftover[0]}: the weights are of another architecture (a bias, another family's norm), or "
            "config.json is not theirs.")


# ---------------------------------------------------------------------------------------------
# Writing


def save_pretrained(path: str | os.PathLike, config: Config, model: Transformer, *,
                    max_shard_bytes: int | None = None) -> None:
    """Write `model` as a Hugging Face checkpoint: config.json and model.safetensors (or shards).

    The files load with `load_pretrained`, with `transformers`' `from_pretrained` and with
    tunix's `create_model_from_safe_tensors`.

    Args:
      path: the folder to write (created if needed; files of the same names are replaced).
      config: the model's config (`config.json` is written from it).
      model: a `Transformer` of that config.
      max_shard_bytes: cut the weights into shards of at most this many bytes each (a
        tensor larger than that gets a shard of its own), with model.safetensors.index.json,
        as `save_pretrained(max_shard_size=...)` does; None: one file.

    Raises:
      CheckpointFormatError: the model's parameters do not have `config`'s shapes.
    """
    path = pathlib.Path(path)
    params = {p: jnp.asarray(v[...]) for p, v in nnx.state(model, nnx.Param).flat_state()}
    _check_shapes(config, params)
    tensors = {m.hf: params[m.ours].T if m.transposed else params[m.ours] for m in tensor_map(config)}
    path.mkdir(parents=True, exist_ok=True)
    dtype = next(iter(tensors.values())).dtype
    (path / "config.json").write_text(json.dumps(config_to_hf(config, dtype), indent=2) + "\n")
    shards = _shards(tensors, max_shard_bytes)
    if len(shards) == 1:
        save_file(tensors, path / SINGLE_FILE, metadata={"format": "pt"})  # "pt": transformers reads it
        return
    weight_map = {}
    for k, shard in enumerate(shards, start=1):
        name = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: tensors[n] for n in shard}, path / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.size * t.dtype.itemsize for t in tensors.values())
    (path / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": int(total)},
                                               "weight_map": weight_map}, indent=2) + "\n")


def _check_shapes(config: Config, params: dict[tuple, jax.Array]) -> None:
    """Refuse a model whose parameters are not those of `config` (missing, extra or misshapen)."""
    abstract = jax.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    expected = {p: v.shape for p, v in nnx.state(abstract, nnx.Param).flat_state()}
    for path in sorted(expected.keys() | params.keys(), key=str):
        name, got, want = "/".join(map(str, path)), params.get(path), expected.get(path)
        if got is None or want is None:
            has, lacks = ("config's model", "the model") if got is None else ("the model", "config's model")
            raise CheckpointFormatError(f"{has} has a parameter {name} that {lacks} has not: save the model "
                                        "with the config it was built from (model.config).")
        if got.shape != want:
            raise CheckpointFormatError(f"The model's {name} has shape {got.shape}, but config makes it "
                                        f"{want}: save the model with the config it was built from "
                                        "(model.config).")


def _shards(tensors: dict[str, jax.Array], max_bytes: int | None) -> list[list[str]]:
    """Tensor names in consecutive groups of at most `max_bytes` each (one group if None)."""
    if max_bytes is None:
        return [list(tensors)]
    shards, size = [[]], 0
    for name, tensor in tensors.items():
        nbytes = tensor.size * tensor.dtype.itemsize
        if shards[-1] and size + nbytes > max_bytes:
            shards, size = [*shards, []], 0
        shards[-1].append(name)
        size += nbytes
    return shards


__all__ = ["CheckpointFormatError", "FAMILIES", "TensorMapping", "config_from_hf", "config_to_hf",
           "load_pretrained", "save_pretrained", "tensor_map"]
