"""Chapter 12's exercise cases: right answers score full marks, planted wrong ones lose points."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stacklib.grading import grade


def apply_rope(x, positions, theta):
    half = x.shape[-1] // 2
    inv_freq = theta ** (-jnp.arange(0, x.shape[-1], 2, dtype=jnp.float32) / x.shape[-1])
    angles = jnp.asarray(positions, jnp.float32)[..., None] * inv_freq  # (B, T, D/2)
    cos, sin = jnp.cos(angles)[:, :, None], jnp.sin(angles)[:, :, None]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def gqa_attention(q, k, v, q_positions, k_positions):
    B, T, H, D = q.shape
    K = k.shape[2]
    q = q.reshape(B, T, K, H // K, D)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k) / np.sqrt(D)
    mask = k_positions[:, None, :] <= q_positions[:, :, None]  # (B, T, S)
    scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
    out = jnp.einsum("bkgts,bskd->btkgd", jnp.exp(scores - scores.max(-1, keepdims=True))
                     / jnp.exp(scores - scores.max(-1, keepdims=True)).sum(-1, keepdims=True), v)
    return out.reshape(B, T, H, D)


def flops_per_token(d_model, n_layers, n_heads, n_kv_heads, head_dim, d_ff, vocab_size, seq_len, causal):
    per_layer = 2 * d_model * n_heads * head_dim + 2 * d_model * n_kv_heads * head_dim + 3 * d_model * d_ff
    n = n_layers * per_layer + d_model * vocab_size
    keys = (seq_len + 1) / 2 if causal else seq_len
    return 6 * n + 3 * n_layers * 2 * 2 * keys * n_heads * head_dim


def pack(documents, seq_len, eos_id):
    stream = np.concatenate([np.append(d, eos_id) for d in documents]).astype(np.int32)
    count = (len(stream) - 1) // seq_len
    return np.array([stream[i * seq_len: (i + 1) * seq_len + 1] for i in range(count)],
                    np.int32).reshape(count, seq_len + 1)


def goodput(log):
    wall = sum(e["time"] for e in log if e["event"] == "end") - sum(
        e["time"] for e in log if e["event"] == "start")
    surviving = {e["step"]: e["seconds"] for e in log if e["event"] == "step"}  # later runs overwrite
    steps = sum(e["seconds"] for e in log if e["event"] == "step")
    result = {kind: sum(e["seconds"] for e in log if e["event"] == kind)
              for kind in ("compile", "checkpoint", "input")}
    result["productive"] = sum(surviving.values())
    result["lost"] = steps - result["productive"]
    result["other"] = wall - sum(result.values())
    result["goodput"] = result["productive"] / wall
    return result


RIGHT = {
    "12.rope": apply_rope,
    "12.gqa_attention": gqa_attention,
    "12.flops_per_token": flops_per_token,
    "12.pack": pack,
    "12.goodput": goodput,
}


@pytest.mark.parametrize("exercise_id", sorted(RIGHT))
def test_a_right_answer_scores_full_marks(exercise_id):
    result = grade(exercise_id, RIGHT[exercise_id])
    assert result.points == result.max_points, [c.message for c in result.cases]



# Planted wrong answers.

def rope_adjacent_pairs(x, positions, theta):  # Meta's (2j, 2j+1) pairing, not the model's halves
    even, odd = x[..., 0::2], x[..., 1::2]
    inv_freq = theta ** (-jnp.arange(0, x.shape[-1], 2, dtype=jnp.float32) / x.shape[-1])
    angles = jnp.asarray(positions, jnp.float32)[..., None, None] * inv_freq
    rotated = jnp.stack([even * jnp.cos(angles) - odd * jnp.sin(angles),
                         odd * jnp.cos(angles) + even * jnp.sin(angles)], axis=-1)
    return rotated.reshape(x.shape)


def rope_ignores_positions(x, positions, theta):  # assumes 0..T-1 in every row
    return apply_rope(x, np.broadcast_to(np.arange(x.shape[1]), x.shape[:2]), theta)


def rope_wrong_frequencies(x, positions, theta):  # theta ** (-j / D): half the exponent
    half = x.shape[-1] // 2
    angles = jnp.asarray(positions, jnp.float32)[..., None] * theta ** (-jnp.arange(half) / x.shape[-1])
    cos, sin = jnp.cos(angles)[:, :, None], jnp.sin(angles)[:, :, None]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def rope_in_place(x, positions, theta):
    x[...] = np.asarray(apply_rope(x, positions, theta))
    return x


def rope_fixed_theta(x, positions, theta):  # 10000 from the text's example, not the argument
    return apply_rope(x, positions, 10_000.0)


def rope_turned_backwards(x, positions, theta):  # (x1 cos + x2 sin, x2 cos - x1 sin): angle -a
    return apply_rope(x, -np.asarray(positions), theta)


def rope_first_row_positions(x, positions, theta):  # every sequence turned by row 0's positions
    return apply_rope(x, np.broadcast_to(np.asarray(positions)[:1], np.shape(positions)), theta)


def rope_positions_from_the_first(x, positions, theta):  # counts from each row's first position
    positions = np.asarray(positions)
    return apply_rope(x, positions - positions[:, :1], theta)


def gqa_interleaved(q, k, v, q_positions, k_positions):  # query head h uses kv head h % K
    group = q.shape[2] // k.shape[2]
    tiled_k, tiled_v = jnp.tile(k, (1, 1, group, 1)), jnp.tile(v, (1, 1, group, 1))  # heads 0,1,0,1,...
    return gqa_attention(q, tiled_k, tiled_v, q_positions, k_positions)


def gqa_index_mask(q, k, v, q_positions, k_positions):  # tril by array index, not by position
    B, T, S = q.shape[0], q.shape[1], k.shape[1]
    rows, columns = np.broadcast_to(np.arange(T), (B, T)), np.broadcast_to(np.arange(S), (B, S))
    return gqa_attention(q, k, v, rows, columns)


def gqa_unscaled(q, k, v, q_positions, k_positions):  # forgets 1/sqrt(D)
    return gqa_attention(q * np.sqrt(q.shape[-1]), k, v, q_positions, k_positions)


def gqa_strict_mask(q, k, v, q_positions, k_positions):  # a query may not see its own key
    return gqa_attention(q, k, v, np.asarray(q_positions) - 1, k_positions)


def gqa_bottom_right_mask(q, k, v, q_positions, k_positions):  # tril aligned to the last key, by index
    T, S = q.shape[1], k.shape[1]
    rows = np.broadcast_to(np.arange(S - T, S), (q.shape[0], T))
    return gqa_attention(q, k, v, rows, np.broadcast_to(np.arange(S), (q.shape[0], S)))


def gqa_first_row_mask(q, k, v, q_positions, k_positions):  # row 0's mask for every sequence
    q_positions, k_positions = np.asarray(q_positions), np.asarray(k_positions)
    return gqa_attention(q, k, v, np.broadcast_to(q_positions[:1], q_positions.shape),
                         np.broadcast_to(k_positions[:1], k_positions.shape))


def gqa_scaled_by_d(q, k, v, q_positions, k_positions):  # 1/D instead of 1/sqrt(D)
    return gqa_attention(q / np.sqrt(q.shape[-1]), k, v, q_positions, k_positions)


def flops_with_embedding(**sizes):  # the lookup is not a matmul
    return flops_per_token(**sizes) + 6 * sizes["vocab_size"] * sizes["d_model"]


def flops_mha_projections(**sizes):
    return flops_per_token(**{**sizes, "n_kv_heads": sizes["n_heads"]})


def flops_half_of_t(**sizes):  # T / 2 keys per query instead of (T + 1) / 2
    full = flops_per_token(**{**sizes, "causal": False})
    if not sizes["causal"]:
        return full
    return full - 3 * sizes["n_layers"] * 2 * 2 * sizes["seq_len"] / 2 * sizes["n_heads"] * sizes["head_dim"]


def flops_forward_only(**sizes):
    return flops_per_token(**sizes) / 3


def flops_square_projections(d_model, n_layers, n_heads, n_kv_heads, head_dim, d_ff, vocab_size, seq_len,
                             causal):  # q and o as d_model x d_model, k and v as d_model x d_model * K / H
    attention_weights = 2 * d_model * d_model + 2 * d_model * d_model * n_kv_heads / n_heads
    n = n_layers * (attention_weights + 3 * d_model * d_ff) + d_model * vocab_size
    keys = (seq_len + 1) / 2 if causal else seq_len
    return 6 * n + 3 * n_layers * 2 * 2 * keys * n_heads * head_dim


def flops_attention_over_d_model(d_model, n_layers, n_heads, n_kv_heads, head_dim, d_ff, vocab_size, seq_len,
                                 causal):  # the score matmuls as wide as d_model
    attention_weights = 2 * d_model * n_heads * head_dim + 2 * d_model * n_kv_heads * head_dim
    n = n_layers * (attention_weights + 3 * d_model * d_ff) + d_model * vocab_size
    keys = (seq_len + 1) / 2 if causal else seq_len
    return 6 * n + 3 * n_layers * 2 * 2 * keys * d_model


def flops_attention_over_kv_heads(d_model, n_layers, n_heads, n_kv_heads, head_dim, d_ff, vocab_size, seq_len,
                                  causal):  # scores counted for the key/value heads only
    attention_weights = 2 * d_model * n_heads * head_dim + 2 * d_model * n_kv_heads * head_dim
    n = n_layers * (attention_weights + 3 * d_model * d_ff) + d_model * vocab_size
    keys = (seq_len + 1) / 2 if causal else seq_len
    return 6 * n + 3 * n_layers * 2 * 2 * keys * n_kv_heads * head_dim


def flops_causal_integer_division(**sizes):  # (seq_len + 1) // 2 keys: 64, not 64.5
    full = flops_per_token(**{**sizes, "causal": False})
    if not sizes["causal"]:
        return full
    dropped_keys = sizes["seq_len"] - (sizes["seq_len"] + 1) // 2
    return full - 3 * sizes["n_layers"] * 2 * 2 * dropped_keys * sizes["n_heads"] * sizes["head_dim"]


def flops_two_mlp_matrices(**sizes):  # an MLP without the gate
    return flops_per_token(**sizes) - 6 * sizes["n_layers"] * sizes["d_model"] * sizes["d_ff"]


def flops_without_output_projection(**sizes):  # the output projection taken as tied to the embedding
    return flops_per_token(**sizes) - 6 * sizes["d_model"] * sizes["vocab_size"]


def pack_without_overlap(documents, seq_len, eos_id):  # records of L+1 side by side: a target is lost
    stream = np.concatenate([np.append(d, eos_id) for d in documents]).astype(np.int32)
    count = len(stream) // (seq_len + 1)
    return stream[:count * (seq_len + 1)].reshape(count, seq_len + 1)


def pack_without_separator(documents, seq_len, eos_id):
    return _pack_stream(np.concatenate(documents).astype(np.int32), seq_len)


def _pack_stream(stream, seq_len):
    count = (len(stream) - 1) // seq_len
    return np.array([stream[i * seq_len: (i + 1) * seq_len + 1] for i in range(count)],
                    np.int32).reshape(count, seq_len + 1)


def pack_padded_tail(documents, seq_len, eos_id):  # keeps the incomplete last record, padded with eos
    stream = np.concatenate([np.append(d, eos_id) for d in documents]).astype(np.int32)
    count = -(-(len(stream) - 1) // seq_len)
    stream = np.concatenate([stream, np.full(count * seq_len + 1 - len(stream), eos_id, np.int32)])
    return _pack_stream(stream, seq_len)


def pack_appends_in_place(documents, seq_len, eos_id):
    for i, d in enumerate(documents):
        documents[i] = np.append(d, eos_id)
    return _pack_stream(np.concatenate(documents).astype(np.int32), seq_len)


def pack_separators_between(documents, seq_len, eos_id):  # eos between documents, none after the last
    pieces = [np.asarray(documents[0])]
    for d in documents[1:]:
        pieces += [np.array([eos_id]), np.asarray(d)]
    return _pack_stream(np.concatenate(pieces).astype(np.int32), seq_len)


def pack_fixed_eos(documents, seq_len, eos_id):  # 0 from the text's example, not the argument
    return pack(documents, seq_len, 0)


def pack_one_record_too_many(documents, seq_len, eos_id):  # len(stream) // L records, the last one short
    stream = np.concatenate([np.append(d, eos_id) for d in documents]).astype(np.int32)
    count = len(stream) // seq_len
    stream = np.append(stream, np.full(max(0, count * seq_len + 1 - len(stream)), eos_id))  # one eos at most
    return _pack_stream(stream, seq_len)


def pack_sorts_in_place(documents, seq_len, eos_id):  # sorts each document's tokens in place
    for d in documents:
        d.sort()
    return pack(documents, seq_len, eos_id)


def pack_longest_first(documents, seq_len, eos_id):  # sorts the caller's list, longest document first
    documents.sort(key=len, reverse=True)
    return pack(documents, seq_len, eos_id)


def goodput_counts_every_step(log):  # the lost runs counted as productive
    result = goodput(log)
    wall = result["productive"] / result["goodput"]
    result.update(productive=result["productive"] + result["lost"], lost=0.0)
    result["goodput"] = result["productive"] / wall
    return result


def goodput_keeps_the_first_run(log):  # the first run of a repeated step survives, not the last
    first = {}
    for e in log:
        if e["event"] == "step":
            first.setdefault(e["step"], e["seconds"])
    result = goodput(log)
    wall = result["productive"] / result["goodput"]
    steps = result["productive"] + result["lost"]
    result.update(productive=sum(first.values()), lost=steps - sum(first.values()))
    result["goodput"] = result["productive"] / wall
    return result


def goodput_without_other(log):  # wall = the sum of the timed categories
    result = goodput(log)
    wall = sum(result[k] for k in ("productive", "lost", "compile", "checkpoint", "input"))
    result.update(other=0.0, goodput=result["productive"] / wall)
    return result


def _with_steps(log, productive, lost):  # the right answer around another split of the step time
    result = goodput(log)
    wall = result["productive"] / result["goodput"]
    result.update(productive=productive, lost=lost)
    timed = sum(result[k] for k in ("productive", "lost", "compile", "checkpoint", "input"))
    result.update(other=wall - timed, goodput=productive / wall)
    return result


def goodput_span_wall(log):  # wall = last end - first start, the pause between jobs included
    result = goodput(log)
    ends = [e["time"] for e in log if e["event"] == "end"]
    wall = max(ends) - min(e["time"] for e in log if e["event"] == "start")
    timed = sum(result[k] for k in ("productive", "lost", "compile", "checkpoint", "input"))
    result.update(other=wall - timed, goodput=result["productive"] / wall)
    return result


def goodput_lost_after_the_last_checkpoint(log):  # lost = a crashed job's steps after its last save
    unsaved = []  # per job, the step seconds since its last checkpoint
    for e in log:
        if e["event"] == "start":
            unsaved.append(0.0)
        elif e["event"] == "step":
            unsaved[-1] += e["seconds"]
        elif e["event"] == "checkpoint":
            unsaved[-1] = 0.0
    lost = sum(unsaved[:-1])  # every job but the last crashed
    return _with_steps(log, sum(e["seconds"] for e in log if e["event"] == "step") - lost, lost)


def goodput_only_the_first_repeat_lost(log):  # a step run three times: its middle run is neither
    runs = {}
    for e in log:
        if e["event"] == "step":
            runs.setdefault(e["step"], []).append(e["seconds"])
    productive = sum(seconds[-1] for seconds in runs.values())
    return _with_steps(log, productive, sum(seconds[0] for seconds in runs.values() if len(seconds) > 1))


def goodput_as_a_percentage(log):
    result = goodput(log)
    result["goodput"] *= 100
    return result


# Fresh wrong answers (issue 38).

def rope_sin_cos_swapped(x, positions, theta):  # x1 sin + x2 cos: the rotation's parts exchanged
    half = x.shape[-1] // 2
    inv_freq = theta ** (-jnp.arange(0, x.shape[-1], 2, dtype=jnp.float32) / x.shape[-1])
    angles = jnp.asarray(positions, jnp.float32)[..., None] * inv_freq
    cos, sin = jnp.cos(angles)[:, :, None], jnp.sin(angles)[:, :, None]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * sin - x2 * cos, x2 * sin + x1 * cos], axis=-1)


def gqa_repeat_tiled(q, k, v, q_positions, k_positions):  # jnp.tile: heads 0..K-1, 0..K-1, ...
    H, K = q.shape[2], k.shape[2]
    return gqa_attention(q, jnp.tile(k, (1, 1, H // K, 1)), jnp.tile(v, (1, 1, H // K, 1)), q_positions,
                         k_positions)


def gqa_softmax_over_queries(q, k, v, q_positions, k_positions):  # normalised over the wrong axis
    B, T, H, D = q.shape
    K = k.shape[2]
    qg = q.reshape(B, T, K, H // K, D)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k) / np.sqrt(D)
    mask = k_positions[:, None, :] <= q_positions[:, :, None]
    scores = jnp.where(mask[:, None, None], scores, -1e30)
    weights = jnp.exp(scores - scores.max(-2, keepdims=True))
    weights = weights / weights.sum(-2, keepdims=True)
    return jnp.einsum("bkgts,bskd->btkgd", weights, v).reshape(B, T, H, D)


def flops_causal_halves_everything(**sizes):  # causal=True read as half of every FLOP, weights included
    full = flops_per_token(**{**sizes, "causal": False})
    return full / 2 if sizes["causal"] else full


def pack_int64(documents, seq_len, eos_id):  # NumPy's default integer, not int32
    return pack(documents, seq_len, eos_id).astype(np.int64)


def pack_eos_before(documents, seq_len, eos_id):  # eos before each document, as a BOS
    stream = np.concatenate([np.insert(np.asarray(d), 0, eos_id) for d in documents]).astype(np.int32)
    count = (len(stream) - 1) // seq_len
    return np.array([stream[i * seq_len: (i + 1) * seq_len + 1] for i in range(count)],
                    np.int32).reshape(count, seq_len + 1)


def goodput_of_step_time(log):  # productive over all step time, not over the wall time
    result = goodput(log)
    steps = sum(e["seconds"] for e in log if e["event"] == "step")
    return dict(result, goodput=result["productive"] / steps)


def rope_frequencies_from_one(x, positions, theta):  # j = 1 .. D/2, not 0 .. D/2 - 1: off by one
    half = x.shape[-1] // 2
    inv_freq = theta ** (-2 * jnp.arange(1, half + 1, dtype=jnp.float32) / x.shape[-1])
    angles = jnp.asarray(positions, jnp.float32)[..., None] * inv_freq
    cos, sin = jnp.cos(angles)[:, :, None], jnp.sin(angles)[:, :, None]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def rope_halves_swapped(x, positions, theta):  # concatenates (x2', x1'): the rotated halves exchanged
    half = x.shape[-1] // 2
    rotated = apply_rope(x, positions, theta)
    return jnp.concatenate([rotated[..., half:], rotated[..., :half]], axis=-1)


def rope_interleaved_output(x, positions, theta):  # halves paired, then stacked as neighbours (Meta's layout)
    half = x.shape[-1] // 2
    rotated = apply_rope(x, positions, theta)
    return jnp.stack([rotated[..., :half], rotated[..., half:]], axis=-1).reshape(x.shape)


def _grouped_scores(q, k, q_positions, k_positions):
    """The right scores (B, K, G, T, S) and mask (B, 1, 1, T, S), for answers that go wrong after them."""
    B, T, H, D = q.shape
    K = k.shape[2]
    scores = jnp.einsum("btkgd,bskd->bkgts", q.reshape(B, T, K, H // K, D), k) / np.sqrt(D)
    return scores, (k_positions[:, None, :] <= q_positions[:, :, None])[:, None, None]


def gqa_masked_with_zero(q, k, v, q_positions, k_positions):  # a masked score of 0 still gets weight
    scores, mask = _grouped_scores(q, k, q_positions, k_positions)
    weights = jax.nn.softmax(jnp.where(mask, scores, 0.0), axis=-1)
    return jnp.einsum("bkgts,bskd->btkgd", weights, v).reshape(q.shape)


def gqa_masked_after_the_softmax(q, k, v, q_positions, k_positions):  # zeroed weights, not renormalised
    scores, mask = _grouped_scores(q, k, q_positions, k_positions)
    weights = jax.nn.softmax(scores, axis=-1) * mask
    return jnp.einsum("bkgts,bskd->btkgd", weights, v).reshape(q.shape)


def gqa_reshaped_without_transposing(q, k, v, q_positions, k_positions):  # (B, K, G, T, D) as (B, T, H, D)
    scores, mask = _grouped_scores(q, k, q_positions, k_positions)
    weights = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)
    return jnp.einsum("bkgts,bskd->bkgtd", weights, v).reshape(q.shape)  # right only when T == 1


def goodput_other_beside_the_steps_only(log):  # other = wall - step time: compile, input, saves counted twice
    result = goodput(log)
    wall = result["productive"] / result["goodput"]
    return dict(result, other=wall - result["productive"] - result["lost"])


def goodput_last_job_productive(log):  # only the final job's steps survive, not the earlier ones it kept
    steps = sum(e["seconds"] for e in log if e["event"] == "step")
    last_job = []
    for e in log:
        if e["event"] == "start":
            last_job = []
        elif e["event"] == "step":
            last_job.append(e["seconds"])
    return _with_steps(log, sum(last_job), steps - sum(last_job))


def goodput_repeated_steps_all_lost(log):  # every run of a repeated step lost, its last run included
    runs = {}
    for e in log:
        if e["event"] == "step":
            runs.setdefault(e["step"], []).append(e["seconds"])
    productive = sum(seconds[0] for seconds in runs.values() if len(seconds) == 1)
    return _with_steps(log, productive, sum(sum(seconds) for seconds in runs.values() if len(seconds) > 1))


def goodput_input_counted_as_productive(log):  # the input wait taken as part of the step
    result = goodput(log)
    wall = result["productive"] / result["goodput"]
    productive = result["productive"] + result["input"]
    return dict(result, productive=productive, other=result["other"] - result["input"],
                goodput=productive / wall)


# Fresh wrong answers a learner writes (issue 38).
FRESH = [
    ("12.rope", rope_frequencies_from_one, 2, "frequencies for j = 1 .. D/2"),
    ("12.rope", rope_halves_swapped, 1, "the rotated halves concatenated in the wrong order"),
    ("12.rope", rope_interleaved_output, 1, "the rotated halves interleaved"),
    ("12.gqa_attention", gqa_masked_with_zero, 0, "masked scores set to 0, not -inf"),
    ("12.gqa_attention", gqa_masked_after_the_softmax, 0, "masked after the softmax, not renormalised"),
    ("12.gqa_attention", gqa_reshaped_without_transposing, 2, "(B, K, G, T, D) reshaped without transposing"),
    ("12.goodput", goodput_other_beside_the_steps_only, 0, "other = wall - step time"),
    ("12.goodput", goodput_last_job_productive, 3, "only the last job's steps are productive"),
    ("12.goodput", goodput_repeated_steps_all_lost, 3, "every run of a repeated step is lost"),
    ("12.goodput", goodput_input_counted_as_productive, 1, "input time counted as productive"),
]


# (exercise, planted wrong answer, points it should still get, why)
WRONG = [
    ("12.rope", rope_adjacent_pairs, 2, "pairs adjacent features (2j, 2j+1) instead of the two halves"),
    ("12.rope", rope_ignores_positions, 0, "uses 0..T-1 instead of the given positions"),
    ("12.rope", rope_wrong_frequencies, 2, "frequencies theta ** (-j / D)"),
    ("12.rope", rope_in_place, 2, "rotates the caller's array in place"),
    ("12.rope", rope_fixed_theta, 5, "theta fixed at 10000, not the argument"),
    ("12.rope", rope_turned_backwards, 2, "turns by -angle"),
    ("12.rope", rope_first_row_positions, 2, "row 0's positions for every sequence"),
    ("12.rope", rope_positions_from_the_first, 1, "positions counted from each row's first"),
    ("12.gqa_attention", gqa_interleaved, 3, "query head h uses kv head h % K"),
    ("12.gqa_attention", gqa_index_mask, 4, "a triangular mask by index, not by position"),
    ("12.gqa_attention", gqa_unscaled, 0, "no 1/sqrt(D)"),
    ("12.gqa_attention", gqa_strict_mask, 0, "a query may not see its own key"),
    ("12.gqa_attention", gqa_bottom_right_mask, 4, "a triangular mask aligned to the last key"),
    ("12.gqa_attention", gqa_first_row_mask, 4, "row 0's mask for every sequence"),
    ("12.gqa_attention", gqa_scaled_by_d, 0, "scores divided by D, not sqrt(D)"),
    ("12.flops_per_token", flops_with_embedding, 0, "counts the embedding lookup as a matmul"),
    ("12.flops_per_token", flops_mha_projections, 6, "k and v projections as wide as q"),
    ("12.flops_per_token", flops_half_of_t, 6, "causal attention as T / 2 keys"),
    ("12.flops_per_token", flops_forward_only, 0, "the forward pass only (2N)"),
    ("12.flops_per_token", flops_square_projections, 6, "q and o projections as d_model x d_model"),
    ("12.flops_per_token", flops_attention_over_d_model, 6, "attention as wide as d_model"),
    ("12.flops_per_token", flops_attention_over_kv_heads, 6, "attention over the key/value heads"),
    ("12.flops_per_token", flops_causal_integer_division, 6, "(seq_len + 1) // 2 keys"),
    ("12.flops_per_token", flops_two_mlp_matrices, 0, "an MLP of two matrices"),
    ("12.flops_per_token", flops_without_output_projection, 0, "no output projection"),
    ("12.pack", pack_without_overlap, 1, "records without the one-token overlap"),
    ("12.pack", pack_without_separator, 1, "no end-of-document token"),
    ("12.pack", pack_padded_tail, 2, "keeps a padded incomplete record"),
    ("12.pack", pack_appends_in_place, 0, "appends eos to the caller's documents in place"),
    ("12.pack", pack_separators_between, 6, "no eos after the last document"),
    ("12.pack", pack_fixed_eos, 6, "eos fixed at 0, not the argument"),
    ("12.pack", pack_one_record_too_many, 6, "len(stream) // L records, the last padded"),
    ("12.pack", pack_sorts_in_place, 0, "sorts each document in place"),
    ("12.pack", pack_longest_first, 1, "sorts the caller's list by length"),
    ("12.goodput", goodput_counts_every_step, 3, "counts the lost runs of repeated steps as productive"),
    ("12.goodput", goodput_keeps_the_first_run, 3, "keeps the first run of a repeated step, not the last"),
    ("12.goodput", goodput_without_other, 0, "divides by the timed categories, not the wall time"),
    ("12.goodput", goodput_span_wall, 2, "wall time from the first start to the last end"),
    ("12.goodput", goodput_lost_after_the_last_checkpoint, 5, "lost = steps after a job's last checkpoint"),
    ("12.goodput", goodput_only_the_first_repeat_lost, 5, "a step run three times: the middle run kept"),
    ("12.goodput", goodput_as_a_percentage, 1, "goodput in per cent"),
    ("12.rope", rope_sin_cos_swapped, 1, "sin and cos exchanged"),
    ("12.gqa_attention", gqa_repeat_tiled, 3, "kv heads tiled, not repeated"),
    ("12.gqa_attention", gqa_softmax_over_queries, 0, "softmax over the queries"),
    ("12.flops_per_token", flops_causal_halves_everything, 6, "causal halves the whole count"),
    ("12.pack", pack_int64, 0, "int64 records"),
    ("12.pack", pack_eos_before, 1, "eos before each document"),
    ("12.goodput", goodput_of_step_time, 1, "goodput over the step time, not the wall time"),
    *FRESH,
]


@pytest.mark.parametrize("exercise_id, answer, points, why", WRONG, ids=[w[3] for w in WRONG])
def test_a_planted_wrong_answer_loses_points(exercise_id, answer, points, why):
    result = grade(exercise_id, answer)
    assert result.points == points, [(c.name, c.status, c.points, c.message) for c in result.cases]
    assert result.points < result.max_points
