"""A keyed permutation of [0, n) that is computed one index at a time.

A global shuffle of a dataset of a billion records cannot afford to build and keep a
permuted list of a billion indices on every host. Grain instead computes where index i
goes with a small block cipher: a cipher is a bijection on B-bit integers chosen by its
key, so `encrypt(i)` visits every B-bit value exactly once as i does. To restrict it to
[0, n) with n < 2^B, apply it again until the value falls inside ("cycle walking": the
orbit of a bijection must come back into [0, n), and two starting points never land on
the same value). Each index costs a few integer operations, whatever n is.

This module reproduces the permutation of grain's `index_shuffle` (C++, in
`grain/_src/python/experimental/index_shuffle/`), so the same seed gives the same order
in both libraries:

* the cipher is a Feistel network with Simon's round function on two W-bit halves,
  f(x) = (rotl(x, 1) & rotl(x, 8)) ^ rotl(x, 2), applied `rounds` times (4 by default);
* the round keys are the first `rounds` words that C++'s `std::seed_seq{seed}`
  generates (the algorithm is fixed by the C++ standard, [rand.util.seedseq]);
* the block has B = 2W bits: enough bits for `max_index`, rounded up to an even
  number, and at least 16.

Differences from grain:
  * Grain sizes the block as ceil(log2(max_index)) bits, one bit too few when
    max_index is a power of two. When that power is even and at least 16 (datasets of
    2^16 + 1, 2^18 + 1, ... records), the largest index does not fit the block and
    grain's "permutation" repeats one record and drops another. We count the bits of
    max_index itself, which gives grain's block size everywhere else and a true
    permutation there too.
  * NumPy arrays of indices are shuffled in one vectorised call; for blocks of 16 bits
    (n <= 65536), where cycle walks are long (2^16 / n steps on average), the whole
    permutation is tabulated once per seed instead (at most 64 Ki entries).

Reference: Black and Rogaway, "Ciphers with arbitrary finite domains" (2002), for
cycle walking; Beaulieu et al., "The SIMON and SPECK families of lightweight block
ciphers" (2013), for the round function.
"""

from __future__ import annotations

import functools

import numpy as np

_WORD = 0xFFFFFFFF  # std::seed_seq works modulo 2^32
_MIN_BLOCK_BITS = 16  # grain's minimum: smaller blocks gave visibly patterned permutations


@functools.lru_cache(maxsize=256)
def seed_seq_words(seed: int, count: int) -> tuple[int, ...]:
    """The first `count` 32-bit words of C++'s `std::seed_seq{seed}.generate(...)`.

    The C++ standard specifies this generator exactly, so it gives the same words on
    every platform; grain uses them as the cipher's round keys. The mixing constants
    1664525 and 1566083941 are the standard's.
    """
    seeds = [seed & _WORD]
    n, s = count, len(seeds)
    words = [0x8B8B8B8B] * n
    t = 11 if n >= 623 else 7 if n >= 68 else 5 if n >= 39 else 3 if n >= 7 else (n - 1) // 2
    p = (n - t) // 2
    q = p + t
    m = max(s + 1, n)

    def scramble(x: int) -> int:
        return x ^ (x >> 27)

    for k in range(m):
        r1 = 1664525 * scramble(words[k % n] ^ words[(k + p) % n] ^ words[(k - 1) % n]) & _WORD
        if k == 0:
            r2 = r1 + s
        elif k <= s:
            r2 = r1 + k % n + seeds[k - 1]
        else:
            r2 = r1 + k % n
        r2 &= _WORD
        words[(k + p) % n] = (words[(k + p) % n] + r1) & _WORD
        words[(k + q) % n] = (words[(k + q) % n] + r2) & _WORD
        words[k % n] = r2
    for k in range(m, m + n):
        r3 = 1566083941 * scramble((words[k % n] + words[(k + p) % n] + words[(k - 1) % n]) & _WORD) & _WORD
        r4 = (r3 - k % n) & _WORD
        words[(k + p) % n] ^= r3
        words[(k + q) % n] ^= r4
        words[k % n] = r4
    return tuple(words)


def block_bits(max_index: int) -> int:
    """Bits of the cipher's block for a permutation of [0, max_index]: even, >= 16."""
    bits = int(max_index).bit_length()
    return max(bits + bits % 2, _MIN_BLOCK_BITS)


def encrypt(x, round_keys: tuple[int, ...], half_bits: int):
    """One pass of the Feistel cipher over the 2 * half_bits-bit block `x`.

    `x` may be a Python int or a NumPy uint64 array: the same shifts, masks and xors
    work on both. Each pair of rounds updates the left half from the right one, then
    the right half from the new left one, so the whole pass is invertible whatever the
    round function is.
    """
    mask = (1 << half_bits) - 1

    def rotl(v, r):
        return ((v << r) | (v >> (half_bits - r))) & mask

    def simon(v):
        return (rotl(v, 1) & rotl(v, 8)) ^ rotl(v, 2)

    left, right = (x >> half_bits) & mask, x & mask
    for k1, k2 in zip(round_keys[0::2], round_keys[1::2], strict=True):
        left = left ^ simon(right) ^ (k1 & mask)
        right = right ^ simon(left) ^ (k2 & mask)
    return (left << half_bits) | right


def _check(max_index: int, seed: int, rounds: int) -> None:
    if max_index < 0:
        raise ValueError(f"max_index must be >= 0, got {max_index}.")
    if not 0 <= seed < 2**32:
        raise ValueError(f"seed must be an integer in [0, 2**32), got {seed}.")
    if rounds < 4 or rounds % 2:
        raise ValueError(f"rounds must be an even number >= 4, got {rounds}.")


@functools.lru_cache(maxsize=16)
def _small_block_permutation(max_index: int, seed: int, rounds: int) -> np.ndarray:
    """The whole permutation of [0, max_index] for a 16-bit block, tabulated.

    Cycle walking in a 2^16 block takes 2^16 / (max_index + 1) steps on average, which is
    slow one index at a time for small datasets. With the cipher tabulated over the
    whole block, "step until inside [0, n)" is a lookup table `hop` (values inside stay
    put); composing `hop` with itself doubles the number of steps it takes, so 16
    compositions cover every possible walk.
    """
    size = 1 << _MIN_BLOCK_BITS
    keys = seed_seq_words(seed, rounds)
    cipher = encrypt(np.arange(size, dtype=np.uint64), keys, _MIN_BLOCK_BITS // 2).astype(np.int64)
    hop = np.where(np.arange(size) <= max_index, np.arange(size), cipher)
    for _ in range(_MIN_BLOCK_BITS):
        hop = hop[hop]
    return hop[cipher[: max_index + 1]]


def _shuffle_one(index: int, max_index: int, seed: int, rounds: int) -> int:
    if not 0 <= index <= max_index:
        raise ValueError(f"index must lie in [0, {max_index}], got {index}.")
    if max_index == 0:
        return 0
    bits = block_bits(max_index)
    if bits == _MIN_BLOCK_BITS:
        return int(_small_block_permutation(max_index, seed, rounds)[index])
    keys = seed_seq_words(seed, rounds)
    while True:  # blocks of >= 18 bits hold at most 4x max_index: a few steps
        index = encrypt(index, keys, bits // 2)
        if index <= max_index:
            return index


def index_shuffle(index, max_index: int, seed: int, rounds: int = 4):
    """The position of `index` in a seeded permutation of [0, max_index].

    Same permutation as grain's `index_shuffle(index, max_index=, seed=, rounds=)`
    (see the module docstring for the one exception), computed without building the
    permutation unless the block is 16 bits.

    Args:
      index: an int in [0, max_index], or a NumPy integer array of them.
      max_index: the largest index; the permutation is of max_index + 1 values.
      seed: selects the permutation, an integer in [0, 2**32).
      rounds: Feistel rounds, an even number >= 4 (grain uses 4).

    Returns:
      An int (or an int64 array shaped like `index`): where `index` goes.

    Raises:
      ValueError: `max_index`, `seed` or `rounds` is out of range, or `index` is
        outside [0, max_index].
    """
    _check(max_index, seed, rounds)
    if isinstance(index, int | np.integer):  # one index: plain Python ints, no array overhead
        return _shuffle_one(int(index), max_index, seed, rounds)
    indices = np.asarray(index)
    if indices.size and (indices.min() < 0 or indices.max() > max_index):
        raise ValueError(f"index must lie in [0, {max_index}], got {index}.")
    if max_index == 0:
        return np.zeros(indices.shape, np.int64)
    bits = block_bits(max_index)
    if bits == _MIN_BLOCK_BITS:
        return _small_block_permutation(max_index, seed, rounds)[indices]
    keys = seed_seq_words(seed, rounds)
    values = encrypt(indices.astype(np.uint64).ravel(), keys, bits // 2)
    result = np.empty(values.shape, np.int64)
    pending = np.arange(values.size)
    while pending.size:
        inside = values <= max_index
        result[pending[inside]] = values[inside]
        pending, values = pending[~inside], encrypt(values[~inside], keys, bits // 2)
    return result.reshape(indices.shape)
