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


def test_a_round_function_that_hashes_a_tuple_mixes_well_enough():
    # The exercise warns against hash() of integers, which is the identity; hashing a tuple of them
    # does mix (CPython's tuple hash multiplies and rotates), and scores like any good round function.
    result = grade("04.index_shuffle", hash_of_a_tuple)
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


def _feistel_with_round(round_function, rounds=6):
    """An index shuffle as the exercise describes it, with the given round function F(seed, r, right)."""

    def shuffled_position(index, n, seed):
        bits = max(8, max(n - 1, 1).bit_length())
        bits += bits % 2
        half, mask = bits // 2, (1 << bits // 2) - 1

        def encrypt(x):
            left, right = x >> half, x & mask
            for r in range(rounds):
                left, right = right, left ^ (round_function(seed, r, right) & mask)
            return (left << half) | right

        x = encrypt(index)
        while x >= n:
            x = encrypt(x)
        return x

    return shuffled_position


hash_of_the_integers = _feistel_with_round(lambda seed, r, right: hash(right * (seed + 1) + r))
hash_xor_seed = _feistel_with_round(lambda seed, r, right: hash(right ^ seed ^ r))
hash_of_a_tuple = _feistel_with_round(lambda seed, r, right: hash((seed, r, right)))  # mixes: a right answer


def ignores_the_seed(index, n, seed):
    return sd.index_shuffle(index, n - 1, 0)


def batches_of_lists(records, batch_size, drop_remainder=False):
    return [records[i:i + batch_size] for i in range(0, len(records), batch_size)]


def one_batch_too_many(records, batch_size, drop_remainder=False):
    count = len(records) // batch_size + (0 if drop_remainder else 1)  # n // b + 1 is not ceil(n / b)
    return [sd.make_batch(records[j * batch_size:(j + 1) * batch_size]) for j in range(count)]


def ignores_drop_remainder(records, batch_size, drop_remainder=False):
    return make_batches(records, batch_size)


def adds_one_in_place(records, batch_size, drop_remainder=False):
    for record in records:  # "normalises" the caller's arrays in place
        for leaf in (record.values() if isinstance(record, dict) else [record]):
            if isinstance(leaf, np.ndarray):
                leaf += 1
    return make_batches(records, batch_size, drop_remainder)


def clears_the_records_afterwards(records, batch_size, drop_remainder=False):
    batches = make_batches(records, batch_size, drop_remainder)
    records.clear()  # "frees memory": the caller's list is now empty
    return batches


def yields_batches(records, batch_size, drop_remainder=False):
    yield from make_batches(records, batch_size, drop_remainder)  # a generator, not the list asked for


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


class ReplaysBatches(CountsBatches):
    """Saves the number of batches, and restores by replaying that many from the start: right, but it
    reads the whole dataset again, which the exercise rules out."""

    def set_state(self, state):
        self.next_index, self.batches = 0, 0
        for _ in range(state["batches"]):
            next(self)


class KeepsOneStateDict(BatchIterator):
    def __init__(self, dataset, batch_size):
        super().__init__(dataset, batch_size)
        self.state = {"next_index": 0}

    def __next__(self):
        self.next_index = self.state["next_index"]
        batch = super().__next__()
        self.state["next_index"] = self.next_index
        return batch

    def get_state(self):
        return self.state  # the live dict: a saved state moves on with the iterator

    def set_state(self, state):
        self.state = dict(state)


class RemovesTheNonesInPlace(BatchIterator):
    def __init__(self, dataset, batch_size):
        while None in dataset:
            dataset.remove(None)  # the caller's list loses its Nones
        super().__init__(dataset, batch_size)


class ForgetsToRestore(BatchIterator):
    def set_state(self, state):
        pass


def ignores_the_remainder(n, shard_index, shard_count, drop_remainder=False):
    per_shard = n // shard_count
    return per_shard * shard_index, per_shard * (shard_index + 1)


def ceil_sized_shards(n, shard_index, shard_count, drop_remainder=False):
    per_shard = n // shard_count if drop_remainder else -(-n // shard_count)  # ceil: the last ones run short
    return min(per_shard * shard_index, n), min(per_shard * (shard_index + 1), n)


def larger_shards_last(n, shard_index, shard_count, drop_remainder=False):
    per_shard, remainder = divmod(n, shard_count)
    if drop_remainder:
        return per_shard * shard_index, per_shard * (shard_index + 1)
    smaller = shard_count - remainder  # the first shards get q records, the last r get q + 1
    start = per_shard * shard_index + max(0, shard_index - smaller)
    return start, start + per_shard + (shard_index >= smaller)


def last_takes_the_rest(n, shard_index, shard_count, drop_remainder=False):
    per_shard = n // shard_count
    stop = n if shard_index == shard_count - 1 and not drop_remainder else per_shard * (shard_index + 1)
    return per_shard * shard_index, stop


# (exercise, planted wrong answer, points it should still get, why)
WRONG = [
    ("04.index_shuffle", materialised_shuffle, 7, "materialises the permutation"),
    ("04.index_shuffle", affine_shuffle, 5, "a multiplication modulo n, not a shuffle"),
    ("04.index_shuffle", feistel_modulo, 7, "modulo instead of cycle walking"),
    ("04.index_shuffle", hash_of_the_integers, 5, "F = hash() of arithmetic on the integers: no mixing"),
    ("04.index_shuffle", hash_xor_seed, 4, "F = hash(right ^ seed ^ r): linear, and the seed cancels out"),
    ("04.index_shuffle", ignores_the_seed, 8, "every seed gives the same order"),
    ("04.batch", batches_of_lists, 0, "lists, not stacked arrays"),
    ("04.batch", one_batch_too_many, 3, "an empty batch at exact multiples"),
    ("04.batch", ignores_drop_remainder, 2, "ignores drop_remainder"),
    ("04.batch", adds_one_in_place, 2, "adds 1 to the caller's arrays in place"),
    ("04.batch", clears_the_records_afterwards, 0, "right batches, then clears the caller's list"),
    ("04.batch", yields_batches, 0, "a generator, not a list"),
    ("04.iterator_state", CountsBatches, 2, "counts batches instead of elements"),
    ("04.iterator_state", ReplaysBatches, 5, "counts batches and replays them from the start"),
    ("04.iterator_state", KeepsOneStateDict, 5, "get_state returns the live state dict"),
    ("04.iterator_state", RemovesTheNonesInPlace, 0, "removes the Nones from the caller's list"),
    ("04.iterator_state", SavesTheElements, 5, "saves the elements themselves"),
    ("04.iterator_state", ForgetsToRestore, 2, "set_state does nothing"),
    ("04.even_split", ignores_the_remainder, 1, "drops the remainder always"),
    ("04.even_split", last_takes_the_rest, 2, "the last shard takes the remainder"),
    ("04.even_split", ceil_sized_shards, 2, "ceil(n / count) per shard"),
    ("04.even_split", larger_shards_last, 2, "the larger shards last"),
]


@pytest.mark.parametrize("exercise_id, answer, points, why", WRONG, ids=[w[3] for w in WRONG])
def test_a_planted_wrong_answer_loses_points(exercise_id, answer, points, why):
    result = grade(exercise_id, answer)
    assert result.points == points, [(c.name, c.status, c.message) for c in result.cases]
    assert result.points < result.max_points
