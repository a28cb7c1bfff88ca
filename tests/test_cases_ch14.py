"""Chapter 14's exercise cases: right answers score full marks, planted wrong ones lose points."""

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


def block_id_plus_offset(block_table, position, block_size):  # forgets to scale the block id
    return block_table[position // block_size] + position % block_size


def contiguous_slots(block_table, position, block_size):  # ignores the table: as if blocks were adjacent
    if position >= len(block_table) * block_size:
        raise IndexError(position)
    return block_table[0] * block_size + position


def wraps_around(block_table, position, block_size):  # modulo the table: never raises
    return block_table[(position // block_size) % len(block_table)] * block_size + position % block_size


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


# (exercise, planted wrong answer, points it should still get, why)
WRONG = [
    ("14.kv_bytes", keys_only, 1, "keys only, no values"),
    ("14.kv_bytes", float_bytes, 4, "a float, not an int"),
    ("14.slot", block_id_plus_offset, 1, "the block id not multiplied by block_size"),
    ("14.slot", contiguous_slots, 1, "the table ignored after its first block"),
    ("14.slot", wraps_around, 4, "wraps past the end of the table"),
    ("14.top_p", drops_the_crossing_token, 0, "drops the token that crosses top_p"),
    ("14.top_p", not_renormalised, 1, "not renormalised"),
    ("14.top_p", sorts_in_place, 0, "sorts the caller's array"),
    ("14.admit", skips_ahead, 5, "a later request jumps the queue"),
    ("14.admit", floor_blocks, 5, "blocks rounded down"),
    ("14.admit", ignores_running, 6, "forgets the running sequences"),
]


@pytest.mark.parametrize("exercise_id, answer, points, why", WRONG, ids=[w[3] for w in WRONG])
def test_a_planted_wrong_answer_loses_points(exercise_id, answer, points, why):
    result = grade(exercise_id, answer)
    assert result.points == points, [(c.name, c.status, c.message) for c in result.cases]
    assert result.points < result.max_points
