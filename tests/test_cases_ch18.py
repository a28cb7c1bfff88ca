"""Chapter 18's exercise cases: right answers score full marks, planted wrong ones lose points."""

import math

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


def output_projection(tensors, tie_word_embeddings):
    if tie_word_embeddings:
        return tensors["model.embed_tokens.weight"].T
    return tensors["lm_head.weight"].T


RIGHT = [("18.to_ours", to_ours), ("18.split_heads", split_heads), ("18.split_heads", split_heads_first),
         ("18.llama3_frequencies", llama3_frequencies), ("18.llama3_frequencies", llama3_frequencies_loop),
         ("18.output_projection", output_projection)]


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
]


@pytest.mark.parametrize("exercise_id, answer, points, why", WRONG, ids=[w[3] for w in WRONG])
def test_a_planted_wrong_answer_loses_points(exercise_id, answer, points, why):
    result = grade(exercise_id, answer)
    assert result.points == points, [(c.name, c.status, c.message) for c in result.cases]
    assert result.points < result.max_points
