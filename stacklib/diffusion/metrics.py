"""Judging samples with chapter 02's digit classifier: class accuracy and a Fréchet distance.

A generative model is judged by a second model. For images the standard pair is the
Inception network's verdicts: the Inception score and the Fréchet Inception Distance (FID,
Heusel et al. 2017). We keep both ideas and swap the judge for the book's own digits
classifier (`stacklib.nn.digits_classifier`, chapters 02 and 15):

* **class accuracy**: the share of samples generated for class y that the classifier
  calls y (with and without guidance);
* **Fréchet distance** between two sets of images, on the classifier's hidden features
  (64 per image, after its LayerNorm and ReLU): fit a Gaussian to each set's features and
  take the Fréchet (2-Wasserstein) distance between the Gaussians,

      d² = ‖μ_a − μ_b‖² + Tr(Σ_a + Σ_b − 2 (Σ_a^{1/2} Σ_b Σ_a^{1/2})^{1/2}).

    judge = metrics.Judge.train()
    judge.accuracy(samples, labels), metrics.frechet_distance(judge.features(a), judge.features(b))

Differences from FID: a 64-feature MLP instead of Inception's 2048 pool features, trained on
the very digits we generate; a few hundred images per set (FID wants 10k+), so compare
distances measured the same way, not with published FIDs.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import stacklib.nn as nnx
from stacklib.diffusion.data import to_pixel_range
from stacklib.nn import digits_classifier


@dataclasses.dataclass
class Judge:
    """Chapter 02's classifier in eval mode, as a judge of (N, 8, 8, 1) images in [-1, 1]."""

    classifier: digits_classifier.Classifier

    @classmethod
    def train(cls, seed: int = 0) -> Judge:
        """The classifier as chapters 02 and 15 train it (300 steps of SGD, a second on a CPU)."""
        model = digits_classifier.train(hidden=64, steps=300, batch_size=128, seed=seed)
        model.eval()  # dropout off
        return cls(model)

    def _run(self, images, features: bool) -> np.ndarray:
        graphdef, state = nnx.split(self.classifier)
        return np.asarray(_forward(graphdef, state, jnp.asarray(to_pixel_range(images)), features))

    def logits(self, images) -> np.ndarray:
        return self._run(images, features=False)

    def features(self, images) -> np.ndarray:
        """(N, 64): the hidden layer after LayerNorm and ReLU, the input of the last layer."""
        return self._run(images, features=True)

    def accuracy(self, images, labels) -> float:
        """The share of `images` the classifier assigns to `labels`."""
        return float(np.mean(np.argmax(self.logits(images), -1) == np.asarray(labels)))


@jax.jit(static_argnums=(0, 3))
def _forward(graphdef, state, x, features: bool):
    model = nnx.merge(graphdef, state)
    hidden = nnx.relu(model.norm(model.hidden(x)))
    return hidden if features else model.out(hidden)


def _sqrt_psd(matrix: np.ndarray) -> np.ndarray:
    """The square root of a symmetric positive semi-definite matrix, by its eigendecomposition."""
    values, vectors = np.linalg.eigh(matrix)
    return (vectors * np.sqrt(np.clip(values, 0.0, None))) @ vectors.T


def frechet_distance(features_a: np.ndarray, features_b: np.ndarray) -> float:
    """d² between Gaussians fitted to two (N, F) feature sets (Heusel et al. 2017), in float64.

    Raises:
      ValueError: feature sets of different widths or with fewer than 2 rows.
    """
    a, b = np.asarray(features_a, np.float64), np.asarray(features_b, np.float64)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1] or min(len(a), len(b)) < 2:
        raise ValueError(f"frechet_distance needs two (N, F) feature sets with the same F and N >= 2; got "
                         f"{a.shape} and {b.shape}.")
    mu_a, mu_b = a.mean(0), b.mean(0)
    cov_a, cov_b = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    root_a = _sqrt_psd(cov_a)
    cross = np.sum(np.sqrt(np.clip(np.linalg.eigvalsh(root_a @ cov_b @ root_a), 0.0, None)))
    return float(np.sum((mu_a - mu_b) ** 2) + np.trace(cov_a) + np.trace(cov_b) - 2.0 * cross)
