"""The model of the sharding lessons: an MLP classifier built with `stacklib.nn`, with named axes.

Two `nnx.Linear` layers with a ReLU between them, built with the module library of
chapter 02 (`import stacklib.nn as nnx`), whose parameters carry logical axis names
through `nnx.with_partitioning`:

    fc1.kernel  ("features", "hidden")      fc1.bias  ("hidden",)
    fc2.kernel  ("hidden", "classes")       fc2.bias  ("classes",)

Inputs are ("batch", "features") and labels ("batch",). The names say nothing about
devices; the rules of `stacklib.parallel.rules` decide which mesh axes they use.

The training step is plain SGD on the pure `nnx.State`, so that it can be jitted
with any shardings, run inside `shard_map`, or run in several processes.

Differences from chapter 02's classifier: no LayerNorm or Dropout, so that the state
is parameters only and every strategy's step is a pure function of it. The same class
written with `flax.nnx` (and `eager_sharding=False`) gives the same weights from the
same seed and the same names; tests/test_parallel_parity.py checks both.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import stacklib.nn as nnx


class MLPClassifier(nnx.Module):
    """features -> hidden (ReLU) -> class logits, with logical axis names on every parameter."""

    def __init__(self, num_features: int, num_hidden: int, num_classes: int, *, rngs: nnx.Rngs):
        self.fc1 = nnx.Linear(
            num_features, num_hidden, rngs=rngs,
            kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), ("features", "hidden")),
            bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), ("hidden",)),
        )
        self.fc2 = nnx.Linear(
            num_hidden, num_classes, rngs=rngs,
            kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), ("hidden", "classes")),
            bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), ("classes",)),
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fc2(jax.nn.relu(self.fc1(x)))  # (batch, classes)


def make_blobs(
    seed: int, num_examples: int, num_features: int, num_classes: int, *, spread: float = 1.0
) -> tuple[np.ndarray, np.ndarray]:
    """A classification problem: Gaussian clusters around random class centres.

    NumPy, not JAX: every process of a multi-process job can make the same data in
    microseconds, without compiling anything, and keep only its own rows.

    Returns:
      x of shape (num_examples, num_features), float32, and int32 labels y of shape
      (num_examples,).
    """
    rng = np.random.default_rng(seed)
    centres = 2.0 * rng.normal(size=(num_classes, num_features))
    y = rng.integers(0, num_classes, size=num_examples)
    x = centres[y] + spread * rng.normal(size=(num_examples, num_features))
    return x.astype(np.float32), y.astype(np.int32)


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean negative log-likelihood of integer `labels` under `logits` (batch, classes)."""
    log_probs = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(log_probs, labels[:, None], axis=1))


def make_loss(graphdef: nnx.GraphDef) -> Callable:
    """loss(state, x, y): the model's mean cross-entropy, as a function of its pure state."""

    def loss(state: nnx.State, x: jax.Array, y: jax.Array) -> jax.Array:
        return cross_entropy(nnx.merge(graphdef, state)(x), y)

    return loss


def make_sgd_step(graphdef: nnx.GraphDef, learning_rate: float) -> Callable:
    """step(state, x, y) -> (new_state, loss): one SGD step, params - lr * grad.

    Pure and unjitted: wrap it in `jax.jit` with the shardings of the strategy at hand.
    """
    loss = make_loss(graphdef)

    def step(state: nnx.State, x: jax.Array, y: jax.Array):
        value, grads = jax.value_and_grad(loss)(state, x, y)
        new_state = jax.tree.map(lambda p, g: p - learning_rate * g, state, grads)
        return new_state, value

    return step
