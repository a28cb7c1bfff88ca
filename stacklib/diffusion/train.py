"""The diffusion training loop, and its command line: `python -m stacklib.diffusion.train CONFIG key=value`.

    python -m stacklib.diffusion.train stacklib/diffusion/configs/base.yml steps=300 objective=ddpm

    result = train(load_config(None, "steps=300"))
    result.model, result.losses                    # a DiT and the loss every `log_every` steps

The pieces are the book's own: the DiT of model.py written with `stacklib.nn`, AdamW from
`stacklib.optim`, the digits through a `stacklib.data` pipeline, and checkpoints (params,
optimizer state and the data iterator's position) with `stacklib.checkpoint`, so a run
stopped at any step resumes where it stopped, on the same batches.

It keeps chapter 12's trainer's contract (`stacklib.llm.train`; tests/test_trainer_contract.py):
the config is saved with every checkpoint and checked on resume (a changed objective or shape
is refused, `FlatConfig.check_checkpoint`); the last step is always saved; `stop_after=n` is a
kill after step n of the run.

Mirrors MaxDiffusion's `train.py` (a config in, a trainer that loads data, builds the
model and the noise scheduler, and loops `train_step`: add noise, predict, MSE, update).
Differences: one device (MaxDiffusion shards the UNet or DiT over a mesh as chapter 12's
loop does; the chapter explains how), no EMA of the weights, no VAE or text encoder, no
mixed precision, no goodput accounting (chapter 12 has it).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import pathlib
import sys
import time
from typing import Any

import jax
import numpy as np

import stacklib.checkpoint as ocp
import stacklib.nn as nnx
import stacklib.optim as optax
from stacklib.diffusion import data, objectives, schedules
from stacklib.diffusion.config import Config, ConfigError
from stacklib.diffusion.model import DiT


def make_model(config: Config) -> DiT:
    return DiT(config.model, rngs=nnx.Rngs(params=config.seed))


def make_schedule(config: Config) -> schedules.NoiseSchedule:
    return schedules.make_schedule(config.num_train_timesteps, config.beta_start, config.beta_end,
                                   config.beta_schedule)


def make_optimizer(config: Config) -> optax.GradientTransformation:
    """Clip the global gradient norm, then AdamW on a warmup-cosine schedule."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=config.learning_rate,
        warmup_steps=min(config.warmup_steps, config.steps - 1),
        decay_steps=config.steps, end_value=config.learning_rate * config.end_learning_rate_fraction)
    return optax.chain(optax.clip_by_global_norm(config.clip_norm),
                       optax.adamw(schedule, weight_decay=config.weight_decay))


def make_train_step(config: Config, graphdef: nnx.GraphDef, tx: optax.GradientTransformation):
    """A pure step `(params, opt_state, batch, key) -> (params, opt_state, loss)`, not jitted."""
    schedule = make_schedule(config)
    null_class = config.model.num_classes

    def loss_fn(params, batch, key):
        drop_key, loss_key = jax.random.split(key)
        labels = objectives.drop_labels(drop_key, batch["label"], null_class, config.label_dropout)
        model = nnx.merge(graphdef, params)
        return objectives.loss(config.objective, model, batch["image"], labels, loss_key, schedule=schedule)

    def train_step(params, opt_state, batch, key):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch, key)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step


@functools.lru_cache(maxsize=8)
def _compiled_step(config: Config, graphdef: nnx.GraphDef):
    """The jitted step, shared by runs whose step is the same (a resumed run compiles nothing)."""
    return jax.jit(make_train_step(config, graphdef, make_optimizer(config)), donate_argnums=(0, 1))


def _step_settings(config: Config) -> Config:
    """`config` with the settings the step does not read reset, as the key of `_compiled_step`."""
    return config.replace(checkpoint_dir="", checkpoint_every=1, max_to_keep=1, log_every=1, progress=False)


@dataclasses.dataclass
class TrainResult:
    graphdef: nnx.GraphDef
    params: Any
    losses: list[float]          # the mean loss of each `log_every` steps of this call
    seconds: float
    start_step: int = 0          # 0, or the checkpoint step this call resumed from

    @property
    def model(self) -> DiT:
        return nnx.merge(self.graphdef, self.params)


def train(config: Config, *, stop_after: int | None = None) -> TrainResult:
    """Train `config`'s model from scratch, or from the newest checkpoint in `checkpoint_dir`.

    Checkpoints hold the parameters, the optimizer state, the data iterator's position and the
    config; one is written every `checkpoint_every` steps, and at the last step whatever the
    interval.

    Args:
      config: the run.
      stop_after: return after step `stop_after` of the run (not of this call), as if the job
        were killed there (the schedule still runs to `config.steps`): the step itself is saved
        only if due, and the next call resumes from the last checkpoint. Chapter 12's trainer
        (`stacklib.llm.train`) means the same.

    Raises:
      CheckpointMismatchError: `checkpoint_dir` holds a checkpoint whose weights mean something
        else (another objective or shape; the message names the keys), or one without a config.
    """
    start = time.perf_counter()
    graphdef, params = nnx.split(make_model(config), nnx.Param)
    tx = make_optimizer(config)
    opt_state = tx.init(params)
    iterator = iter(data.train_batches(config))
    manager, first = make_checkpoint_manager(config), 0
    if manager is not None and manager.latest_step() is not None:
        first, params, opt_state = _resume(manager, params, opt_state, iterator, config)
    step_fn = _compiled_step(_step_settings(config), graphdef)
    base_key = jax.random.key(config.seed)
    last = config.steps if stop_after is None else min(config.steps, stop_after)
    window, losses = [], []
    for step in _progress(range(first, last), config):
        batch = next(iterator)
        params, opt_state, loss = step_fn(params, opt_state, batch, jax.random.fold_in(base_key, step))
        window.append(loss)
        if len(window) == config.log_every or step + 1 == last:
            losses.append(float(np.mean(jax.device_get(window))))  # one host sync per window
            window = []
        if manager is not None:  # step + 1 steps are done: that is the checkpoint's number
            _save(manager, step + 1, params, opt_state, iterator, config)
    if manager is not None:
        manager.wait_until_finished()
        manager.close()
    return TrainResult(graphdef, params, losses, time.perf_counter() - start, first)


def make_checkpoint_manager(config: Config) -> ocp.CheckpointManager | None:
    """The run's checkpoint manager (every `checkpoint_every` steps, keep `max_to_keep`), or None."""
    if not config.checkpoint_dir:
        return None
    options = ocp.CheckpointManagerOptions(max_to_keep=config.max_to_keep,
                                           save_interval_steps=config.checkpoint_every)
    return ocp.CheckpointManager(pathlib.Path(config.checkpoint_dir).resolve(), options=options)


def _save(manager: ocp.CheckpointManager, step: int, params, opt_state, iterator, config: Config) -> None:
    """Save `step` if due, and the run's last step whatever the interval, with the config."""
    manager.save(step, force=step == config.steps, args=ocp.args.Composite(
        params=ocp.args.StandardSave(params), opt_state=ocp.args.StandardSave(opt_state),
        data=ocp.args.JsonSave(iterator.get_state()), config=ocp.args.JsonSave(config.to_dict())))


def _resume(manager: ocp.CheckpointManager, params, opt_state, iterator, config: Config):
    """(step, params, opt_state) of the newest checkpoint, its config checked first; the iterator moved on."""
    step = manager.latest_step()
    try:
        saved = manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore())).config
    except KeyError:  # written before checkpoints held the config
        saved = None
    config.check_checkpoint(saved, str(manager.directory))
    restored = manager.restore(step, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(params), opt_state=ocp.args.StandardRestore(opt_state),
        data=ocp.args.JsonRestore()))
    iterator.set_state(restored.data)
    return step, restored.params, restored.opt_state


def _progress(steps: range, config: Config):
    if not config.progress:
        return steps
    from tqdm.auto import tqdm

    return tqdm(steps, desc="train", unit="step")


USAGE_EXAMPLE = ("python -m stacklib.diffusion.train stacklib/diffusion/configs/base.yml "
                 "steps=300 objective=ddpm")


def _parser() -> argparse.ArgumentParser:
    return argparse.ArgumentParser(
        prog="python -m stacklib.diffusion.train", usage="%(prog)s [CONFIG.yml] key=value [key=value ...]",
        description="Train a class-conditional diffusion transformer on the digits from one flat config, "
                    "as MaxDiffusion's train.py does: a YAML file (default: the base config) and key=value "
                    "overrides.",
        epilog=f"example: {USAGE_EXAMPLE}\n\nkeys (see stacklib/diffusion/configs/base.yml): "
               + ", ".join(Config.keys()),
        formatter_class=argparse.RawDescriptionHelpFormatter)


def parse_command_line(argv: list[str]) -> Config:
    """The config a command line asks for; a mistake exits with status 2 and one message naming the fix."""
    return Config.from_command_line(argv, _parser(), USAGE_EXAMPLE)


def main(argv: list[str] | None = None) -> int:
    """`python -m stacklib.diffusion.train [CONFIG.yml] key=value ...`; prints a JSON summary."""
    config = parse_command_line(list(sys.argv[1:] if argv is None else argv))
    try:
        result = train(config)
    except ConfigError as error:  # a checkpoint of other weights (CheckpointMismatchError)
        print(f"{_parser().prog}: error: {error}", file=sys.stderr)
        return 2
    print(json.dumps({"steps": config.steps, "objective": config.objective, "losses": result.losses,
                      "seconds": round(result.seconds, 2)}, indent=1), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
