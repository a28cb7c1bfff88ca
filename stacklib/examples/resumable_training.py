"""A training run that can be killed at any moment and resumed with identical results.

It puts chapters 02-05 together: a small MLP (stacklib.nn), AdamW with gradient clipping
(stacklib.optim), a shuffled, batched, checkpointable input pipeline (stacklib.data), and
asynchronous checkpoints of the model, the optimizer state and the data iterator
(stacklib.checkpoint). Chapter 05 runs it as a separate process, kills it with SIGKILL
in the middle of an epoch, runs it again, and checks that the final parameters are
bitwise identical to those of an uninterrupted run; tests/test_checkpoint.py does the
same without processes.

Why the result is bitwise identical: everything a step depends on is either restored
(parameters, optimizer state, the iterator's position) or a pure function of the seed
and the step (the shuffled order, the batches, the initial parameters), and XLA on one
machine runs the same compiled step the same way every time.

Run it as a script:

    python -m stacklib.examples.resumable_training /tmp/ckpt --steps 48

It prints `step N loss L` after each step and `final <sha256 of the parameters>`.

Every component is ours, imported under the real libraries' names (`nnx`, `optax`,
`ocp`, `grain`), as the book's drop-in principle intends.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import stacklib.checkpoint as ocp
import stacklib.data as grain
import stacklib.nn as nnx
import stacklib.optim as optax


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Sizes of the run (the chapter reads them from `stacklib.hw.sizes("resumable_training")`)."""

    steps: int = 48
    records: int = 512
    batch_size: int = 32
    width: int = 64
    save_every: int = 4
    features: int = 8
    learning_rate: float = 3e-3
    seed: int = 0


class MLP(nnx.Module):
    """features -> width -> 1, with a ReLU."""

    def __init__(self, features: int, width: int, *, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(features, width, rngs=rngs)
        self.out = nnx.Linear(width, 1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(nnx.relu(self.hidden(x)))


def make_source(config: RunConfig) -> grain.ArrayDataSource:
    """A regression problem that needs the hidden layer: y = sin(3 x.w) + noise."""
    rng = np.random.default_rng(config.seed)
    x = rng.normal(size=(config.records, config.features)).astype(np.float32)
    w = rng.normal(size=(config.features,)).astype(np.float32) / np.sqrt(config.features)
    y = np.sin(3 * x @ w)[:, None] + 0.05 * rng.normal(size=(config.records, 1))
    return grain.ArrayDataSource({"x": x, "y": y.astype(np.float32)})


def make_pipeline(config: RunConfig) -> grain.IterDataset:
    """Shuffled anew each epoch, in fixed-size batches, for as many epochs as the steps need."""
    steps_per_epoch = config.records // config.batch_size
    epochs = -(-config.steps // steps_per_epoch)
    dataset = (grain.MapDataset.source(make_source(config)).shuffle(seed=config.seed).repeat(epochs)
               .batch(config.batch_size, drop_remainder=True))
    return dataset.to_iter_dataset(grain.ReadOptions(num_threads=0))


def make_optimizer(config: RunConfig) -> optax.GradientTransformation:
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(config.learning_rate))


def make_train_step(graphdef, optimizer: optax.GradientTransformation) -> Callable:
    """A jitted pure function (params, opt_state, batch) -> (params, opt_state, loss)."""

    def loss_fn(params, batch):
        model = nnx.merge(graphdef, params)
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

    @jax.jit
    def train_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step


def digest(params) -> str:
    """SHA-256 of every parameter's bytes, in tree order: equal digests mean bitwise-equal parameters."""
    sha = hashlib.sha256()
    for leaf in jax.tree.leaves(params):
        sha.update(np.asarray(leaf).tobytes())
    return sha.hexdigest()


def train(directory: str, config: RunConfig, *, log: Callable[[int, float], None] | None = None,
          stop_after: int | None = None):
    """Train for `config.steps` steps, resuming from the latest checkpoint in `directory` if any.

    Args:
      directory: the checkpoint directory (created if missing).
      config: the run's sizes and seed.
      log: called as `log(step, loss)` after every step.
      stop_after: return after this many steps of this call (an interruption, for tests).

    Returns:
      The parameters (an `nnx.State`) when the run stops.
    """
    graphdef, params = nnx.split(MLP(config.features, config.width, rngs=nnx.Rngs(config.seed)), nnx.Param)
    optimizer = make_optimizer(config)
    opt_state = optimizer.init(params)
    iterator = iter(make_pipeline(config))
    train_step = make_train_step(graphdef, optimizer)
    options = ocp.CheckpointManagerOptions(max_to_keep=2, save_interval_steps=config.save_every)
    with ocp.CheckpointManager(directory, options=options) as manager:
        start = manager.latest_step() or 0
        if start:
            restored = manager.restore(start, args=ocp.args.Composite(
                state=ocp.args.StandardRestore({"params": params, "opt_state": opt_state}),
                data=ocp.args.JsonRestore()))
            params, opt_state = restored.state["params"], restored.state["opt_state"]
            iterator.set_state(restored.data)
        for step in range(start + 1, config.steps + 1):
            params, opt_state, loss = train_step(params, opt_state, next(iterator))
            if log is not None:
                log(step, float(loss))
            manager.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave({"params": params, "opt_state": opt_state}),
                data=ocp.args.JsonSave(iterator.get_state())))
            if stop_after is not None and step - start >= stop_after:
                break
    return params


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory")
    for field in dataclasses.fields(RunConfig):
        flag = f"--{field.name.replace('_', '-')}"
        parser.add_argument(flag, type=type(field.default), default=field.default)
    arguments = vars(parser.parse_args(argv))
    directory = arguments.pop("directory")
    params = train(directory, RunConfig(**arguments),
                   log=lambda step, loss: print(f"step {step} loss {loss:.6f}", flush=True))
    print(f"final {digest(params)}", flush=True)


if __name__ == "__main__":
    main()
