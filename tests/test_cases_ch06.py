"""Chapter 06's exercise cases: right answers score full marks, planted wrong ones lose points."""

import re

import jax.numpy as jnp
import pytest

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


def whole_text_fusion_lines(hlo_text):  # counts fusions in every computation, not just ENTRY
    return sum(1 for line in hlo_text.splitlines() if _INSTRUCTION.match(line) and " fusion(" in line)


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


# (exercise, planted wrong answer, points it should still get, why)
WRONG = [
    ("06.dense_cost", lambda b, i, o, e: {**dense_cost(b, i, o, e), "flops": b * i * o + b * o},
     2, "counts a multiply-add as one FLOP"),
    ("06.dense_cost", lambda b, i, o, e: {**dense_cost(b, i, o, e), "flops": 2 * b * i * o},
     2, "forgets the bias add"),
    ("06.dense_cost", lambda b, i, o, e: {**dense_cost(b, i, o, e), "bytes": 4 * (b * i + i * o + b * o)},
     2, "ignores the bias and the dtype in the bytes"),
    ("06.dense_cost", lambda b, i, o, e: (2 * b * i * o + b * o, 0), 0, "returns a tuple, not a dict"),
    ("06.count_kernels", lambda text: text.count("fusion("), 2, "counts 'fusion(' anywhere, nested ones too"),
    ("06.count_kernels", whole_text_fusion_lines, 2, "counts fusion instructions outside ENTRY"),
    ("06.count_kernels", lambda text: text.count("calls=%fused"), 1, "counts calls= attributes"),
    ("06.pad_to_bucket", pad_to_largest, 3, "always pads to the largest bucket"),
    ("06.pad_to_bucket", pad_to_next_power_of_two, 1, "ignores the buckets and never raises"),
    ("06.pad_to_bucket", no_padding, 0, "no padding: one compilation per length, never raises"),
    ("06.pad_to_bucket", pad_without_mask, 0, "the padding zeros count in the mean"),
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
