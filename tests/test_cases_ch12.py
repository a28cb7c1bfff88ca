"""Chapter 12's exercise cases: right answers score full marks, planted wrong ones lose points."""


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


# (exercise, planted wrong answer, points it should still get, why)
WRONG = [
    ("12.rope", rope_adjacent_pairs, 2, "pairs adjacent features (2j, 2j+1) instead of the two halves"),
    ("12.rope", rope_ignores_positions, 0, "uses 0..T-1 instead of the given positions"),
    ("12.rope", rope_wrong_frequencies, 2, "frequencies theta ** (-j / D)"),
    ("12.rope", rope_in_place, 2, "rotates the caller's array in place"),
    ("12.gqa_attention", gqa_interleaved, 1, "query head h uses kv head h % K"),
    ("12.gqa_attention", gqa_index_mask, 3, "a triangular mask by index, not by position"),
    ("12.gqa_attention", gqa_unscaled, 0, "no 1/sqrt(D)"),
    ("12.flops_per_token", flops_with_embedding, 0, "counts the embedding lookup as a matmul"),
    ("12.flops_per_token", flops_mha_projections, 2, "k and v projections as wide as q"),
    ("12.flops_per_token", flops_half_of_t, 3, "causal attention as T / 2 keys"),
    ("12.flops_per_token", flops_forward_only, 0, "the forward pass only (2N)"),
    ("12.pack", pack_without_overlap, 1, "records without the one-token overlap"),
    ("12.pack", pack_without_separator, 1, "no end-of-document token"),
    ("12.pack", pack_padded_tail, 0, "keeps a padded incomplete record"),
    ("12.pack", pack_appends_in_place, 0, "appends eos to the caller's documents in place"),
    ("12.goodput", goodput_counts_every_step, 3, "counts the lost runs of repeated steps as productive"),
    ("12.goodput", goodput_keeps_the_first_run, 3, "keeps the first run of a repeated step, not the last"),
    ("12.goodput", goodput_without_other, 0, "divides by the timed categories, not the wall time"),
]


@pytest.mark.parametrize("exercise_id, answer, points, why", WRONG, ids=[w[3] for w in WRONG])
def test_a_planted_wrong_answer_loses_points(exercise_id, answer, points, why):
    result = grade(exercise_id, answer)
    assert result.points == points, [(c.name, c.status, c.points, c.message) for c in result.cases]
    assert result.points < result.max_points
