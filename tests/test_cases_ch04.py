"""Chapter 04's exercise cases: right answers score full marks, planted wrong ones lose points."""


import jax.numpy as jnp
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


def _feistel_with_round(round_function, rounds=6, *, even_bits=True, walk_once=False):
    """An index shuffle as the exercise describes it, with the given round function F(seed, r, right).

    even_bits=False forgets to round the width up to an even number of bits; walk_once=True
    applies the network again once, with an `if` where cycle walking needs a `while`.
    """

    def shuffled_position(index, n, seed):
        bits = max(8, max(n - 1, 1).bit_length())
        if even_bits:
            bits += bits % 2
        half, mask = bits // 2, (1 << bits // 2) - 1

        def encrypt(x):
            left, right = x >> half, x & mask
            for r in range(rounds):
                left, right = right, left ^ (round_function(seed, r, right) & mask)
            return (left << half) | right

        x = encrypt(index)
        if walk_once:
            return encrypt(x) if x >= n else x
        while x >= n:
            x = encrypt(x)
        return x

    return shuffled_position


def _mix(seed, r, right):
    """A round function that mixes: multiplications by odd constants, xors and right shifts."""
    value = (right * 0x9E3779B1 + seed * 0x85EBCA77 + r * 0xC2B2AE3D) & 0xFFFFFFFF
    value ^= value >> 15
    value = (value * 0x2C1B3C6D) & 0xFFFFFFFF
    return value ^ (value >> 13)


hash_of_the_integers = _feistel_with_round(lambda seed, r, right: hash(right * (seed + 1) + r))
hash_xor_seed = _feistel_with_round(lambda seed, r, right: hash(right ^ seed ^ r))
hash_of_a_tuple = _feistel_with_round(lambda seed, r, right: hash((seed, r, right)))  # mixes: a right answer
# An odd width: with 6 rounds the network is a bijection, but F never reaches the wider half's top
# bit, which stays where it was; with 5 rounds the halves come back swapped and collide.
odd_width_even_rounds = _feistel_with_round(_mix, even_bits=False)
odd_width_odd_rounds = _feistel_with_round(_mix, rounds=5, even_bits=False)
walks_once = _feistel_with_round(_mix, walk_once=True)
two_rounds = _feistel_with_round(_mix, rounds=2)
one_round = _feistel_with_round(_mix, rounds=1)
round_function_without_right = _feistel_with_round(lambda seed, r, right: _mix(seed, r, 0))  # xors constants
seed_through_its_lowest_bit = _feistel_with_round(lambda seed, r, right: _mix(seed & 1, r, right))


def ignores_the_seed(index, n, seed):
    return sd.index_shuffle(index, n - 1, 0)


def _stacking_with(stack):
    """make_batches with each batch's records stacked by `stack`."""

    def batches(records, batch_size, drop_remainder=False):
        stop = len(records) - len(records) % batch_size if drop_remainder else len(records)
        return [stack(records[start:start + batch_size]) for start in range(0, stop, batch_size)]

    return batches


def _stack_fields(stack_one):
    return lambda values: ({key: stack_one([v[key] for v in values]) for key in values[0]}
                           if isinstance(values[0], dict) else stack_one(values))


stacks_with_jax_numpy = _stacking_with(_stack_fields(jnp.stack))  # int32 where NumPy gives int64
stacks_fields_as_float32 = _stacking_with(
    lambda values: ({key: np.stack([v[key] for v in values]).astype(np.float32) for key in values[0]}
                    if isinstance(values[0], dict) else np.stack(values)))


def reads_the_first_record_first(records, batch_size, drop_remainder=False):
    is_dict = isinstance(records[0], dict)  # IndexError for no records
    stack = _stack_fields(np.stack) if is_dict else np.stack
    return _stacking_with(stack)(records, batch_size, drop_remainder)


def drops_the_last_batch_whatever_its_size(records, batch_size, drop_remainder=False):
    batches = make_batches(records, batch_size)
    return batches[:-1] if drop_remainder else batches  # a full last batch is dropped too


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


class _ReadsWith(BatchIterator):
    """The right iterator, with the test for an element to keep and the element it returns replaced."""

    def keep(self, element):
        return element is not None

    def value(self, index):
        return self.dataset[index]

    def __next__(self):
        batch = []
        while len(batch) < self.batch_size and self.next_index < len(self.dataset):
            if self.keep(self.dataset[self.next_index]):
                batch.append(self.value(self.next_index))
            self.next_index += 1
        if not batch:
            raise StopIteration
        return batch


class ReturnsPositions(_ReadsWith):
    def value(self, index):
        return index  # the position, not the element


class KeepsTruthyElements(_ReadsWith):
    def keep(self, element):
        return bool(element)  # drops 0 as well as None


class ReturnsAnEmptyLastBatch(BatchIterator):
    def __next__(self):
        if self.next_index >= len(self.dataset):  # only Nones left still make a batch: []
            raise StopIteration
        batch = []
        while len(batch) < self.batch_size and self.next_index < len(self.dataset):
            if self.dataset[self.next_index] is not None:
                batch.append(self.dataset[self.next_index])
            self.next_index += 1
        return batch


class DropsAShortLastBatch(BatchIterator):
    def __next__(self):
        batch = []
        while len(batch) < self.batch_size:
            if self.next_index >= len(self.dataset):
                raise StopIteration  # the elements of a short last batch are lost
            if self.dataset[self.next_index] is not None:
                batch.append(self.dataset[self.next_index])
            self.next_index += 1
        return batch


class ChangesTheGivenStateDict(KeepsOneStateDict):
    def get_state(self):
        return dict(self.state)

    def set_state(self, state):
        self.state = state  # later calls of next() write into the caller's dict


class SavesWhereTheLastBatchStarted(BatchIterator):
    def __next__(self):
        self.batch_start = self.next_index
        return super().__next__()

    def get_state(self):
        return {"batch_start": getattr(self, "batch_start", 0)}  # restoring repeats the last batch

    def set_state(self, state):
        self.next_index = state["batch_start"]


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


def rounded_boundaries(n, shard_index, shard_count, drop_remainder=False):
    if drop_remainder:
        per_shard = n // shard_count
        return per_shard * shard_index, per_shard * (shard_index + 1)
    return round(shard_index * n / shard_count), round((shard_index + 1) * n / shard_count)


def truncated_boundaries(n, shard_index, shard_count, drop_remainder=False):
    if drop_remainder:
        per_shard = n // shard_count
        return per_shard * shard_index, per_shard * (shard_index + 1)
    return int(shard_index * n / shard_count), int((shard_index + 1) * n / shard_count)  # larger shards last


def ignores_drop_remainder_when_splitting(n, shard_index, shard_count, drop_remainder=False):
    return even_split(n, shard_index, shard_count, False)


def drop_remainder_keeping_the_offsets(n, shard_index, shard_count, drop_remainder=False):
    per_shard, remainder = divmod(n, shard_count)
    start = per_shard * shard_index + min(shard_index, remainder)  # offsets as if the remainder were kept
    return start, start + per_shard + (0 if drop_remainder else shard_index < remainder)


def inclusive_stop(n, shard_index, shard_count, drop_remainder=False):
    start, stop = even_split(n, shard_index, shard_count, drop_remainder)
    return start, stop - 1


def last_takes_the_rest(n, shard_index, shard_count, drop_remainder=False):
    per_shard = n // shard_count
    stop = n if shard_index == shard_count - 1 and not drop_remainder else per_shard * (shard_index + 1)
    return per_shard * shard_index, stop


# (exercise, planted wrong answer, points it should still get, why)
# Fresh wrong answers a learner writes (issue 38).


def rotation_by_the_seed(index, n, seed):
    return (index + seed) % n  # a permutation, and seeded, but neighbours stay neighbours


def reversal(index, n, seed):
    return n - 1 - index  # a fixed permutation: no seed, no shuffle


def batches_balanced_by_array_split(records, batch_size, drop_remainder=False):
    count = -(-len(records) // batch_size)
    parts = np.array_split(np.arange(len(records)), max(count, 1)) if records else []
    return [np.stack([records[i] for i in part]) for part in parts if len(part)]


def batches_of_dicts_as_object_arrays(records, batch_size, drop_remainder=False):
    stop = len(records) - len(records) % batch_size if drop_remainder else len(records)
    return [np.array(records[i:min(i + batch_size, stop)]) for i in range(0, stop, batch_size)]


def even_split_by_ceil_without_clamping(n, shard_index, shard_count, drop_remainder=False):
    size = -(-n // shard_count)
    return shard_index * size, min((shard_index + 1) * size, n)



class CountsTheElementsReturned(BatchIterator):
    """Saves how many elements it returned: the Nones it skipped are not counted, so it restores early."""

    def __next__(self):
        batch = super().__next__()
        self.returned = getattr(self, "returned", 0) + len(batch)
        return batch

    def get_state(self):
        return {"next_index": getattr(self, "returned", 0)}


hash_of_a_string = _feistel_with_round(lambda seed, r, right: hash(f"{seed}:{r}:{right}"))  # salted


def batches_in_one_reused_buffer(records, batch_size, drop_remainder=False):
    stop = len(records) - len(records) % batch_size if drop_remainder else len(records)
    batches, buffer = [], None
    for start in range(0, stop, batch_size):
        chunk = [np.asarray(record) for record in records[start:start + batch_size]]
        if buffer is None or len(chunk) != len(buffer):
            buffer = np.empty((len(chunk), *chunk[0].shape), chunk[0].dtype)
        np.stack(chunk, out=buffer)  # saves an allocation, but every full batch is this one array
        batches.append(buffer)
    return batches


class SavesANumpyInteger(BatchIterator):
    """Keeps its position as a NumPy integer, as np.flatnonzero gives it: json.dumps refuses it."""

    def get_state(self):
        return {"next_index": np.int64(self.next_index)}


def even_split_dropping_the_first_records(n, shard_index, shard_count, drop_remainder=False):
    per_shard, remainder = divmod(n, shard_count)
    if drop_remainder:  # leaves the first `remainder` records unused, not the last
        return remainder + per_shard * shard_index, remainder + per_shard * (shard_index + 1)
    return even_split(n, shard_index, shard_count)


FRESH = [
    ("04.index_shuffle", rotation_by_the_seed, 8, "(index + seed) % n"),
    ("04.index_shuffle", reversal, 6, "reverses the indices"),
    ("04.index_shuffle", hash_of_a_string, 11, "F = hash() of a string: another order in another process"),
    ("04.batch", batches_balanced_by_array_split, 1, "np.array_split: balanced, not b per batch"),
    ("04.batch", batches_of_dicts_as_object_arrays, 4, "np.array of dicts, and no remainder rule"),
    ("04.batch", batches_in_one_reused_buffer, 1, "stacks every batch into one reused buffer"),
    ("04.even_split", even_split_by_ceil_without_clamping, 1, "ceil-sized shards, starts past n"),
    ("04.even_split", even_split_dropping_the_first_records, 2, "drop_remainder drops the first records"),
    ("04.iterator_state", CountsTheElementsReturned, 3, "saves the count of elements returned"),
    ("04.iterator_state", SavesANumpyInteger, 3, "a NumPy integer in the state: not JSON"),
]


WRONG = [
    ("04.index_shuffle", materialised_shuffle, 10, "materialises the permutation"),
    ("04.index_shuffle", affine_shuffle, 8, "a multiplication modulo n, not a shuffle"),
    ("04.index_shuffle", feistel_modulo, 10, "modulo instead of cycle walking"),
    ("04.index_shuffle", hash_of_the_integers, 8, "F = hash() of arithmetic on the integers: no mixing"),
    ("04.index_shuffle", hash_xor_seed, 6, "F = hash(right ^ seed ^ r): linear, and the seed cancels out"),
    ("04.index_shuffle", ignores_the_seed, 11, "every seed gives the same order"),
    ("04.index_shuffle", odd_width_even_rounds, 12, "an odd number of bits: the top bit stays"),
    ("04.index_shuffle", odd_width_odd_rounds, 10, "an odd number of bits and 5 rounds: collisions"),
    ("04.index_shuffle", walks_once, 10, "cycle walking with an if, not a while"),
    ("04.index_shuffle", two_rounds, 10, "two Feistel rounds"),
    ("04.index_shuffle", one_round, 9, "one Feistel round"),
    ("04.index_shuffle", round_function_without_right, 6, "F ignores R: each round xors a constant"),
    ("04.index_shuffle", seed_through_its_lowest_bit, 11, "only the seed's lowest bit matters"),
    ("04.batch", batches_of_lists, 1, "lists, not stacked arrays"),
    ("04.batch", one_batch_too_many, 3, "an empty batch at exact multiples"),
    ("04.batch", ignores_drop_remainder, 3, "ignores drop_remainder"),
    ("04.batch", adds_one_in_place, 3, "adds 1 to the caller's arrays in place"),
    ("04.batch", clears_the_records_afterwards, 1, "right batches, then clears the caller's list"),
    ("04.batch", yields_batches, 0, "a generator, not a list"),
    ("04.batch", stacks_with_jax_numpy, 2, "jnp.stack: int32 where np.stack gives int64"),
    ("04.batch", stacks_fields_as_float32, 4, "casts dict fields to float32"),
    ("04.batch", reads_the_first_record_first, 4, "looks at records[0]: fails on no records"),
    ("04.batch", drops_the_last_batch_whatever_its_size, 4, "drop_remainder drops a full last batch"),
    ("04.iterator_state", CountsBatches, 3, "counts batches instead of elements"),
    ("04.iterator_state", ReplaysBatches, 7, "counts batches and replays them from the start"),
    ("04.iterator_state", KeepsOneStateDict, 7, "get_state returns the live state dict"),
    ("04.iterator_state", RemovesTheNonesInPlace, 0, "removes the Nones from the caller's list"),
    ("04.iterator_state", SavesTheElements, 7, "saves the elements themselves"),
    ("04.iterator_state", ForgetsToRestore, 3, "set_state does nothing"),
    ("04.iterator_state", ReturnsPositions, 4, "returns positions, not elements"),
    ("04.iterator_state", KeepsTruthyElements, 4, "skips 0 as well as None"),
    ("04.iterator_state", ReturnsAnEmptyLastBatch, 6, "returns [] when only Nones are left"),
    ("04.iterator_state", DropsAShortLastBatch, 6, "drops a short last batch"),
    ("04.iterator_state", ChangesTheGivenStateDict, 7, "set_state keeps and changes the caller's dict"),
    ("04.iterator_state", SavesWhereTheLastBatchStarted, 3, "saves where the last batch started"),
    ("04.even_split", ignores_the_remainder, 1, "drops the remainder always"),
    ("04.even_split", last_takes_the_rest, 2, "the last shard takes the remainder"),
    ("04.even_split", ceil_sized_shards, 2, "ceil(n / count) per shard"),
    ("04.even_split", larger_shards_last, 2, "the larger shards last"),
    ("04.even_split", rounded_boundaries, 2, "boundaries round(i * n / count)"),
    ("04.even_split", truncated_boundaries, 2, "boundaries int(i * n / count)"),
    ("04.even_split", ignores_drop_remainder_when_splitting, 2, "ignores drop_remainder"),
    ("04.even_split", drop_remainder_keeping_the_offsets, 2, "drop_remainder with the remainder's offsets"),
    ("04.even_split", inclusive_stop, 0, "an inclusive stop"),
    *FRESH,
]


@pytest.mark.parametrize("exercise_id, answer, points, why", WRONG, ids=[w[3] for w in WRONG])
def test_a_planted_wrong_answer_loses_points(exercise_id, answer, points, why):
    result = grade(exercise_id, answer)
    assert result.points == points, [(c.name, c.status, c.message) for c in result.cases]
    assert result.points < result.max_points
