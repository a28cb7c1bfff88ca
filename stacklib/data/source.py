"""Where records come from: `MapDataset.source(...)`, `MapDataset.range(...)`, `ArrayDataSource`.

Mirrors grain's `SourceMapDataset` and `RangeMapDataset`
(`grain/_src/python/dataset/transformations/source.py`). A source is anything with a
length and random access by index (grain's `RandomAccessDataSource` protocol): a list,
a NumPy array, `ArrayDataSource` below, or `RecordFileDataSource` (record_file.py).
Indices past the end wrap around, so element `len + i` of a source is record i.

Differences from grain:
  * `ArrayDataSource` (records as dicts of rows of in-memory arrays) is ours; grain
    users write such a class themselves.
  * No sequential per-worker slicing (`set_slice`), no read metrics.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from stacklib.data.dataset import IterDataset, MapDataset
from stacklib.data.options import ReadOptions


class SourceMapDataset(MapDataset):
    """A `MapDataset` over a random-access source; element i is `source[i % len(source)]`."""

    def __init__(self, source: Sequence[Any]):
        super().__init__()
        if not (hasattr(source, "__len__") and hasattr(source, "__getitem__")):
            raise TypeError(
                f"MapDataset.source needs an object with __len__ and __getitem__(int), got "
                f"{type(source).__name__}. Wrap an iterator with list(...) or write a class with both."
            )
        self._source = source

    def __len__(self) -> int:
        return len(self._source)

    def _getitem(self, index: int) -> Any:
        return self._source[index % len(self._source)]

    def _getitems(self, indices: Sequence[int]) -> list[Any]:
        if hasattr(self._source, "_getitems"):  # a source that reads many records at once
            return list(self._source._getitems([i % len(self._source) for i in indices]))
        return super()._getitems(indices)

    def _source_index(self, index: int) -> int:
        return index % len(self._source)

    def __str__(self) -> str:
        return f"SourceMapDataset(source={type(self._source).__name__})"


class RangeMapDataset(MapDataset):
    """The integers of `range(start, stop, step)`, as a dataset."""

    def __init__(self, start: int, stop: int | None = None, step: int = 1):
        super().__init__()
        if stop is None:
            start, stop = 0, start
        self._range = range(start, stop, step)

    def __len__(self) -> int:
        return len(self._range)

    def _getitem(self, index: int) -> int:
        return self._range[index % len(self._range)]

    def _source_index(self, index: int) -> int:
        return index % len(self._range)

    def to_iter_dataset(
        self, read_options: ReadOptions | None = None, *, allow_nones: bool = False
    ) -> IterDataset:
        # As in grain: computing an integer is cheaper than handing it to a thread.
        return super().to_iter_dataset(read_options or ReadOptions(prefetch_buffer_size=0),
                                       allow_nones=allow_nones)

    def __str__(self) -> str:
        r = self._range
        return f"RangeMapDataset(start={r.start}, stop={r.stop}, step={r.step})"


class ArrayDataSource:
    """Records made of rows of in-memory arrays: record i is `{name: array[i] for each array}`.

    Example: `ArrayDataSource({"image": images, "label": labels})[3]` is
    `{"image": images[3], "label": labels[3]}`. Reading many records at once
    (`_getitems`) is one fancy-indexing operation per array.

    Args:
      arrays: a mapping from field name to an array; all arrays have the same first
        dimension, the number of records.

    Raises:
      ValueError: the arrays disagree on the number of records (the message lists them).
    """

    def __init__(self, arrays: Mapping[str, np.ndarray]):
        self._arrays = {name: np.asarray(array) for name, array in arrays.items()}
        lengths = {name: array.shape[0] if array.ndim else None for name, array in self._arrays.items()}
        if not lengths or len(set(lengths.values())) != 1 or None in lengths.values():
            raise ValueError(
                f"ArrayDataSource needs arrays with the same first dimension; got lengths {lengths}."
            )
        self._length = next(iter(lengths.values()))

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return {name: array[index] for name, array in self._arrays.items()}

    def _getitems(self, indices: Sequence[int]) -> list[dict[str, np.ndarray]]:
        rows = {name: array[np.asarray(indices)] for name, array in self._arrays.items()}
        return [{name: rows[name][k] for name in rows} for k in range(len(indices))]

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}: {a.dtype}{list(a.shape[1:])}" for name, a in self._arrays.items())
        return f"ArrayDataSource({self._length} records of {{{fields}}})"
