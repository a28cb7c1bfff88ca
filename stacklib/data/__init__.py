"""Deterministic, checkpointable input pipelines: a subset of Grain's dataset API.

Mirrors `grain.MapDataset`, `grain.IterDataset`, `grain.DatasetIterator`,
`grain.ReadOptions` and `grain.MultiprocessingOptions` (grain 0.2.18), so that

    import grain                      # the real library
    import stacklib.data as grain     # ours: the pipeline below does not change

    ds = grain.MapDataset.source(records).shuffle(seed=0).map(parse).batch(32, drop_remainder=True)
    iterator = iter(ds.to_iter_dataset().mp_prefetch(grain.MultiprocessingOptions(num_workers=2)))
    state = iterator.get_state()      # saved with the model; set_state(state) resumes exactly

gives the same batches in the same order with both. One file per transformation, as
in grain: source.py, shuffle.py (with index_shuffle.py), slice.py, repeat.py, map.py,
filter.py, batch.py, prefetch.py (to_iter_dataset and threads), process_prefetch.py
(worker processes), record_file.py (a file-backed source). NumPy only: worker
processes start without importing JAX.

Differences from grain (each file lists its own):
  * transformations are plain callables; seeds are passed to each random step;
  * `mix`, `concatenate`, `flat_map`, `interleave`, packing, `map_with_index`,
    `ds.seed()`, element specs, statistics and autotuning are left out;
  * the file source reads our own minimal record format, not ArrayRecord;
  * `shuffle` is a true permutation for every length (grain's repeats a record for
    lengths 2^16 + 1, 2^18 + 1, ...);
  * `mp_prefetch` state has its own format and restores only into the same worker count;
  * a negative index into a `random_map` raises an IndexError that says why (grain's
    fails inside NumPy with an OverflowError).
"""

from stacklib.data.batch import make_batch
from stacklib.data.dataset import DatasetIterator, IterDataset, MapDataset
from stacklib.data.index_shuffle import index_shuffle
from stacklib.data.options import MultiprocessingOptions, ReadOptions
from stacklib.data.record_file import RecordFileDataSource, write_record_file
from stacklib.data.source import ArrayDataSource

__all__ = [
    "ArrayDataSource",
    "DatasetIterator",
    "IterDataset",
    "MapDataset",
    "MultiprocessingOptions",
    "ReadOptions",
    "RecordFileDataSource",
    "index_shuffle",
    "make_batch",
    "write_record_file",
]
