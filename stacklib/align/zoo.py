"""The recipe's trained models, trained once per machine and cached, like `stacklib.llm.zoo`.

Chapter 13, the capstone (chapter 16), the recipe test and the benchmark all start GRPO
from the same briefly SFT-ed model, and some of them want the GRPO result too. Training
each costs 20 s to a minute and a half on a 2-core CPU, so the first caller trains and
every later one, in any process, loads:

    model, tokenizer, info = stacklib.align.zoo.sft_start(seed=0)   # GRPO's starting point
    model, tokenizer, info = stacklib.align.zoo.grpo(seed=0)        # sft_start + the recipe's GRPO
    info["heldout_accuracy"], info["seconds"], info["steps"]

The cache is `$STACKLIB_CACHE/align/<name>-<hash>/`, where the hash covers every field
of the `Recipe` and the base model's config: change a setting and a new model is trained,
the old one is kept. The protocol is stacklib.checkpoint.zoo's (its docstring explains it):
trained in a fresh process with one CPU device and one core, so the files are the same
whoever asks first; written atomically; serialised by an exclusive lock; a cache that is
broken or was made with another recipe is deleted and rebuilt with a warning. The training
time is kept apart from the model and its scores (the `timing` item), as the one thing that
differs between two builds.

Differences from llm.zoo: the models are fine-tuned copies of a `stacklib.llm` zoo model
(which is itself cached), and each comes with an `info` dict of how it was made and how
well it does on the recipe's held-out problems.
"""

from __future__ import annotations

import functools
import hashlib
import json
import pathlib
from typing import Any

import jax

import stacklib.checkpoint as ocp
import stacklib.nn as nnx
from stacklib.align import recipes, tasks
from stacklib.checkpoint import zoo as checkpoint_zoo
from stacklib.llm import zoo as llm_zoo


def cache_dir() -> pathlib.Path:
    """`$STACKLIB_CACHE/align`, default `~/.cache/stacklib/align`: beside the llm zoo's folder."""
    return llm_zoo.cache_dir().parent / "align"


def _key(name: str, request: dict[str, Any]) -> str:
    digest = hashlib.sha1(json.dumps(request, sort_keys=True).encode()).hexdigest()[:10]
    return f"{name}-{digest}"


def _load(directory: pathlib.Path, recipe: recipes.Recipe):
    model, tokenizer = recipes.base_model(recipe)
    graphdef, params = nnx.split(model, nnx.Param)
    abstract = jax.eval_shape(lambda: params)
    manager, step = checkpoint_zoo.open_latest(directory)
    restored = manager.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(abstract),
                                                              info=ocp.args.JsonRestore(),
                                                              timing=ocp.args.JsonRestore()))
    if restored.info.get("recipe") != recipe.to_dict():
        raise checkpoint_zoo.StaleCacheError(f"the cached model in {directory} was made with another recipe")
    return nnx.merge(graphdef, restored.params), tokenizer, {**restored.info, **restored.timing}


def _cached(name: str, recipe: recipes.Recipe):
    # The request names the base model by its full config, so that the build process can
    # train it too (a name registered only in this process's memory would mean nothing there).
    request = {"name": name, "recipe": recipe.to_dict(),
               "base_config": llm_zoo.zoo_config(recipe.base_model).to_dict()}
    load = functools.partial(_load, recipe=recipe)
    directory = cache_dir() / _key(name, request)
    return checkpoint_zoo.load_or_build(directory, load, "stacklib.align.zoo:build", request)


def build(directory: str, name: str, recipe: dict[str, Any], base_config: dict[str, Any]) -> None:
    """Train the recipe's model `name` ("sft-start" or "grpo") and write it into `directory`.

    Run by stacklib.checkpoint.zoo in the fixed build process; call `sft_start` or `grpo`.
    """
    recipe = recipes.Recipe(**recipe)
    llm_zoo.register(recipe.base_model, **base_config)  # as the caller knew it
    model, info = _BUILDERS[name](recipe)
    timing = {"seconds": info.pop("seconds")}
    checkpoint_zoo.write_atomically(pathlib.Path(directory), 0, {
        "params": ocp.args.StandardSave(nnx.state(model, nnx.Param)),
        "info": ocp.args.JsonSave({**info, "recipe": recipe.to_dict()}),
        "timing": ocp.args.JsonSave(timing)})


def _build_sft_start(recipe: recipes.Recipe):
    result = recipes.sft_start(recipe)
    tokenizer = recipes.base_model(recipe)[1]
    heldout = tasks.heldout_accuracy(result.model, tokenizer, recipes.problems(recipe).heldout)
    return result.model, {
        "method": "sft", "steps": result.steps, "validation_accuracy": result.validation_accuracy,
        "heldout_accuracy": heldout, "seconds": result.seconds,
        "trainable_params": result.trainer.trainable_params}


def _build_grpo(recipe: recipes.Recipe):
    model, tokenizer, start = sft_start(recipe=recipe)
    result = recipes.grpo(model, recipe, tokenizer, eval_every_n_steps=25)
    logger = result.learner.rl_cluster.metrics_logger
    heldout = tasks.heldout_accuracy(model, tokenizer, recipes.problems(recipe).heldout)
    return model, {
        "method": "grpo", "steps": result.learner.rl_cluster.global_steps, "heldout_accuracy": heldout,
        "start_heldout_accuracy": start["heldout_accuracy"], "seconds": result.seconds,
        "trainable_params": result.learner.rl_cluster.actor_trainer.trainable_params,
        "reward": logger.get_metric_history("", "rewards/mean", "train").tolist(),
        "eval_accuracy": logger.get_metric_history("", "rewards/exact_match_reward", "eval").tolist(),
        "eval_steps": logger.get_metric_steps("", "rewards/exact_match_reward", "eval").tolist()}


_BUILDERS = {"sft-start": _build_sft_start, "grpo": _build_grpo}


def sft_start(seed: int = 0, recipe: recipes.Recipe | None = None):
    """The base model after the recipe's brief SFT: (model, tokenizer, info).

    info: steps, validation_accuracy, heldout_accuracy, seconds (training only), trainable_params.
    """
    return _cached("sft-start", recipe or recipes.Recipe(seed=seed))


def grpo(seed: int = 0, recipe: recipes.Recipe | None = None):
    """`sft_start` followed by the recipe's GRPO: (model, tokenizer, info).

    info: steps, heldout_accuracy, start_heldout_accuracy, seconds (GRPO only), trainable_params,
    and the per-step histories 'reward' (train, mean of the batch) and 'eval_accuracy'
    (held out, every 25 steps, with 'eval_steps').
    """
    return _cached("grpo", recipe or recipes.Recipe(seed=seed))


__all__ = ["build", "cache_dir", "grpo", "sft_start"]
