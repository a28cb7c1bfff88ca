"""Chapter 09's exercise cases: right answers score full marks, planted wrong ones lose points."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stacklib.grading import grade


def rhs_index_map(i, j, k):
    return (j, k)


def online_softmax_update(m, ell, acc, s, v):
    m_new = np.maximum(m, s.max(axis=1))
    m_safe = np.where(np.isneginf(m_new), 0.0, m_new)
    alpha, p = np.exp(m - m_safe), np.exp(s - m_safe[:, None])
    return m_new, alpha * ell + p.sum(axis=1), alpha[:, None] * acc + p @ v


def block_is_live(i, j, block_q, block_k):
    return j * block_k <= i * block_q + block_q - 1


def matmul_vmem_bytes(block_m, block_n, block_k, itemsize):
    blocks = block_m * block_k + block_k * block_n + block_m * block_n
    return 2 * blocks * itemsize + block_m * block_n * 4


def swiglu_kernel(gate_ref, up_ref, o_ref):
    gate, up = gate_ref[...].astype(jnp.float32), up_ref[...].astype(jnp.float32)
    o_ref[...] = (jax.nn.silu(gate) * up).astype(o_ref.dtype)


RIGHT = {
    "09.transposed_index_map": rhs_index_map,
    "09.online_softmax": online_softmax_update,
    "09.causal_block_skip": block_is_live,
    "09.matmul_vmem": matmul_vmem_bytes,
    "09.fused_kernel": swiglu_kernel,
}


@pytest.mark.parametrize("exercise_id", sorted(RIGHT))
def test_a_right_answer_scores_full_marks(exercise_id):
    result = grade(exercise_id, RIGHT[exercise_id])
    assert result.points == result.max_points, [c.message for c in result.cases]


def untouched(*args, **kwargs):  # what an exercise notebook holds before the learner writes anything
    raise NotImplementedError


@pytest.mark.parametrize("exercise_id", sorted(RIGHT))
def test_an_untouched_exercise_scores_zero(exercise_id):
    assert grade(exercise_id, untouched).points == 0


def update_without_rescaling(m, ell, acc, s, v):  # forgets alpha: old sums stay relative to the old max
    m_new = np.maximum(m, s.max(axis=1))
    m_safe = np.where(np.isneginf(m_new), 0.0, m_new)
    p = np.exp(s - m_safe[:, None])
    return m_new, ell + p.sum(axis=1), acc + p @ v


def update_without_max(m, ell, acc, s, v):  # exp(s) directly: overflows for large logits
    p = np.exp(s)
    return m, ell + p.sum(axis=1), acc + p @ v


def update_without_inf_guard(m, ell, acc, s, v):  # exp(-inf - (-inf)) = NaN for a masked block
    m_new = np.maximum(m, s.max(axis=1))
    alpha, p = np.exp(m - m_new), np.exp(s - m_new[:, None])
    return m_new, alpha * ell + p.sum(axis=1), alpha[:, None] * acc + p @ v


def live_with_python_if(i, j, block_q, block_k):  # right values, but `if` fails on traced indices
    if j * block_k <= i * block_q + block_q - 1:
        return True
    return False


def gelu_kernel(gate_ref, up_ref, o_ref):
    o_ref[...] = (jax.nn.gelu(gate_ref[...].astype(jnp.float32)) * up_ref[...]).astype(o_ref.dtype)


def uncast_kernel(gate_ref, up_ref, o_ref):  # stores float32 into a bfloat16 output
    o_ref[...] = jax.nn.silu(gate_ref[...].astype(jnp.float32)) * up_ref[...].astype(jnp.float32)


# (exercise, planted wrong answer, points it should still get, why)
WRONG = [
    ("09.transposed_index_map", lambda i, j, k: (k, j), 0, "the untransposed map (k, j)"),
    ("09.transposed_index_map", lambda i, j, k: (j, i), 2, "uses i for k (right when K is one block)"),
    ("09.transposed_index_map", lambda i, j, k: [j, k], 4, "a list, not a tuple (the kernel accepts it)"),
    ("09.online_softmax", update_without_rescaling, 3, "forgets to rescale by alpha"),
    ("09.online_softmax", update_without_max, 5, "no running maximum: overflows"),
    ("09.online_softmax", update_without_inf_guard, 4, "NaN after a fully masked block"),
    ("09.causal_block_skip", lambda i, j, bq, bk: j <= i, 3, "compares block indices, not positions"),
    ("09.causal_block_skip", lambda i, j, bq, bk: j * bk < i * bq, 0, "misses the diagonal block"),
    ("09.causal_block_skip", live_with_python_if, 4, "a Python `if` on traced indices"),
    ("09.matmul_vmem", lambda bm, bn, bk, s: (bm * bk + bk * bn + bm * bn) * s + bm * bn * 4, 0,
     "no double buffering"),
    ("09.matmul_vmem", lambda bm, bn, bk, s: 2 * (bm * bk + bk * bn + bm * bn) * s + bm * bn * s, 2,
     "an accumulator in the input dtype"),
    ("09.matmul_vmem", lambda bm, bn, bk, s: 2 * (bm * bk + bk * bn + bm * bn) * s, 0,
     "forgets the accumulator"),
    ("09.fused_kernel", gelu_kernel, 0, "gelu instead of silu"),
    ("09.fused_kernel", uncast_kernel, 2, "does not cast to the output dtype"),
]


@pytest.mark.parametrize("exercise_id, answer, points, why", WRONG, ids=[w[3] for w in WRONG])
def test_a_planted_wrong_answer_loses_points(exercise_id, answer, points, why):
    result = grade(exercise_id, answer)
    assert result.points == points, [(c.name, c.status, c.message) for c in result.cases]
    assert result.points < result.max_points
