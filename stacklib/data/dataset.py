"""Datasets as lazy, immutable pipelines: `MapDataset`, `IterDataset`, `DatasetIterator`.

Mirrors grain's `grain.MapDataset`, `grain.IterDataset` and `grain.DatasetIterator`
(`grain/_src/python/dataset/dataset.py`). A pipeline is a chain of dataset objects, each
holding its parent; nothing is read or computed until an element is asked for.

* A `MapDataset` has a length and random access: `ds[i]` computes element i by asking
  its parent for the element(s) it needs. Every transformation that can say which
  parent element it needs (shuffle, slice, repeat, map, batch) lives here, which is
  what makes a global shuffle, sharding by slicing, and one-integer iterator state
  possible. Elements that a `filter` removed are `None`.
* An `IterDataset` can only be iterated. `MapDataset.to_iter_dataset()` turns the
  first into the second; after that come transformations that need to see elements
  in order (batching after a filter) and worker processes (`mp_prefetch`).
* A `DatasetIterator` is the running state of one pass. `get_state()` returns a small
  JSON-serialisable dict and `set_state(state)` puts a fresh iterator in the same place,
  so a restarted job continues with exactly the elements it would have seen.

Each transformation is a small class in its own file (`shuffle.py`, `map.py`, ...);
the methods below only construct them.

A dataset of your own follows grain's contract: subclass `MapDataset` and write
`__len__` and `__getitem__` (or `IterDataset` and `__iter__`, returning a
`DatasetIterator` with `__next__`, `get_state` and `set_state`); every transformation
then chains onto it. Our own classes write `_getitem(index)` instead and let the base
class handle slices and integer types once.

Differences from grain:
  * Transformations take plain callables, not `grain.transforms.Map`-style objects.
  * Seeds are passed to `shuffle` and `random_map` directly; there is no `ds.seed()`.
  * No `mix`, `concatenate`, `map_with_index`, `flat_map`, `interleave`, packing,
    element-spec inference or execution statistics.
  * An index must be an int (a NumPy integer too) or a slice: a bool or a float raises
    a TypeError, where grain's `MapDataset.range(3)[1.0]` returns 1.0 and `[True]` is 1.
"""

from __future__ import annotations

import abc
import builtins
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Generic, TypeVar

import numpy as np

from stacklib.data.options import MultiprocessingOptions, ReadOptions

T = TypeVar("T")  # the element type, as in grain: `MapDataset[int]`, `IterDataset[dict]`


def _getitem_by_dunder(self: MapDataset, index: int) -> Any:
    return self.__getitem__(index)


class MapDataset(abc.ABC, Generic[T]):
    """A dataset of known length whose elements can be computed in any order.

    Subclasses implement `__len__` and `_getitem(index)` (ours) or `__getitem__(index)`
    (grain's contract, for user classes). Indices wrap around epochs, as in grain:
    `ds[len(ds) + i]` is element i of the second epoch, which is how `repeat` works and
    how `shuffle` reshuffles each epoch, and a negative index falls in an epoch before
    the first, so `ds[-1]` is the last element of a pipeline that does not shuffle.
    """

    def __init__(self, parents: MapDataset | Sequence[MapDataset] = ()):
        self._parents = (parents,) if isinstance(parents, MapDataset) else tuple(parents)

    def __init_subclass__(cls, **kwargs):
        # A class written to grain's contract defines `__getitem__` itself; our
        # transformations ask parents for `_getitem`, so route that to it. (This runs
        # before ABCMeta collects the abstract methods, so the class is instantiable.)
        super().__init_subclass__(**kwargs)
        if "__getitem__" in cls.__dict__ and "_getitem" not in cls.__dict__:
            cls._getitem = _getitem_by_dunder

    @property
    def parents(self) -> tuple[MapDataset, ...]:
        return self._parents

    @property
    def _parent(self) -> MapDataset:
        return self._parents[0]

    @abc.abstractmethod
    def __len__(self) -> int:
        """The number of elements in one epoch (`sys.maxsize` if infinite)."""

    @abc.abstractmethod
    def _getitem(self, index: int) -> T | None:
        """Element `index` (any int; wrapped into its epoch), or None if a filter removed it."""

    def __getitem__(self, index: int | builtins.slice) -> Any:
        if isinstance(index, builtins.slice):
            return self.slice(index)
        if not isinstance(index, int | np.integer) or isinstance(index, bool):
            raise TypeError(f"{self}: index must be an int or a slice, got {index!r}.")
        return self._getitem(int(index))

    def _getitems(self, indices: Sequence[int]) -> list[Any]:
        """Elements at `indices` (sources and shuffles override this to batch the work)."""
        return [self._getitem(int(i)) for i in indices]

    def _source_index(self, index: int) -> int | None:
        """Which record of the source element `index` comes from, if one-to-one (for errors)."""
        return None

    def _describe_index(self, index: int) -> str:
        source = self._source_index(index)
        return f"element {index}" + ("" if source is None else f" (record {source} of the source)")

    def __str__(self) -> str:
        return type(self).__name__

    # Constructors. Static, so that `MapDataset.range(10)` reads like grain's.

    @staticmethod
    def source(source: Sequence[Any]) -> MapDataset:
        """A dataset over anything with `__len__` and `__getitem__(int)`: a list, an array, a file source."""
        from stacklib.data.source import SourceMapDataset

        return SourceMapDataset(source)

    @staticmethod
    def range(start: int, stop: int | None = None, step: int = 1) -> MapDataset:
        """The integers of Python's `range(start, stop, step)`."""
        from stacklib.data.source import RangeMapDataset

        return RangeMapDataset(start, stop, step)

    # Transformations: each returns a new dataset; `self` never changes.

    def shuffle(self, seed: int | None = None) -> MapDataset:
        """The same elements in a seeded global order, reshuffled each epoch (see `shuffle.py`)."""
        from stacklib.data.shuffle import ShuffleMapDataset

        return ShuffleMapDataset(self, seed=seed)

    def slice(self, sl: builtins.slice) -> MapDataset:
        """Elements `sl.start`, `sl.start + sl.step`, ...; `ds[i::n]` is host i's shard of n."""
        from stacklib.data.slice import SliceMapDataset

        return SliceMapDataset(self, sl)

    def repeat(self, num_epochs: int | None = None, *, reseed_each_epoch: bool = True) -> MapDataset:
        """`num_epochs` epochs (forever if None); each reshuffled unless `reseed_each_epoch=False`."""
        from stacklib.data.repeat import RepeatMapDataset

        return RepeatMapDataset(self, num_epochs, reseed_each_epoch=reseed_each_epoch)

    def map(self, transform: Callable[[Any], Any]) -> MapDataset:
        """`transform(element)` for every element."""
        from stacklib.data.map import MapMapDataset

        return MapMapDataset(self, transform)

    def random_map(
        self, transform: Callable[[Any, np.random.Generator], Any], *, seed: int | None = None
    ) -> MapDataset:
        """`transform(element, rng)`, with an `rng` that depends only on `seed` and the index."""
        from stacklib.data.map import RandomMapMapDataset

        return RandomMapMapDataset(self, transform, seed=seed)

    def filter(self, transform: Callable[[Any], bool]) -> MapDataset:
        """Elements for which `transform(element)` is true; the others become None."""
        from stacklib.data.filter import FilterMapDataset

        return FilterMapDataset(self, transform)

    def batch(
        self, batch_size: int, *, drop_remainder: bool = False, batch_fn: Callable[[list], Any] | None = None
    ) -> MapDataset:
        """Consecutive elements stacked along a new first axis, `batch_size` at a time."""
        from stacklib.data.batch import BatchMapDataset

        return BatchMapDataset(self, batch_size, drop_remainder=drop_remainder, batch_fn=batch_fn)

    def to_iter_dataset(
        self, read_options: ReadOptions | None = None, *, allow_nones: bool = False
    ) -> IterDataset:
        """An `IterDataset` over this dataset's elements, read ahead by `read_options.num_threads` threads."""
        from stacklib.data.prefetch import PrefetchIterDataset

        return PrefetchIterDataset(self, read_options=read_options or ReadOptions(), allow_nones=allow_nones)

    def __iter__(self) -> DatasetIterator:
        return self.to_iter_dataset().__iter__()


class IterDataset(abc.ABC, Generic[T]):
    """A dataset that can only be iterated; `iter(ds)` gives a checkpointable `DatasetIterator`."""

    def __init__(self, parents: IterDataset | MapDataset | Sequence[IterDataset | MapDataset] = ()):
        if isinstance(parents, IterDataset | MapDataset):
            parents = (parents,)
        self._parents = tuple(parents)

    @property
    def parents(self) -> tuple[IterDataset | MapDataset, ...]:
        return self._parents

    @property
    def _parent(self) -> IterDataset | MapDataset:
        return self._parents[0]

    @abc.abstractmethod
    def __iter__(self) -> DatasetIterator:
        """A new iterator, positioned at the first element."""

    def __str__(self) -> str:
        return type(self).__name__

    def map(self, transform: Callable[[Any], Any]) -> IterDataset:
        """`transform(element)` for every element, in iteration order."""
        from stacklib.data.map import MapIterDataset

        return MapIterDataset(self, transform)

    def filter(self, transform: Callable[[Any], bool]) -> IterDataset:
        """Only the elements for which `transform(element)` is true."""
        from stacklib.data.filter import FilterIterDataset

        return FilterIterDataset(self, transform)

    def batch(
        self, batch_size: int, *, drop_remainder: bool = False, batch_fn: Callable[[list], Any] | None = None
    ) -> IterDataset:
        """The next `batch_size` elements stacked along a new first axis."""
        from stacklib.data.batch import BatchIterDataset

        return BatchIterDataset(self, batch_size, drop_remainder=drop_remainder, batch_fn=batch_fn)

    def mp_prefetch(self, options: MultiprocessingOptions | None = None) -> IterDataset:
        """This pipeline run by `options.num_workers` worker processes (see `process_prefetch.py`)."""
        from stacklib.data.process_prefetch import MultiprocessPrefetchIterDataset

        options = options or MultiprocessingOptions(num_workers=10)  # grain's default
        if options.num_workers == 0:
            return self
        return MultiprocessPrefetchIterDataset(self, options)


class DatasetIterator(Iterator[T], abc.ABC):
    """One pass over an `IterDataset`, with a state that can be saved and restored.

    The state is a small dict of ints, lists and nested dicts (JSON-serialisable), so a
    checkpoint can store it next to the model. `set_state` on a fresh iterator of the
    same pipeline makes it produce exactly what the saved one would have produced next.
    As in grain, the constructor takes the parent iterator(s), if any.
    """

    def __init__(self, parents: DatasetIterator | Sequence[DatasetIterator] = ()):
        self._parents = (parents,) if isinstance(parents, DatasetIterator) else tuple(parents)

    @property
    def _parent(self) -> DatasetIterator:
        return self._parents[0]

    def __iter__(self) -> DatasetIterator:
        return self

    @abc.abstractmethod
    def __next__(self) -> Any:
        """The next element; StopIteration at the end."""

    @abc.abstractmethod
    def get_state(self) -> dict[str, Any]:
        """Where this iterator is, as a JSON-serialisable dict."""

    @abc.abstractmethod
    def set_state(self, state: dict[str, Any]) -> None:
        """Move to the position `state` (from `get_state` of the same pipeline) describes."""

    def close(self) -> None:
        """Release threads or worker processes (a no-op for iterators that have none)."""

    def __str__(self) -> str:
        return type(self).__name__


class ParentStateIterator(DatasetIterator):
    """An iterator that keeps no position of its own, so its state is its parent's.

    Map, filter and batch consume whole elements of the parent between two `next` calls,
    so saving and restoring the parent's position is all there is to do.
    """

    def get_state(self) -> dict[str, Any]:
        return self._parent.get_state()

    def set_state(self, state: dict[str, Any]) -> None:
        self._parent.set_state(state)

    def close(self) -> None:
        self._parent.close()


def transform_name(transform: Callable) -> str:
    """A readable name for a user's function (lambdas and partials included)."""
    return getattr(transform, "__name__", None) or type(transform).__name__


def note_failing_element(error: BaseException, dataset: MapDataset | IterDataset, where: str) -> None:
    """Add to `error` which dataset and which element it was raised on (`error.add_note`).

    The exception keeps its type, so a caller's `except ValueError` still works, and the
    traceback ends with a line such as "raised on element 7 (record 42 of the source)".
    """
    error.add_note(f"stacklib.data: {dataset} raised on {where}.")


def is_infinite(dataset: MapDataset) -> bool:
    """True for datasets repeated forever, whose length is `sys.maxsize`, as in grain."""
    return len(dataset) >= sys.maxsize
