"""Slicing a dataset: `ds[start:stop:step]`, and with it sharding across hosts.

Mirrors grain's `SliceMapDataset` (`grain/_src/python/dataset/transformations/slice.py`).
Element i of `ds[start:stop:step]` is parent element `start + i * step`; indices past
the end wrap into the next epoch of the parent.

Sharding is the special case `ds[host::host_count]`: host h takes elements h, h + H,
h + 2H, ... of the (shuffled) global order. The shards are disjoint and together hold
every element, because every index i is congruent to exactly one h modulo H. Slicing
after `shuffle` keeps the global shuffle; slicing before it would shuffle each shard
on its own.

Differences from grain: none in behaviour.
"""

from __future__ import annotations

import builtins
from collections.abc import Sequence
from typing import Any

from stacklib.data.dataset import MapDataset


class SliceMapDataset(MapDataset):
    """The parent's elements at `range(*sl.indices(len(parent)))`."""

    def __init__(self, parent: MapDataset, sl: builtins.slice):
        super().__init__(parent)
        if not isinstance(sl, builtins.slice):
            raise ValueError(f"slice needs a Python slice such as slice(0, None, 4), got {sl!r}. "
                             "For one element, index instead: ds[i].")
        self._start, self._stop, self._step = sl.indices(len(parent))
        self._length = len(range(self._start, self._stop, self._step))

    def __len__(self) -> int:
        return self._length

    def _sliced_index(self, index: int) -> int:
        epoch, offset = divmod(index, self._length)
        return self._start + offset * self._step + epoch * len(self._parent)

    def _getitem(self, index: int) -> Any:
        return self._parent[self._sliced_index(index)]

    def _getitems(self, indices: Sequence[int]) -> list[Any]:
        return self._parent._getitems([self._sliced_index(i) for i in indices])

    def _source_index(self, index: int) -> int | None:
        return self._parent._source_index(self._sliced_index(index))

    def __str__(self) -> str:
        return f"SliceMapDataset[{self._start}:{self._stop}:{self._step}]"
