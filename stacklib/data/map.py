"""Applying a function to every element: `map` and `random_map`.

Mirrors grain's `MapMapDataset`, `RandomMapMapDataset` and the `IterDataset.map`
iterator (`grain/_src/python/dataset/transformations/map.py`).

`random_map(f, seed=s)` calls `f(element, rng)` with a NumPy generator that depends only
on `s` and the element's index: a Philox generator keyed by `s`, with the index in its
counter (exactly grain's construction, so both libraries draw the same numbers). The
draws for record i are then the same whichever worker computes it, in whatever order,
after whatever restart; a generator shared by all records would instead hand out
numbers in the order records happen to be processed.

An exception raised by the function keeps its type and gains a note naming the element
(and the source record), e.g. "raised on element 7 (record 42 of the source)", so a
bad record in a billion can be found and reproduced with `ds[7]`.

Differences from grain: transformations are callables (no `grain.transforms.Map`
objects); no `map_with_index`; `IterDataset.random_map` is not provided; a negative
index into a `random_map` raises an IndexError that says why (grain's fails inside
NumPy with an OverflowError).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from stacklib.data.dataset import (
    DatasetIterator,
    IterDataset,
    MapDataset,
    ParentStateIterator,
    note_failing_element,
    transform_name,
)


class MapMapDataset(MapDataset):
    """`transform(element)` for each element; None (filtered) stays None."""

    def __init__(self, parent: MapDataset, transform: Callable[[Any], Any]):
        super().__init__(parent)
        if not callable(transform):
            raise TypeError(f"map needs a callable, got {transform!r}.")
        self._transform = transform

    def __len__(self) -> int:
        return len(self._parent)

    def _apply(self, element: Any, index: int) -> Any:
        if element is None:
            return None
        try:
            return self._transform(element)
        except Exception as error:
            note_failing_element(error, self, self._describe_index(index))
            raise

    def _getitem(self, index: int) -> Any:
        return self._apply(self._parent[index], index)

    def _getitems(self, indices: Sequence[int]) -> list[Any]:
        return [self._apply(e, i) for e, i in zip(self._parent._getitems(indices), indices, strict=True)]

    def _source_index(self, index: int) -> int | None:
        return self._parent._source_index(index)

    def __str__(self) -> str:
        return f"MapMapDataset(transform={transform_name(self._transform)})"


def philox_key(seed: int) -> np.ndarray:
    """The Philox key NumPy derives from `seed` (through its SeedSequence), computed once."""
    return np.random.Philox(seed).state["state"]["key"]


def record_rng(key: np.ndarray, index: int) -> np.random.Generator:
    """The generator for element `index`: Philox with `key` and counter (0, 0, 0, index).

    Raises:
      IndexError: `index` is negative (an epoch before the first has no draws: the
        counter is an unsigned 64-bit integer).
    """
    if index < 0:
        raise IndexError(f"random_map has no random draws for element {index}: negative indices fall in "
                         "an epoch before the first. Index from the start: ds[len(ds) + i].")
    return np.random.Generator(np.random.Philox(key=key, counter=np.array([0, 0, 0, index], np.uint64)))


class RandomMapMapDataset(MapMapDataset):
    """`transform(element, rng)` with a per-element generator derived from (seed, index).

    Raises:
      ValueError: the seed is missing or negative. Any non-negative int is a seed, as in
        grain, whose `np.random.Philox(seed)` hashes it through a SeedSequence.
    """

    def __init__(
        self, parent: MapDataset, transform: Callable[[Any, np.random.Generator], Any], *, seed: int | None
    ):
        super().__init__(parent, transform)
        if not isinstance(seed, int | np.integer) or isinstance(seed, bool) or seed < 0:
            raise ValueError(f"random_map needs a seed, a non-negative int; got {seed!r}. "
                             "Example: ds.random_map(augment, seed=0).")
        self._seed = int(seed)
        self._key = philox_key(self._seed)

    def _apply(self, element: Any, index: int) -> Any:
        if element is None:
            return None
        try:
            return self._transform(element, record_rng(self._key, index))
        except Exception as error:
            note_failing_element(error, self, self._describe_index(index))
            raise

    def __str__(self) -> str:
        return f"RandomMapMapDataset(transform={transform_name(self._transform)}, seed={self._seed})"


class MapIterDataset(IterDataset):
    """`transform(element)` applied to each element as it is iterated."""

    def __init__(self, parent: IterDataset, transform: Callable[[Any], Any]):
        super().__init__(parent)
        if not callable(transform):
            raise TypeError(f"map needs a callable, got {transform!r}.")
        self._transform = transform

    def __iter__(self) -> DatasetIterator:
        return _MapDatasetIterator(self, iter(self._parent))

    def __str__(self) -> str:
        return f"MapIterDataset(transform={transform_name(self._transform)})"


class _MapDatasetIterator(ParentStateIterator):
    """Maps as it goes; one element in, one out, so its state is its parent's."""

    def __init__(self, dataset: MapIterDataset, parent: DatasetIterator):
        super().__init__(parent)
        self._dataset = dataset
        self._count = 0  # elements taken since creation or set_state, only to name a failing one

    def __next__(self) -> Any:
        element = next(self._parent)
        self._count += 1
        try:
            return self._dataset._transform(element)
        except Exception as error:
            where = f"its element {self._count - 1} (counted from creation or set_state)"
            note_failing_element(error, self._dataset, where)
            raise

    def set_state(self, state: dict[str, Any]) -> None:
        super().set_state(state)
        self._count = 0
