"""Chapter 11 exercises: absmax scales for a tiled axis, the straight-through estimator,
which rule matches which path, and the memory arithmetic of QLoRA.

Expected answers come from stacklib.quant (itself checked against qwix) or from closed
forms, computed before the learner's code runs; arrays are handed over as copies
(`call_on_copies`).
"""

import jax
import jax.numpy as jnp
import numpy as np

import stacklib.nn as nnx
import stacklib.quant as quant
from stacklib.grading import Exercise, call_on_copies, expect, expect_close

# ---------------------------------------------------------------- 11.tiled_scales

tiled_scales = Exercise("11.tiled_scales", "int8 absmax scales for tiles of a kernel's input axis")


def _kernel(seed, shape):
    rows = np.linspace(0.1, 3.0, shape[0], dtype=np.float32)[:, None]  # tiles differ in size
    return np.asarray(jax.random.normal(jax.random.key(seed), shape)) * rows


@tiled_scales.case(points=2, hint="Each scale covers tile_size consecutive rows of one column and comes from "
                                  "the largest magnitude there, negative values included. See 'Per-tensor, "
                                  "per-channel and tiled scales'.")
def equals_qwix_scales(scales_fn):
    for shape, tile in [((64, 8), 16), ((96, 5), 32), ((12, 3), 4)]:
        w = _kernel(0, shape)
        expected = quant.quantize(w, jnp.int8, channelwise_axes=(1,), tiled_axes={0: tile}).scale
        got = call_on_copies(scales_fn, w, tile, what="tiled_scales")
        expect_close(np.asarray(got), expected, rtol=1e-6, what=f"scales of a {shape} kernel, tile {tile}")


@tiled_scales.case(hint="A tile as long as the axis is one scale per output channel: shape (1, d_out).")
def one_tile_is_per_channel(scales_fn):
    w = _kernel(1, (32, 6))
    expected = quant.quantize(w, jnp.int8, channelwise_axes=(1,)).scale
    expect_close(np.asarray(call_on_copies(scales_fn, w, 32, what="tiled_scales")), expected, rtol=1e-6,
                 what="scales with tile size 32 on a (32, 6) kernel")


@tiled_scales.case(points=2, hint="Only a tile whose scale would be exactly 0 changes: its scale is 1 itself "
                                  "(not 1 / 127.5), and a tile of tiny values keeps its own tiny scale.")
def an_all_zero_tile_gets_scale_one(scales_fn):
    w = _kernel(2, (16, 4))
    w[4:8, 1] = 0.0  # an all-zero tile
    w[8:12, 2] *= 1e-6  # a tile of tiny values, which is not zero
    absmax = np.abs(w).reshape(4, 4, 4).max(axis=1)  # (tile count, tile, d_out) -> (tile count, d_out)
    expected = np.where(absmax == 0, 1.0, absmax / 127.5)
    got = np.asarray(call_on_copies(scales_fn, w, 4, what="tiled_scales"))
    expect(got.shape == (4, 4), f"expected scales of shape (4, 4), got {got.shape}")
    expect(float(got[1, 1]) == 1.0, f"the all-zero tile (rows 4-7 of column 1) should get scale 1.0, "
                                    f"got {float(got[1, 1])}")
    expect_close(got, expected, rtol=1e-6, atol=0,
                 what="scales of a (16, 4) kernel, tile 4, one tile all zero and one of values near 1e-6")


# ---------------------------------------------------------------- 11.fake_quant

fake_quant = Exercise("11.fake_quant", "Fake int8 quantization with a straight-through gradient")


def _reference_fake_quant(x, scale):
    return np.clip(np.round(x / scale), -128, 127) * scale


@fake_quant.case(points=3, hint="Check each step of the forward value against the text: ties round to "
                                "even, and it is x / scale, rounded, that is clipped to int8's range "
                                "[-128, 127], before multiplying by scale.")
def forward_rounds_and_clips(fake_quant_fn):
    x = np.array([-300.0, -1.26, -0.5, 0.0, 0.25, 0.74, 1.5, 2.5, 127.4, 400.0], np.float32)
    expected = _reference_fake_quant(x, 1.0)
    expect_close(np.asarray(call_on_copies(fake_quant_fn, x, 1.0, what="fake_quant")), expected,
                 what="fake_quant(x, scale=1.0)")
    y = np.linspace(-2, 2, 17, dtype=np.float32)
    got = np.asarray(call_on_copies(fake_quant_fn, y, 0.1, what="fake_quant"))
    expect_close(got, _reference_fake_quant(y, 0.1), rtol=1e-5, atol=1e-6, what="fake_quant(x, scale=0.1)")
    z = np.linspace(-3, 3, 13, dtype=np.float32)  # x / scale reaches +-300: clipped
    got = np.asarray(call_on_copies(fake_quant_fn, z, 0.01, what="fake_quant"))
    expect_close(got, _reference_fake_quant(z, 0.01), rtol=1e-5, atol=1e-6, what="fake_quant(x, scale=0.01)")


def _gradient_of_weighted_sum(fake_quant_fn, x, scale):
    """d/dx of sum(fake_quant(x, scale) * w) with w = 0, 1, 2, ...: the straight-through answer is w."""
    weights = jnp.arange(float(x.size))
    return np.asarray(jax.grad(lambda x: jnp.sum(fake_quant_fn(x, scale) * weights))(x)), np.asarray(weights)


@fake_quant.case(points=2, hint="round() has zero derivative almost everywhere: the value must be the "
                                "quantized one while the gradient flows as if fake_quant were the identity. "
                                "See 'Quantization-aware training' and jax.lax.stop_gradient.")
def gradient_is_straight_through(fake_quant_fn):
    grad, weights = _gradient_of_weighted_sum(fake_quant_fn, jnp.linspace(-3.0, 3.0, 13), 0.1)
    expect_close(grad, weights, what="d/dx of sum(fake_quant(x, 0.1) * w) for x in [-3, 3] (should be w)")


@fake_quant.case(points=2, hint="The derivative is 1 everywhere, also where x / scale is clipped: the "
                                "clip must not stop the gradient either.")
def gradient_is_one_outside_the_clip_range_too(fake_quant_fn):
    grad, weights = _gradient_of_weighted_sum(fake_quant_fn, jnp.linspace(-3.0, 3.0, 13), 0.01)
    expect_close(grad, weights, what="d/dx of sum(fake_quant(x, 0.01) * w) for x in [-3, 3], mostly beyond "
                                     "the clip range [-1.28, 1.27] (should be w)")


@fake_quant.case(hint="Use jax.numpy inside, so the function traces under jax.jit.")
def runs_under_jit(fake_quant_fn):
    x = jnp.linspace(-1.0, 1.0, 9)
    expect_close(np.asarray(jax.jit(fake_quant_fn)(x, 0.01)), _reference_fake_quant(np.asarray(x), 0.01),
                 rtol=1e-5, atol=1e-6, what="jax.jit(fake_quant)(x, 0.01)")


# ---------------------------------------------------------------- 11.which_rule

which_rule = Exercise("11.which_rule", "Which rule matches a module path", none_is_an_answer=True)

_RULES = [
    quant.QuantizationRule(module_path="blocks/0/.*", weight_qtype=jnp.int8),
    quant.QuantizationRule(module_path="blocks/[0-9]+/attn", op_names=("einsum",), weight_qtype=jnp.int4),
    quant.QuantizationRule(module_path="blocks/[0-9]+/mlp", weight_qtype=jnp.int4),
    quant.QuantizationRule(module_path="head", weight_qtype=jnp.int8),
]


def _answer(rule_fn, rules, path, op_name):
    return call_on_copies(rule_fn, list(rules), path, op_name, what="which_rule")


@which_rule.case(points=2, hint="module_path must match the whole path, not a prefix or a part of it: "
                                "'head' must not match 'header' or 'my/head'. See 'Rules, paths and "
                                "interception'.")
def the_regex_matches_the_whole_path(rule_fn):
    for path, expected in [("head", 3), ("header", None), ("blocks/1/mlp", 2), ("blocks/1/mlp/out", None),
                           ("my/head", None)]:
        got = _answer(rule_fn, _RULES, path, "dot_general")
        expect(got == expected, f"path {path!r}, op 'dot_general': expected rule {expected}, got {got!r}")


@which_rule.case(points=2, hint="Rules are tried in order and the first match wins, even when a later rule "
                                "matches as well.")
def the_first_match_wins(rule_fn):
    for path, op in [("blocks/0/mlp", "dot_general"), ("blocks/0/attn", "einsum")]:
        got = _answer(rule_fn, _RULES, path, op)
        expect(got == 0, f"path {path!r}, op {op!r}: expected rule 0 (the first that matches), got {got!r}")


@which_rule.case(points=2, hint="A rule with op_names applies only to those ops; an empty op_names means "
                                "every op.")
def op_names_restrict_a_rule(rule_fn):
    for path, op, expected in [("blocks/3/attn", "einsum", 1), ("blocks/3/attn", "dot_general", None),
                               ("blocks/0/attn", "dot_general", 0)]:
        got = _answer(rule_fn, _RULES, path, op)
        expect(got == expected, f"path {path!r}, op {op!r}: expected rule {expected}, got {got!r}")


# ---------------------------------------------------------------- 11.qlora_bytes

qlora_bytes = Exercise("11.qlora_bytes", "The bytes of a QLoRA layer")


def _expected_bytes(d_in, d_out, rank, bits, tile_size):
    tiles = d_in // tile_size if tile_size else 1
    return {"base": d_in * d_out * bits // 8, "scales": 4 * tiles * d_out,
            "adapters": 4 * rank * (d_in + d_out)}


def _check_key(bytes_fn, key, cases):
    for args in cases:
        got = call_on_copies(bytes_fn, *args, what="qlora_bytes")
        expect(isinstance(got, dict) and key in got,
               f"expected a dict with keys 'base', 'scales', 'adapters', got {got!r:.80}")
        expected = _expected_bytes(*args)[key]
        shown = f"{got[key]:,}" if isinstance(got[key], int | float | np.number) else repr(got[key])
        expect(got[key] == expected, f"{key} bytes for (d_in, d_out, rank, bits, tile_size) = {args}: "
                                     f"expected {expected:,}, got {shown}")
        expect(isinstance(got[key], int | np.integer) and not isinstance(got[key], bool),
               f"{key} bytes for {args}: expected an integer, got {type(got[key]).__name__} {shown} "
               f"(a count of bytes is a whole number)")


@qlora_bytes.case(points=2, hint="The frozen base holds d_in * d_out integers of `bits` bits each, packed "
                                 "(int4 takes half a byte): a whole number of bytes, for whatever `bits` "
                                 "the call gives.")
def base_bytes(bytes_fn):
    _check_key(bytes_fn, "base", [(4096, 4096, 16, 4, None), (1024, 512, 8, 8, 128)])


@qlora_bytes.case(points=2, hint="Scales are float32: one per output channel, or, with tiles, one per tile "
                                 "of the input axis for each output channel (count the tiles, not their "
                                 "size). See 'Per-tensor, per-channel and tiled scales'.")
def scale_bytes(bytes_fn):
    _check_key(bytes_fn, "scales", [(4096, 4096, 16, 4, None), (4096, 4096, 16, 4, 128),
                                    (1024, 512, 8, 8, 64)])


@qlora_bytes.case(hint="A is (d_in, rank) and B is (rank, d_out), both float32.")
def adapter_bytes(bytes_fn):
    _check_key(bytes_fn, "adapters", [(4096, 4096, 16, 4, None), (1024, 512, 8, 8, 64)])


@qlora_bytes.case(hint="The three parts together should be what stacklib.quant stores for a Linear layer "
                       "with a LoraRule(rank=..., weight_qtype=jnp.int4, tile_size=...).")
def matches_a_real_qlora_layer(bytes_fn):
    layer = nnx.Linear(128, 64, use_bias=False, rngs=nnx.Rngs(0))
    rule = quant.LoraRule(module_path=".*", rank=4, alpha=4.0, weight_qtype=jnp.int4, tile_size=32)
    adapted = quant.apply_lora_to_model(layer, quant.LoraProvider([rule]), jnp.ones((1, 128)),
                                        rngs=nnx.Rngs(0))
    parts = ("kernel", "kernel_lora_a", "kernel_lora_b")
    measured = sum(getattr(adapted, name)[...].nbytes for name in parts)
    got = call_on_copies(bytes_fn, 128, 64, 4, 4, 32, what="qlora_bytes")
    expect(isinstance(got, dict), f"expected a dict, got {got!r:.80}")
    total = sum(got.get(key, 0) for key in ("base", "scales", "adapters"))
    expect(total == measured, f"base + scales + adapters for a 128x64 int4 layer, rank 4, tiles of 32: "
                              f"stacklib.quant stores {measured:,} bytes, your parts add up to {total:,}")
