"""Chapter 04's exercise cases: right answers score full marks, planted wrong ones lose points."""

import numpy as np
import pytest
from grain._src.core.sharding import ShardOptions
from grain._src.core.sharding import even_split as grain_even_split

import stacklib.data as sd
from stacklib.cases.ch04 import even_split_reference
from stacklib.grading import grade


def shuffled_position(index, n, seed):
    return sd.index_shuffle(index, n - 1, seed)


def make_batches(records, batch_size, drop_remainder=False):
    return list(sd.MapDataset.source(records).batch(batch_size, drop_remainder=drop_remainder))


class BatchIterator:
    def __init__(self, dataset, batch_size):
        self.dataset, self.batch_size, self.next_index = dataset, batch_size, 0

    def __iter__(self):
        return self

    def __next__(self):
        batch = []
        while len(batch) < self.batch_size and self.next_index < len(self.dataset):
            if self.dataset[self.next_index] is not None:
                batch.append(self.dataset[self.next_index])
            self.next_index += 1
        if not batch:
            raise StopIteration
        return batch

    def get_state(self):
        return {"next_index": self.next_index}

    def set_state(self, state):
        self.next_index = state["next_index"]


def even_split(n, shard_index, shard_count, drop_remainder=False):
    return grain_even_split(n, ShardOptions(shard_index, shard_count, drop_remainder))


RIGHT = {
    "04.index_shuffle": shuffled_position,
    "04.batch": make_batches,
    "04.iterator_state": BatchIterator,
    "04.even_split": even_split,
}


@pytest.mark.parametrize("exercise_id", sorted(RIGHT))
def test_a_right_answer_scores_full_marks(exercise_id):
    result = grade(exercise_id, RIGHT[exercise_id])
    assert result.points == result.max_points, [c.message for c in result.cases]


def test_the_cases_reference_split_is_grains():
    for n in range(0, 40):
        for count in range(1, 9):
            for index in range(count):
                for drop in (False, True):
                    expected = grain_even_split(n, ShardOptions(index, count, drop))
                    assert even_split_reference(n, index, count, drop) == expected


# Planted wrong answers.

def materialised_shuffle(index, n, seed):
    return int(np.random.default_rng(seed).permutation(n)[index])  # a trillion indices: MemoryError


def affine_shuffle(index, n, seed):
    return (index * 7 + seed) % n  # a permutation for these n, but no shuffle


def feistel_modulo(index, n, seed):
    block = (1 << max(16, (n - 1).bit_length())) - 1
    return sd.index_shuffle(index, block, seed) % n  # no cycle walking: positions collide


def batches_of_lists(records, batch_size, drop_remainder=False):
    return [records[i:i + batch_size] for i in range(0, len(records), batch_size)]


def one_batch_too_many(records, batch_size, drop_remainder=False):
    count = len(records) // batch_size + (0 if drop_remainder else 1)  # n // b + 1 is not ceil(n / b)
    return [sd.make_batch(records[j * batch_size:(j + 1) * batch_size]) for j in range(count)]


def ignores_drop_remainder(records, batch_size, drop_remainder=False):
    return make_batches(records, batch_size)


class CountsBatches(BatchIterator):
    """Saves the number of batches, and restores by skipping batches * batch_size elements."""

    def get_state(self):
        return {"batches": getattr(self, "batches", 0)}

    def __next__(self):
        self.batches = getattr(self, "batches", 0) + 1
        return super().__next__()

    def set_state(self, state):
        self.batches = state["batches"]
        self.next_index = state["batches"] * self.batch_size


class SavesTheElements(BatchIterator):
    def get_state(self):
        return {"remaining": [x for x in self.dataset[self.next_index:] if x is not None]}

    def set_state(self, state):
        self.dataset, self.next_index = state["remaining"], 0


class ForgetsToRestore(BatchIterator):
    def set_state(self, state):
        pass


def ignores_the_remainder(n, shard_index, shard_count, drop_remainder=False):
    per_shard = n // shard_count
    return per_shard * shard_index, per_shard * (shard_index + 1)


def last_takes_the_rest(n, shard_index, shard_count, drop_remainder=False):
    per_shard = n // shard_count
    stop = n if shard_index == shard_count - 1 and not drop_remainder else per_shard * (shard_index + 1)
    return per_shard * shard_index, stop


# (exercise, planted wrong answer, points it should still get, why)
WRONG = [
    ("04.index_shuffle", materialised_shuffle, 5, "materialises the permutation"),
    ("04.index_shuffle", affine_shuffle, 5, "a multiplication modulo n, not a shuffle"),
    ("04.index_shuffle", feistel_modulo, 5, "modulo instead of cycle walking"),
    ("04.batch", batches_of_lists, 0, "lists, not stacked arrays"),
    ("04.batch", one_batch_too_many, 3, "an empty batch at exact multiples"),
    ("04.batch", ignores_drop_remainder, 2, "ignores drop_remainder"),
    ("04.iterator_state", CountsBatches, 2, "counts batches instead of elements"),
    ("04.iterator_state", SavesTheElements, 4, "saves the elements themselves"),
    ("04.iterator_state", ForgetsToRestore, 2, "set_state does nothing"),
    ("04.even_split", ignores_the_remainder, 1, "drops the remainder always"),
    ("04.even_split", last_takes_the_rest, 2, "the last shard takes the remainder"),
]


@pytest.mark.parametrize("exercise_id, answer, points, why", WRONG, ids=[w[3] for w in WRONG])
def test_a_planted_wrong_answer_loses_points(exercise_id, answer, points, why):
    result = grade(exercise_id, answer)
    assert result.points == points, [(c.name, c.status, c.message) for c in result.cases]
    assert result.points < result.max_points
