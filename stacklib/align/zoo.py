"""The recipe's trained models, trained once per machine and cached, like `stacklib.llm.zoo`.

Chapter 13, the capstone (chapter 16), the recipe test and the benchmark all start GRPO
from the same briefly SFT-ed model, and some of them want the GRPO result too. Training
each costs 20 s to a minute and a half on a 2-core CPU, so the first caller trains and
every later one, in any process, loads:

    model, tokenizer, info = stacklib.align.zoo.sft_start(seed=0)   # GRPO's starting point
    model, tokenizer, info = stacklib.align.zoo.grpo(seed=0)        # sft_start + the recipe's GRPO
    info["heldout_accuracy"], info["seconds"], info["steps"]

The cache is `$STACKLIB_CACHE/align/<name>-<hash>/`, where the hash covers every field
of the `Recipe`: change a setting and a new model is trained, the old one is kept.
Writes are atomic (a temporary directory renamed into place) and serialised by an
exclusive lock, exactly as in stacklib/llm/zoo.py (its docstring explains both); a cache
that fails to load is deleted and rebuilt with a warning.

Differences from llm.zoo: the models are fine-tuned copies of a `stacklib.llm` zoo model
(which is itself cached), and each comes with an `info` dict of how it was made and how
well it does on the recipe's held-out problems.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import uuid
from collections.abc import Callable
from typing import Any

import jax

import stacklib.checkpoint as ocp
import stacklib.nn as nnx
from stacklib.align import recipes, tasks
from stacklib.llm.zoo import CACHE_ENV, load_or_build


def cache_dir() -> pathlib.Path:
    """`$STACKLIB_CACHE/align`, default `~/.cache/stacklib/align`."""
    base = os.environ.get(CACHE_ENV) or pathlib.Path.home() / ".cache" / "stacklib"
    return pathlib.Path(base) / "align"


def _key(name: str, recipe: recipes.Recipe) -> str:
    digest = hashlib.sha1(json.dumps(recipe.to_dict(), sort_keys=True).encode()).hexdigest()[:10]
    return f"{name}-{digest}"


def _save(directory: pathlib.Path, model, info: dict[str, Any]) -> None:
    staging = directory.with_name(f"{directory.name}.partial-{uuid.uuid4().hex[:8]}")
    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False)
    manager = ocp.CheckpointManager(staging, options=options)
    manager.save(0, args=ocp.args.Composite(params=ocp.args.StandardSave(nnx.state(model, nnx.Param)),
                                            info=ocp.args.JsonSave(info)))
    manager.close()
    os.replace(staging, directory)  # directory does not exist here: the rename is atomic


def _load(directory: pathlib.Path, recipe: recipes.Recipe):
    model, tokenizer = recipes.base_model(recipe)
    graphdef, params = nnx.split(model, nnx.Param)
    abstract = jax.eval_shape(lambda: params)
    manager = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(read_only=True))
    step = manager.latest_step()
    if step is None:
        raise FileNotFoundError(f"{directory} holds no committed model")
    restored = manager.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(abstract),
                                                              info=ocp.args.JsonRestore()))
    if restored.info.get("recipe") != recipe.to_dict():
        raise ValueError("the cached model was made with another recipe")
    return nnx.merge(graphdef, restored.params), tokenizer, dict(restored.info)


def cached(name: str, recipe: recipes.Recipe, build: Callable[[], tuple[Any, Any, dict[str, Any]]]):
    """`build()` -> (model, tokenizer, info) once per machine per recipe; loaded after that."""

    def build_and_save(directory: pathlib.Path):
        model, tokenizer, info = build()
        info = {**info, "recipe": recipe.to_dict()}
        _save(directory, model, info)
        return model, tokenizer, info

    return load_or_build(cache_dir() / _key(name, recipe), lambda directory: _load(directory, recipe),
                         build_and_save)


def sft_start(seed: int = 0, recipe: recipes.Recipe | None = None):
    """The base model after the recipe's brief SFT: (model, tokenizer, info).

    info: steps, validation_accuracy, heldout_accuracy, seconds (training only), trainable_params.
    """
    recipe = recipe or recipes.Recipe(seed=seed)

    def build():
        result = recipes.sft_start(recipe)
        tokenizer = recipes.base_model(recipe)[1]
        heldout = tasks.heldout_accuracy(result.model, tokenizer, recipes.problems(recipe).heldout)
        return result.model, tokenizer, {
            "method": "sft", "steps": result.steps, "validation_accuracy": result.validation_accuracy,
            "heldout_accuracy": heldout, "seconds": result.seconds,
            "trainable_params": result.trainer.trainable_params}

    return cached("sft-start", recipe, build)


def grpo(seed: int = 0, recipe: recipes.Recipe | None = None):
    """`sft_start` followed by the recipe's GRPO: (model, tokenizer, info).

    info: steps, heldout_accuracy, start_heldout_accuracy, seconds (GRPO only), trainable_params,
    and the per-step histories 'reward' (train, mean of the batch) and 'eval_accuracy'
    (held out, every 25 steps, with 'eval_steps').
    """
    recipe = recipe or recipes.Recipe(seed=seed)

    def build():
        model, tokenizer, start = sft_start(recipe=recipe)
        result = recipes.grpo(model, recipe, tokenizer, eval_every_n_steps=25)
        logger = result.learner.rl_cluster.metrics_logger
        heldout = tasks.heldout_accuracy(model, tokenizer, recipes.problems(recipe).heldout)
        return model, tokenizer, {
            "method": "grpo", "steps": result.learner.rl_cluster.global_steps, "heldout_accuracy": heldout,
            "start_heldout_accuracy": start["heldout_accuracy"], "seconds": result.seconds,
            "trainable_params": result.learner.rl_cluster.actor_trainer.trainable_params,
            "reward": logger.get_metric_history("", "rewards/mean", "train").tolist(),
            "eval_accuracy": logger.get_metric_history("", "rewards/exact_match_reward", "eval").tolist(),
            "eval_steps": logger.get_metric_steps("", "rewards/exact_match_reward", "eval").tolist()}

    return cached("grpo", recipe, build)


__all__ = ["cache_dir", "cached", "grpo", "sft_start"]
