"""Chapter 02's digits classifier, as a model to export and serve (chapter 15).

An MLP with LayerNorm and dropout built with `stacklib.nn`, trained on scikit-learn's
bundled 8×8 digits (no download) with hand-written SGD, exactly as chapter 02 trains it.
`predict_function(model)` returns what `stacklib.serve.export` takes: a pure function
`predict(params, x)` closed over the graph definition (and the non-parameter state, in
eval mode), and the parameters as plain nested dicts (an nnx State cannot be serialized).

It lives in `stacklib.nn` (layer 1) because it needs nothing else, so that every layer
above may import it: chapter 15 serves it, chapter 17's diffusion trains on `digits()`
and judges its samples with the classifier, and the tests and benchmarks use both.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import stacklib.nn as nnx

FEATURES, CLASSES = 64, 10


class Classifier(nnx.Module):
    def __init__(self, hidden: int = 64, *, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(FEATURES, hidden, rngs=rngs)
        self.norm = nnx.LayerNorm(hidden, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)
        self.out = nnx.Linear(hidden, CLASSES, rngs=rngs)

    def __call__(self, x):  # (B, 64) -> (B, 10) logits
        return self.out(self.dropout(nnx.relu(self.norm(self.hidden(x)))))


def digits() -> tuple[np.ndarray, np.ndarray]:
    """(images (1797, 64) float32 in [0, 1], labels (1797,) int32)."""
    from sklearn.datasets import load_digits

    data = load_digits()
    return (data.data / 16.0).astype(np.float32), data.target.astype(np.int32)


def train(hidden: int = 64, steps: int = 200, batch_size: int = 128, learning_rate: float = 0.1,
          seed: int = 0) -> Classifier:
    """Chapter 02's training loop: split outside jit, merge inside, SGD by hand."""
    images, labels = digits()
    model = Classifier(hidden, rngs=nnx.Rngs(seed))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    @jax.jit
    def train_step(params, rest, x, y):
        def loss_fn(params):
            model = nnx.merge(graphdef, params, rest, copy=True)
            logits = model(x)
            loss = jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, y[:, None], -1)[:, 0])
            return loss, nnx.state(model, nnx.Not(nnx.Param))

        (_, rest), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        return jax.tree.map(lambda p, g: p - learning_rate * g, params, grads), rest

    batches = np.random.default_rng(seed).integers(0, len(images), size=(steps, batch_size))
    for batch in batches:
        params, rest = train_step(params, rest, images[batch], labels[batch])
    nnx.update(model, params, rest)
    return model


def predict_function(model: Classifier):
    """`(predict, params)`: `predict(params, x)` is pure; `params` are plain nested dicts."""
    model.eval()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def predict(params, x):
        return nnx.merge(graphdef, params, rest, copy=True)(x)

    return predict, nnx.to_pure_dict(params)
