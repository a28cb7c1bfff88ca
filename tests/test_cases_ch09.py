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


def online_update(m, ell, acc, s, v, *, rescale=True, running_max=True, inf_guard=True, store_guard=False,
                  guard_at_zero=False, max_over_all_rows=False):
    """The online-softmax update, with switches that plant one mistake each."""
    if not running_max:  # exp(s) directly: overflows for large logits, underflows for very negative ones
        p = np.exp(s)
        return m, ell + p.sum(axis=1), acc + p @ v
    m_new = np.maximum(m, s.max() if max_over_all_rows else s.max(axis=1))
    if guard_at_zero:
        m_safe = np.maximum(m_new, 0.0)  # "use 0 in place of -inf" read as max(m_new, 0)
    elif inf_guard:
        m_safe = np.where(np.isneginf(m_new), 0.0, m_new)
    else:
        m_safe = m_new
    if store_guard:
        m_new = m_safe
    alpha, p = np.exp(m - m_safe), np.exp(s - m_safe[:, None])
    if not rescale:
        alpha = np.ones_like(alpha)
    return m_new, alpha * ell + p.sum(axis=1), alpha[:, None] * acc + p @ v


def update_that_skips_fully_masked_blocks(m, ell, acc, s, v):  # guards the block, not each row
    if np.all(np.isneginf(s)):
        return m, ell, acc
    return online_update(m, ell, acc, s, v, inf_guard=False)


def update_with_column_state(m, ell, acc, s, v):  # the chapter's kernel keeps m and l as (block_q, 1)
    m_new = jnp.maximum(m, s.max(axis=1, keepdims=True))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha, p = jnp.exp(m - m_safe), jnp.exp(s - m_safe)
    return m_new, alpha * ell + p.sum(axis=1, keepdims=True), alpha * acc + p @ v


def live_with_python_if(i, j, block_q, block_k):  # right values, but `if` fails on traced indices
    if j * block_k <= i * block_q + block_q - 1:
        return True
    return False


def live_by_rounded_block_counts(i, j, block_q, block_k):  # right only when one block size divides the other
    return j <= i * block_q // block_k + (block_q - 1) // block_k


def gelu_kernel(gate_ref, up_ref, o_ref):
    o_ref[...] = (jax.nn.gelu(gate_ref[...].astype(jnp.float32)) * up_ref[...]).astype(o_ref.dtype)


def uncast_kernel(gate_ref, up_ref, o_ref):  # stores float32 into a bfloat16 output
    o_ref[...] = jax.nn.silu(gate_ref[...].astype(jnp.float32)) * up_ref[...].astype(jnp.float32)


def bfloat16_kernel(gate_ref, up_ref, o_ref):  # computes in the input dtype: rounds at every step
    o_ref[...] = (jax.nn.silu(gate_ref[...]) * up_ref[...]).astype(o_ref.dtype)


def silu_of_up_kernel(gate_ref, up_ref, o_ref):
    gate, up = gate_ref[...].astype(jnp.float32), up_ref[...].astype(jnp.float32)
    o_ref[...] = (jax.nn.silu(up) * gate).astype(o_ref.dtype)


def always_bfloat16_kernel(gate_ref, up_ref, o_ref):
    gate, up = gate_ref[...].astype(jnp.float32), up_ref[...].astype(jnp.float32)
    o_ref[...] = (jax.nn.silu(gate) * up).astype(jnp.bfloat16)


def vmem(bm, bn, bk, itemsize, *, buffers=2, accumulator=4, output_buffers=2, double_accumulator=False):
    inputs, output = bm * bk + bk * bn, bm * bn
    scratch = bm * bn * accumulator * (2 if double_accumulator else 1)
    return buffers * inputs * itemsize + output_buffers * output * itemsize + scratch


# Fresh wrong answers (issue 38).

def live_last_row_against_the_last_key(i, j, block_q, block_k):  # compares the blocks' ends
    return (j + 1) * block_k - 1 <= (i + 1) * block_q - 1


def live_one_past_the_block(i, j, block_q, block_k):  # <= the next block's first row: one row too far
    return j * block_k <= (i + 1) * block_q


def live_with_python_and(i, j, block_q, block_k):  # `and` of two comparisons: fails on traced indices
    return j * block_k <= i * block_q + block_q - 1 and i >= 0


def update_rescales_acc_only(m, ell, acc, s, v):  # l is not rescaled
    m_new, _, acc_new = online_softmax_update(m, ell, acc, s, v)
    m_safe = np.where(np.isneginf(m_new), 0.0, m_new)
    return m_new, ell + np.exp(s - m_safe[:, None]).sum(axis=1), acc_new


def update_normalises_each_block(m, ell, acc, s, v):  # acc divided by l inside the update
    m_new, ell_new, acc_new = online_softmax_update(m, ell, acc, s, v)
    return m_new, ell_new, acc_new / np.maximum(ell_new, 1e-30)[:, None]


def vmem_accumulator_in_itemsize_doubled(bm, bn, bk, itemsize):  # the accumulator double-buffered too
    return matmul_vmem_bytes(bm, bn, bk, itemsize) + bm * bn * 4


def vmem_inputs_only_doubled(bm, bn, bk, itemsize):  # the output block buffered once
    return 2 * (bm * bk + bk * bn) * itemsize + bm * bn * itemsize + bm * bn * 4


def sigmoid_not_silu_kernel(gate_ref, up_ref, o_ref):  # sigmoid(gate) * up: silu's x factor missing
    gate, up = gate_ref[...].astype(jnp.float32), up_ref[...].astype(jnp.float32)
    o_ref[...] = (jax.nn.sigmoid(gate) * up).astype(o_ref.dtype)


def numpy_in_the_kernel(gate_ref, up_ref, o_ref):  # np.exp on a traced block fails
    gate, up = gate_ref[...].astype(jnp.float32), up_ref[...].astype(jnp.float32)
    o_ref[...] = (gate / (1 + np.exp(-gate)) * up).astype(o_ref.dtype)


def vmem_blocks_mixed_up(bm, bn, bk, itemsize):  # x's block taken as (block_m, block_n)
    return 2 * (bm * bn + bk * bn + bm * bn) * itemsize + bm * bn * 4


def vmem_in_kib(bm, bn, bk, itemsize):  # KiB, not bytes
    return matmul_vmem_bytes(bm, bn, bk, itemsize) // 1024


def cast_to_the_input_dtype_kernel(gate_ref, up_ref, o_ref):  # right while the output has the inputs' dtype
    gate, up = gate_ref[...].astype(jnp.float32), up_ref[...].astype(jnp.float32)
    o_ref[...] = (jax.nn.silu(gate) * up).astype(gate_ref.dtype)


def returning_kernel(gate_ref, up_ref, o_ref):  # returns the block instead of storing it into o_ref
    gate, up = gate_ref[...].astype(jnp.float32), up_ref[...].astype(jnp.float32)
    return (jax.nn.silu(gate) * up).astype(o_ref.dtype)


def rebinding_kernel(gate_ref, up_ref, o_ref):  # `o_ref = ...` rebinds the name: the output is never written
    gate, up = gate_ref[...].astype(jnp.float32), up_ref[...].astype(jnp.float32)
    o_ref = (jax.nn.silu(gate) * up).astype(o_ref.dtype)


# Fresh wrong answers a learner writes (issue 38).
FRESH = [
    ("09.transposed_index_map", lambda i, j, k: (i, j, k), 0, "returns the grid indices themselves"),
    ("09.transposed_index_map", lambda i, j, k: (k, i), 0, "x's map (i, k) transposed"),
    ("09.transposed_index_map", lambda i, j, k: (0, k), 0, "assumes N is one block"),
    # Pallas clamps a block index past the end, so with two blocks per axis offset 16 reads block 1: the
    # square case passes by accident and only the three-block rectangular case shows the mistake.
    ("09.transposed_index_map", lambda i, j, k: (j * 16, k * 16), 2,
     "element offsets (blocks of 16), not block indices"),
    ("09.fused_kernel", cast_to_the_input_dtype_kernel, 3, "casts to gate_ref.dtype, not the output's"),
    ("09.fused_kernel", returning_kernel, 0, "returns the result instead of storing it"),
    ("09.fused_kernel", rebinding_kernel, 0, "rebinds o_ref instead of storing into o_ref[...]"),
]


# (exercise, planted wrong answer, points it should still get, why)
WRONG = [
    ("09.transposed_index_map", lambda i, j, k: (k, j), 0, "the untransposed map (k, j)"),
    ("09.transposed_index_map", lambda i, j, k: (j, i), 0, "uses i for k"),
    ("09.transposed_index_map", lambda i, j, k: (j, 0), 0, "assumes K is one block"),
    ("09.transposed_index_map", lambda i, j, k: (i, k), 0, "copies x's map (i, k)"),
    ("09.transposed_index_map", lambda i, j, k: (i, j), 0, "copies the output's map (i, j)"),
    ("09.transposed_index_map", lambda i, j, k: [j, k], 4, "a list, not a tuple (the kernel accepts it)"),
    ("09.online_softmax", lambda *a: online_update(*a, rescale=False), 2, "forgets to rescale by alpha"),
    ("09.online_softmax", lambda *a: online_update(*a, running_max=False), 3, "no running maximum"),
    ("09.online_softmax", lambda *a: online_update(*a, inf_guard=False), 5, "NaN after a fully masked block"),
    ("09.online_softmax", lambda *a: online_update(*a, store_guard=True), 5,
     "keeps 0 as m after a masked block: very negative logits then underflow"),
    ("09.online_softmax", lambda *a: online_update(*a, guard_at_zero=True), 3,
     "guards with max(m_new, 0): very negative logits underflow"),
    ("09.online_softmax", lambda *a: online_update(*a, max_over_all_rows=True), 3,
     "one maximum for all rows"),
    ("09.online_softmax", update_that_skips_fully_masked_blocks, 5,
     "skips a block only when every row of it is masked"),
    ("09.online_softmax", update_with_column_state, 0,
     "the chapter's (rows, 1) state: named as a shape mistake"),
    ("09.causal_block_skip", lambda i, j, bq, bk: j <= i, 4, "compares block indices, not positions"),
    ("09.causal_block_skip", lambda i, j, bq, bk: j * bk < i * bq, 0, "misses the diagonal block"),
    ("09.causal_block_skip", lambda i, j, bq, bk: j * bk <= i * bq, 4, "compares with the block's first row"),
    ("09.causal_block_skip", lambda i, j, bq, bk: (j + 1) * bk <= (i + 1) * bq, 4,
     "requires the block's last key to be visible"),
    ("09.causal_block_skip", lambda i, j, bq, bk: j * bk <= i * bq + bk - 1, 4, "block_k for the row offset"),
    ("09.causal_block_skip", live_by_rounded_block_counts, 6, "rounds block counts: wrong for odd sizes"),
    ("09.causal_block_skip", live_with_python_if, 6, "a Python `if` on traced indices"),
    ("09.matmul_vmem", lambda *a: vmem(*a, buffers=1, output_buffers=1), 0, "no double buffering"),
    ("09.matmul_vmem", lambda bm, bn, bk, s: vmem(bm, bn, bk, s, accumulator=s), 2,
     "an accumulator in the input dtype"),
    ("09.matmul_vmem", lambda *a: vmem(*a, accumulator=0), 0, "forgets the accumulator"),
    ("09.matmul_vmem", lambda *a: vmem(*a, double_accumulator=True), 0,
     "double-buffers the scratch accumulator"),
    ("09.matmul_vmem", lambda *a: vmem(*a, output_buffers=1), 0, "buffers the output block once"),
    ("09.matmul_vmem", lambda *a: vmem(*a) / 2**20, 0, "MiB, not bytes"),
    ("09.fused_kernel", gelu_kernel, 0, "gelu instead of silu"),
    ("09.fused_kernel", silu_of_up_kernel, 0, "silu of the wrong input"),
    ("09.fused_kernel", uncast_kernel, 2, "does not cast to the output dtype"),
    ("09.fused_kernel", bfloat16_kernel, 3, "computes in bfloat16"),
    ("09.fused_kernel", always_bfloat16_kernel, 1, "casts to bfloat16, not to o_ref.dtype"),
    ("09.causal_block_skip", live_last_row_against_the_last_key, 4, "the blocks' last key against last row"),
    ("09.causal_block_skip", live_one_past_the_block, 0, "one row past the query block"),
    ("09.causal_block_skip", live_with_python_and, 6, "`and` on traced indices"),
    ("09.online_softmax", update_rescales_acc_only, 2, "l not rescaled"),
    ("09.online_softmax", update_normalises_each_block, 0, "acc normalised inside the update"),
    ("09.matmul_vmem", vmem_accumulator_in_itemsize_doubled, 0, "the accumulator double-buffered"),
    ("09.matmul_vmem", vmem_inputs_only_doubled, 0, "the output block buffered once, written out"),
    ("09.fused_kernel", sigmoid_not_silu_kernel, 0, "sigmoid where silu belongs"),
    ("09.fused_kernel", numpy_in_the_kernel, 0, "np.exp inside the kernel"),
    ("09.matmul_vmem", vmem_blocks_mixed_up, 0, "x's block as (block_m, block_n)"),
    ("09.matmul_vmem", vmem_in_kib, 0, "KiB, not bytes"),
    *FRESH,
]


@pytest.mark.parametrize("exercise_id, answer, points, why", WRONG, ids=[w[3] for w in WRONG])
def test_a_planted_wrong_answer_loses_points(exercise_id, answer, points, why):
    result = grade(exercise_id, answer)
    assert result.points == points, [(c.name, c.status, c.message) for c in result.cases]
    assert result.points < result.max_points


def test_a_state_kept_as_columns_is_reported_as_a_shape_mistake():
    result = grade("09.online_softmax", update_with_column_state)
    first = result.cases[0]
    assert first.status == "failed" and "m and l of shape (4,)" in first.message, first.message
    assert "not a (4, 1) column" in first.message, first.message


def test_vmem_bytes_are_printed_readably():
    message = grade("09.matmul_vmem", lambda *a: vmem(*a, buffers=1, output_buffers=1)).cases[0].message
    assert "expected 458,752 bytes (0.44 MiB)" in message and "e+0" not in message, message
