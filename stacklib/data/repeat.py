"""Repeating a dataset for several epochs, each one reshuffled.

Mirrors grain's `RepeatMapDataset` (`grain/_src/python/dataset/transformations/repeat.py`).
A `MapDataset` already answers indices past its end (they wrap into later epochs), so
`repeat` only changes the length: `num_epochs * len(parent)`, or `sys.maxsize` for
"forever". Upstream random transformations see the global index, so `shuffle` and
`random_map` differ from epoch to epoch; with `reseed_each_epoch=False` the index is
reduced modulo the parent's length first and every epoch repeats the first.

Put `repeat` after `shuffle`: then each epoch is a full permutation. Before it, the
shuffle would mix records of different epochs.

Differences from grain: none in behaviour.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from stacklib.data.dataset import MapDataset, is_infinite


class RepeatMapDataset(MapDataset):
    """`num_epochs` epochs of the parent (forever if None).

    Raises:
      ValueError: `num_epochs` is not positive, or the parent is already infinite.
    """

    def __init__(self, parent: MapDataset, num_epochs: int | None = None, *, reseed_each_epoch: bool = True):
        super().__init__(parent)
        if num_epochs is not None and num_epochs <= 0:
            raise ValueError(f"repeat: num_epochs must be positive or None (forever), got {num_epochs}.")
        if is_infinite(parent):
            raise ValueError(f"repeat: {parent} is already infinite; repeating it does nothing.")
        self._num_epochs = num_epochs
        self._reseed_each_epoch = reseed_each_epoch
        if num_epochs is None:
            self._length = sys.maxsize if len(parent) else 0
        else:
            self._length = num_epochs * len(parent)

    def __len__(self) -> int:
        return self._length

    def _parent_index(self, index: int) -> int:
        return index if self._reseed_each_epoch else index % len(self._parent)

    def _getitem(self, index: int) -> Any:
        return self._parent[self._parent_index(index)]

    def _getitems(self, indices: Sequence[int]) -> list[Any]:
        return self._parent._getitems([self._parent_index(i) for i in indices])

    def _source_index(self, index: int) -> int | None:
        return self._parent._source_index(self._parent_index(index))

    def __str__(self) -> str:
        return f"RepeatMapDataset(num_epochs={self._num_epochs})"
