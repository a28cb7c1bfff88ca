"""Chapter 14 exercises: the KV-cache memory formula, the block-table lookup, top-p
filtering, and the scheduler's admission rule.

Expected answers come from closed forms or from `stacklib.infer` itself, computed before
the learner's code runs; lists and arrays are handed over as copies (`call_on_copies`).
"""

import numpy as np

from stacklib.grading import Exercise, call_on_copies, expect, expect_close, expect_equal
from stacklib.infer.sampling_params import filter_probs

# ---------------------------------------------------------------- 14.kv_bytes

kv_bytes = Exercise("14.kv_bytes", "The KV cache's size in bytes")


def _kv_bytes(n_layers, n_kv_heads, head_dim, num_tokens, bytes_per_value):
    return 2 * n_layers * n_kv_heads * head_dim * num_tokens * bytes_per_value


@kv_bytes.case(points=2, hint="A key AND a value, per layer, per KV head, per feature, per token.")
def the_chapter_model_at_128_tokens_in_float32(fn):
    expected = _kv_bytes(4, 2, 16, 128, 4)
    got = fn(4, 2, 16, 128, 4)
    expect(got == expected, f"kv_cache_bytes(4, 2, 16, 128, 4): expected {expected}, got {got!r}")


@kv_bytes.case(points=2, hint="Llama-3-8B: 32 layers, 8 KV heads of 128, bf16 (2 bytes): 8192 tokens "
                              "take 1 GiB.")
def llama_3_8b_at_8192_tokens_in_bfloat16(fn):
    got = fn(32, 8, 128, 8192, 2)
    expect(got == 1 << 30, f"kv_cache_bytes(32, 8, 128, 8192, 2): expected {1 << 30} (1 GiB), got {got!r}")


@kv_bytes.case(hint="Bytes are a whole number: return an int (use integer arithmetic).")
def the_answer_is_an_int(fn):
    got = fn(1, 1, 8, 3, 2)
    expect(isinstance(got, (int, np.integer)) and not isinstance(got, bool),
           f"expected an int, got {type(got).__name__} {got!r}")


# ---------------------------------------------------------------- 14.slot

slot = Exercise("14.slot", "Where a token's key and value live in the paged cache")


@slot.case(points=2, hint="Block table[position // block_size], slot position % block_size inside it: "
                          "block * block_size + offset.")
def positions_inside_blocks(fn):
    table, block_size = [7, 2, 9], 4
    for position, expected in [(0, 28), (1, 29), (5, 9), (10, 38)]:
        got = call_on_copies(fn, table, position, block_size, what="slot_for")
        expect_equal(got, expected, what=f"slot_for({table}, {position}, {block_size})")


@slot.case(points=2, hint="The last slot of a block is block * block_size + block_size - 1; the next "
                          "position starts the next block of the table, wherever that block lies.")
def block_boundaries(fn):
    table, block_size = [3, 11, 5], 16
    for position, expected in [(15, 63), (16, 176), (31, 191), (32, 80)]:
        got = call_on_copies(fn, table, position, block_size, what="slot_for")
        expect_equal(got, expected, what=f"slot_for({table}, {position}, {block_size})")


@slot.case(hint="A position past the sequence's blocks has no slot: raise IndexError (do not wrap around).")
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


@top_p.case(points=2, hint="Sort most likely first; keep tokens while the mass of those before them is "
                           "below top_p (the token that crosses top_p stays); zero the rest; renormalise.")
def matches_the_engine_on_random_distributions(fn):
    for seed, p in [(0, 0.5), (1, 0.9), (2, 0.3)]:
        probs = _probs(seed)
        expected = filter_probs(probs, 0, p, 0.0)
        got = call_on_copies(fn, probs, p, what="top_p_filter")
        expect_close(got, expected, rtol=1e-9, atol=1e-12, what=f"top_p_filter(seed {seed}, top_p={p})")


@top_p.case(hint="The token whose probability crosses top_p is kept: [0.5, 0.3, 0.2] at 0.6 keeps two.")
def the_crossing_token_is_kept(fn):
    probs = np.array([0.2, 0.5, 0.3])
    got = call_on_copies(fn, probs, 0.6, what="top_p_filter")
    expect_close(got, np.array([0.0, 0.625, 0.375]), rtol=1e-9, atol=1e-12,
                 what="top_p_filter([0.2, 0.5, 0.3], 0.6)")


@top_p.case(hint="top_p=1 keeps every token, and the result still sums to 1.")
def top_p_1_keeps_everything(fn):
    probs = _probs(3)
    got = call_on_copies(fn, probs, 1.0, what="top_p_filter")
    expect_close(got, probs, rtol=1e-9, atol=1e-12, what="top_p_filter(probs, 1.0)")


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


@admit.case(hint="Stop when running + admitted reaches max_num_seqs.")
def limited_by_max_num_seqs(fn):
    _check_admit(fn, ([5, 5, 5, 5], 2, 4, 1000, 100, 4))


@admit.case(points=2, hint="Each admitted prompt spends its tokens from the step's budget.")
def limited_by_the_token_budget(fn):
    _check_admit(fn, ([30, 30, 30], 0, 8, 70, 100, 4))
    _check_admit(fn, ([30, 40, 30], 0, 8, 70, 100, 4))


@admit.case(points=2, hint="A prompt of n tokens needs ceil(n / block_size) blocks, not n // block_size.")
def limited_by_free_blocks(fn):
    _check_admit(fn, ([9, 9, 9], 0, 8, 1000, 8, 4))  # 3 blocks each: two fit in 8
    _check_admit(fn, ([8, 8, 1], 0, 8, 1000, 5, 4))


@admit.case(points=2, hint="First come, first served: when the oldest waiting request does not fit, stop; "
                           "do not let a later, smaller one jump the queue.")
def first_come_first_served(fn):
    _check_admit(fn, ([10, 90, 5, 5], 0, 8, 60, 100, 4))
