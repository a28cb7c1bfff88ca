"""Chapter 06's exercise cases: right answers score full marks, planted wrong ones lose points."""

import re

import jax.numpy as jnp
import numpy as np
import pytest

from stacklib.cases.ch06 import HAND_WRITTEN_MODULES
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


@pytest.mark.parametrize("module", range(len(HAND_WRITTEN_MODULES)))
def test_each_hand_written_module_has_the_kernels_its_case_expects(module):
    text, kernels = HAND_WRITTEN_MODULES[module]
    assert count_fusions(text) == kernels == count_kernels(text)



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


def output_bytes_in_float32(batch, d_in, d_out, bytes_per_element):
    inputs = batch * d_in + d_in * d_out + d_out
    return {**dense_cost(batch, d_in, d_out, bytes_per_element),
            "bytes": inputs * bytes_per_element + 4 * batch * d_out}  # the output always 4 bytes


def bias_read_per_row(batch, d_in, d_out, bytes_per_element):
    elements = batch * d_in + d_in * d_out + batch * d_out + batch * d_out  # the broadcast bias, not b
    return {**dense_cost(batch, d_in, d_out, bytes_per_element), "bytes": elements * bytes_per_element}


def _entry_lines(hlo_text, to_the_end=False):
    entry = hlo_text[hlo_text.index("\nENTRY"):]
    body = entry[entry.index("{\n") + 2:]
    return (body if to_the_end else body[:body.index("\n}")]).splitlines()


def fusion_paren_on_entry_lines(hlo_text):  # metadata may hold "fusion(" too
    return sum("fusion(" in line for line in _entry_lines(hlo_text))


def spaced_fusion_paren_on_entry_lines(hlo_text):  # so may metadata with a space in it
    return sum(" fusion(" in line for line in _entry_lines(hlo_text))


def names_that_say_fusion(hlo_text):  # a name is not an opcode
    return sum(bool(re.match(r"\s*(ROOT )?%\S*fusion\S* =", line)) for line in _entry_lines(hlo_text))


def distinct_called_computations(hlo_text):  # two fusions may call one computation
    called = [re.search(r"calls=%([\w.\-]+)", line) for line in _entry_lines(hlo_text)]
    return len({m.group(1) for m in called if m})


def from_entry_to_the_end_of_the_text(hlo_text):  # other computations may follow the ENTRY
    instructions = [_INSTRUCTION.match(line) for line in _entry_lines(hlo_text, to_the_end=True)]
    return [m.group(1) for m in instructions if m].count("fusion")


def float64_padding(x, buckets):
    n = x.shape[0]
    fitting = [size for size in buckets if size >= n]
    if not fitting:
        raise ValueError(f"length {n} is longer than the largest bucket, {max(buckets)}")
    padded = np.zeros(min(fitting))  # float64, whatever x's dtype
    padded[:n] = x
    return padded, np.arange(min(fitting)) < n


def the_largest_bucket_is_too_small(x, buckets):
    n = x.shape[0]
    if n >= max(buckets):  # an input as long as the largest bucket fits it
        raise ValueError(f"length {n} does not fit the largest bucket, {max(buckets)}")
    return pad_to_bucket(x, buckets)


def mask_from_the_values(x, buckets):
    padded, _ = pad_to_bucket(x, buckets)
    return padded, padded != 0  # x's own zeros are masked out too


def pads_on_the_left(x, buckets):
    padded, mask = pad_to_bucket(x, buckets)
    return jnp.roll(padded, -int(mask.sum())), jnp.roll(mask, -int(mask.sum()))


def raises_min_of_nothing(x, buckets):
    n = x.shape[0]
    size = min(b for b in buckets if b >= n)  # ValueError: min() arg is an empty sequence
    return jnp.pad(x, (0, size - n)), jnp.arange(size) < n


def mask_one_too_long(x, buckets):
    padded, _ = pad_to_bucket(x, buckets)
    return padded, jnp.arange(padded.shape[0]) <= x.shape[0]



# (exercise, planted wrong answer, points it should still get, why)
# Fresh wrong answers a learner writes (issue 38).


def pad_choosing_with_searchsorted_right(x, buckets):
    n = x.shape[0]
    i = int(np.searchsorted(buckets, n, side="right"))  # a length equal to a bucket goes one bucket up
    if i == len(buckets):
        raise ValueError(f"length {n} is longer than the largest bucket, {max(buckets)}")
    return jnp.pad(x, (0, buckets[i] - n)), jnp.arange(buckets[i]) < n


def pad_to_the_first_bucket_listed_that_fits(x, buckets):
    n = x.shape[0]
    fitting = [size for size in buckets if size >= n]
    if not fitting:
        raise ValueError(f"length {n} is longer than the largest bucket, {max(buckets)}")
    return jnp.pad(x, (0, fitting[-1] - n)), jnp.arange(fitting[-1]) < n  # the largest that fits



def opcode_as_the_fourth_word(hlo_text):  # a ROOT line and a tuple shape both move the opcode along
    words = [line.split() for line in _entry_lines(hlo_text)]
    return sum(len(w) > 3 and w[3].startswith("fusion(") for w in words)


def entry_found_case_blind(hlo_text):
    start = hlo_text.lower().index("entry")  # the header's entry_computation_layout= comes first
    body = hlo_text[start:]
    body = body[:body.index("\n}")]  # so this is the first computation printed, not the ENTRY
    return sum(" = " in line and bool(re.search(r"\sfusion\(", line)) for line in body.splitlines())


def pad_with_nan(x, buckets):  # "so that padding shows": the mask hides it, but the zeros were asked for
    n = x.shape[0]
    fitting = [size for size in buckets if size >= n]
    if not fitting:
        raise ValueError(f"length {n} is longer than the largest bucket, {max(buckets)}")
    return jnp.pad(x, (0, min(fitting) - n), constant_values=np.nan), jnp.arange(min(fitting)) < n


FRESH = [
    ("06.dense_cost", lambda b, i, o, e: {**dense_cost(b, i, o, e), "bytes": e * (2 * b * i + i * o + o)},
     2, "the output counted as (batch, d_in)"),
    ("06.dense_cost", lambda b, i, o, e: {**dense_cost(b, i, o, e), "flops": 2 * b * i * o + 2 * b * o},
     2, "two FLOPs per bias add"),
    ("06.dense_cost", lambda b, i, o, e: {**dense_cost(b, i, o, e), "bytes": b * i + i * o + o + b * o},
     2, "counts elements, not bytes"),
    ("06.count_kernels", opcode_as_the_fourth_word, 4, "takes the fourth word for the opcode"),
    ("06.count_kernels", entry_found_case_blind, 1, "finds 'entry' in the header, not the ENTRY line"),
    ("06.matmul_intensity", lambda m, k, n, e: n / (3 * e / 2), 2, "n / 6 for every shape"),
    ("06.matmul_intensity", lambda m, k, n, e: 2 * m * k * n / (e * (m * k + k * n + m * n)) * 8, 1,
     "FLOPs per bit"),
    ("06.pad_to_bucket", pad_choosing_with_searchsorted_right, 4, "searchsorted(side='right')"),
    ("06.pad_to_bucket", pad_to_the_first_bucket_listed_that_fits, 4, "the largest bucket that fits"),
    ("06.matmul_intensity", lambda m, k, n, e: 2 * m * k * n / (m * k + k * n + m * n), 0,
     "FLOPs per element, not per byte"),
    ("06.matmul_intensity", lambda m, k, n, e: 2 * m * k * n / (e * (m * k + k * n + 2 * m * n)), 1,
     "reads the output as well as writing it (C += A @ B)"),
    ("06.matmul_intensity", lambda m, k, n, e: e * (m * k + k * n + m * n) / (2 * m * k * n), 0,
     "bytes per FLOP, the inverse"),
    ("06.pad_to_bucket", pad_with_nan, 5, "pads with NaN, not zeros"),
]


WRONG = [
    ("06.dense_cost", lambda b, i, o, e: {**dense_cost(b, i, o, e), "flops": b * i * o + b * o},
     2, "counts a multiply-add as one FLOP"),
    ("06.dense_cost", lambda b, i, o, e: {**dense_cost(b, i, o, e), "flops": 2 * b * i * o},
     2, "forgets the bias add"),
    ("06.dense_cost", lambda b, i, o, e: {**dense_cost(b, i, o, e), "flops": 2 * b * i * o + o},
     2, "adds the bias once, not once per output element"),
    ("06.dense_cost", lambda b, i, o, e: {**dense_cost(b, i, o, e), "bytes": 4 * (b * i + i * o + b * o)},
     2, "ignores the bias and the dtype in the bytes"),
    ("06.dense_cost", bytes_without_fusion, 2, "counts x @ W written and read back (no fusion)"),
    ("06.dense_cost", output_bytes_in_float32, 3, "writes the output in 4 bytes whatever the dtype"),
    ("06.dense_cost", bias_read_per_row, 2, "reads the broadcast bias, not b"),
    ("06.dense_cost", lambda b, i, o, e: (2 * b * i * o + b * o, 0), 0, "returns a tuple, not a dict"),
    ("06.count_kernels", lambda text: text.count("fusion("), 5, "counts 'fusion(' anywhere, nested ones too"),
    ("06.count_kernels", whole_text_fusion_lines, 5, "counts fusion instructions outside ENTRY"),
    ("06.count_kernels", lambda text: text.count("calls=%fused"), 5, "counts calls= attributes"),
    ("06.count_kernels", skips_the_root, 3, "skips the ROOT instruction"),
    ("06.count_kernels", shape_without_spaces, 6, "misses a fusion with a tuple shape"),
    ("06.count_kernels", fusion_paren_on_entry_lines, 7, "counts ENTRY lines holding 'fusion('"),
    ("06.count_kernels", spaced_fusion_paren_on_entry_lines, 7, "counts ENTRY lines holding ' fusion('"),
    ("06.count_kernels", names_that_say_fusion, 5, "counts instructions named *fusion*"),
    ("06.count_kernels", distinct_called_computations, 7, "counts the distinct computations called"),
    ("06.count_kernels", from_entry_to_the_end_of_the_text, 7, "reads from ENTRY to the end of the text"),
    ("06.count_kernels", count_fusions, 0, "calls stacklib.compile instead of reading the text"),
    ("06.pad_to_bucket", pad_to_largest, 4, "always pads to the largest bucket"),
    ("06.pad_to_bucket", pad_to_next_power_of_two, 3, "ignores the buckets and never raises"),
    ("06.pad_to_bucket", no_padding, 1, "no padding: one compilation per length, never raises"),
    ("06.pad_to_bucket", pad_without_mask, 1, "the padding zeros count in the mean"),
    ("06.pad_to_bucket", integer_mask, 5, "an int32 mask, not a boolean one"),
    ("06.pad_to_bucket", pads_in_place, 1, "pads the caller's array in place (ndarray.resize)"),
    ("06.pad_to_bucket", zeroes_its_input, 0, "zeroes the caller's array after padding"),
    ("06.pad_to_bucket", pads_with_the_last_value, 4, "pads with the last value, not zeros"),
    ("06.pad_to_bucket", float64_padding, 5, "pads into a float64 array"),
    ("06.pad_to_bucket", the_largest_bucket_is_too_small, 5, "refuses an input as long as the last bucket"),
    ("06.pad_to_bucket", mask_from_the_values, 4, "masks x's own zeros out"),
    ("06.pad_to_bucket", pads_on_the_left, 4, "puts the zeros before x"),
    ("06.pad_to_bucket", raises_min_of_nothing, 5, "the error of min() names neither length"),
    ("06.pad_to_bucket", mask_one_too_long, 2, "the mask marks one padding position"),
    ("06.matmul_intensity", lambda m, k, n, e: m * k * n / (e * (m * k + k * n + m * n)), 1,
     "a multiply-add as one FLOP (the bf16 ratio still holds)"),
    ("06.matmul_intensity", lambda m, k, n, e: 2 * m * k * n / (4 * (m * k + k * n + m * n)), 2,
     "always 4 bytes per element"),
    ("06.matmul_intensity", lambda m, k, n, e: 2 * m * k * n / (e * (m * k + k * n)), 1,
     "forgets the output's bytes (the bf16 ratio still holds)"),
    ("06.matmul_intensity", lambda m, k, n, e: 2 * m * k * n / (e * (m * k + k * n + n * n)), 2,
     "the output taken as (N, N)"),
    ("06.matmul_intensity", lambda m, k, n, e: 2 * m * k * n / (e * (m * k + k * n) + 4 * m * n), 2,
     "writes the output in 4 bytes whatever the dtype"),
    ("06.matmul_intensity", lambda m, k, n, e: 2 * m * k * n // (e * (m * k + k * n + m * n)), 0,
     "integer division"),
    *FRESH,
]


@pytest.mark.parametrize("exercise_id, answer, points, why", WRONG, ids=[w[3] for w in WRONG])
def test_a_planted_wrong_answer_loses_points(exercise_id, answer, points, why):
    result = grade(exercise_id, answer)
    assert result.points == points, [(c.name, c.status, c.message) for c in result.cases]
    assert result.points < result.max_points
