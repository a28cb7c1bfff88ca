"""Chapter 14's exercise cases: right answers score full marks, planted wrong ones lose points."""

import jax.numpy as jnp
import numpy as np
import pytest

from stacklib.grading import grade


def kv_cache_bytes(n_layers, n_kv_heads, head_dim, num_tokens, bytes_per_value):
    return 2 * n_layers * n_kv_heads * head_dim * num_tokens * bytes_per_value


def slot_for(block_table, position, block_size):
    return block_table[position // block_size] * block_size + position % block_size


def top_p_filter(probs, top_p):
    order = np.argsort(-probs, kind="stable")
    before = np.concatenate([[0.0], np.cumsum(probs[order])[:-1]])
    keep = np.zeros(len(probs), bool)
    keep[order[before < top_p]] = True
    filtered = np.where(keep, probs, 0.0)
    return filtered / filtered.sum()


def num_admitted(waiting, num_running, max_num_seqs, token_budget, free_blocks, block_size):
    admitted = 0
    for tokens in waiting:
        blocks = -(-tokens // block_size)
        if num_running + admitted >= max_num_seqs or tokens > token_budget or blocks > free_blocks:
            break
        admitted += 1
        token_budget -= tokens
        free_blocks -= blocks
    return admitted


RIGHT = {"14.kv_bytes": kv_cache_bytes, "14.slot": slot_for, "14.top_p": top_p_filter,
         "14.admit": num_admitted}


@pytest.mark.parametrize("exercise_id", sorted(RIGHT))
def test_a_right_answer_scores_full_marks(exercise_id):
    result = grade(exercise_id, RIGHT[exercise_id])
    assert result.points == result.max_points, [c.message for c in result.cases]


# Planted wrong answers.

def keys_only(n_layers, n_kv_heads, head_dim, num_tokens, bytes_per_value):  # forgets the values
    return n_layers * n_kv_heads * head_dim * num_tokens * bytes_per_value


def float_bytes(n_layers, n_kv_heads, head_dim, num_tokens, bytes_per_value):  # right number, a float
    return 2.0 * n_layers * n_kv_heads * head_dim * num_tokens * bytes_per_value


def values_not_bytes(n_layers, n_kv_heads, head_dim, num_tokens, bytes_per_value):  # counts values
    return 2 * n_layers * n_kv_heads * head_dim * num_tokens


def forgets_the_layers(n_layers, n_kv_heads, head_dim, num_tokens, bytes_per_value):
    return 2 * n_kv_heads * head_dim * num_tokens * bytes_per_value


def int32_product(n_layers, n_kv_heads, head_dim, num_tokens, bytes_per_value):  # jnp's int32 overflows
    return int(jnp.prod(jnp.array([2, n_layers, n_kv_heads, head_dim, num_tokens, bytes_per_value])))


def bits_not_bytes(n_layers, n_kv_heads, head_dim, num_tokens, bytes_per_value):
    return 8 * kv_cache_bytes(n_layers, n_kv_heads, head_dim, num_tokens, bytes_per_value)


def rounded_up_to_kib(n_layers, n_kv_heads, head_dim, num_tokens, bytes_per_value):
    return -(-kv_cache_bytes(n_layers, n_kv_heads, head_dim, num_tokens, bytes_per_value) // 1024) * 1024


def block_id_plus_offset(block_table, position, block_size):  # forgets to scale the block id
    return block_table[position // block_size] + position % block_size


def contiguous_slots(block_table, position, block_size):  # ignores the table: as if blocks were adjacent
    if position >= len(block_table) * block_size:
        raise IndexError(position)
    return block_table[0] * block_size + position


def wraps_around(block_table, position, block_size):  # modulo the table: never raises
    return block_table[(position // block_size) % len(block_table)] * block_size + position % block_size


def ignores_the_table(block_table, position, block_size):  # the position itself
    return (position // block_size) * block_size + position % block_size


def table_length_as_stride(block_table, position, block_size):
    return block_table[position // block_size] * len(block_table) + position % block_size


def value_error_past_the_end(block_table, position, block_size):
    if position >= len(block_table) * block_size:
        raise ValueError(position)
    return slot_for(block_table, position, block_size)


def minus_one_past_the_end(block_table, position, block_size):
    return slot_for(block_table, position, block_size) if position < len(block_table) * block_size else -1


def drops_the_crossing_token(probs, top_p):  # keeps only tokens whose cumulative mass stays below top_p
    order = np.argsort(-probs, kind="stable")
    keep = np.zeros(len(probs), bool)
    keep[order[np.cumsum(probs[order]) < top_p]] = True
    keep[order[0]] = True
    filtered = np.where(keep, probs, 0.0)
    return filtered / filtered.sum()


def not_renormalised(probs, top_p):
    order = np.argsort(-probs, kind="stable")
    before = np.concatenate([[0.0], np.cumsum(probs[order])[:-1]])
    return np.where(np.isin(np.arange(len(probs)), order[before < top_p]), probs, 0.0)


def sorts_in_place(probs, top_p):  # right numbers, but sorts the caller's array
    original = probs.copy()
    probs.sort()
    return top_p_filter(original, top_p)


def ties_highest_id_first(probs, top_p):  # ascending sort reversed: ties come highest id first
    order = np.argsort(probs, kind="stable")[::-1]
    before = np.concatenate([[0.0], np.cumsum(probs[order])[:-1]])
    keep = np.zeros(len(probs), bool)
    keep[order[before < top_p]] = True
    filtered = np.where(keep, probs, 0.0)
    return filtered / filtered.sum()


def keeps_every_tie_at_the_cutoff(probs, top_p):  # a threshold on the probability value
    ranked = np.sort(probs)[::-1]
    before = np.concatenate([[0.0], np.cumsum(ranked)[:-1]])
    cutoff = ranked[before < top_p][-1]
    filtered = np.where(probs >= cutoff, probs, 0.0)
    return filtered / filtered.sum()


def at_most_top_p_before(probs, top_p):  # <= where the text says below: one token too many at an exact sum
    order = np.argsort(-probs, kind="stable")
    before = np.concatenate([[0.0], np.cumsum(probs[order])[:-1]])
    keep = np.zeros(len(probs), bool)
    keep[order[before <= top_p]] = True
    filtered = np.where(keep, probs, 0.0)
    return filtered / filtered.sum()


def in_float32(probs, top_p):  # right tokens, computed with jax.numpy
    p = jnp.asarray(probs)
    order = jnp.argsort(-p, stable=True)
    before = jnp.concatenate([jnp.zeros(1), jnp.cumsum(p[order])[:-1]])
    filtered = jnp.where(jnp.zeros(len(probs), bool).at[order].set(before < top_p), p, 0.0)
    return filtered / filtered.sum()


def left_in_sorted_order(probs, top_p):  # filtered while sorted, never put back in token order
    ranked = np.sort(probs)[::-1]
    before = np.concatenate([[0.0], np.cumsum(ranked)[:-1]])
    filtered = np.where(before < top_p, ranked, 0.0)
    return filtered / filtered.sum()


def skips_ahead(waiting, num_running, max_num_seqs, token_budget, free_blocks, block_size):
    admitted = 0
    for tokens in waiting:  # a request that does not fit is passed over, not waited for
        blocks = -(-tokens // block_size)
        if num_running + admitted >= max_num_seqs:
            break
        if tokens <= token_budget and blocks <= free_blocks:
            admitted, token_budget, free_blocks = admitted + 1, token_budget - tokens, free_blocks - blocks
    return admitted


def floor_blocks(waiting, num_running, max_num_seqs, token_budget, free_blocks, block_size):
    admitted = 0
    for tokens in waiting:
        blocks = tokens // block_size  # a partial block is forgotten
        if num_running + admitted >= max_num_seqs or tokens > token_budget or blocks > free_blocks:
            break
        admitted, token_budget, free_blocks = admitted + 1, token_budget - tokens, free_blocks - blocks
    return admitted


def ignores_running(waiting, num_running, max_num_seqs, token_budget, free_blocks, block_size):
    return num_admitted(waiting, 0, max_num_seqs, token_budget, free_blocks, block_size)


def one_seat_short(waiting, num_running, max_num_seqs, token_budget, free_blocks, block_size):
    admitted = 0
    for tokens in waiting:  # counts this request as running already
        blocks = -(-tokens // block_size)
        if num_running + admitted + 1 >= max_num_seqs or tokens > token_budget or blocks > free_blocks:
            break
        admitted, token_budget, free_blocks = admitted + 1, token_budget - tokens, free_blocks - blocks
    return admitted


def one_seat_too_many(waiting, num_running, max_num_seqs, token_budget, free_blocks, block_size):
    return num_admitted(waiting, num_running - 1, max_num_seqs, token_budget, free_blocks, block_size)


def budget_not_spent(waiting, num_running, max_num_seqs, token_budget, free_blocks, block_size):
    admitted = 0
    for tokens in waiting:  # every prompt is measured against the whole budget
        blocks = -(-tokens // block_size)
        if num_running + admitted >= max_num_seqs or tokens > token_budget or blocks > free_blocks:
            break
        admitted, free_blocks = admitted + 1, free_blocks - blocks
    return admitted


def blocks_not_spent(waiting, num_running, max_num_seqs, token_budget, free_blocks, block_size):
    admitted = 0
    for tokens in waiting:  # every prompt is measured against all the free blocks
        blocks = -(-tokens // block_size)
        if num_running + admitted >= max_num_seqs or tokens > token_budget or blocks > free_blocks:
            break
        admitted, token_budget = admitted + 1, token_budget - tokens
    return admitted


def exact_fit_refused(waiting, num_running, max_num_seqs, token_budget, free_blocks, block_size):
    admitted = 0
    for tokens in waiting:  # >= where the text says fits: a prompt that uses up the rest is refused
        blocks = -(-tokens // block_size)
        if num_running + admitted >= max_num_seqs or tokens >= token_budget or blocks >= free_blocks:
            break
        admitted, token_budget, free_blocks = admitted + 1, token_budget - tokens, free_blocks - blocks
    return admitted


def pops_the_queue(waiting, num_running, max_num_seqs, token_budget, free_blocks, block_size):
    admitted = num_admitted(waiting, num_running, max_num_seqs, token_budget, free_blocks, block_size)
    del waiting[:admitted]  # the caller's queue changes under it
    return admitted


def gibibytes(n_layers, n_kv_heads, head_dim, num_tokens, bytes_per_value):  # a size for humans
    return kv_cache_bytes(n_layers, n_kv_heads, head_dim, num_tokens, bytes_per_value) / 2 ** 30


def int32_numpy_product(n_layers, n_kv_heads, head_dim, num_tokens, bytes_per_value):  # wraps past 2 GiB
    factors = np.array([2, n_layers, n_kv_heads, head_dim, num_tokens, bytes_per_value], np.int32)
    with np.errstate(over="ignore"):
        return int(np.prod(factors, dtype=np.int32))


def forgets_the_kv_heads(n_layers, n_kv_heads, head_dim, num_tokens, bytes_per_value):
    return 2 * n_layers * head_dim * num_tokens * bytes_per_value


def inverse_lookup(block_table, position, block_size):  # which entry holds the block, not which block
    return block_table.index(block_table[position // block_size]) * block_size + position % block_size


def rounds_the_block_index(block_table, position, block_size):  # round(), not floor division
    return block_table[round(position / block_size)] * block_size + position % block_size


def last_slot_refused(block_table, position, block_size):  # >= len * block_size - 1
    if position >= len(block_table) * block_size - 1:
        raise IndexError(position)
    return slot_for(block_table, position, block_size)


def sorted_table(block_table, position, block_size):  # "blocks in order"
    return slot_for(sorted(block_table), position, block_size)


def unstable_argsort(probs, top_p):  # np.argsort's default kind reorders ties past 16 elements
    order = np.argsort(-probs)
    before = np.concatenate([[0.0], np.cumsum(probs[order])[:-1]])
    keep = np.zeros(len(probs), bool)
    keep[order[before < top_p]] = True
    filtered = np.where(keep, probs, 0.0)
    return filtered / filtered.sum()


def in_jax(probs, top_p):  # jnp.argsort is stable, but the result is a jax.Array in float32
    return jnp.asarray(top_p_filter(probs, top_p))


def renormalised_by_top_p(probs, top_p):
    kept = top_p_filter(probs, top_p) > 0
    return np.where(kept, probs, 0.0) / top_p


def kept_probs_only(probs, top_p):  # the kept probabilities, compressed
    filtered = top_p_filter(probs, top_p)
    return filtered[filtered > 0]


def blocks_plus_one(waiting, num_running, max_num_seqs, token_budget, free_blocks, block_size):
    admitted = 0
    for tokens in waiting:
        blocks = tokens // block_size + 1  # one too many when tokens is a multiple of block_size
        if num_running + admitted >= max_num_seqs or tokens > token_budget or blocks > free_blocks:
            break
        admitted, token_budget, free_blocks = admitted + 1, token_budget - tokens, free_blocks - blocks
    return admitted


def admitted_lengths(waiting, num_running, max_num_seqs, token_budget, free_blocks, block_size):
    return waiting[:num_admitted(waiting, num_running, max_num_seqs, token_budget, free_blocks, block_size)]


# (exercise, planted wrong answer, points it should still get, why)
WRONG = [
    ("14.kv_bytes", keys_only, 0, "keys only, no values"),
    ("14.kv_bytes", float_bytes, 5, "a float, not an int"),
    ("14.kv_bytes", values_not_bytes, 0, "values counted, not bytes"),
    ("14.kv_bytes", forgets_the_layers, 1, "one layer's cache"),
    ("14.kv_bytes", int32_product, 5, "overflows int32 past 2 GiB"),
    ("14.kv_bytes", bits_not_bytes, 0, "bits, not bytes"),
    ("14.kv_bytes", rounded_up_to_kib, 5, "rounded up to whole KiB"),
    ("14.slot", block_id_plus_offset, 2, "the block id not multiplied by block_size"),
    ("14.slot", contiguous_slots, 2, "the table ignored after its first block"),
    ("14.slot", wraps_around, 6, "wraps past the end of the table"),
    ("14.slot", ignores_the_table, 0, "the position itself, the table ignored"),
    ("14.slot", table_length_as_stride, 2, "the table's length as the block stride"),
    ("14.slot", value_error_past_the_end, 6, "ValueError instead of IndexError"),
    ("14.slot", minus_one_past_the_end, 6, "-1 past the end instead of raising"),
    ("14.top_p", drops_the_crossing_token, 5, "drops the token that crosses top_p"),
    ("14.top_p", not_renormalised, 2, "not renormalised"),
    ("14.top_p", sorts_in_place, 0, "sorts the caller's array"),
    ("14.top_p", ties_highest_id_first, 7, "ties ranked highest id first"),
    ("14.top_p", keeps_every_tie_at_the_cutoff, 7, "every token tied with the cutoff kept"),
    ("14.top_p", at_most_top_p_before, 7, "a token after an exact sum kept"),
    ("14.top_p", in_float32, 10, "float32 from jax.numpy"),
    ("14.top_p", left_in_sorted_order, 1, "returned in sorted order"),
    ("14.admit", skips_ahead, 10, "a later request jumps the queue"),
    ("14.admit", floor_blocks, 10, "blocks rounded down"),
    ("14.admit", ignores_running, 10, "forgets the running sequences"),
    ("14.admit", one_seat_short, 10, "one seat short of max_num_seqs"),
    ("14.admit", one_seat_too_many, 10, "one seat past max_num_seqs"),
    ("14.admit", budget_not_spent, 10, "the token budget never spent"),
    ("14.admit", blocks_not_spent, 10, "the free blocks never spent"),
    ("14.admit", exact_fit_refused, 10, "an exact fit refused"),
    ("14.admit", pops_the_queue, 2, "pops the admitted requests off the caller's queue"),
    ("14.kv_bytes", gibibytes, 0, "GiB, not bytes"),
    ("14.kv_bytes", int32_numpy_product, 5, "an np.int32 product"),
    ("14.kv_bytes", forgets_the_kv_heads, 1, "the KV heads forgotten"),
    ("14.slot", inverse_lookup, 2, "the table's index of the block"),
    ("14.slot", rounds_the_block_index, 4, "round(), not //"),
    ("14.slot", last_slot_refused, 6, "the last slot of the last block refused"),
    ("14.slot", sorted_table, 2, "the table sorted first"),
    ("14.top_p", unstable_argsort, 9, "np.argsort's unstable default"),
    ("14.top_p", in_jax, 10, "a float32 jax.Array"),
    ("14.top_p", renormalised_by_top_p, 4, "divided by top_p"),
    ("14.top_p", kept_probs_only, 2, "the kept probabilities only"),
    ("14.admit", blocks_plus_one, 8, "tokens // block_size + 1 blocks"),
    ("14.admit", admitted_lengths, 0, "the admitted lengths, not their count"),
]


@pytest.mark.parametrize("exercise_id, answer, points, why", WRONG, ids=[w[3] for w in WRONG])
def test_a_planted_wrong_answer_loses_points(exercise_id, answer, points, why):
    result = grade(exercise_id, answer)
    assert result.points == points, [(c.name, c.status, c.message) for c in result.cases]
    assert result.points < result.max_points
