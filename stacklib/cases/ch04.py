"""Chapter 04 exercises: an index shuffle, batching with a remainder, iterator state, an even split.

Every expected answer is computed before the learner's code runs, and the learner gets
copies of the records and datasets (`call_on_copies`, `_given`), so an answer that
changes its inputs in place cannot change what it is compared with; it fails with a
message that says so instead.
"""

import itertools
import json
import operator

import numpy as np

import stacklib.data as sd
from stacklib.grading import CaseFailure, Exercise, call_on_copies, expect, expect_equal, expect_same_sequence
from stacklib.grading.expect import as_in_another_process

# 04.index_shuffle -----------------------------------------------------------------------

index_shuffle = Exercise("04.index_shuffle", "A permutation computed one index at a time")


def _order(position, n, seed):
    return [int(position(i, n, seed)) for i in range(n)]


# 300 and 2000 need 9 and 11 bits: odd widths, where halves of unequal size break the network.
@index_shuffle.case(points=3, hint="Two indices landed on the same position, or one outside range(n): the "
                                   "network must be a bijection on b bits (b even, both halves b/2 bits, F "
                                   "masked to b/2 bits), and cycle walking must repeat until the result is "
                                   "below n (steps 1 to 3 of the recipe).")
def is_a_permutation_of_every_length(position):
    for n in (1, 2, 3, 10, 100, 300, 1000, 2000):
        for seed in (0, 1):
            order = _order(position, n, seed)
            missing = sorted(set(range(n)) - set(order))[:5]
            expect(sorted(order) == list(range(n)),
                   f"n={n}, seed={seed}: not a permutation of range({n}); e.g. never produced {missing}")


# A shuffle that ignores its seed gives every epoch the same order: worth as much as the other
# properties, so 2 points, and five seeds must give five different orders.
@index_shuffle.case(points=2, hint="The position must depend only on (index, n, seed), and every seed must "
                                   "give its own order: F must use the seed (step 2 of the recipe).")
def is_deterministic_and_depends_on_the_seed(position):
    first, again = _order(position, 100, 3), _order(position, 100, 3)
    expect(first == again, "two calls with seed 3 gave different orders")
    with as_in_another_process():  # hash() of a str is salted per process
        elsewhere = _order(position, 100, 3)
    expect(first == elsewhere, "seed 3 gives another order in another Python process: the order must be "
                               "the same wherever the job runs, or a restarted job reads another order",
           hint="hash() of a str (or of a tuple holding one) changes from one Python process to the next "
                "(PYTHONHASHSEED salts it): build F from the integers alone.")
    orders = [_order(position, 100, seed) for seed in range(5)]
    for a, b in itertools.combinations(range(5), 2):
        expect(orders[a] != orders[b], f"seeds {a} and {b} gave the same order")


@index_shuffle.case(points=2, hint="A rotation or a multiplication modulo n is a permutation but not a "
                                   "shuffle: neighbouring indices must not land a fixed distance apart.")
def looks_shuffled(position):
    order = np.array(_order(position, 1000, 0))
    steps = len(set(np.diff(order) % 1000))
    fixed = int((order == np.arange(1000)).sum())
    correlation = abs(np.corrcoef(np.arange(1000), order)[0, 1])
    expect(steps > 100, f"consecutive indices land only {steps} distinct distances apart: that is a pattern")
    expect(fixed < 20, f"{fixed} of 1000 indices stay where they are")
    expect(correlation < 0.2, f"position and index are correlated (|r| = {correlation:.2f})")


@index_shuffle.case(points=2, hint="hash() of an integer is the integer itself (hash(5) == 5), so a round "
                                   "function made of hash() and arithmetic on the integers mixes nothing. "
                                   "Mix the bits: multiply by a large odd constant, xor with a right shift "
                                   "of itself, repeat, then mask.")
def mixes_the_bits_of_the_index(position):
    n = 4096  # a power of two: every index is in the block, so this sees the network itself
    for seed in (0, 1):
        order = np.array(_order(position, n, seed))
        for bit in range(12):
            # For a shuffle, position(i) ^ position(i with that bit flipped) looks random over i. For a
            # network whose round function is linear (as hash() of an int is), it is one fixed pattern.
            pattern = order[np.arange(n) ^ (1 << bit)] ^ order
            values, counts = np.unique(pattern, return_counts=True)
            most = int(counts.max())
            expect(most < n // 8,  # a good network: about 10 of 4096; a linear one: all 4096
                   f"seed {seed}: flipping bit {bit} of the index xors the position with "
                   f"{int(values[counts.argmax()])} for {most} of {n} indices: the round function does "
                   "not mix, so the order has a pattern")


# With an odd number of bits, halves of b // 2 and b - b // 2 bits, and an even number of
# rounds, the network is still a bijection, but F's output (b // 2 bits) never reaches the
# wider half's top bit: bit b - 1 of the position is always bit b - 1 of the index.
@index_shuffle.case(hint="Some bit of the position equals the same bit of the index for (almost) every "
                         "index: with an odd number of bits, the halves differ in size and F never reaches "
                         "the wider half's top bit. Use an even number of bits (step 1 of the recipe).")
def no_bit_of_the_index_stays_in_place(position):
    for n in (512, 2048):  # 9 and 11 bits: powers of two, so every index is in the block
        for seed in (0, 1):
            order = np.array(_order(position, n, seed))
            for bit in range(n.bit_length() - 1):
                kept = float(((order >> bit) & 1 == (np.arange(n) >> bit) & 1).mean())
                expect(abs(kept - 0.5) < 0.2,  # a shuffle: 0.5 +- 0.03; a bit left in place: 1.0
                       f"n={n}, seed {seed}: bit {bit} of the position equals bit {bit} of the index for "
                       f"{kept:.0%} of the indices, where a shuffle gives about 50%")


@index_shuffle.case(points=3, time_limit_s=5, hint="Do not build the permutation: 10**12 indices do "
                                                   "not fit in memory. Compute only the index asked for.")
def answers_one_index_of_a_trillion(position):
    n = 10**12
    positions = [int(position(i, n, 5)) for i in (0, 1, 2, 123_456_789, n - 1)]
    expect(all(0 <= p < n for p in positions), f"positions {positions} are not all in [0, 10**12)")
    expect(len(set(positions)) == len(positions), f"different indices gave the same position: {positions}")


# 04.batch -------------------------------------------------------------------------------

batch = Exercise("04.batch", "Batching with a remainder")


def _reference_batches(records, batch_size, drop_remainder):
    return list(sd.MapDataset.source(records).batch(batch_size, drop_remainder=drop_remainder))


def _batches(make_batches, records, batch_size, **drop_remainder):
    got = call_on_copies(make_batches, records, batch_size, what="make_batches", **drop_remainder)
    expect(isinstance(got, list), f"make_batches should return a list of batches, got a {type(got).__name__}")
    return got


@batch.case(hint="Batch j holds records j*b ... min((j+1)*b, n) - 1, stacked with np.stack.")
def keeps_the_remainder_by_default(make_batches):
    records = [np.arange(3) + i for i in range(10)]
    expected = _reference_batches(records, 4, False)
    expect_equal(_batches(make_batches, records, 4), expected, what="make_batches(records, 4)")


@batch.case(hint="With drop_remainder=True there are n // b batches.")
def drops_the_remainder_when_asked(make_batches):
    records = list(range(10))
    expected = _reference_batches(records, 4, True)
    expect_equal(_batches(make_batches, records, 4, drop_remainder=True), expected,
                 what="make_batches(range(10), 4, drop_remainder=True)")


@batch.case(hint="Stack each field of dict records separately: {'x': (b, ...), 'y': (b,)}; keep the dtypes.")
def stacks_dict_records_field_by_field(make_batches):
    records = [{"x": np.full(3, i, np.float16), "y": np.int32(i)} for i in range(5)]
    expected = _reference_batches(records, 2, False)
    expect_equal(_batches(make_batches, records, 2), expected, what="batches of dicts")


@batch.case(hint="ceil(n / b) batches, or n // b with drop_remainder: 10 records in batches of 5 make 2 "
                 "either way (no remainder to drop); 3 records in batches of 8 make one short batch, or none "
                 "with drop_remainder.")
def has_no_empty_batch_and_drops_only_a_remainder_at_exact_multiples(make_batches):
    got = _batches(make_batches, list(range(10)), 5)
    expect(len(got) == 2, f"10 records, batch size 5: expected 2 batches, got {len(got)}")
    expected = _reference_batches(list(range(10)), 5, True)
    expect_equal(_batches(make_batches, list(range(10)), 5, drop_remainder=True), expected,
                 what="make_batches(range(10), 5, drop_remainder=True)")
    expect_equal(_batches(make_batches, [1, 2, 3], 8), [np.array([1, 2, 3])],
                 what="make_batches([1, 2, 3], 8)")
    got = _batches(make_batches, [1, 2, 3], 8, drop_remainder=True)
    expect(isinstance(got, list) and len(got) == 0,
           f"3 records, batch size 8, drop_remainder=True: expected no batches ([]), got {got!r:.80}")


@batch.case(hint="No records make no batches: return [] for an empty list, without looking at records[0] "
                 "to decide how to stack.")
def no_records_make_no_batches(make_batches):
    for drop_remainder in (False, True):
        got = _batches(make_batches, [], 4, drop_remainder=drop_remainder)
        expect(len(got) == 0, f"make_batches([], 4, drop_remainder={drop_remainder}): expected [], "
                              f"got {got!r:.80}")


# 04.iterator_state ----------------------------------------------------------------------

iterator_state = Exercise("04.iterator_state", "A batching iterator that can be saved and restored")

# The elements differ from their positions (an iterator that returns indices is caught), one
# of them is falsy (`if element:` is not `is not None`), and the list ends with Nones after a
# full batch, so the last read finds nothing: next() must then raise StopIteration, not
# return []. In batches of 3 the last batch is short instead.
_WITH_HOLES = [0, None, 20, 30, None, 50, 60, None, None, 90, 100, None, 110, None, None]
_EXPECTED = [[0, 20], [30, 50], [60, 90], [100, 110]]
_EXPECTED_IN_THREES = [[0, 20, 30], [50, 60, 90], [100, 110]]


def _given(dataset):
    """A copy of `dataset` for the learner's iterator (the case's own stays as it was)."""
    return list(dataset)


def _expect_unchanged(given, original):
    if list.__eq__(given, list(original)) is not True:  # list's own comparison: no reads are logged
        raise CaseFailure(
            "your iterator changed the dataset list it was given (e.g. removed its Nones): the caller's "
            "data must stay as it was. Skip the Nones as you read, or work on a copy (list(dataset))"
        )


@iterator_state.case(hint="Return the elements (not their positions), skipping only the Nones; the last "
                          "batch may be short but never empty: when only Nones are left, raise "
                          "StopIteration.")
def iterates_batches_skipping_nones(BatchIterator):
    for batch_size, expected in ((2, _EXPECTED), (3, _EXPECTED_IN_THREES)):
        dataset = _given(_WITH_HOLES)
        got = [list(b) for b in BatchIterator(dataset, batch_size)]
        _expect_unchanged(dataset, _WITH_HOLES)
        expect_same_sequence(got, expected, what=f"batch size {batch_size}: the batches")


@iterator_state.case(points=2, hint="Store the index of the next element to read (not the number of batches: "
                                    "Nones make batches span more elements than batch_size).")
def a_restored_iterator_continues_exactly_at_every_step(BatchIterator):
    for batch_size, expected in ((2, _EXPECTED), (3, _EXPECTED_IN_THREES)):
        dataset = _given(_WITH_HOLES)
        iterator = BatchIterator(dataset, batch_size)
        for consumed in range(len(expected) + 1):
            state = json.loads(json.dumps(iterator.get_state()))
            fresh_dataset = _given(_WITH_HOLES)
            fresh = BatchIterator(fresh_dataset, batch_size)
            fresh.set_state(state)
            rest = [list(b) for b in fresh]
            _expect_unchanged(dataset, _WITH_HOLES)
            _expect_unchanged(fresh_dataset, _WITH_HOLES)
            expect_same_sequence(rest, expected[consumed:],
                                 what=f"batch size {batch_size}, restored after {consumed} batches: "
                                      "the batches that follow")
            if consumed < len(expected):
                next(iterator)


class _ReadLog(list):
    """A list that records which of its positions are read, by index, slice or iteration."""

    def __init__(self, items):
        super().__init__(items)
        self.read: list[int] = []

    def __getitem__(self, key):
        if isinstance(key, slice):
            self.read.extend(range(*key.indices(len(self))))
            return list(super().__getitem__(key))
        index = operator.index(key)
        self.read.append(index + len(self) if index < 0 else index)
        return super().__getitem__(key)

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]


@iterator_state.case(points=2, hint="set_state must go straight to the saved position: replaying the batches "
                                    "returned so far from the start re-reads (in a real pipeline: "
                                    "recomputes) everything before it. Store the index of the next element "
                                    "to read.")
def restoring_does_not_read_the_data_again(BatchIterator):
    holes = [None if i % 3 == 1 else i for i in range(60)]
    kept = [i for i, x in enumerate(holes) if x is not None]
    position = kept[4 * 3 - 1] + 1  # four batches of 3 end with element 17; 18 is the next to read
    iterator = BatchIterator(_ReadLog(holes), 3)
    for _ in range(4):
        next(iterator)
    state = json.loads(json.dumps(iterator.get_state()))
    dataset = _ReadLog(holes)
    fresh = BatchIterator(dataset, 3)
    dataset.read.clear()  # reading during construction (e.g. copying the list) is allowed
    fresh.set_state(state)
    got = list(next(fresh))
    again = sorted({i for i in dataset.read if i < position})
    _expect_unchanged(dataset, holes)
    expect(not again, f"restoring after 4 batches (elements 0 to {position - 1} consumed) read element(s) "
                      f"{again[:3]}{'...' if len(again) > 3 else ''} again before returning {got}")


@iterator_state.case(points=2, hint="get_state returns a small dict of numbers, not the elements "
                                    "themselves.")
def the_state_is_small_json(BatchIterator):
    records = [None if i % 10 == 3 else i for i in range(1000)]
    dataset = _given(records)
    iterator = BatchIterator(dataset, 10)
    next(iterator)
    state = iterator.get_state()
    _expect_unchanged(dataset, records)
    expect(isinstance(state, dict), f"get_state should return a dict, got {type(state).__name__}")
    text = json.dumps(state)
    expect(len(text) < 200, f"the state of a 1000-element iterator is {len(text)} characters of JSON: "
                            f"{text:.60}...")


@iterator_state.case(points=2, hint="set_state must also move an iterator that has already run (rewind it), "
                                    "and the state dicts belong to the caller: get_state returns a new dict, "
                                    "and the iterator never changes a dict given to set_state (copy what you "
                                    "keep).")
def set_state_rewinds_a_running_iterator_as_often_as_asked(BatchIterator):
    dataset = _given(_WITH_HOLES)
    iterator = BatchIterator(dataset, 2)
    next(iterator)
    state = iterator.get_state()
    next(iterator), next(iterator)
    for attempt in ("after set_state", "after a second set_state from the same dict"):
        iterator.set_state(state)
        got = list(next(iterator))
        expect_same_sequence(got, _EXPECTED[1], what=f"{attempt}, the next batch")
    _expect_unchanged(dataset, _WITH_HOLES)


# 04.even_split --------------------------------------------------------------------------

even_split_exercise = Exercise("04.even_split", "An even split of a dataset across hosts")


def even_split_reference(n: int, index: int, count: int, drop_remainder: bool) -> tuple[int, int]:
    """Grain's `even_split` (grain/_src/core/sharding.py); tests/test_cases_ch04.py checks they agree."""
    per_shard, remainder = divmod(n, count)
    if drop_remainder:
        return per_shard * index, per_shard * (index + 1)
    start = per_shard * index + min(index, remainder)
    return start, start + per_shard + (index < remainder)


def _splits(split, n, count, drop_remainder=False):
    return [tuple(int(v) for v in split(n, i, count, drop_remainder)) for i in range(count)]


@even_split_exercise.case(hint="Shard i is [start, stop); consecutive shards touch, the first starts at 0 "
                               "and the last stops at n.")
def shards_are_disjoint_and_complete(split):
    for n, count in ((10, 3), (7, 7), (3, 5), (100, 8)):
        covered = [i for start, stop in _splits(split, n, count) for i in range(start, stop)]
        expect(covered == list(range(n)), f"n={n}, {count} shards: the shards cover {covered[:12]}..., "
                                          f"expected each of range({n}) exactly once, in order")


@even_split_exercise.case(hint="Give the n % count extra records to the first shards, one each: sizes "
                               "q + 1 then q, never further apart.")
def shard_sizes_differ_by_at_most_one_larger_first(split):
    for n, count, expected in ((11, 4, [3, 3, 3, 2]), (5, 4, [2, 1, 1, 1]), (9, 6, [2, 2, 2, 1, 1, 1])):
        sizes = [stop - start for start, stop in _splits(split, n, count)]
        expect_same_sequence(sizes, expected, what=f"{n} records on {count} shards: the sizes of the shards",
                             describe=str)


@even_split_exercise.case(hint="drop_remainder=True: every shard gets n // count records; "
                               "the rest is unused.")
def drop_remainder_makes_equal_shards(split):
    got = _splits(split, 11, 4, True)
    expect_same_sequence(got, [(0, 2), (2, 4), (4, 6), (6, 8)],
                         what="11 records on 4 shards, drop_remainder=True: the shards")


@even_split_exercise.case(hint="Work small cases by hand: 5 records on 3 shards are (0, 2), (2, 4), (4, 5).")
def matches_grain_everywhere(split):
    for n in (0, 1, 5, 16, 17, 31):
        for count in (1, 2, 3, 4, 7):
            for drop in (False, True):
                expected = [even_split_reference(n, i, count, drop) for i in range(count)]
                got = _splits(split, n, count, drop)
                expect_same_sequence(got, expected, what=f"n={n}, count={count}, drop_remainder={drop}: the "
                                                         "shards (start, stop)")
