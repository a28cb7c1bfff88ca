"""Chapter 18's exercise cases: right answers score full marks, planted wrong ones lose points."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from stacklib.grading import grade

# ---------------------------------------------------------------- right answers


def to_ours(name, weight):
    transposed = name.endswith("proj.weight") or name == "lm_head.weight"
    return weight.T if transposed else weight


def split_heads(weight, n_heads):
    d_model = weight.shape[1]
    return weight.T.reshape(d_model, n_heads, weight.shape[0] // n_heads)


def split_heads_first(weight, n_heads):  # a right answer written another way: split, then move d_model
    return weight.reshape(n_heads, -1, weight.shape[1]).transpose(2, 0, 1)  # (heads, head_dim, d) -> (d, ...)


def llama3_frequencies(head_dim, theta, factor, low_freq_factor, high_freq_factor, original_max_len):
    freq = theta ** (-np.arange(0, head_dim, 2) / head_dim)
    wavelength = 2 * math.pi / freq
    smooth = (original_max_len / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    between = (1 - smooth) * freq / factor + smooth * freq
    slow = wavelength > original_max_len / low_freq_factor
    fast = wavelength < original_max_len / high_freq_factor
    return np.where(fast, freq, np.where(slow, freq / factor, between))


def llama3_frequencies_loop(head_dim, theta, factor, low_freq_factor, high_freq_factor, original_max_len):
    out = []  # Meta's reference code, one pair at a time
    for i in range(head_dim // 2):
        f = 1.0 / theta ** (2 * i / head_dim)
        wavelength = 2 * math.pi / f
        if wavelength < original_max_len / high_freq_factor:
            out.append(f)
        elif wavelength > original_max_len / low_freq_factor:
            out.append(f / factor)
        else:
            s = (original_max_len / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append((1 - s) * f / factor + s * f)
    return np.array(out)


def llama3_frequencies_clipped(head_dim, theta, factor, low_freq_factor, high_freq_factor, original_max_len):
    freq = theta ** (-np.arange(0, head_dim, 2) / head_dim)  # one formula: s clipped to [0, 1] is the bands
    wavelength = 2 * math.pi / freq
    smooth = (original_max_len / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smooth = np.clip(smooth, 0.0, 1.0)
    return (1 - smooth) * freq / factor + smooth * freq


def output_projection(tensors, tie_word_embeddings):
    if tie_word_embeddings:
        return tensors["model.embed_tokens.weight"].T
    return tensors["lm_head.weight"].T


RIGHT = [("18.to_ours", to_ours), ("18.split_heads", split_heads), ("18.split_heads", split_heads_first),
         ("18.llama3_frequencies", llama3_frequencies), ("18.llama3_frequencies", llama3_frequencies_loop),
         ("18.llama3_frequencies", llama3_frequencies_clipped), ("18.output_projection", output_projection)]


@pytest.mark.parametrize("exercise_id, answer", RIGHT, ids=[f"{e}-{a.__name__}" for e, a in RIGHT])
def test_a_right_answer_scores_full_marks(exercise_id, answer):
    result = grade(exercise_id, answer)
    assert result.points == result.max_points, [c.message for c in result.cases]


# ---------------------------------------------------------------- planted wrong answers: 18.to_ours


def transposes_everything(name, weight):
    return weight.T


def transposes_nothing(name, weight):
    return weight


def reshapes_instead(name, weight):  # the right shape, the wrong order of values
    transposed = name.endswith("proj.weight") or name == "lm_head.weight"
    return weight.reshape(weight.shape[::-1]) if transposed else weight


def forgets_lm_head(name, weight):
    return weight.T if name.endswith("proj.weight") else weight


# ---------------------------------------------------------------- 18.split_heads


def heads_last(weight, n_heads):  # (d, head_dim, heads) read as (d, heads, head_dim): heads interleaved
    d_model, head_dim = weight.shape[1], weight.shape[0] // n_heads
    return weight.T.reshape(d_model, head_dim, n_heads).transpose(0, 2, 1)


def reshape_without_transpose(weight, n_heads):
    return weight.reshape(weight.shape[1], n_heads, weight.shape[0] // n_heads)


def head_dim_from_d_model(weight, n_heads):
    d_model = weight.shape[1]
    return weight.T[:, : d_model].reshape(d_model, n_heads, d_model // n_heads)


# ---------------------------------------------------------------- 18.llama3_frequencies


def _llama3(head_dim, theta, factor, low, high, original, *, two_pi=2 * math.pi, swap=False, invert=False,
            multiply=False, step=False):
    freq = theta ** (-np.arange(0, head_dim, 2) / head_dim)
    wavelength = two_pi / freq
    smooth = (original / wavelength - low) / (high - low)
    if invert:
        smooth = 1 - smooth
    scaled = freq * factor if multiply else freq / factor
    between = (1 - smooth) * scaled + smooth * freq
    if step:
        between = np.where(smooth < 0.5, scaled, freq)
    slow, fast = wavelength > original / low, wavelength < original / high
    if swap:
        slow, fast = fast, slow
    return np.where(fast, freq, np.where(slow, scaled, between))


def wavelength_without_two_pi(*args):
    return _llama3(*args, two_pi=1.0)


def scales_the_fast_pairs(*args):
    return _llama3(*args, swap=True)


def interpolation_inverted(*args):
    return _llama3(*args, invert=True)


def multiplies_by_the_factor(*args):
    return _llama3(*args, multiply=True)


def no_interpolation(*args):
    return _llama3(*args, step=True)


def unscaled(head_dim, theta, *rest):
    return theta ** (-np.arange(0, head_dim, 2) / head_dim)


# ---------------------------------------------------------------- 18.output_projection


def lm_head_when_present(tensors, tie_word_embeddings):
    return tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"]).T


def forgets_the_transpose(tensors, tie_word_embeddings):
    name = "model.embed_tokens.weight" if tie_word_embeddings else "lm_head.weight"
    return tensors[name].reshape(tensors[name].shape[::-1])


def always_the_embedding(tensors, tie_word_embeddings):
    return tensors["model.embed_tokens.weight"].T


# ---------------------------------------------------------------- fresh wrong answers: 18.to_ours

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_LISTED = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "down_proj", "lm_head")  # no o_proj


def _transposed(name):
    return name.endswith("proj.weight") or name == "lm_head.weight"


def swaps_axes_of_all_but_the_embedding(name, weight):
    return weight if "embed" in name else weight.swapaxes(0, 1)  # a norm's 1-D scale has no axis 1


def checks_the_name_without_its_suffix(name, weight):
    return weight.T if name.endswith("proj") or name == "lm_head.weight" else weight  # names end in .weight


def transposes_attention_only(name, weight):
    return weight.T if any(p in name for p in _ATTENTION) or name == "lm_head.weight" else weight


def lists_the_projections_but_o_proj(name, weight):
    return weight.T if any(p in name for p in _LISTED) else weight


def converts_to_float64(name, weight):
    return np.array(weight.T if _transposed(name) else weight, dtype=float)


def converts_to_bfloat16(name, weight):  # the Hub's checkpoints are bfloat16
    return jnp.asarray(weight.T if _transposed(name) else weight, dtype=jnp.bfloat16)


# ---------------------------------------------------------------- fresh wrong answers: 18.split_heads


def reverses_all_axes(weight, n_heads):  # (heads, head_dim, d).T is (d, head_dim, heads)
    return weight.reshape(n_heads, -1, weight.shape[1]).T


def head_dim_is_d_model_over_heads(weight, n_heads):
    d_model = weight.shape[1]
    return weight.T.reshape(d_model, n_heads, d_model // n_heads)


def permutes_to_rotate_half_again(weight, n_heads):  # Meta's interleaved -> rotate-half, on a Hub file
    head_dim, d_model = weight.shape[0] // n_heads, weight.shape[1]
    rows = weight.reshape(n_heads, head_dim // 2, 2, d_model).swapaxes(1, 2)  # (heads, 2, head_dim / 2, d)
    return rows.reshape(n_heads * head_dim, d_model).T.reshape(d_model, n_heads, head_dim)


def stacks_the_heads_last(weight, n_heads):
    return np.stack(np.split(weight.T, n_heads, axis=1), axis=-1)  # (d, head_dim, heads)


def transposes_each_head_then_reshapes(weight, n_heads):
    head_dim, d_model = weight.shape[0] // n_heads, weight.shape[1]
    per_head = weight.reshape(n_heads, head_dim, d_model).transpose(0, 2, 1)  # (heads, d, head_dim)
    return per_head.reshape(d_model, n_heads, head_dim)  # a reshape where a transpose belongs


def reshapes_the_weight_in_place(weight, n_heads):
    weight.shape = (n_heads, weight.shape[0] // n_heads, weight.shape[1])  # the caller's array changes
    return weight.transpose(2, 0, 1)


def folds_the_attention_scale_into_q(weight, n_heads):
    d_model, head_dim = weight.shape[1], weight.shape[0] // n_heads
    return weight.T.reshape(d_model, n_heads, head_dim) / math.sqrt(head_dim)


def split_heads_in_float64(weight, n_heads):
    return weight.T.reshape(weight.shape[1], n_heads, -1).astype(np.float64)


# ---------------------------------------------------------------- fresh wrong answers: 18.llama3_frequencies


def _bands(freq, factor, low, high, original, between):
    wavelength = 2 * math.pi / freq
    return np.where(wavelength < original / high, freq,
                    np.where(wavelength > original / low, freq / factor, between))


def hard_codes_the_original_length(head_dim, theta, factor, low, high, original):
    original = 8192  # Llama 3's pre-training length, not the argument
    freq = theta ** (-np.arange(0, head_dim, 2) / head_dim)
    smooth = (original * freq / (2 * math.pi) - low) / (high - low)
    return _bands(freq, factor, low, high, original, (1 - smooth) * freq / factor + smooth * freq)


def one_frequency_per_feature(head_dim, theta, factor, low, high, original):
    half = llama3_frequencies(head_dim, theta, factor, low, high, original)
    return np.concatenate([half, half])  # rotate-half's cos/sin layout, not the pairs' frequencies


def if_where_elif_belongs(head_dim, theta, factor, low, high, original):
    out = []
    for i in range(head_dim // 2):
        f = theta ** (-2 * i / head_dim)
        wavelength = 2 * math.pi / f
        if wavelength < original / high:
            out.append(f)
        if wavelength > original / low:  # a fast pair also falls to the else below
            out.append(f / factor)
        else:
            s = (original / wavelength - low) / (high - low)
            out.append((1 - s) * f / factor + s * f)
    return np.array(out)


def interpolates_the_wavelengths(head_dim, theta, factor, low, high, original):
    freq = theta ** (-np.arange(0, head_dim, 2) / head_dim)
    wavelength = 2 * math.pi / freq
    smooth = (original / wavelength - low) / (high - low)
    between = 2 * math.pi / ((1 - smooth) * wavelength * factor + smooth * wavelength)
    return _bands(freq, factor, low, high, original, between)


def band_edges_swapped(head_dim, theta, factor, low, high, original):
    freq = theta ** (-np.arange(0, head_dim, 2) / head_dim)
    wavelength = 2 * math.pi / freq
    smooth = (original / wavelength - low) / (high - low)
    between = (1 - smooth) * freq / factor + smooth * freq
    return np.where(wavelength < original / low, freq,  # low_freq_factor's edge taken as the fast one
                    np.where(wavelength > original / high, freq / factor, between))


def exponent_without_the_two(head_dim, theta, factor, low, high, original):
    freq = theta ** (-np.arange(head_dim // 2) / head_dim)  # i / head_dim, not 2i / head_dim
    smooth = (original * freq / (2 * math.pi) - low) / (high - low)
    return _bands(freq, factor, low, high, original, (1 - smooth) * freq / factor + smooth * freq)


# ---------------------------------------------------------------- fresh wrong answers: 18.output_projection

EMBEDDING, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"


def ties_by_writing_into_the_dict(tensors, tie_word_embeddings):
    if tie_word_embeddings:
        tensors[LM_HEAD] = tensors[EMBEDDING]  # as PyTorch's tie_weights() does, on the caller's dict
    return tensors[LM_HEAD].T


def pops_the_lm_head(tensors, tie_word_embeddings):
    head = tensors.pop(LM_HEAD, None)  # removes it from the caller's dict
    if tie_word_embeddings or head is None:
        head = tensors[EMBEDDING]
    return head.T


def lm_head_untransposed(tensors, tie_word_embeddings):
    return tensors[EMBEDDING].T if tie_word_embeddings else tensors[LM_HEAD]


def embedding_untransposed(tensors, tie_word_embeddings):
    return tensors[EMBEDDING] if tie_word_embeddings else tensors[LM_HEAD].T


def lm_head_under_model(tensors, tie_word_embeddings):
    return tensors[EMBEDDING].T if tie_word_embeddings else tensors["model.lm_head.weight"].T


def projection_in_float64(tensors, tie_word_embeddings):
    return np.asarray(tensors[EMBEDDING if tie_word_embeddings else LM_HEAD].T, dtype=np.float64)


def projection_in_bfloat16(tensors, tie_word_embeddings):
    return jnp.asarray(tensors[EMBEDDING if tie_word_embeddings else LM_HEAD].T, dtype=jnp.bfloat16)


# Fresh wrong answers a learner writes (issue 38).
FRESH = [
    ("18.to_ours", swaps_axes_of_all_but_the_embedding, 7, "swapaxes(0, 1) on the 1-D norm scales"),
    ("18.to_ours", checks_the_name_without_its_suffix, 5, "name.endswith('proj'): names end in .weight"),
    ("18.to_ours", transposes_attention_only, 5, "the MLP's projections left untransposed"),
    ("18.to_ours", lists_the_projections_but_o_proj, 5, "a list of projections without o_proj"),
    ("18.to_ours", converts_to_float64, 0, "to_ours returns float64"),
    ("18.to_ours", converts_to_bfloat16, 0, "to_ours returns bfloat16"),
    ("18.split_heads", reverses_all_axes, 0, ".T of (heads, head_dim, d) reverses all three axes"),
    ("18.split_heads", head_dim_is_d_model_over_heads, 4, "reshape to d_model // n_heads, raising"),
    ("18.split_heads", permutes_to_rotate_half_again, 0, "Meta's rotate-half permutation applied again"),
    ("18.split_heads", stacks_the_heads_last, 0, "np.split heads stacked on the last axis"),
    ("18.split_heads", transposes_each_head_then_reshapes, 1, "each head transposed, then a reshape"),
    ("18.split_heads", reshapes_the_weight_in_place, 0, "weight.shape assigned in place"),
    ("18.split_heads", folds_the_attention_scale_into_q, 0, "1 / sqrt(head_dim) folded into q"),
    ("18.split_heads", split_heads_in_float64, 0, "split_heads returns float64"),
    ("18.llama3_frequencies", hard_codes_the_original_length, 7, "original_max_len hard-coded to 8192"),
    ("18.llama3_frequencies", one_frequency_per_feature, 0, "head_dim frequencies, the half repeated"),
    ("18.llama3_frequencies", if_where_elif_belongs, 0, "if where elif belongs: fast pairs twice"),
    ("18.llama3_frequencies", interpolates_the_wavelengths, 4, "the wavelengths interpolated"),
    ("18.llama3_frequencies", band_edges_swapped, 4, "low and high band edges swapped"),
    ("18.llama3_frequencies", exponent_without_the_two, 0, "f_i = theta ** (-i / head_dim)"),
    ("18.output_projection", ties_by_writing_into_the_dict, 3, "ties by writing lm_head into the dict"),
    ("18.output_projection", pops_the_lm_head, 3, "pops lm_head from the caller's dict"),
    ("18.output_projection", lm_head_untransposed, 5, "lm_head untransposed"),
    ("18.output_projection", embedding_untransposed, 3, "the tied embedding untransposed"),
    ("18.output_projection", lm_head_under_model, 5, "model.lm_head.weight: no such name"),
    ("18.output_projection", projection_in_float64, 0, "output_projection returns float64"),
    ("18.output_projection", projection_in_bfloat16, 0, "output_projection returns bfloat16"),
]

# (exercise, planted wrong answer, points it keeps, why)
WRONG = [
    ("18.to_ours", transposes_everything, 6, "the embedding transposed too"),
    ("18.to_ours", transposes_nothing, 3, "nothing transposed"),
    ("18.to_ours", reshapes_instead, 3, "a reshape where a transpose belongs"),
    ("18.to_ours", forgets_lm_head, 6, "lm_head left untransposed"),
    ("18.split_heads", heads_last, 1, "heads as the faster-varying index"),
    ("18.split_heads", reshape_without_transpose, 0, "reshaped without the transpose"),
    ("18.split_heads", head_dim_from_d_model, 4, "head_dim = d_model / n_heads"),
    ("18.llama3_frequencies", wavelength_without_two_pi, 4, "wavelength 1 / f"),
    ("18.llama3_frequencies", scales_the_fast_pairs, 0, "the fast pairs scaled"),
    ("18.llama3_frequencies", interpolation_inverted, 4, "s and 1 − s swapped"),
    ("18.llama3_frequencies", multiplies_by_the_factor, 2, "multiplied by the factor"),
    ("18.llama3_frequencies", no_interpolation, 4, "a step instead of the interpolation"),
    ("18.llama3_frequencies", unscaled, 2, "no scaling at all"),
    ("18.output_projection", lm_head_when_present, 8, "the file's lm_head even when tied"),
    ("18.output_projection", forgets_the_transpose, 0, "no transpose"),
    ("18.output_projection", always_the_embedding, 5, "always the embedding"),
    *FRESH,
]


@pytest.mark.parametrize("exercise_id, answer, points, why", WRONG, ids=[w[3] for w in WRONG])
def test_a_planted_wrong_answer_loses_points(exercise_id, answer, points, why):
    result = grade(exercise_id, answer)
    assert result.points == points, [(c.name, c.status, c.message) for c in result.cases]
    assert result.points < result.max_points
