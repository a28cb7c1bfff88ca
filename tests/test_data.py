"""stacklib.data: determinism, epochs, shards, iterator state, workers, sources, and errors."""

import json
import pickle

import numpy as np
import pytest

import stacklib.data as sd
from stacklib.data.index_shuffle import block_bits, index_shuffle

NO_THREADS = sd.ReadOptions(num_threads=0)
THREADS = sd.ReadOptions(num_threads=3, prefetch_buffer_size=4)


def square(x):  # module level, so worker processes can import it
    return x * x


def fail_on_seven(x):
    if x == 7:
        raise ValueError("record seven is malformed")
    return x


# The index shuffle.

@pytest.mark.parametrize("length", [1, 2, 3, 10, 1000, 65536, 65537, 70_000, 262_145])
def test_index_shuffle_is_a_permutation_for_every_length(length):
    shuffled = index_shuffle(np.arange(length), length - 1, seed=123)
    assert np.array_equal(np.sort(shuffled), np.arange(length))


@pytest.mark.parametrize("length", [10, 5000, 300_000])
def test_index_shuffle_gives_the_same_position_one_index_at_a_time_and_vectorised(length):
    indices = np.random.default_rng(0).integers(0, length, size=50)
    vectorised = index_shuffle(indices, length - 1, seed=9)
    assert [index_shuffle(int(i), length - 1, seed=9) for i in indices] == vectorised.tolist()


def test_index_shuffle_answers_one_index_of_a_trillion_without_materialising_anything():
    assert 0 <= index_shuffle(123_456_789, 10**12 - 1, seed=1) < 10**12
    assert block_bits(10**12 - 1) == 40


@pytest.mark.parametrize("bad", [dict(max_index=-1, seed=0), dict(max_index=5, seed=2**32),
                                 dict(max_index=5, seed=0, rounds=3)])
def test_index_shuffle_rejects_out_of_range_arguments(bad):
    with pytest.raises(ValueError):
        index_shuffle(0, **bad)


# Shuffle, repeat, slice.

def test_the_same_seed_gives_the_same_order_and_another_seed_another():
    first = list(sd.MapDataset.range(100).shuffle(seed=5))
    assert first == list(sd.MapDataset.range(100).shuffle(seed=5))
    assert first != list(sd.MapDataset.range(100).shuffle(seed=6))
    assert first != list(range(100))


def test_every_epoch_holds_every_record_once_in_a_new_order():
    n, epochs = 37, 4
    stream = list(sd.MapDataset.range(n).shuffle(seed=0).repeat(epochs))
    orders = [stream[e * n:(e + 1) * n] for e in range(epochs)]
    assert all(sorted(order) == list(range(n)) for order in orders)
    assert len({tuple(order) for order in orders}) == epochs


def test_repeat_without_reseeding_repeats_the_first_epoch_exactly():
    stream = list(sd.MapDataset.range(20).shuffle(seed=0).repeat(3, reseed_each_epoch=False))
    assert stream[:20] == stream[20:40] == stream[40:]


def test_an_infinite_repeat_has_length_maxsize_and_answers_any_index():
    ds = sd.MapDataset.range(10).repeat()
    assert len(ds) == __import__("sys").maxsize and ds[123_456] == 6
    with pytest.raises(ValueError, match="already infinite"):
        ds.repeat(2)


@pytest.mark.parametrize("length, hosts", [(100, 1), (100, 3), (101, 4), (7, 8)])
def test_shards_are_disjoint_and_together_hold_every_record(length, hosts):
    ds = sd.MapDataset.range(length).shuffle(seed=3)
    shards = [list(ds[host::hosts]) for host in range(hosts)]
    flat = [x for shard in shards for x in shard]
    assert sorted(flat) == list(range(length))
    assert max(map(len, shards)) - min(map(len, shards)) <= 1


def test_slicing_is_python_slicing():
    assert list(sd.MapDataset.range(20)[3:17:4]) == list(range(20))[3:17:4]
    assert list(sd.MapDataset.range(20)[-5:]) == list(range(15, 20))


# map, random_map, filter, batch.

def test_random_map_draws_depend_only_on_the_seed_and_the_index():
    ds = sd.MapDataset.range(50).random_map(lambda x, rng: (x, rng.integers(1 << 30)), seed=7)
    forwards = [ds[i] for i in range(50)]
    backwards = [ds[i] for i in reversed(range(50))][::-1]
    assert forwards == backwards
    assert len({draw for _, draw in forwards}) == 50
    reseeded = sd.MapDataset.range(50).random_map(lambda x, rng: (x, rng.integers(1 << 30)), seed=8)
    assert [reseeded[i] for i in range(50)] != forwards


def test_filter_leaves_none_at_the_index_and_iteration_skips_it():
    ds = sd.MapDataset.range(10).filter(lambda x: x % 3 == 0)
    assert ds[1] is None and ds[3] == 3
    assert list(ds) == [0, 3, 6, 9]
    assert list(ds.to_iter_dataset(NO_THREADS, allow_nones=True))[:3] == [0, None, None]


@pytest.mark.parametrize("drop_remainder, sizes", [(False, [4, 4, 2]), (True, [4, 4])])
def test_batches_of_ten_by_four_keep_or_drop_the_remainder(drop_remainder, sizes):
    ds = sd.MapDataset.range(10).batch(4, drop_remainder=drop_remainder)
    assert len(ds) == len(sizes) and [len(b) for b in ds] == sizes


def test_a_batch_never_straddles_two_epochs():
    batches = list(sd.MapDataset.range(5).repeat(2).batch(3))
    assert [b.tolist() for b in batches] == [[0, 1, 2], [3, 4, 0], [1, 2, 3], [4]]
    per_epoch = list(sd.MapDataset.range(5).batch(3).repeat(2))
    assert [b.tolist() for b in per_epoch] == [[0, 1, 2], [3, 4], [0, 1, 2], [3, 4]]


def test_batching_stacks_pytrees_leaf_by_leaf_and_keeps_dtypes():
    source = sd.ArrayDataSource({"x": np.arange(12, dtype=np.float16).reshape(6, 2), "y": np.arange(6)})
    batch = sd.MapDataset.source(source).batch(4)[0]
    assert batch["x"].shape == (4, 2) and batch["x"].dtype == np.float16
    assert batch["y"].tolist() == [0, 1, 2, 3]
    nested = sd.make_batch([{"a": [1, (2.0, 3)]}, {"a": [4, (5.0, 6)]}])
    assert nested["a"][0].tolist() == [1, 4] and isinstance(nested["a"][1], tuple)


def test_batching_elements_of_different_structure_names_the_path():
    with pytest.raises(ValueError, match=r"\['image'\].*shapes \[\(2,\), \(3,\)\]"):
        sd.make_batch([{"image": np.zeros(2)}, {"image": np.zeros(3)}])


def test_map_dataset_batch_after_filter_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"to_iter_dataset\(\)\.batch"):
        sd.MapDataset.range(10).filter(lambda x: x > 2).batch(2)
    batches = list(sd.MapDataset.range(10).filter(lambda x: x > 2).to_iter_dataset(NO_THREADS).batch(3))
    assert [b.tolist() for b in batches] == [[3, 4, 5], [6, 7, 8], [9]]


def test_a_failing_map_names_the_element_and_the_source_record():
    ds = sd.MapDataset.range(10).shuffle(seed=3).map(fail_on_seven)
    position = [sd.MapDataset.range(10).shuffle(seed=3)[i] for i in range(10)].index(7)
    with pytest.raises(ValueError, match="seven") as raised:
        list(ds.to_iter_dataset(NO_THREADS))
    assert f"raised on element {position} (record 7 of the source)" in "\n".join(raised.value.__notes__)


@pytest.mark.parametrize("step", ["map", "filter"])
def test_a_failing_iterator_step_counts_its_elements_from_the_last_set_state(step):
    pipeline = getattr(sd.MapDataset.range(10).to_iter_dataset(NO_THREADS), step)(fail_on_seven)
    iterator = iter(pipeline)
    for _ in range(5):
        next(iterator)
    iterator.set_state({"next_index": 4})  # elements 4, 5, 6 pass; 7, the fourth, fails
    with pytest.raises(ValueError, match="seven") as raised:
        list(iterator)
    assert "its element 3 (counted from creation or set_state)" in raised.value.__notes__[0]


def test_negative_indices_fall_in_the_epoch_before_so_minus_one_is_the_last_element():
    ds = sd.MapDataset.range(10).map(square)
    assert ds[-1] == 81 and ds[-10] == 0 and ds[-11] == 81
    assert sd.MapDataset.range(10).batch(4)[-1].tolist() == [8, 9]


def test_a_failing_map_in_a_reader_thread_is_raised_in_the_consumer():
    with pytest.raises(ValueError, match="seven") as raised:
        list(sd.MapDataset.range(10).map(fail_on_seven).to_iter_dataset(sd.ReadOptions(num_threads=2)))
    assert "element 7" in raised.value.__notes__[0]


@pytest.mark.parametrize("make, error, match", [
    (lambda: sd.MapDataset.range(5).shuffle(seed=None), ValueError, "seed=42"),
    (lambda: sd.MapDataset.range(5).shuffle(seed=-1), ValueError, "2\\*\\*32"),
    (lambda: sd.MapDataset.range(5).batch(0), ValueError, "positive"),
    (lambda: sd.MapDataset.range(5)["0"], TypeError, "an int or a slice"),
    (lambda: sd.MapDataset.range(5).slice(2), ValueError, r"index instead: ds\[i\]"),
    (lambda: sd.MapDataset.range(5).random_map(lambda x, rng: x, seed=-1), ValueError, "non-negative"),
    (lambda: sd.MapDataset.range(5).random_map(lambda x, rng: x, seed=0)[-1], IndexError, r"len\(ds\) \+ i"),
    (lambda: sd.MapDataset.range(5).map(3), TypeError, "callable"),
    (lambda: sd.MapDataset.source(iter([1, 2])), TypeError, "list"),
    (lambda: sd.ReadOptions(num_threads=-1), ValueError, "num_threads"),
    (lambda: sd.ArrayDataSource({"a": np.zeros(3), "b": np.zeros(4)}), ValueError, "first dimension"),
])
def test_bad_arguments_raise_errors_that_say_what_to_do(make, error, match):
    with pytest.raises(error, match=match):
        make()


# Iterator state.

def _pipelines():
    base = sd.MapDataset.range(23).shuffle(seed=1)
    return {
        "elements": base.map(square).to_iter_dataset(NO_THREADS),
        "with threads": base.map(square).to_iter_dataset(THREADS),
        "map batches": base.batch(4).to_iter_dataset(NO_THREADS),
        "filter then batch": base.filter(lambda x: x % 2).to_iter_dataset(NO_THREADS).batch(3).map(np.sum),
        "three epochs": base.repeat(3).to_iter_dataset(NO_THREADS),
    }


def _as_lists(elements):
    return [np.asarray(e).tolist() for e in elements]


@pytest.mark.parametrize("name", list(_pipelines()))
def test_a_restored_iterator_continues_exactly_where_the_saved_one_was_at_every_step(name):
    pipeline = _pipelines()[name]
    reference = _as_lists(pipeline)
    iterator = iter(pipeline)
    for consumed in range(len(reference) + 1):
        state = json.loads(json.dumps(iterator.get_state()))  # as a checkpoint would store it
        restored = iter(pipeline)
        restored.set_state(state)
        assert _as_lists(restored) == reference[consumed:], f"after {consumed} elements"
        if consumed < len(reference):
            next(iterator)


def test_the_iterator_state_is_grains_next_index():
    iterator = iter(sd.MapDataset.range(10).to_iter_dataset())
    next(iterator), next(iterator)
    assert iterator.get_state() == {"next_index": 2}


def test_a_state_past_the_end_is_rejected_as_from_another_pipeline():
    # Grain's state is the bare {"next_index": i}, with no fingerprint of the pipeline, and
    # ours equals it (a grain state restores into our iterator), so a state from another
    # pipeline can only be caught when its index cannot belong to this one.
    iterator = iter(sd.MapDataset.range(5).to_iter_dataset())
    with pytest.raises(IndexError, match="different pipeline"):
        iterator.set_state({"next_index": 9})


# Sources.

def test_record_files_read_back_every_record_across_files(tmp_path):
    records = [f"record {i}".encode() * (i % 4) for i in range(25)]
    sd.write_record_file(tmp_path / "a.rec", records[:10])
    sd.write_record_file(tmp_path / "b.rec", records[10:])
    source = sd.RecordFileDataSource([tmp_path / "a.rec", tmp_path / "b.rec"])
    assert len(source) == 25 and [source[i] for i in range(25)] == records
    assert list(sd.MapDataset.source(pickle.loads(pickle.dumps(source)))) == records
    with pytest.raises(IndexError, match="out of range"):
        source[25]


def test_a_truncated_record_file_is_named(tmp_path):
    path = tmp_path / "broken.rec"
    sd.write_record_file(path, [b"abc"] * 10)
    path.write_bytes(path.read_bytes()[:-5])
    with pytest.raises(ValueError, match="broken.rec is not a record file|broken.rec is truncated"):
        sd.RecordFileDataSource(path)
    with pytest.raises(TypeError, match="record 1 is a str"):
        sd.write_record_file(tmp_path / "x.rec", [b"ok", "not bytes"])


# Worker processes (each pipeline starts workers: a second or two).

@pytest.mark.slow
def test_workers_give_the_same_order_whatever_their_number():
    ds = sd.MapDataset.range(31).shuffle(seed=4).map(square).batch(2)
    reference = _as_lists(ds.to_iter_dataset(NO_THREADS))
    for workers in (1, 2, 3):
        options = sd.MultiprocessingOptions(num_workers=workers)
        assert _as_lists(ds.to_iter_dataset(NO_THREADS).mp_prefetch(options)) == reference, workers


@pytest.mark.slow
def test_a_restored_worker_pipeline_continues_exactly(tmp_path):
    sd.write_record_file(tmp_path / "r.rec", [bytes([i]) * 3 for i in range(40)])
    ds = sd.MapDataset.source(sd.RecordFileDataSource(tmp_path / "r.rec")).shuffle(seed=2).map(len)
    ds = ds.random_map(lambda n, rng: int(rng.integers(100)) + n, seed=1)
    pipeline = ds.to_iter_dataset(NO_THREADS).mp_prefetch(sd.MultiprocessingOptions(num_workers=2))
    iterator = iter(pipeline)
    head = [next(iterator) for _ in range(13)]
    state = json.loads(json.dumps(iterator.get_state()))
    tail = list(iterator)
    restored = iter(pipeline)
    restored.set_state(state)
    assert list(restored) == tail
    assert head + tail == list(ds.to_iter_dataset(NO_THREADS))
    with pytest.raises(ValueError, match="num_workers=2"):
        iter(ds.to_iter_dataset().mp_prefetch(sd.MultiprocessingOptions(num_workers=3))).set_state(state)


@pytest.mark.slow
def test_a_failing_map_in_a_worker_names_the_record_and_the_worker():
    pipeline = sd.MapDataset.range(10).map(fail_on_seven).to_iter_dataset(NO_THREADS)
    with pytest.raises(ValueError, match="seven") as raised:
        list(pipeline.mp_prefetch(sd.MultiprocessingOptions(num_workers=2)))
    notes = "\n".join(raised.value.__notes__)
    assert "element 7 (record 7 of the source)" in notes and "data worker 1 of 2" in notes


def tag_with_pid(x):
    return x, __import__("os").getpid()


@pytest.mark.slow
def test_set_state_moves_the_running_workers_instead_of_restarting_them():
    ds = sd.MapDataset.range(30).shuffle(seed=1).map(tag_with_pid).to_iter_dataset(NO_THREADS)
    iterator = iter(ds.mp_prefetch(sd.MultiprocessingOptions(num_workers=2)))
    head = [next(iterator) for _ in range(6)]
    state = iterator.get_state()
    skipped = [next(iterator) for _ in range(10)]
    iterator.set_state(state)  # back 10 elements, with the workers' buffers holding later ones
    tail = list(iterator)
    assert [x for x, _ in tail[:10]] == [x for x, _ in skipped]
    assert [x for x, _ in head + tail] == list(sd.MapDataset.range(30).shuffle(seed=1))
    assert {pid for _, pid in tail} == {pid for _, pid in head}  # the same two processes


@pytest.mark.slow
def test_one_worker_runs_a_pipeline_with_no_map_dataset_beneath():
    class Countdown(sd.IterDataset):
        def __iter__(self):
            return iter(sd.MapDataset.range(3).to_iter_dataset(NO_THREADS).map(lambda x: 2 - x))

    assert list(Countdown().mp_prefetch(sd.MultiprocessingOptions(num_workers=1))) == [2, 1, 0]


def test_more_than_one_worker_needs_a_map_dataset_underneath():
    class Counting(sd.IterDataset):
        def __iter__(self):
            raise NotImplementedError

    with pytest.raises(ValueError, match="to_iter_dataset.*or use one worker"):
        Counting().mp_prefetch(sd.MultiprocessingOptions(num_workers=2))
    pipeline = sd.MapDataset.range(3).to_iter_dataset()
    assert pipeline.mp_prefetch(sd.MultiprocessingOptions(num_workers=0)) is pipeline


def test_a_batch_of_none_in_some_elements_only_names_the_path():
    with pytest.raises(ValueError, match=r"differ in structure at \['label'\]: None in some"):
        sd.make_batch([{"label": None}, {"label": 1}])


@pytest.mark.parametrize("index", [1.0, True])
def test_an_index_that_is_not_an_int_is_a_type_error_unlike_grains_range(index):
    with pytest.raises(TypeError, match="index must be an int or a slice"):
        sd.MapDataset.range(3)[index]
