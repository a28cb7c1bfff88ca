"""stacklib.data against grain: the same pipelines give the same elements, in the same order.

Every comparison here is exact (no tolerance): grain's shuffle, random_map and worker
interleaving are deterministic functions of the seed and the index, and ours computes
the same functions.
"""

import grain
import numpy as np
import pytest
from absl import flags
from grain._src.python.experimental.index_shuffle.python import index_shuffle_module as grain_index_shuffle

import stacklib.data as sd

flags.FLAGS.mark_as_parsed()  # grain's worker processes read absl flags (PITFALLS.md)


def square(x):
    return x * x


def grain_position(index, length, seed):
    return grain_index_shuffle.index_shuffle(index, max_index=length - 1, seed=seed, rounds=4)


def as_lists(elements):
    return [np.asarray(e).tolist() for e in elements]


# One case table per component.

SHUFFLE_CASES = [  # (length, seed): small blocks, 16-bit block edge, larger blocks, seeds near 2**32
    (1, 0), (2, 1), (10, 3), (1000, 42), (65_535, 7), (65_536, 7), (70_001, 2**32 - 1), (300_000, 12_345),
]


@pytest.mark.parametrize("length, seed", SHUFFLE_CASES)
def test_index_shuffle_matches_grains(length, seed):
    indices = np.unique(np.random.default_rng(seed).integers(0, length, size=200))
    theirs = [grain_position(int(i), length, seed) for i in indices]
    assert sd.index_shuffle(indices, length - 1, seed).tolist() == theirs


@pytest.mark.parametrize("length", [65_537, 262_145])
def test_where_grains_shuffle_repeats_a_record_ours_is_a_permutation(length):
    # Grain sizes its cipher block as ceil(log2(length - 1)) bits, one too few when
    # length - 1 is an even power of two >= 2**16: the last index then collides.
    theirs = {grain_position(i, length, seed=0) for i in range(length)}
    ours = set(sd.index_shuffle(np.arange(length), length - 1, 0).tolist())
    assert len(theirs) == length - 1
    assert ours == set(range(length))


def odd(x):
    return x % 2 == 1


def _square_of_record(record, rng):
    return int(record) ** 2 + int(rng.integers(1000))


PIPELINE_CASES = {  # name: a function of the library (grain or stacklib.data) building a MapDataset
    "range shuffle": lambda lib: lib.MapDataset.range(100).shuffle(seed=5),
    "shuffle repeat batch": lambda lib: lib.MapDataset.range(10).shuffle(seed=3).repeat(3).batch(4),
    "drop remainder": lambda lib: lib.MapDataset.range(11).shuffle(seed=0).batch(4, drop_remainder=True),
    "no reseed": lambda lib: lib.MapDataset.range(9).shuffle(seed=2).repeat(2, reseed_each_epoch=False),
    "source map filter": lambda lib: lib.MapDataset.source(list(range(30))).map(square).filter(odd),
    "random map": lambda lib: lib.MapDataset.range(40).shuffle(seed=1).random_map(_square_of_record, seed=9),
    "shard 1 of 3": lambda lib: lib.MapDataset.range(50).shuffle(seed=8)[1::3],
    "range step": lambda lib: lib.MapDataset.range(3, 40, 7).repeat(2),
    "dict batches": lambda lib: lib.MapDataset.range(7).map(lambda i: {"x": np.full(2, i), "y": i}).batch(3),
}


def _flatten(element):
    if isinstance(element, dict):
        return {k: _flatten(v) for k, v in element.items()}
    return np.asarray(element).tolist()


@pytest.mark.parametrize("name", list(PIPELINE_CASES))
def test_pipelines_give_grains_elements_in_grains_order(name):
    build = PIPELINE_CASES[name]
    ours, theirs = build(sd), build(grain)
    assert len(ours) == len(theirs)
    assert [_flatten(e) for e in ours] == [_flatten(e) for e in theirs]
    ends = (0, len(ours) - 1)  # random access as well as iteration
    assert [_flatten(ours[i]) for i in ends] == [_flatten(theirs[i]) for i in ends]


@pytest.mark.parametrize("consumed", [0, 1, 7, 20])
def test_iterator_states_equal_grains(consumed):
    def make(lib):
        dataset = lib.MapDataset.range(20).shuffle(seed=1).map(square)
        return dataset.to_iter_dataset(lib.ReadOptions(num_threads=0))

    ours, theirs = iter(make(sd)), iter(make(grain))
    for _ in range(consumed):
        assert next(ours) == next(theirs)
    assert ours.get_state() == theirs.get_state()
    restored = iter(make(sd))
    restored.set_state(theirs.get_state())  # a grain state restores into our iterator
    assert list(restored) == list(theirs)


def test_record_file_source_matches_array_record_source(tmp_path):
    from array_record.python.array_record_module import ArrayRecordWriter

    records = [f"record-{i}".encode() * (1 + i % 3) for i in range(64)]
    writer = ArrayRecordWriter(str(tmp_path / "data.array_record"), "group_size:1")
    for record in records:
        writer.write(record)
    writer.close()
    sd.write_record_file(tmp_path / "data.rec", records)
    theirs = grain.MapDataset.source(grain.sources.ArrayRecordDataSource(str(tmp_path / "data.array_record")))
    ours = sd.MapDataset.source(sd.RecordFileDataSource(tmp_path / "data.rec"))
    assert list(ours.shuffle(seed=4)) == list(theirs.shuffle(seed=4))


WORKER_CASES = {  # name: (pipeline builder, worker counts); grain's workers take ~2 s each to start
    "one-to-one": (lambda lib: lib.MapDataset.range(20).shuffle(seed=3).map(square), (3,)),
    # A filter before the split acts per shard, so the order depends on the worker count.
    "filter before workers": (lambda lib: lib.MapDataset.range(20).filter(lambda x: x % 4 != 1), (2,)),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(WORKER_CASES))
def test_worker_interleaving_matches_grains(name):
    build, worker_counts = WORKER_CASES[name]
    for workers in worker_counts:
        streams = []
        for lib in (sd, grain):
            pipeline = build(lib).to_iter_dataset(lib.ReadOptions(num_threads=0))
            streams.append(as_lists(pipeline.mp_prefetch(lib.MultiprocessingOptions(num_workers=workers))))
        assert streams[0] == streams[1], workers


# Drop-in details: indexing, subclassing, argument checks, as grain's own tests use them.

NEGATIVE_INDEX_CASES = {  # a negative index falls in an epoch before the first, in both libraries
    "range": lambda lib: lib.MapDataset.range(10),
    "source map": lambda lib: lib.MapDataset.source(list(range(10))).map(square),
    "shuffle": lambda lib: lib.MapDataset.range(10).shuffle(seed=0),
    "slice": lambda lib: lib.MapDataset.range(10)[1::3],
    "repeat": lambda lib: lib.MapDataset.range(10).shuffle(seed=2).repeat(2),
    "batch": lambda lib: lib.MapDataset.range(10).batch(3),
    "filter": lambda lib: lib.MapDataset.range(10).filter(odd),
}


@pytest.mark.parametrize("name", list(NEGATIVE_INDEX_CASES))
def test_negative_indices_give_grains_elements(name):
    ours, theirs = NEGATIVE_INDEX_CASES[name](sd), NEGATIVE_INDEX_CASES[name](grain)
    indices = [-1, -2, -len(ours), -len(ours) - 1, -25]
    assert [_flatten(ours[i]) for i in indices] == [_flatten(theirs[i]) for i in indices]


def test_datasets_are_generic_like_grains():
    for lib in (sd, grain):
        assert lib.MapDataset[int] is not None and lib.IterDataset[int] is not None
        assert lib.DatasetIterator[int] is not None


def _user_classes(lib):
    """A source and an iterable written to grain's contract, as a user would write them."""

    class Squares(lib.MapDataset):
        def __init__(self, n):
            super().__init__()
            self._n = n

        def __len__(self):
            return self._n

        def __getitem__(self, index):
            if isinstance(index, slice):
                return self.slice(index)
            return (index % self._n) ** 2

    class Countdown(lib.IterDataset):
        def __iter__(self):
            return CountdownIterator()

    class CountdownIterator(lib.DatasetIterator):
        def __init__(self):
            super().__init__()
            self._left = 6

        def __next__(self):
            if self._left == 0:
                raise StopIteration
            self._left -= 1
            return self._left

        def get_state(self):
            return {"left": self._left}

        def set_state(self, state):
            self._left = state["left"]

    return Squares, Countdown


def test_a_user_dataset_written_to_grains_contract_chains_like_grains():
    results = []
    for lib in (sd, grain):
        squares, countdown = _user_classes(lib)
        mapped = squares(12).shuffle(seed=3).map(lambda x: x + 1)
        iterated = countdown().map(lambda x: 10 * x).batch(4)
        results.append((list(mapped), mapped[-1], list(squares(12)[2:9:3]),
                        as_lists(iterated), as_lists(squares(7).to_iter_dataset().batch(3))))
    assert results[0] == results[1]


def test_slice_with_an_int_raises_grains_value_error():
    for lib in (sd, grain):
        with pytest.raises(ValueError):
            lib.MapDataset.range(10).slice(5)


@pytest.mark.parametrize("seed", [2**32, 2**40 + 7, 2**64 - 1])
def test_random_map_accepts_grains_seeds_beyond_32_bits(seed):
    def build(lib):
        return lib.MapDataset.range(20).random_map(_square_of_record, seed=seed)

    assert list(build(sd)) == list(build(grain))


@pytest.mark.slow
def test_one_worker_runs_an_iter_dataset_without_a_map_dataset_beneath_like_grain():
    streams = []
    for lib in (sd, grain):
        _, countdown = _user_classes(lib)
        pipeline = countdown().map(square).mp_prefetch(lib.MultiprocessingOptions(num_workers=1))
        streams.append(as_lists(pipeline))
    assert streams[0] == streams[1] == [25, 16, 9, 4, 1, 0]


def _with_optional_label(x):
    return {"x": np.full(2, x), "label": None}


def test_none_in_an_element_is_an_empty_subtree_that_batches_to_none_as_in_grain():
    batches = []
    for lib in (sd, grain):
        ds = lib.MapDataset.range(6).map(_with_optional_label)
        batched = [ds.batch(3)[0], next(iter(ds.to_iter_dataset().batch(2)))]
        batches.append([(b["label"], b["x"].tolist()) for b in batched])
    assert batches[0] == batches[1]
    assert batches[0][0] == (None, [[0, 0], [1, 1], [2, 2]])
