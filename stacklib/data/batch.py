"""Stacking consecutive elements into batches: `batch(batch_size, drop_remainder=...)`.

Mirrors grain's `BatchMapDataset`, `BatchIterDataset` and `make_batch`
(`grain/_src/python/dataset/transformations/batch.py`).

A batch of pytree elements is one pytree whose leaves gain a leading axis:
`[{"x": (3,), "y": ()}] * 8` becomes `{"x": (8, 3), "y": (8,)}`. None is an empty
subtree, not a leaf: `{"x": ..., "label": None}` batches to `{"x": ..., "label": None}`.
With n elements and batch size b there are ceil(n / b) batches, the last holding
n mod b elements (the remainder), or floor(n / b) batches with `drop_remainder=True`,
which training loops use so that every step has the same shape and `jit` compiles once.

On a `MapDataset`, batch j of epoch e holds parent elements e*n + j*b ... up to the end
of that epoch: batches never straddle two epochs, so the remainder comes once per
epoch. On an `IterDataset`, a batch is the next b elements, whatever they are.

Differences from grain: `make_batch` walks dicts, lists, tuples and named tuples itself
(grain uses its tree library), so this package needs only NumPy; no shared-memory
output, no padding helper.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from stacklib.data.dataset import DatasetIterator, IterDataset, MapDataset, ParentStateIterator
from stacklib.data.filter import FilterMapDataset


def _stack(values: Sequence[Any], path: str) -> Any:
    first = values[0]
    if first is None or any(v is None for v in values):
        if all(v is None for v in values):
            return None  # an empty subtree, as in grain's tree library: an optional field stays None
        raise ValueError(f"batch: elements differ in structure at {path or 'the top'}: None in some "
                         "elements and a value in others.")
    if isinstance(first, dict):
        if any(not isinstance(v, dict) or v.keys() != first.keys() for v in values):
            raise ValueError(f"batch: elements differ in structure at {path or 'the top'}: "
                             f"expected dicts with keys {sorted(first)} in every element.")
        return {key: _stack([v[key] for v in values], f"{path}[{key!r}]") for key in first}
    if isinstance(first, list | tuple):
        if any(type(v) is not type(first) or len(v) != len(first) for v in values):
            raise ValueError(f"batch: elements differ in structure at {path or 'the top'}: "
                             f"expected {type(first).__name__}s of length {len(first)}.")
        parts = [_stack([v[i] for v in values], f"{path}[{i}]") for i in range(len(first))]
        return type(first)(*parts) if hasattr(first, "_fields") else type(first)(parts)
    try:
        return np.stack([np.asarray(v) for v in values])
    except ValueError as error:
        shapes = sorted({np.shape(v) for v in values})
        raise ValueError(f"batch: cannot stack leaves at {path or 'the top'} with shapes {shapes}; "
                         "every element must have the same shapes.") from error


def make_batch(values: Sequence[Any]) -> Any:
    """Stack a list of same-structure pytrees leaf by leaf along a new first axis.

    Raises:
      ValueError: `values` is empty, or the elements differ in structure or in a leaf's
        shape (the message gives the path, e.g. `['image']`).
    """
    if not values:
        raise ValueError("batch: cannot make a batch of 0 elements.")
    return _stack(list(values), "")


def _check_batch_size(batch_size: int) -> None:
    if not isinstance(batch_size, int) or batch_size <= 0:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}.")


class BatchMapDataset(MapDataset):
    """Batch j of an epoch stacks parent elements j*b ... min((j+1)*b, n) - 1 of that epoch.

    Raises:
      ValueError: `batch_size` is not positive, or a `filter` comes before (a batch of
        indices could then hold missing elements; batch after `to_iter_dataset()`).
    """

    def __init__(self, parent: MapDataset, batch_size: int, *, drop_remainder: bool = False,
                 batch_fn: Callable[[list], Any] | None = None):
        super().__init__(parent)
        _check_batch_size(batch_size)
        ancestors = [parent]
        while ancestors:
            ancestor = ancestors.pop()
            if isinstance(ancestor, FilterMapDataset):
                raise ValueError(
                    "MapDataset.batch cannot follow MapDataset.filter, which leaves holes (None) that "
                    "would make batches short. Batch the iterator instead: "
                    "ds.filter(f).to_iter_dataset().batch(batch_size)."
                )
            ancestors.extend(ancestor.parents)
        self._batch_size = batch_size
        self._drop_remainder = drop_remainder
        self._batch_fn = batch_fn or make_batch
        n = len(parent)
        self._length = n // batch_size if drop_remainder else math.ceil(n / batch_size)

    def __len__(self) -> int:
        return self._length

    def _getitem(self, index: int) -> Any:
        n = len(self._parent)
        epoch, batch_in_epoch = divmod(index, self._length)
        start = batch_in_epoch * self._batch_size
        stop = min(start + self._batch_size, n)
        return self._batch_fn(self._parent._getitems(range(epoch * n + start, epoch * n + stop)))

    def __str__(self) -> str:
        return f"BatchMapDataset(batch_size={self._batch_size}, drop_remainder={self._drop_remainder})"


class BatchIterDataset(IterDataset):
    """The next `batch_size` elements of the parent iterator, stacked."""

    def __init__(self, parent: IterDataset, batch_size: int, *, drop_remainder: bool = False,
                 batch_fn: Callable[[list], Any] | None = None):
        super().__init__(parent)
        _check_batch_size(batch_size)
        self._batch_size = batch_size
        self._drop_remainder = drop_remainder
        self._batch_fn = batch_fn or make_batch

    def __iter__(self) -> DatasetIterator:
        return _BatchDatasetIterator(self, iter(self._parent))

    def __str__(self) -> str:
        return f"BatchIterDataset(batch_size={self._batch_size}, drop_remainder={self._drop_remainder})"


class _BatchDatasetIterator(ParentStateIterator):
    """Collects whole batches, so between two `next` calls its state is its parent's."""

    def __init__(self, dataset: BatchIterDataset, parent: DatasetIterator):
        super().__init__(parent)
        self._dataset = dataset

    def __next__(self) -> Any:
        values = []
        for _ in range(self._dataset._batch_size):
            try:
                values.append(next(self._parent))
            except StopIteration:
                break
        if not values or (self._dataset._drop_remainder and len(values) < self._dataset._batch_size):
            raise StopIteration
        return self._dataset._batch_fn(values)
