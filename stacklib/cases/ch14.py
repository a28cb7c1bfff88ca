"""Chapter 14 exercises: the KV-cache memory formula, the block-table lookup, top-p
filtering, and the scheduler's admission rule.

Expected answers come from closed forms or from `stacklib.infer` itself, computed before
the learner's code runs; lists and arrays are handed over as copies (`call_on_copies`).
"""

import numpy as np

from stacklib.grading import Exercise, call_on_copies, expect, expect_close, expect_equal
from stacklib.grading.expect import seeded_permutation
from stacklib.infer.sampling_params import filter_probs

# ---------------------------------------------------------------- 14.kv_bytes

kv_bytes = Exercise("14.kv_bytes", "The KV cache's size in bytes")


def _kv_bytes(n_layers, n_kv_heads, head_dim, num_tokens, bytes_per_value):
    return 2 * n_layers * n_kv_heads * head_dim * num_tokens * bytes_per_value


@kv_bytes.case(points=2, hint="The count is off: check that every factor of the cache's size is there, "
                              "keys and values both (section 'Naive generation, and the KV cache').")
def the_chapter_model_at_128_tokens_in_float32(fn):
    expected = _kv_bytes(4, 2, 16, 128, 4)
    got = fn(4, 2, 16, 128, 4)
    expect(got == expected, f"kv_cache_bytes(4, 2, 16, 128, 4): expected {expected}, got {got!r}")


@kv_bytes.case(points=2, hint="Llama-3-8B: 32 layers, 8 KV heads of 128, bf16 (2 bytes): 8192 tokens "
                              "take 1 GiB.")
def llama_3_8b_at_8192_tokens_in_bfloat16(fn):
    got = fn(32, 8, 128, 8192, 2)
    expect(got == 1 << 30, f"kv_cache_bytes(32, 8, 128, 8192, 2): expected {1 << 30} (1 GiB), got {got!r}")


@kv_bytes.case(hint="Bytes are a whole number: return an int (use integer arithmetic), the exact count.")
def the_answer_is_an_exact_int(fn):
    got = fn(1, 1, 8, 3, 2)
    expect(isinstance(got, (int, np.integer)) and not isinstance(got, bool),
           f"expected an int, got {type(got).__name__} {got!r}")
    expect(got == 96, f"kv_cache_bytes(1, 1, 8, 3, 2): expected 96, got {got!r}")


@kv_bytes.case(hint="A cache past 2 GiB overflows 32-bit integers (a jnp array's default): compute with "
                    "Python ints.")
def a_cache_past_2_gib_does_not_overflow(fn):
    expected = _kv_bytes(80, 8, 128, 131072, 2)  # Llama-3-70B at 128k tokens: 40 GiB
    got = fn(80, 8, 128, 131072, 2)
    expect(got == expected,
           f"kv_cache_bytes(80, 8, 128, 131072, 2): expected {expected} (40 GiB), got {got!r}")


# ---------------------------------------------------------------- 14.slot

slot = Exercise("14.slot", "Where a token's key and value live in the paged cache")


@slot.case(points=2, hint="The slot is a place in the whole cache, not in the sequence: find the block the "
                          "table gives for this position, then count from that block's first slot (section "
                          "'A paged KV cache').")
def positions_inside_blocks(fn):
    table, block_size = [7, 2, 9], 4
    for position, expected in [(0, 28), (1, 29), (5, 9), (10, 38)]:
        got = call_on_copies(fn, table, position, block_size, what="slot_for")
        expect_equal(got, expected, what=f"slot_for({table}, {position}, {block_size})")


@slot.case(points=2, hint="These positions sit at the edges of blocks: the last position of a block and "
                          "the first of the next lie in different blocks of the table, wherever those "
                          "blocks are.")
def block_boundaries(fn):
    table, block_size = [3, 11, 5], 16
    for position, expected in [(15, 63), (16, 176), (31, 191), (32, 80)]:
        got = call_on_copies(fn, table, position, block_size, what="slot_for")
        expect_equal(got, expected, what=f"slot_for({table}, {position}, {block_size})")


@slot.case(points=2, hint="The last slot of the last block is still inside the table: only a position at "
                          "len(block_table) * block_size or beyond is past it.")
def the_last_slot_of_the_last_block(fn):
    """Negative positions are outside the statement (positions count from 0) and are not tried."""
    table, block_size = [int(b) for b in seeded_permutation(64, seed=14)], 16
    last = len(table) * block_size - 1
    got = call_on_copies(fn, table, last, block_size, what="slot_for")
    expect_equal(got, table[-1] * block_size + block_size - 1, what=f"slot_for(<64 blocks>, {last}, 16)")
    for position in np.random.default_rng(14).integers(0, last, 8):  # a realistic table, shuffled blocks
        got = call_on_copies(fn, table, int(position), block_size, what="slot_for")
        expected = table[position // block_size] * block_size + position % block_size
        expect_equal(got, expected, what=f"slot_for(<64 blocks>, {position}, 16)")


@slot.case(points=2, hint="A position past the sequence's blocks has no slot: raise IndexError (do not wrap "
                          "around).")
def a_position_past_the_table_raises_index_error(fn):
    try:
        got = fn([4, 1], 8, 4)
    except IndexError:
        return
    except Exception as error:  # noqa: BLE001 - any other exception is a wrong answer, reported
        expect(False, f"expected IndexError, got {type(error).__name__}: {error}")
    expect(False, f"slot_for([4, 1], 8, 4) returned {got!r}; position 8 needs a third block")


# ---------------------------------------------------------------- 14.top_p

top_p = Exercise("14.top_p", "Top-p (nucleus) filtering")


def _probs(seed, n=12):
    p = np.random.default_rng(seed).random(n) ** 3
    return p / p.sum()


def _check_top_p(fn, probs, p, expected=None):
    """top_p_filter(probs, p) against `expected` (default: the engine's filter), to float32 precision.

    The float64 reference and a float32 answer differ by ~1e-8 relative; a wrong kept set differs by far more.
    The dtype has its own case.
    """
    expected = filter_probs(probs, 0, p, 0.0) if expected is None else np.asarray(expected)
    got = call_on_copies(fn, probs, p, what="top_p_filter")
    expect_close(got, expected, rtol=1e-6, atol=1e-9,
                 what=f"top_p_filter({np.round(probs, 4).tolist()}, {p})")


@top_p.case(points=2, hint="The kept tokens or their values differ from the engine's: compare the token the "
                           "message names with the exercise's rule (which tokens stay, and the result sums "
                           "to 1).")
def matches_the_engine_on_random_distributions(fn):
    for seed, p in [(0, 0.5), (1, 0.9), (2, 0.3)]:
        _check_top_p(fn, _probs(seed), p)


@top_p.case(hint="The token whose probability crosses top_p is kept: [0.5, 0.3, 0.2] at 0.6 keeps two.")
def the_crossing_token_is_kept(fn):
    _check_top_p(fn, np.array([0.2, 0.5, 0.3]), 0.6, [0.0, 0.625, 0.375])


@top_p.case(points=2, hint="A token is kept only while the mass before it is BELOW top_p: when the tokens "
                           "before it already sum to exactly top_p, it is not kept.")
def a_token_after_an_exact_sum_is_dropped(fn):
    # Powers of two add exactly. top_p is the largest probability, so only the most likely token stays.
    _check_top_p(fn, np.array([0.25, 0.5, 0.25]), 0.5, [0.0, 1.0, 0.0])


@top_p.case(points=2, hint="Among tokens of equal probability the lower token id ranks first, and only as "
                           "many of them as the rule needs are kept (the exercise's 'ties by token id').")
def ties_are_broken_by_token_id(fn):
    # top_p is below the largest probability, so one token stays: the first of the tied ones.
    _check_top_p(fn, np.array([0.4, 0.2, 0.4]), 0.3, [1.0, 0.0, 0.0])
    _check_top_p(fn, np.array([0.1, 0.3, 0.3, 0.3]), 0.25, [0.0, 1.0, 0.0, 0.0])


@top_p.case(points=2, hint="With many tied tokens the order among them must be by token id: np.argsort's "
                           "default sort is not stable (past 16 elements it reorders equal values); sort "
                           "with kind='stable' on the negated probabilities.")
def ties_among_many_tokens_keep_token_order(fn):
    probs = np.concatenate([np.full(32, 1 / 64), np.full(64, 1 / 128)])[seeded_permutation(96, seed=5)]
    for p in (0.6, 0.75):  # the cut falls inside a run of tied tokens
        expected = filter_probs(probs, 0, p, 0.0)
        got = call_on_copies(fn, probs, p, what="top_p_filter")
        expect_close(got, expected, rtol=1e-6, atol=1e-9, what=f"top_p_filter(<96 probs, many tied>, {p})")


@top_p.case(hint="top_p=1 keeps every token, and the result still sums to 1.")
def top_p_1_keeps_everything(fn):
    probs = _probs(3)
    _check_top_p(fn, probs, 1.0, probs)


@top_p.case(hint="Return a NumPy array of probs' dtype (float64 here): jax.numpy computes in float32.")
def the_result_keeps_the_dtype_of_probs(fn):
    got = call_on_copies(fn, _probs(4), 0.8, what="top_p_filter")
    dtype = getattr(got, "dtype", None)
    expect(isinstance(got, np.ndarray) and dtype == np.float64,
           f"expected a NumPy array of dtype float64 like probs, got {type(got).__name__}"
           + ("" if dtype is None else f" of dtype {dtype}"))


# ---------------------------------------------------------------- 14.admit

admit = Exercise("14.admit", "The scheduler's admission rule")


def _admit(waiting, num_running, max_num_seqs, token_budget, free_blocks, block_size):
    admitted = 0
    for tokens in waiting:
        blocks = -(-tokens // block_size)
        if num_running + admitted >= max_num_seqs or tokens > token_budget or blocks > free_blocks:
            break
        admitted, token_budget, free_blocks = admitted + 1, token_budget - tokens, free_blocks - blocks
    return admitted


def _check_admit(fn, args):
    expected = _admit(*args)
    got = call_on_copies(fn, *args, what="num_admitted")
    expect_equal(got, expected, what=f"num_admitted{tuple(args)}")


@admit.case(points=2, hint="Wrong at the max_num_seqs limit: count the sequences already running together "
                           "with those admitted before this one (the exercise's first rule).")
def limited_by_max_num_seqs(fn):
    _check_admit(fn, ([5, 5, 5, 5], 2, 4, 1000, 100, 4))  # two seats left
    _check_admit(fn, ([5, 5, 5], 0, 1, 1000, 100, 4))  # one seat
    _check_admit(fn, ([5, 5], 3, 3, 1000, 100, 4))  # every seat taken


@admit.case(points=2, hint="Each admitted prompt spends its tokens from the step's budget: the next one "
                           "must fit what is left.")
def the_token_budget_is_spent(fn):
    _check_admit(fn, ([30, 30, 30], 0, 8, 70, 100, 4))


@admit.case(points=2, hint="Each admitted prompt takes its blocks from free_blocks: the next one must fit "
                           "what is left.")
def the_free_blocks_are_spent(fn):
    _check_admit(fn, ([8, 8, 8], 0, 8, 1000, 5, 4))  # 2 + 2 blocks; the third needs 2 of the 1 left


@admit.case(points=2, hint="A prompt whose tokens, or whose blocks, exactly use up what is left still fits.")
def a_prompt_that_exactly_fits_is_admitted(fn):
    _check_admit(fn, ([30, 40, 80], 0, 8, 70, 100, 4))  # 30 + 40 tokens: exactly the budget
    _check_admit(fn, ([8, 8, 1], 0, 8, 1000, 5, 4))  # 2 + 2 + 1 blocks: exactly the free blocks


@admit.case(points=2, hint="A partly filled block is still a whole block: 9 tokens in blocks of 4 take 3 "
                           "blocks.")
def a_partial_block_takes_a_whole_block(fn):
    _check_admit(fn, ([9], 0, 8, 1000, 2, 4))  # 3 blocks: more than the 2 free
    _check_admit(fn, ([13], 0, 8, 1000, 3, 4))  # 4 blocks: more than the 3 free


@admit.case(points=2, hint="First come, first served: when the oldest waiting request does not fit, stop; "
                           "do not let a later, smaller one jump the queue.")
def first_come_first_served(fn):
    _check_admit(fn, ([10, 90, 5, 5], 0, 8, 60, 100, 4))
