"""Class-conditional digits, fed by `stacklib.data`: scikit-learn's 8×8 images, no download.

The 1797 images of `sklearn.datasets.load_digits` (the same data chapter 02 trains its
classifier on, `stacklib.nn.digits_classifier.digits()`), scaled from [0, 1] to
[-1, 1] (the range the samplers clip to) and shaped (8, 8, 1). Every `heldout_every`-th
image is held out: the Fréchet distance (metrics.py) compares samples with those.

    iterator = iter(train_batches(config))          # {"image": (B, 8, 8, 1), "label": (B,)}
    state = iterator.get_state()                    # saved with the checkpoint

Mirrors a Grain pipeline as MaxDiffusion builds one for its small datasets
(`MapDataset.source(...).shuffle(seed).repeat().batch(...)`). Differences: MaxDiffusion
reads TFRecords or Hugging Face datasets of images and captions and encodes them with a
VAE first (latent diffusion); we diffuse the pixels themselves.
"""

from __future__ import annotations

import numpy as np

import stacklib.data as grain
from stacklib.diffusion.config import Config
from stacklib.nn import digits_classifier


def to_model_range(images: np.ndarray) -> np.ndarray:
    """(N, 64) in [0, 1] -> (N, 8, 8, 1) in [-1, 1]."""
    return (2.0 * images.reshape(-1, 8, 8, 1) - 1.0).astype(np.float32)


def to_pixel_range(images) -> np.ndarray:
    """(N, 8, 8, 1) in about [-1, 1] -> (N, 64) in [0, 1], as the classifier reads digits."""
    return np.clip((np.asarray(images, np.float32) + 1.0) / 2.0, 0.0, 1.0).reshape(len(images), -1)


def split(heldout_every: int = 6) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{"train": (images, labels), "heldout": (images, labels)}: images (N, 8, 8, 1) in [-1, 1]."""
    images, labels = digits_classifier.digits()
    images = to_model_range(images)
    held = np.arange(len(images)) % heldout_every == 0
    return {"train": (images[~held], labels[~held]), "heldout": (images[held], labels[held])}


class DigitRecords:
    """A random-access source: record i is {"image": (8, 8, 1), "label": ()}."""

    def __init__(self, images: np.ndarray, labels: np.ndarray):
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return {"image": self.images[index], "label": self.labels[index]}


def train_batches(config: Config) -> grain.IterDataset:
    """Shuffled, repeated batches of the training digits; iterate it, save `get_state()`."""
    images, labels = split(config.heldout_every)["train"]
    if len(images) < config.batch_size:
        raise ValueError(f"batch_size={config.batch_size} is larger than the {len(images)} training digits; "
                         "lower batch_size.")
    dataset = (grain.MapDataset.source(DigitRecords(images, labels)).shuffle(seed=config.data_seed).repeat()
               .batch(config.batch_size, drop_remainder=True))
    return dataset.to_iter_dataset(grain.ReadOptions(num_threads=0))  # tiny records: threads cost more
