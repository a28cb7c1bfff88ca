"""Chapter 06's exercise cases: right answers score full marks, planted wrong ones lose points."""

import re

import jax.numpy as jnp
import numpy as np
import pytest

from stacklib.cases.ch06 import _HAND_WRITTEN_HLO, HAND_WRITTEN_KERNELS
from stacklib.compile import count_fusions
from stacklib.grading import grade


def dense_cost(batch, d_in, d_out, bytes_per_element):
    elements = batch * d_in + d_in * d_out + d_out + batch * d_out
    return {"flops": 2 * batch * d_in * d_out + batch * d_out, "bytes": elements * bytes_per_element}


_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?:\([^=]*\)|\S+)\s+([\w\-]+)\(")


def count_kernels(hlo_text):
    entry = hlo_text[hlo_text.index("\nENTRY"):]
    body = entry[entry.index("{\n") + 2: entry.index("\n}")]
    return [m.group(1) for line in body.splitlines() if (m := _INSTRUCTION.match(line))].count("fusion")


def pad_to_bucket(x, buckets):
    n = x.shape[0]
    fitting = [size for size in buckets if size >= n]
    if not fitting:
        raise ValueError(f"length {n} is longer than the largest bucket, {max(buckets)}")
    return jnp.pad(x, (0, min(fitting) - n)), jnp.arange(min(fitting)) < n


def matmul_intensity(m, k, n, bytes_per_element):
    return 2 * m * k * n / (bytes_per_element * (m * k + k * n + m * n))


RIGHT = {
    "06.dense_cost": dense_cost,
    "06.count_kernels": count_kernels,
    "06.pad_to_bucket": pad_to_bucket,
    "06.matmul_intensity": matmul_intensity,
}


@pytest.mark.parametrize("exercise_id", sorted(RIGHT))
def test_a_right_answer_scores_full_marks(exercise_id):
    result = grade(exercise_id, RIGHT[exercise_id])
    assert result.points == result.max_points, [c.message for c in result.cases]


def test_the_hand_written_module_has_the_kernels_the_case_expects():
    assert count_fusions(_HAND_WRITTEN_HLO) == HAND_WRITTEN_KERNELS == count_kernels(_HAND_WRITTEN_HLO)



# Planted wrong answers.

def whole_text_fusion_lines(hlo_text):  # counts fusions in every computation, not just ENTRY
    return sum(1 for line in hlo_text.splitlines() if _INSTRUCTION.match(line) and " fusion(" in line)


def bytes_without_fusion(batch, d_in, d_out, bytes_per_element):
    elements = batch * d_in + d_in * d_out + d_out + 3 * batch * d_out  # x @ W written, then read back
    return {**dense_cost(batch, d_in, d_out, bytes_per_element), "bytes": elements * bytes_per_element}


def skips_the_root(hlo_text):  # the ROOT line is an instruction too
    entry = hlo_text[hlo_text.index("\nENTRY"):]
    return sum(1 for line in entry.splitlines() if re.match(r"\s*%[\w.\-]+ = \S+ fusion\(", line))


def shape_without_spaces(hlo_text):  # a tuple shape "(f32[4,8]{1,0}, f32[4,8]{1,0})" has a space in it
    entry = hlo_text[hlo_text.index("\nENTRY"):]
    return sum(1 for line in entry.splitlines() if re.match(r"\s*(ROOT )?%[\w.\-]+ = \S+ fusion\(", line))


def pad_to_largest(x, buckets):  # one shape for everything: bounded compiles, but not what was asked
    n = x.shape[0]
    if n > max(buckets):
        raise ValueError(f"length {n} is longer than the largest bucket, {max(buckets)}")
    return jnp.pad(x, (0, max(buckets) - n)), jnp.arange(max(buckets)) < n


def pad_to_next_power_of_two(x, buckets):  # ignores the buckets: more shapes than buckets
    n = x.shape[0]
    size = 1 << max(n - 1, 0).bit_length()
    return jnp.pad(x, (0, size - n)), jnp.arange(size) < n


def no_padding(x, buckets):
    return x, jnp.ones(x.shape[0], bool)


def pad_without_mask(x, buckets):
    size = min(b for b in buckets if b >= x.shape[0])
    return jnp.pad(x, (0, size - x.shape[0])), jnp.ones(size, bool)


def integer_mask(x, buckets):
    padded, mask = pad_to_bucket(x, buckets)
    return padded, mask.astype(jnp.int32)  # where() accepts it, but the exercise asks for booleans


def pads_in_place(x, buckets):
    n = x.shape[0]
    if n > max(buckets):
        raise ValueError(f"length {n} is longer than the largest bucket, {max(buckets)}")
    x.resize(min(b for b in buckets if b >= n), refcheck=False)  # NumPy pads with zeros, in place
    return x, np.arange(x.shape[0]) < n


def zeroes_its_input(x, buckets):
    padded, mask = pad_to_bucket(x, buckets)
    x[:] = 0  # "done with it": but the caller is not
    return padded, mask


def pads_with_the_last_value(x, buckets):
    n = x.shape[0]
    if n > max(buckets):
        raise ValueError(f"length {n} is longer than the largest bucket, {max(buckets)}")
    size = min(b for b in buckets if b >= n)
    return jnp.pad(x, (0, size - n), mode="edge"), jnp.arange(size) < n


# (exercise, planted wrong answer, points it should still get, why)
WRONG = [
    ("06.dense_cost", lambda b, i, o, e: {**dense_cost(b, i, o, e), "flops": b * i * o + b * o},
     2, "counts a multiply-add as one FLOP"),
    ("06.dense_cost", lambda b, i, o, e: {**dense_cost(b, i, o, e), "flops": 2 * b * i * o},
     2, "forgets the bias add"),
    ("06.dense_cost", lambda b, i, o, e: {**dense_cost(b, i, o, e), "bytes": 4 * (b * i + i * o + b * o)},
     2, "ignores the bias and the dtype in the bytes"),
    ("06.dense_cost", bytes_without_fusion, 3, "counts x @ W written and read back (no fusion)"),
    ("06.dense_cost", lambda b, i, o, e: (2 * b * i * o + b * o, 0), 0, "returns a tuple, not a dict"),
    ("06.count_kernels", lambda text: text.count("fusion("), 2, "counts 'fusion(' anywhere, nested ones too"),
    ("06.count_kernels", whole_text_fusion_lines, 2, "counts fusion instructions outside ENTRY"),
    ("06.count_kernels", lambda text: text.count("calls=%fused"), 1, "counts calls= attributes"),
    ("06.count_kernels", skips_the_root, 0, "skips the ROOT instruction"),
    ("06.count_kernels", shape_without_spaces, 2, "misses a fusion with a tuple shape"),
    ("06.count_kernels", count_fusions, 0, "calls stacklib.compile instead of reading the text"),
    ("06.pad_to_bucket", pad_to_largest, 4, "always pads to the largest bucket"),
    ("06.pad_to_bucket", pad_to_next_power_of_two, 2, "ignores the buckets and never raises"),
    ("06.pad_to_bucket", no_padding, 1, "no padding: one compilation per length, never raises"),
    ("06.pad_to_bucket", pad_without_mask, 1, "the padding zeros count in the mean"),
    ("06.pad_to_bucket", integer_mask, 4, "an int32 mask, not a boolean one"),
    ("06.pad_to_bucket", pads_in_place, 1, "pads the caller's array in place (ndarray.resize)"),
    ("06.pad_to_bucket", zeroes_its_input, 1, "zeroes the caller's array after padding"),
    ("06.pad_to_bucket", pads_with_the_last_value, 4, "pads with the last value, not zeros"),
    ("06.matmul_intensity", lambda m, k, n, e: m * k * n / (e * (m * k + k * n + m * n)), 1,
     "a multiply-add as one FLOP (the bf16 ratio still holds)"),
    ("06.matmul_intensity", lambda m, k, n, e: 2 * m * k * n / (4 * (m * k + k * n + m * n)), 2,
     "always 4 bytes per element"),
    ("06.matmul_intensity", lambda m, k, n, e: 2 * m * k * n / (e * (m * k + k * n)), 1,
     "forgets the output's bytes (the bf16 ratio still holds)"),
]


@pytest.mark.parametrize("exercise_id, answer, points, why", WRONG, ids=[w[3] for w in WRONG])
def test_a_planted_wrong_answer_loses_points(exercise_id, answer, points, why):
    result = grade(exercise_id, answer)
    assert result.points == points, [(c.name, c.status, c.message) for c in result.cases]
    assert result.points < result.max_points
