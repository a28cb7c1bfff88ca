"""Keeping only some elements: `filter`.

Mirrors grain's `FilterMapDataset` and the `IterDataset.filter` iterator
(`grain/_src/python/dataset/transformations/filter.py`).

On a `MapDataset` a removed element becomes None, so indices keep their meaning (element
i is still the i-th of the shuffled order) and iteration skips the Nones. That is also
why `MapDataset.batch` refuses to follow a filter: a batch of indices 8..15 might hold
fewer than 8 elements. Batch on the `IterDataset` instead (`to_iter_dataset().batch(8)`),
which collects 8 surviving elements.

Differences from grain: no warning or error when a filter drops most elements.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from stacklib.data.dataset import (
    DatasetIterator,
    IterDataset,
    MapDataset,
    ParentStateIterator,
    note_failing_element,
    transform_name,
)


class FilterMapDataset(MapDataset):
    """The element where `transform(element)` is true, None where it is false."""

    def __init__(self, parent: MapDataset, transform: Callable[[Any], bool]):
        super().__init__(parent)
        if not callable(transform):
            raise TypeError(f"filter needs a callable returning a bool, got {transform!r}.")
        self._transform = transform

    def __len__(self) -> int:
        return len(self._parent)

    def _keep(self, element: Any, index: int) -> Any:
        if element is None:
            return None
        try:
            return element if self._transform(element) else None
        except Exception as error:
            note_failing_element(error, self, self._describe_index(index))
            raise

    def _getitem(self, index: int) -> Any:
        return self._keep(self._parent[index], index)

    def _getitems(self, indices: Sequence[int]) -> list[Any]:
        return [self._keep(e, i) for e, i in zip(self._parent._getitems(indices), indices, strict=True)]

    def _source_index(self, index: int) -> int | None:
        return self._parent._source_index(index)

    def __str__(self) -> str:
        return f"FilterMapDataset(transform={transform_name(self._transform)})"


class FilterIterDataset(IterDataset):
    """Only the elements for which `transform(element)` is true."""

    def __init__(self, parent: IterDataset, transform: Callable[[Any], bool]):
        super().__init__(parent)
        if not callable(transform):
            raise TypeError(f"filter needs a callable returning a bool, got {transform!r}.")
        self._transform = transform

    def __iter__(self) -> DatasetIterator:
        return _FilterDatasetIterator(self, iter(self._parent))

    def __str__(self) -> str:
        return f"FilterIterDataset(transform={transform_name(self._transform)})"


class _FilterDatasetIterator(ParentStateIterator):
    """Pulls from its parent until an element passes; its state is its parent's."""

    def __init__(self, dataset: FilterIterDataset, parent: DatasetIterator):
        super().__init__(parent)
        self._dataset = dataset
        self._count = 0  # elements taken since creation or set_state, only to name a failing one

    def __next__(self) -> Any:
        while True:
            element = next(self._parent)
            self._count += 1
            try:
                keep = self._dataset._transform(element)
            except Exception as error:
                where = f"its element {self._count - 1} (counted from creation or set_state)"
                note_failing_element(error, self._dataset, where)
                raise
            if keep:
                return element

    def set_state(self, state: dict[str, Any]) -> None:
        super().set_state(state)
        self._count = 0
