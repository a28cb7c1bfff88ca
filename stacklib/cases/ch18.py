"""Chapter 18 exercises: reading a Hugging Face checkpoint into our layout, the head split, Llama 3's
RoPE frequency scaling, and tied embeddings.

Expected answers come from `stacklib.llm.hf` (`tensor_map`: which tensors are transposed),
`stacklib.llm.model.rope_frequencies` (checked against Meta's reference code in
tests/test_llm_hf.py) or are written out here in NumPy. Inputs are handed over as copies
(`call_on_copies`), so an answer that edits the checkpoint's arrays or dict in place fails with its own
message. The weights the statements ask for are float32, as the file hands them over, and that is
checked: a float64 copy has the right values at twice the memory, and a bfloat16 one rounds them. Every
case runs on small random arrays in well under a second; none builds a model.
"""

import math

import numpy as np

from stacklib.grading import Exercise, call_on_copies, expect, expect_close
from stacklib.llm import hf, model
from stacklib.llm.config import load_config


def _random(seed: int, shape) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _expect_array(got, shape, what: str, *, float32: bool = True) -> np.ndarray:
    """`got` as a NumPy array, once it is known to be an array of `shape` (float32 unless told otherwise)."""
    expect(hasattr(got, "shape"), f"{what}: expected an array, got {type(got).__name__}")
    expect(tuple(got.shape) == tuple(shape), f"{what}: expected shape {tuple(shape)}, got {tuple(got.shape)}")
    if float32:  # the values alone do not tell a float64 copy of a float32 weight
        dtype = np.dtype(got.dtype)
        expect(dtype == np.float32, f"{what}: expected dtype float32, got {dtype}",
               hint="Keep the checkpoint's dtype: the weight comes in as float32 and our parameter is "
                    "float32. A float64 copy doubles the memory; a bfloat16 one rounds the values.")
    return np.asarray(got)


# ---------------------------------------------------------------- 18.to_ours

to_ours = Exercise("18.to_ours", "One Hugging Face tensor in our layout")

_CONFIG = load_config(None, vocab_size=40, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8,
                      d_ff=24, max_seq_len=32, seq_len=32, qk_norm=True)
_TRANSPOSED = {m.hf: m.transposed for m in hf.tensor_map(_CONFIG)}  # the library's answer, name by name


def _check_tensor(fn, name: str, shape, seed: int) -> None:
    weight = _random(seed, shape)
    expected = weight.T if _TRANSPOSED[name] else weight
    got = call_on_copies(fn, name, weight, what="to_ours")
    got = _expect_array(got, expected.shape, f"to_ours({name!r})")
    expect_close(got, expected, rtol=0, atol=0, what=f"to_ours({name!r}, weight)")


@to_ours.case(points=3, hint="PyTorch's nn.Linear stores weight as (out, in) and computes x @ weight.T; "
                             "our kernel is (in, out). Every projection's weight is transposed (q, k, v "
                             "and o in attention; gate, up and down in the MLP): .T, not a reshape.")
def projections_are_transposed(fn):
    """All seven projections of a layer: an answer that lists names must not miss one (o_proj, say)."""
    _check_tensor(fn, "model.layers.0.self_attn.q_proj.weight", (16, 16), 0)  # square: a reshape looks right
    _check_tensor(fn, "model.layers.0.self_attn.k_proj.weight", (8, 16), 1)
    _check_tensor(fn, "model.layers.0.self_attn.v_proj.weight", (8, 16), 7)
    _check_tensor(fn, "model.layers.0.self_attn.o_proj.weight", (16, 16), 8)
    _check_tensor(fn, "model.layers.0.mlp.gate_proj.weight", (24, 16), 9)
    _check_tensor(fn, "model.layers.0.mlp.up_proj.weight", (24, 16), 14)
    _check_tensor(fn, "model.layers.0.mlp.down_proj.weight", (16, 24), 2)


@to_ours.case(points=2, hint="An embedding is a table of rows, one per token: (vocab, d_model) in both "
                             "libraries. Only the projections (names ending in proj.weight, and lm_head) "
                             "change layout.")
def the_embedding_keeps_its_layout(fn):
    _check_tensor(fn, "model.embed_tokens.weight", (40, 16), 3)


@to_ours.case(points=1, hint="Norm scales are vectors, the same in both layouts: return them unchanged.")
def norm_scales_are_unchanged(fn):
    _check_tensor(fn, "model.layers.0.input_layernorm.weight", (16,), 4)
    _check_tensor(fn, "model.layers.0.self_attn.q_norm.weight", (8,), 5)


@to_ours.case(points=2, hint="lm_head is an nn.Linear too (d_model in, vocab out): transpose it, although "
                             "its name does not end in proj.")
def the_output_head_is_transposed(fn):
    _check_tensor(fn, "lm_head.weight", (40, 16), 6)


# ---------------------------------------------------------------- 18.split_heads

split_heads = Exercise("18.split_heads", "q_proj's weight as a (d_model, heads, head_dim) kernel")


def _check_split(fn, n_heads: int, head_dim: int, d_model: int, seed: int) -> None:
    weight = _random(seed, (n_heads * head_dim, d_model))  # Hugging Face's (heads * head_dim, d_model)
    expected = weight.T.reshape(d_model, n_heads, head_dim)  # row h * head_dim + j: feature j of head h
    what = f"split_heads(weight of shape {weight.shape}, n_heads={n_heads})"
    got = _expect_array(call_on_copies(fn, weight, n_heads, what="split_heads"), expected.shape, what)
    expect_close(got, expected, rtol=0, atol=0, what=what)


@split_heads.case(points=3, hint="Transpose first, to (d_model, heads * head_dim), then split the last axis "
                                 "into (heads, head_dim): row h * head_dim + j of the weight is feature j of "
                                 "head h, so the head is the slower-varying index.")
def four_heads(fn):
    _check_split(fn, n_heads=4, head_dim=8, d_model=32, seed=10)


@split_heads.case(points=2, hint="head_dim is not d_model / n_heads in Qwen3 (128 vs 64 in Qwen3-0.6B): "
                                 "take it from the weight's shape, weight.shape[0] // n_heads.")
def head_dim_is_not_d_model_over_heads(fn):
    _check_split(fn, n_heads=4, head_dim=16, d_model=32, seed=11)


@split_heads.case(points=2, hint="k_proj of a grouped-query model has fewer heads than q_proj: the same "
                                 "split, with n_kv_heads.")
def two_key_value_heads(fn):
    _check_split(fn, n_heads=2, head_dim=8, d_model=32, seed=12)


@split_heads.case(points=1, hint="With one head the kernel is the transposed weight with an axis of size 1 "
                                 "in the middle.")
def one_head(fn):
    _check_split(fn, n_heads=1, head_dim=8, d_model=8, seed=13)


# ---------------------------------------------------------------- 18.llama3_frequencies

llama3_frequencies = Exercise("18.llama3_frequencies", "Llama 3.1's RoPE frequency scaling")


def _reference_frequencies(head_dim, theta, factor, low, high, original):
    """The frequencies in float64, from the library's unscaled ones and the formula of the chapter."""
    plain = np.asarray(model.rope_frequencies(head_dim, theta), np.float64)
    wavelength = 2 * math.pi / plain
    smooth = (original / wavelength - low) / (high - low)
    between = (1 - smooth) * plain / factor + smooth * plain
    return np.where(wavelength < original / high, plain, np.where(wavelength > original / low, plain / factor,
                                                                   between))


def _check_frequencies(fn, head_dim, theta, factor, low, high, original, *, only=None):
    expected = _reference_frequencies(head_dim, theta, factor, low, high, original)
    what = (f"llama3_frequencies(head_dim={head_dim}, theta={theta}, factor={factor}, low_freq_factor={low}, "
            f"high_freq_factor={high}, original_max_len={original})")
    got = _expect_array(call_on_copies(fn, head_dim, theta, factor, low, high, original,
                                       what="llama3_frequencies"), expected.shape, what,
                        float32=False)  # the statement allows float64 or float32; rtol 2e-6 holds for both
    if only is not None:  # the pairs a case is about
        got, expected, what = got[only], expected[only], f"{what}, pairs {only.start or 0}..{only.stop}"
    expect_close(np.asarray(got, np.float64), expected, rtol=2e-6, atol=0, what=what)


_LLAMA_3P1 = dict(head_dim=128, theta=500000.0, factor=8.0, low=1.0, high=4.0, original=8192)


@llama3_frequencies.case(points=2, hint="Pairs whose wavelength 2π / f is shorter than original_max_len / "
                                        "high_freq_factor keep their frequency: the scaling changes only the "
                                        "slow pairs.")
def fast_pairs_keep_their_frequency(fn):
    _check_frequencies(fn, **_LLAMA_3P1, only=slice(0, 20))


@llama3_frequencies.case(points=2, hint="Pairs whose wavelength is longer than original_max_len / "
                                        "low_freq_factor turn `factor` times slower: divide the frequency by "
                                        "factor (a longer wavelength), do not multiply.")
def slow_pairs_are_divided_by_the_factor(fn):
    _check_frequencies(fn, **_LLAMA_3P1, only=slice(48, 64))


@llama3_frequencies.case(points=3, hint="Between the two wavelengths, interpolate: s = (original_max_len "
                                        "/ wavelength − low_freq_factor) / (high_freq_factor − "
                                        "low_freq_factor) is 0 at the slow end and 1 at the fast end; the "
                                        "frequency is (1 − s) · f / factor + s · f. The wavelength is "
                                        "2π / f, not 1 / f.")
def the_band_between_is_interpolated(fn):
    _check_frequencies(fn, **_LLAMA_3P1)


@llama3_frequencies.case(points=2, hint="Use the arguments: Llama 3.2 scales by 32 with head_dim 64, and a "
                                        "small model may have its own original_max_len.")
def other_settings(fn):
    _check_frequencies(fn, head_dim=64, theta=500000.0, factor=32.0, low=1.0, high=4.0, original=8192)
    _check_frequencies(fn, head_dim=16, theta=10000.0, factor=4.0, low=1.0, high=4.0, original=64)


# ---------------------------------------------------------------- 18.output_projection

output_projection = Exercise("18.output_projection", "The output projection of a checkpoint, tied or not")


def _tensors(seed, vocab, d_model, *, lm_head: bool):
    tensors = {"model.embed_tokens.weight": _random(seed, (vocab, d_model))}
    if lm_head:
        tensors["lm_head.weight"] = _random(seed + 1, (vocab, d_model))
    return tensors


def _check_projection(fn, tensors, tied: bool, expected_from: str) -> None:
    expected = tensors[expected_from].T  # (d_model, vocab)
    what = (f"output_projection(tensors with {sorted(tensors)}, tie_word_embeddings={tied})")
    got = _expect_array(call_on_copies(fn, tensors, tied, what="output_projection"), expected.shape, what)
    expect_close(got, expected, rtol=0, atol=0, what=what)


@output_projection.case(points=3, hint="Untied, the head is lm_head.weight, (vocab, d_model) as nn.Linear "
                                       "stores it: transpose it to our kernel's (d_model, vocab).")
def an_untied_head_is_lm_head_transposed(fn):
    _check_projection(fn, _tensors(20, 40, 16, lm_head=True), False, "lm_head.weight")


@output_projection.case(points=3, hint="Tied, there is no lm_head.weight: the logits are x @ embedding.T, so "
                                       "the projection is the embedding table transposed.")
def a_tied_head_is_the_embedding_transposed(fn):
    _check_projection(fn, _tensors(22, 40, 16, lm_head=False), True, "model.embed_tokens.weight")


@output_projection.case(points=2, hint="tie_word_embeddings decides, not the file: a tied checkpoint may "
                                       "carry a stale lm_head.weight, which the model never uses.")
def a_tied_checkpoint_with_a_stale_lm_head_uses_the_embedding(fn):
    _check_projection(fn, _tensors(24, 40, 16, lm_head=True), True, "model.embed_tokens.weight")


@output_projection.case(points=2, hint="With vocab == d_model every layout has the right shape: only the "
                                       "values tell a missing transpose.")
def a_square_head(fn):
    _check_projection(fn, _tensors(26, 16, 16, lm_head=True), False, "lm_head.weight")
    _check_projection(fn, _tensors(28, 16, 16, lm_head=False), True, "model.embed_tokens.weight")
