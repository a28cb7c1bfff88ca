"""Trained diffusion models, trained once per machine and cached, like `stacklib.llm.zoo`.

    model, config = stacklib.diffusion.pretrained("digits-flow")   # rectified flow: sample with "euler"
    model, config = stacklib.diffusion.pretrained("digits-ddpm")   # noise prediction: "ddim" or "ddpm"

Each is configs/base.yml with a few settings changed, trained for 1500 and 1200 steps (about 35
and 30 s on one core). The cache is `$STACKLIB_CACHE/diffusion/<name>/` (default `~/.cache/stacklib/
diffusion/<name>/`), and the protocol is `stacklib.checkpoint.zoo`'s (its docstring explains
it): trained in a fresh process with one CPU device and one core, so the files are the same
whoever asks first; serialised by a lock; written atomically; a cache that fails to load is
deleted and rebuilt with a warning. The training time is kept apart (the `timing` item), as
the one thing that differs between two builds.

Differences from MaxDiffusion, which loads pretrained weights from the Hugging Face hub
(`pretrained_model_name_or_path`): ours are trained here, from the code, with no download.
"""

from __future__ import annotations

import pathlib
from typing import Any

import jax

import stacklib.checkpoint as ocp
import stacklib.nn as nnx
from stacklib.checkpoint.zoo import StaleCacheError, cache_root, load_or_build, open_latest, write_atomically
from stacklib.diffusion import train
from stacklib.diffusion.config import Config, load_config
from stacklib.diffusion.model import DiT

# name -> the settings that differ from configs/base.yml.
ZOO: dict[str, dict[str, Any]] = {
    "digits-flow": dict(objective="flow"),
    "digits-ddpm": dict(objective="ddpm", steps=1200),  # the two together: about a minute on one core
}


def cache_dir() -> pathlib.Path:
    """`$STACKLIB_CACHE/diffusion`, default `~/.cache/stacklib/diffusion`: beside the llm zoo's folder."""
    return cache_root() / "diffusion"


def zoo_config(name: str) -> Config:
    """The full config of zoo model `name`.

    Raises:
      KeyError: no such model; the message lists the zoo.
    """
    if name not in ZOO:
        raise KeyError(f"No diffusion model {name!r} in the zoo; choose one of {sorted(ZOO)}, or add "
                       "stacklib.diffusion.zoo.ZOO[name] = {config overrides}.")
    return load_config(None, **{**ZOO[name], "progress": False, "checkpoint_dir": ""})


def _load(directory: pathlib.Path, config: Config) -> tuple[DiT, Config]:
    manager, step = open_latest(directory)
    saved = manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore())).config
    if saved != config.to_dict():
        raise StaleCacheError("the cached model was trained with another config")
    graphdef, abstract = nnx.split(jax.eval_shape(lambda: train.make_model(config)), nnx.Param)
    restored = manager.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(abstract)))
    return nnx.merge(graphdef, restored.params), config


def build(directory: str, config: dict[str, Any]) -> None:
    """Train the model of `config` (a full `Config` dict) and write it into `directory`.

    Run by stacklib.checkpoint.zoo in the fixed build process; call `pretrained` instead.
    """
    config = load_config(None, **config)
    result = train.train(config)
    write_atomically(pathlib.Path(directory), config.steps, {
        "params": ocp.args.StandardSave(result.params),
        "config": ocp.args.JsonSave(config.to_dict()),
        "metrics": ocp.args.JsonSave({"losses": result.losses}),
        "timing": ocp.args.JsonSave({"seconds": result.seconds})})


def losses(name: str) -> list[float]:
    """The training losses (mean of each `log_every` steps) of zoo model `name`, trained if needed."""
    pretrained(name)
    manager, step = open_latest(cache_dir() / name)
    return manager.restore(step, args=ocp.args.Composite(metrics=ocp.args.JsonRestore())).metrics["losses"]


def pretrained(name: str = "digits-flow") -> tuple[DiT, Config]:
    """Zoo model `name` and its config, trained on the first call and cached after.

    Safe to call from several processes at once: one trains, the others wait and load.

    Raises:
      KeyError: `name` is not in the zoo.
    """
    config = zoo_config(name)
    return load_or_build(cache_dir() / name, lambda directory: _load(directory, config),
                         "stacklib.diffusion.zoo:build", {"config": config.to_dict()})
