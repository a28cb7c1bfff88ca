"""A model zoo: `pretrained(name)` returns a trained model, training it once per machine.

Chapters 13-15 start from a trained language model. Downloading one is not allowed (the
book needs no network at run time) and training it in every notebook would cost a
minute each, so the first call trains it deterministically with `train.py` and caches the
parameters; later calls, in any process, load them in a second:

    model, tokenizer = stacklib.llm.pretrained("stdlib-bytes")
    model = stacklib.llm.zoo.load_model_dir(folder)   # a folder in the zoo's format (the engine's)

The cache is `$STACKLIB_CACHE/llm/<name>/` (default `~/.cache/stacklib/llm/<name>/`).
The protocol is `stacklib.checkpoint.zoo`'s, shared by every zoo (its docstring explains
it): trained in a fresh process with one CPU device and one core, so the files are the same
whoever asks first; serialised by an exclusive lock, so training happens once; written
atomically and checksummed; a cache that is broken or stale (of another architecture than
the zoo's entry now asks for) is deleted and rebuilt with a warning. This file holds what
is particular to language models: the zoo's configs, and how to build and load a
`Transformer`.

Differences from `transformers.AutoModel.from_pretrained`, whose shape it mirrors: no hub,
no revisions; the "weights" are a function of this library's code and this Python's
standard library, so a cache is only valid on the CPU instruction set that made it.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

import jax

import stacklib.checkpoint as ocp
import stacklib.nn as nnx
from stacklib.checkpoint.zoo import CACHE_ENV as CACHE_ENV  # re-exported: tests and users set it
from stacklib.checkpoint.zoo import StaleCacheError, cache_root, load_or_build, open_latest, write_atomically
from stacklib.llm import train
from stacklib.llm.config import MODEL_KEYS, OPEN_MODEL_KEYS, Config, load_config
from stacklib.llm.model import Transformer
from stacklib.llm.tokenizer import ByteTokenizer

# name -> the settings that differ from configs/base.yml. Each trains in about a minute
# on an idle 2-core CPU.
ZOO: dict[str, dict[str, Any]] = {
    "stdlib-bytes": dict(d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=192,
                         seq_len=128, batch_size=16, steps=300, learning_rate=3e-3),
}


def register(name: str, **overrides: Any) -> None:
    """Add a model to the zoo: `overrides` of the base config (checked now)."""
    load_config(None, **{**overrides, "progress": False})
    ZOO[name] = dict(overrides)


def cache_dir() -> pathlib.Path:
    """Where trained models are kept: `$STACKLIB_CACHE/llm`, default `~/.cache/stacklib/llm`."""
    return cache_root() / "llm"


def zoo_config(name: str) -> Config:
    """The full config of zoo model `name`.

    Raises:
      KeyError: no such model; the message lists the zoo.
    """
    if name not in ZOO:
        raise KeyError(f"No model {name!r} in the zoo; choose one of {sorted(ZOO)}, or "
                       "stacklib.llm.zoo.register(name, **config_overrides) a new one.")
    return load_config(None, **{**ZOO[name], "progress": False, "checkpoint_dir": "", "metrics_file": ""})


def _abstract_params(config: Config) -> tuple[nnx.GraphDef, Any]:
    """The graphdef and parameter shapes of `config`'s model, without initialising it."""
    abstract = jax.eval_shape(lambda: train.make_model(config))
    graphdef, params = nnx.split(abstract, nnx.Param)
    return graphdef, params


def load_model_dir(directory: str | os.PathLike, config: Config | None = None) -> Transformer:
    """The model saved in `directory` in the zoo's format (`params` and `config` items).

    Args:
      directory: a folder the zoo (or `write_atomically` with the same items) wrote.
      config: the architecture the caller expects, checked against the saved one; default:
        the saved architecture.

    Raises:
      FileNotFoundError: the folder holds no committed model.
      ArchitectureMismatchError: the saved model is not `config`'s architecture.
    """
    directory = pathlib.Path(directory)
    manager, step = open_latest(directory, "; save one with stacklib.llm.pretrained (the zoo's format: "
                                           "params + config).")
    saved = manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore())).config
    if config is None:  # the saved architecture; a training length the model can hold
        architecture = {key: saved[key] for key in MODEL_KEYS}
        architecture |= {key: saved[key] for key in OPEN_MODEL_KEYS if key in saved}  # absent: the default
        config = load_config(None, **architecture, progress=False, seq_len=saved["max_seq_len"])
    config.check_checkpoint(saved, str(directory))  # ArchitectureMismatchError for other MODEL_KEYS
    graphdef, abstract = _abstract_params(config)
    restored = manager.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(abstract)))
    return nnx.merge(graphdef, restored.params)


def _load_cached(directory: pathlib.Path, config: Config) -> Transformer:
    """The cached model; one of another architecture is stale (the zoo's entry changed since)."""
    try:
        return load_model_dir(directory, config)
    except train.ArchitectureMismatchError as error:
        raise StaleCacheError(str(error)) from error


def build(directory: str, config: dict[str, Any]) -> None:
    """Train the model of `config` (a full `Config` dict) and write it into `directory`.

    Run by stacklib.checkpoint.zoo in the fixed build process; call `pretrained` instead.
    """
    config = load_config(None, **config)
    result = train.train(config)
    write_atomically(pathlib.Path(directory), config.steps, {
        "params": ocp.args.StandardSave(result.params),
        "config": ocp.args.JsonSave(config.to_dict()),
        "metrics": ocp.args.JsonSave({"eval_loss": result.eval_loss, "losses": result.losses})})


def pretrained(name: str = "stdlib-bytes") -> tuple[Transformer, ByteTokenizer]:
    """Zoo model `name` and its tokenizer, trained on the first call and cached after.

    Safe to call from several processes at once: one trains, the others wait and load.

    Raises:
      KeyError: `name` is not in the zoo.
    """
    config = zoo_config(name)
    model = load_or_build(cache_dir() / name, lambda directory: _load_cached(directory, config),
                          "stacklib.llm.zoo:build", {"config": config.to_dict()})
    return model, ByteTokenizer()
