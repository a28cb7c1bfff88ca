"""A global shuffle that reshuffles every epoch and stores nothing but a seed.

Mirrors grain's `ShuffleMapDataset` (`grain/_src/python/dataset/transformations/shuffle.py`):
element i of epoch e is parent element `index_shuffle(i, n - 1, seed + e) + e * n`, where
`index_shuffle` is the keyed permutation of `index_shuffle.py`. So:

* the order is a function of (seed, index) only: the same on every host, every
  restart and every worker count, and computable for any index without visiting the
  ones before it;
* every record appears exactly once per epoch (a permutation), and each epoch has its
  own order (the seed advances with the epoch);
* nothing is materialised per record; the memory cost is the same for ten records or
  ten billion.

Differences from grain: the seed is required (no `ds.seed()`); for datasets of
2^16 + 1, 2^18 + 1, ... records ours is a true permutation where grain's repeats a
record (see index_shuffle.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from stacklib.data.dataset import MapDataset
from stacklib.data.index_shuffle import index_shuffle


class ShuffleMapDataset(MapDataset):
    """The parent's elements in a seeded order that changes each epoch.

    Args:
      parent: the dataset to shuffle (of finite length).
      seed: an integer in [0, 2**32) choosing the permutation.

    Raises:
      ValueError: the seed is missing or out of range.
    """

    def __init__(self, parent: MapDataset, *, seed: int | None):
        super().__init__(parent)
        if not isinstance(seed, int | np.integer) or not 0 <= seed < 2**32:
            raise ValueError(
                f"shuffle needs a seed, an integer in [0, 2**32); got {seed!r}. "
                "Example: ds.shuffle(seed=42)."
            )
        self._seed = int(seed)

    def __len__(self) -> int:
        return len(self._parent)

    def _shuffled_index(self, index: int) -> int:
        n = len(self._parent)
        epoch, index_in_epoch = divmod(index, n)
        per_epoch_seed = (self._seed + epoch) % 2**32
        return index_shuffle(index_in_epoch, n - 1, per_epoch_seed) + epoch * n

    def _getitem(self, index: int) -> Any:
        return self._parent[self._shuffled_index(index)]

    def _getitems(self, indices: Sequence[int]) -> list[Any]:
        n = len(self._parent)
        indices = np.asarray(indices, dtype=np.int64)
        epochs, within = np.divmod(indices, n)
        shuffled = np.empty_like(indices)
        for epoch in np.unique(epochs):  # one vectorised permutation per epoch present
            mask = epochs == epoch
            seed = (self._seed + int(epoch)) % 2**32
            shuffled[mask] = index_shuffle(within[mask], n - 1, seed) + epoch * n
        return self._parent._getitems(shuffled.tolist())

    def _source_index(self, index: int) -> int | None:
        return self._parent._source_index(self._shuffled_index(index))

    def __str__(self) -> str:
        return f"ShuffleMapDataset(seed={self._seed})"
