"""Chapter 11's exercise cases: right answers score full marks, planted wrong ones lose points."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stacklib.grading import grade


def tiled_scales(w, tile_size):
    d_in, d_out = w.shape
    scale = jnp.max(jnp.abs(jnp.asarray(w).reshape(d_in // tile_size, tile_size, d_out)), axis=1) / 127.5
    return jnp.where(scale == 0, 1.0, scale)


def fake_quant(x, scale):
    q = jnp.clip(jnp.round(x / scale), -128, 127) * scale
    return x + jax.lax.stop_gradient(q - x)


def which_rule(rules, path, op_name):
    for index, rule in enumerate(rules):
        if re.fullmatch(rule.module_path, path) and (not rule.op_names or op_name in rule.op_names):
            return index
    return None


def qlora_bytes(d_in, d_out, rank, bits, tile_size=None):
    tiles = d_in // tile_size if tile_size else 1
    return {"base": d_in * d_out * bits // 8, "scales": 4 * tiles * d_out,
            "adapters": 4 * rank * (d_in + d_out)}


RIGHT = {
    "11.tiled_scales": tiled_scales,
    "11.fake_quant": fake_quant,
    "11.which_rule": which_rule,
    "11.qlora_bytes": qlora_bytes,
}


@pytest.mark.parametrize("exercise_id", sorted(RIGHT))
def test_a_right_answer_scores_full_marks(exercise_id):
    result = grade(exercise_id, RIGHT[exercise_id])
    assert result.points == result.max_points, [c.message for c in result.cases]



# Planted wrong answers.

def scales_over_127(w, tile_size):  # qmax, not qmax + 0.5
    return tiled_scales(w, tile_size) * 127.5 / 127


def interleaved_tiles(w, tile_size):  # tiles of every (d_in // tile_size)-th row, not consecutive rows
    d_in, d_out = w.shape
    scale = jnp.max(jnp.abs(jnp.asarray(w).reshape(tile_size, d_in // tile_size, d_out)), axis=0) / 127.5
    return jnp.where(scale == 0, 1.0, scale)


def zero_tile_gets_zero(w, tile_size):
    d_in, d_out = w.shape
    return jnp.max(jnp.abs(jnp.asarray(w).reshape(d_in // tile_size, tile_size, d_out)), axis=1) / 127.5


def zero_tile_gets_one_over_127_5(w, tile_size):  # the guard before the division
    d_in, d_out = w.shape
    absmax = jnp.max(jnp.abs(jnp.asarray(w).reshape(d_in // tile_size, tile_size, d_out)), axis=1)
    return jnp.where(absmax == 0, 1.0, absmax) / 127.5


def scales_with_eps(w, tile_size):  # a small constant instead of the guard: tiny tiles are shifted too
    return zero_tile_gets_zero(w, tile_size) + 1e-12


def scales_with_a_large_threshold(w, tile_size):  # treats a tile of tiny values as zero
    scale = zero_tile_gets_zero(w, tile_size)
    return jnp.where(scale < 1e-6, 1.0, scale)


def scales_without_abs(w, tile_size):  # the largest value, not the largest magnitude
    d_in, d_out = w.shape
    scale = jnp.max(jnp.asarray(w).reshape(d_in // tile_size, tile_size, d_out), axis=1) / 127.5
    return jnp.where(scale == 0, 1.0, scale)


def scales_in_place(w, tile_size):
    w /= 127.5  # divides the caller's kernel
    d_in, d_out = w.shape
    scale = np.max(np.abs(w.reshape(d_in // tile_size, tile_size, d_out)), axis=1)
    return np.where(scale == 0, 1.0, scale)


def no_straight_through(x, scale):  # the gradient of round() is zero
    return jnp.clip(jnp.round(x / scale), -128, 127) * scale


def no_clip(x, scale):
    q = jnp.round(x / scale) * scale
    return x + jax.lax.stop_gradient(q - x)


def floor_instead_of_round(x, scale):
    q = jnp.clip(jnp.floor(x / scale + 0.5), -128, 127) * scale  # ties go up, not to even
    return x + jax.lax.stop_gradient(q - x)


def numpy_fake_quant(x, scale):  # NumPy cannot trace or differentiate
    return np.clip(np.round(np.asarray(x) / scale), -128, 127) * scale


def clipped_straight_through(x, scale):  # the clip outside the estimator: gradient 0 beyond the range
    q = jnp.round(x / scale) * scale
    return jnp.clip(x + jax.lax.stop_gradient(q - x), -128 * scale, 127 * scale)


def clips_x_not_x_over_scale(x, scale):  # right only when scale is 1
    q = jnp.round(jnp.clip(x, -128, 127) / scale) * scale
    return x + jax.lax.stop_gradient(q - x)


def symmetric_clip(x, scale):  # [-127, 127]: int8's -128 is never used
    q = jnp.clip(jnp.round(x / scale), -127, 127) * scale
    return x + jax.lax.stop_gradient(q - x)


def straight_through_backwards(x, scale):  # q + stop_gradient(x - q): the value is x, the gradient 0
    q = jnp.clip(jnp.round(x / scale), -128, 127) * scale
    return q + jax.lax.stop_gradient(x - q)


def prefix_match(rules, path, op_name):
    for index, rule in enumerate(rules):
        if re.match(rule.module_path, path) and (not rule.op_names or op_name in rule.op_names):
            return index
    return None


def last_match_wins(rules, path, op_name):
    matches = [i for i, r in enumerate(rules)
               if re.fullmatch(r.module_path, path) and (not r.op_names or op_name in r.op_names)]
    return matches[-1] if matches else None


def ignores_op_names(rules, path, op_name):
    return next((i for i, r in enumerate(rules) if re.fullmatch(r.module_path, path)), None)


def search_match(rules, path, op_name):
    for index, rule in enumerate(rules):
        if re.search(rule.module_path, path) and (not rule.op_names or op_name in rule.op_names):
            return index
    return None


def empty_op_names_match_nothing(rules, path, op_name):
    matches = (i for i, r in enumerate(rules) if re.fullmatch(r.module_path, path) and op_name in r.op_names)
    return next(matches, None)


def minus_one_for_no_match(rules, path, op_name):
    index = which_rule(rules, path, op_name)
    return -1 if index is None else index


def int4_takes_a_byte(d_in, d_out, rank, bits, tile_size=None):
    return {**qlora_bytes(d_in, d_out, rank, bits, tile_size), "base": d_in * d_out * max(bits, 8) // 8}


def forgets_tiles(d_in, d_out, rank, bits, tile_size=None):
    return {**qlora_bytes(d_in, d_out, rank, bits, tile_size), "scales": 4 * d_out}


def full_rank_adapters(d_in, d_out, rank, bits, tile_size=None):
    return {**qlora_bytes(d_in, d_out, rank, bits, tile_size), "adapters": 4 * d_in * d_out}


def float_byte_counts(d_in, d_out, rank, bits, tile_size=None):  # bits / 8 gives a float
    return {**qlora_bytes(d_in, d_out, rank, bits, tile_size), "base": d_in * d_out * bits / 8}


def int4_always(d_in, d_out, rank, bits, tile_size=None):
    return {**qlora_bytes(d_in, d_out, rank, bits, tile_size), "base": d_in * d_out // 2}


def tile_size_not_tile_count(d_in, d_out, rank, bits, tile_size=None):
    return {**qlora_bytes(d_in, d_out, rank, bits, tile_size), "scales": 4 * (tile_size or 1) * d_out}


def scales_per_input_channel(d_in, d_out, rank, bits, tile_size=None):
    tiles = d_in // tile_size if tile_size else 1
    return {**qlora_bytes(d_in, d_out, rank, bits, tile_size), "scales": 4 * tiles * d_in}


def tile_size_none_unhandled(d_in, d_out, rank, bits, tile_size=None):
    return {**qlora_bytes(d_in, d_out, rank, bits, tile_size), "scales": 4 * (d_in // tile_size) * d_out}


# Fresh wrong answers (issue 38).

def per_tensor_scale(w, tile_size):  # one scale for the whole kernel, broadcast
    tiles = w.shape[0] // tile_size
    return jnp.full((tiles, w.shape[1]), jnp.max(jnp.abs(jnp.asarray(w))) / 127.5)


def tiles_along_the_output_axis(w, tile_size):  # tiles of the columns: the transpose of the right shape
    return tiled_scales(jnp.asarray(w).T, tile_size).T if w.shape[1] % tile_size == 0 else \
        jnp.zeros((w.shape[0] // tile_size, w.shape[1]))


def scales_as_a_column(w, tile_size):  # (d_out, tiles): transposed
    return tiled_scales(w, tile_size).T


def fullmatch_arguments_swapped(rules, path, op_name):  # re.fullmatch(path, pattern)
    for index, rule in enumerate(rules):
        ops_match = not rule.op_names or op_name in rule.op_names
        if re.fullmatch(re.escape(path), rule.module_path) and ops_match:
            return index
    return None


def glob_match(rules, path, op_name):  # fnmatch: a glob, not a regex
    import fnmatch
    for index, rule in enumerate(rules):
        if fnmatch.fnmatchcase(path, rule.module_path) and (not rule.op_names or op_name in rule.op_names):
            return index
    return None


def straight_through_without_stop_gradient(x, scale):  # x + (q - x): the value right, the gradient 0
    q = jnp.clip(jnp.round(x / scale), -128, 127) * scale
    return x + (q - x)


def float16_scales(d_in, d_out, rank, bits, tile_size=None):  # scales at 2 bytes
    parts = qlora_bytes(d_in, d_out, rank, bits, tile_size)
    return {**parts, "scales": parts["scales"] // 2}


def bfloat16_adapters(d_in, d_out, rank, bits, tile_size=None):  # adapters at 2 bytes
    parts = qlora_bytes(d_in, d_out, rank, bits, tile_size)
    return {**parts, "adapters": parts["adapters"] // 2}


def returns_integer_codes(x, scale):  # forgets to multiply back by scale: int8 codes, not values
    q = jnp.clip(jnp.round(x / scale), -128, 127)
    return x + jax.lax.stop_gradient(q - x)


def multiplies_by_scale(x, scale):  # x * scale to quantize, / scale to dequantize: the scale inverted
    q = jnp.clip(jnp.round(x * scale), -128, 127) / scale
    return x + jax.lax.stop_gradient(q - x)


def returns_the_rule(rules, path, op_name):  # the rule itself, not its index
    for rule in rules:
        if re.fullmatch(rule.module_path, path) and (not rule.op_names or op_name in rule.op_names):
            return rule
    return None


def most_specific_rule_wins(rules, path, op_name):  # the longest matching pattern, not the first
    matches = [i for i, r in enumerate(rules)
               if re.fullmatch(r.module_path, path) and (not r.op_names or op_name in r.op_names)]
    return max(matches, key=lambda i: len(rules[i].module_path)) if matches else None


def op_name_equals_op_names(rules, path, op_name):  # == on the tuple: a rule with op_names never matches
    for index, rule in enumerate(rules):
        if re.fullmatch(rule.module_path, path) and (not rule.op_names or op_name == rule.op_names):
            return index
    return None


# Fresh wrong answers a learner writes (issue 38).
FRESH = [
    ("11.fake_quant", returns_integer_codes, 4, "returns the int8 codes, not codes * scale"),
    ("11.fake_quant", multiplies_by_scale, 4, "multiplies by scale where it divides"),
    ("11.which_rule", returns_the_rule, 0, "returns the rule, not its index"),
    ("11.which_rule", most_specific_rule_wins, 4, "the most specific (longest) pattern wins"),
    ("11.which_rule", op_name_equals_op_names, 4, "op_name == op_names, not `in`"),
]


# (exercise, planted wrong answer, points it should still get, why)
WRONG = [
    ("11.tiled_scales", scales_over_127, 0, "divides by 127, not 127.5 (the zero tile too)"),
    ("11.tiled_scales", interleaved_tiles, 1, "tiles interleaved rows (reshape in the wrong order)"),
    ("11.tiled_scales", scales_without_abs, 0, "the largest value, not the largest magnitude"),
    ("11.tiled_scales", zero_tile_gets_zero, 3, "an all-zero tile gets scale 0"),
    ("11.tiled_scales", zero_tile_gets_one_over_127_5, 3, "an all-zero tile gets scale 1 / 127.5"),
    ("11.tiled_scales", scales_with_eps, 3, "adds a small constant instead of the guard"),
    ("11.tiled_scales", scales_with_a_large_threshold, 3, "gives scale 1 to a tile of tiny values too"),
    ("11.tiled_scales", scales_in_place, 0, "divides the caller's kernel in place"),
    ("11.fake_quant", no_straight_through, 4, "no straight-through estimator: zero gradient"),
    ("11.fake_quant", clipped_straight_through, 6, "the gradient stops at the clip range"),
    ("11.fake_quant", straight_through_backwards, 1, "q + stop_gradient(x - q): the value is x"),
    ("11.fake_quant", no_clip, 5, "no clipping to [-128, 127]"),
    ("11.fake_quant", clips_x_not_x_over_scale, 5, "clips x, not x / scale"),
    ("11.fake_quant", symmetric_clip, 5, "clips to [-127, 127]"),
    ("11.fake_quant", floor_instead_of_round, 5, "rounds ties up, not to even"),
    ("11.fake_quant", numpy_fake_quant, 3, "NumPy: cannot be differentiated or jitted"),
    ("11.which_rule", prefix_match, 4, "re.match: a prefix match"),
    ("11.which_rule", search_match, 4, "re.search: a match anywhere in the path"),
    ("11.which_rule", last_match_wins, 4, "the last match wins"),
    ("11.which_rule", ignores_op_names, 4, "ignores op_names"),
    ("11.which_rule", empty_op_names_match_nothing, 0, "a rule without op_names matches no op"),
    ("11.which_rule", minus_one_for_no_match, 2, "-1, not None, when no rule matches"),
    ("11.qlora_bytes", int4_takes_a_byte, 3, "an int4 value takes a whole byte"),
    ("11.qlora_bytes", int4_always, 4, "the base is int4 whatever `bits` is"),
    ("11.qlora_bytes", float_byte_counts, 4, "bits / 8: a float, not an integer count"),
    ("11.qlora_bytes", forgets_tiles, 3, "one scale per channel even with tiles"),
    ("11.qlora_bytes", tile_size_not_tile_count, 3, "the tile size where the tile count belongs"),
    ("11.qlora_bytes", scales_per_input_channel, 3, "scales per input channel"),
    ("11.qlora_bytes", full_rank_adapters, 4, "adapters as large as the kernel"),
    ("11.qlora_bytes", tile_size_none_unhandled, 1, "fails without tiles (tile_size=None)"),
    ("11.tiled_scales", per_tensor_scale, 0, "one scale for the whole kernel"),
    ("11.tiled_scales", tiles_along_the_output_axis, 0, "tiles of the output axis"),
    ("11.tiled_scales", scales_as_a_column, 0, "scales transposed, (d_out, tiles)"),
    ("11.which_rule", fullmatch_arguments_swapped, 0, "re.fullmatch with its arguments swapped"),
    ("11.which_rule", glob_match, 0, "a glob match, not a regex"),
    ("11.fake_quant", straight_through_without_stop_gradient, 4, "x + (q - x) without stop_gradient"),
    ("11.qlora_bytes", float16_scales, 3, "float16 scales"),
    ("11.qlora_bytes", bfloat16_adapters, 4, "bfloat16 adapters"),
    *FRESH,
]


@pytest.mark.parametrize("exercise_id, answer, points, why", WRONG, ids=[w[3] for w in WRONG])
def test_a_planted_wrong_answer_loses_points(exercise_id, answer, points, why):
    result = grade(exercise_id, answer)
    assert result.points == points, [(c.name, c.status, c.message) for c in result.cases]
    assert result.points < result.max_points
