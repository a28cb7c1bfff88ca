"""Chapter 13's exercise cases: right answers score full marks, planted wrong ones lose points."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stacklib.grading import grade


def completion_loss(logits, tokens, prompt_lengths, lengths):
    T = tokens.shape[1]
    positions = jnp.arange(T)[None, :]
    mask = (positions >= jnp.asarray(prompt_lengths)[:, None]) & (positions < jnp.asarray(lengths)[:, None])
    logp = jax.nn.log_softmax(jnp.asarray(logits)[:, :-1], axis=-1)
    picked = jnp.take_along_axis(logp, jnp.asarray(tokens)[:, 1:, None], axis=-1)[..., 0]
    target_mask = mask[:, 1:]
    return -(picked * target_mask).sum() / target_mask.sum()


def dpo_loss(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, beta, label_smoothing):
    chosen_ratio, rejected_ratio = chosen_logps - ref_chosen_logps, rejected_logps - ref_rejected_logps
    delta = chosen_ratio - rejected_ratio
    losses = -(jax.nn.log_sigmoid(beta * delta) * (1 - label_smoothing)
               + jax.nn.log_sigmoid(-beta * delta) * label_smoothing)
    chosen_rewards, rejected_rewards = beta * chosen_ratio, beta * rejected_ratio
    return losses.mean(), {
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/margin": (chosen_rewards - rejected_rewards).mean(),
        "rewards/accuracy": (chosen_rewards > rejected_rewards).mean(),
    }


def compute_advantages(rewards, num_generations):
    if num_generations < 2 or len(rewards) % num_generations:
        raise ValueError(f"num_generations={num_generations} must be >= 2 and divide {len(rewards)}")
    grouped = np.asarray(rewards).reshape(-1, num_generations)
    mean = grouped.mean(-1).repeat(num_generations)
    std = grouped.std(-1, ddof=1).repeat(num_generations)
    return (rewards - mean) / (std + 1e-6)


def _aggregate(per_token, mask, mode):
    if mode == "token-mean":
        return (per_token * mask).sum() / jnp.maximum(mask.sum(), 1)
    rows = mask.sum(-1)
    return ((per_token * mask).sum(-1) / jnp.maximum(rows, 1)).sum() / jnp.maximum((rows > 0).sum(), 1)


def policy_loss(logps, old_logps, advantages, mask, epsilon, loss_agg_mode):
    ratio = jnp.exp(logps - old_logps)
    adv = jnp.asarray(advantages)[:, None]
    per_token = jnp.maximum(-adv * ratio, -adv * jnp.clip(ratio, 1 - epsilon, 1 + epsilon))
    return _aggregate(per_token, mask, loss_agg_mode)


def kl_divergence(logps, ref_logps, method):
    if method == "kl":
        return logps - ref_logps
    if method == "mse_kl":
        return 0.5 * (logps - ref_logps) ** 2
    diff = ref_logps - logps
    return jnp.exp(diff) - diff - 1


RIGHT = {
    "13.completion_loss": completion_loss,
    "13.dpo_loss": dpo_loss,
    "13.group_advantages": compute_advantages,
    "13.clipped_objective": policy_loss,
    "13.kl_estimator": kl_divergence,
}


@pytest.mark.parametrize("exercise_id", sorted(RIGHT))
def test_a_right_answer_scores_full_marks(exercise_id):
    result = grade(exercise_id, RIGHT[exercise_id])
    assert result.points == result.max_points, [c.message for c in result.cases]


# Planted wrong answers.

def loss_with_prompt(logits, tokens, prompt_lengths, lengths):  # trains on the question too
    return completion_loss(logits, tokens, np.ones_like(prompt_lengths), lengths)


def loss_without_shift(logits, tokens, prompt_lengths, lengths):  # logits at t scored against token t
    rolled = jnp.concatenate([logits[:, 1:], logits[:, :1]], axis=1)
    return completion_loss(rolled, tokens, prompt_lengths, lengths)


def loss_with_padding(logits, tokens, prompt_lengths, lengths):  # ignores the lengths
    return completion_loss(logits, tokens, prompt_lengths, np.full_like(lengths, tokens.shape[1]))


def loss_mean_of_means(logits, tokens, prompt_lengths, lengths):  # each sequence weighs the same
    rows = [slice(b, b + 1) for b in range(len(tokens))]
    per_sequence = [completion_loss(logits[r], tokens[r], prompt_lengths[r], lengths[r]) for r in rows]
    return jnp.mean(jnp.stack(per_sequence))


def _loss_with_mask(logits, tokens, target_mask):
    logp = jax.nn.log_softmax(jnp.asarray(logits)[:, :-1], axis=-1)
    picked = jnp.take_along_axis(logp, jnp.asarray(tokens)[:, 1:, None], axis=-1)[..., 0]
    return -(picked * target_mask).sum() / target_mask.sum()


def _answer_mask(tokens, first, end):  # True at positions first <= t < end of each row
    positions = jnp.arange(tokens.shape[1])[None, :]
    return (positions >= jnp.asarray(first)[:, None]) & (positions < jnp.asarray(end)[:, None])


def loss_without_the_first_answer_token(logits, tokens, prompt_lengths, lengths):  # t > prompt_length
    return _loss_with_mask(logits, tokens, _answer_mask(tokens, prompt_lengths + 1, lengths)[:, 1:])


def loss_without_the_last_answer_token(logits, tokens, prompt_lengths, lengths):  # t < length - 1
    return _loss_with_mask(logits, tokens, _answer_mask(tokens, prompt_lengths, lengths - 1)[:, 1:])


def loss_mask_not_shifted(logits, tokens, prompt_lengths, lengths):  # mask[:, :-1]: one position early
    return _loss_with_mask(logits, tokens, _answer_mask(tokens, prompt_lengths, lengths)[:, :-1])


def loss_over_every_position(logits, tokens, prompt_lengths, lengths):  # divides by B * (T - 1)
    target_mask = _answer_mask(tokens, prompt_lengths, lengths)[:, 1:]
    return completion_loss(logits, tokens, prompt_lengths, lengths) * target_mask.sum() / target_mask.size


def loss_padding_from_token_zero(logits, tokens, prompt_lengths, lengths):  # tokens != 0, not the lengths
    positions = jnp.arange(tokens.shape[1])[None, :]
    mask = (positions >= jnp.asarray(prompt_lengths)[:, None]) & (jnp.asarray(tokens) != 0)
    return _loss_with_mask(logits, tokens, mask[:, 1:])


def loss_fixed_prompt_length(logits, tokens, prompt_lengths, lengths):  # row 0's prompt length for all
    return completion_loss(logits, tokens, np.full_like(prompt_lengths, prompt_lengths[0]), lengths)


def dpo_without_reference(chosen, rejected, ref_chosen, ref_rejected, beta, label_smoothing):
    return dpo_loss(chosen, rejected, 0 * ref_chosen, 0 * ref_rejected, beta, label_smoothing)


def dpo_smoothing_swapped(chosen, rejected, ref_chosen, ref_rejected, beta, label_smoothing):
    return dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta, 1 - label_smoothing
                    if label_smoothing else 0.0)


def dpo_without_beta(chosen, rejected, ref_chosen, ref_rejected, beta, label_smoothing):  # beta 1 in the loss
    loss, _ = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, 1.0, label_smoothing)
    return loss, dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta, label_smoothing)[1]


def dpo_ties_win(chosen, rejected, ref_chosen, ref_rejected, beta, label_smoothing):
    loss, metrics = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta, label_smoothing)
    metrics["rewards/accuracy"] = ((chosen - ref_chosen) >= (rejected - ref_rejected)).mean()
    return loss, metrics


def dpo_ignores_smoothing(chosen, rejected, ref_chosen, ref_rejected, beta, label_smoothing):
    return dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta, 0.0)


def dpo_smoothing_sign(chosen, rejected, ref_chosen, ref_rejected, beta, label_smoothing):  # + e log s(-bd)
    delta = (chosen - ref_chosen) - (rejected - ref_rejected)
    losses = -(1 - label_smoothing) * jax.nn.log_sigmoid(beta * delta) + label_smoothing * jax.nn.log_sigmoid(
        -beta * delta)
    return losses.mean(), dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta, label_smoothing)[1]


def dpo_fixed_beta(chosen, rejected, ref_chosen, ref_rejected, beta, label_smoothing):  # tunix's 0.1 default
    return dpo_loss(chosen, rejected, ref_chosen, ref_rejected, 0.1, label_smoothing)


def dpo_rewards_without_beta(chosen, rejected, ref_chosen, ref_rejected, beta, label_smoothing):
    loss, _ = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta, label_smoothing)
    return loss, dpo_loss(chosen, rejected, ref_chosen, ref_rejected, 1.0, label_smoothing)[1]


def dpo_accuracy_of_the_mean(chosen, rejected, ref_chosen, ref_rejected, beta, label_smoothing):
    loss, metrics = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta, label_smoothing)
    metrics["rewards/accuracy"] = (metrics["rewards/margin"] > 0).astype(jnp.float32)  # one verdict
    return loss, metrics


def advantages_population_std(rewards, num_generations):  # ddof=0
    compute_advantages(rewards, num_generations)  # the same checks
    grouped = np.asarray(rewards).reshape(-1, num_generations)
    std = grouped.std(-1).repeat(num_generations)
    return (rewards - grouped.mean(-1).repeat(num_generations)) / (std + 1e-6)


def advantages_over_the_batch(rewards, num_generations):  # one baseline for every prompt
    compute_advantages(rewards, num_generations)
    return (rewards - rewards.mean()) / (rewards.std(ddof=1) + 1e-6)


def advantages_unchecked(rewards, num_generations):  # a group of one: NaN, silently
    whole = len(rewards) % num_generations == 0
    grouped = np.asarray(rewards).reshape(-1, num_generations) if whole else np.asarray(rewards)[None]
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # numpy: "Degrees of freedom <= 0"
        std = grouped.std(-1, ddof=1).repeat(grouped.shape[1])
        return (rewards - grouped.mean(-1).repeat(grouped.shape[1])) / (std + 1e-6)


def advantages_guarded_without_epsilon(rewards, num_generations):  # 0 where std is 0, else no + 1e-6
    compute_advantages(rewards, num_generations)
    grouped = np.asarray(rewards, np.float64).reshape(-1, num_generations)
    deviation = (grouped - grouped.mean(-1, keepdims=True)).ravel()
    std = grouped.std(-1, ddof=1).repeat(num_generations)
    return np.where(std == 0, 0.0, deviation / np.where(std == 0, 1.0, std))


def advantages_epsilon_as_a_floor(rewards, num_generations):  # max(std, 1e-6) instead of std + 1e-6
    compute_advantages(rewards, num_generations)
    grouped = np.asarray(rewards, np.float64).reshape(-1, num_generations)
    deviation = (grouped - grouped.mean(-1, keepdims=True)).ravel()
    return deviation / np.maximum(grouped.std(-1, ddof=1).repeat(num_generations), 1e-6)


def advantages_interleaved_groups(rewards, num_generations):  # completion i of every prompt side by side
    compute_advantages(rewards, num_generations)
    columns = np.asarray(rewards).reshape(num_generations, -1)  # (G, prompts): the wrong grouping
    return ((columns - columns.mean(0)) / (columns.std(0, ddof=1) + 1e-6)).ravel()


def advantages_whole_groups_only(rewards, num_generations):  # a ragged tail is dropped, not refused
    if num_generations < 2:
        raise ValueError(f"num_generations={num_generations} must be at least 2")
    whole = len(rewards) // num_generations * num_generations
    return compute_advantages(np.asarray(rewards)[:whole], num_generations)


def advantages_refuses_one_only(rewards, num_generations):  # num_generations == 1 refused, 0 divides by zero
    if num_generations == 1:
        raise ValueError("num_generations=1: nothing to compare with")
    if len(rewards) % num_generations:
        raise ValueError(f"{len(rewards)} rewards do not split into groups of {num_generations}")
    return compute_advantages(rewards, num_generations)


def advantages_in_place(rewards, num_generations):
    rewards[:] = compute_advantages(rewards, num_generations)
    return rewards


def policy_optimistic(logps, old_logps, advantages, mask, epsilon, loss_agg_mode):  # min, not max
    ratio = jnp.exp(logps - old_logps)
    adv = jnp.asarray(advantages)[:, None]
    per_token = jnp.minimum(-adv * ratio, -adv * jnp.clip(ratio, 1 - epsilon, 1 + epsilon))
    return _aggregate(per_token, mask, loss_agg_mode)


def policy_unclipped(logps, old_logps, advantages, mask, epsilon, loss_agg_mode):  # plain policy gradient
    return policy_loss(logps, old_logps, advantages, mask, 1e9, loss_agg_mode)


def policy_always_token_mean(logps, old_logps, advantages, mask, epsilon, loss_agg_mode):
    return policy_loss(logps, old_logps, advantages, mask, epsilon, "token-mean")


def policy_mean_over_every_completion(logps, old_logps, advantages, mask, epsilon, loss_agg_mode):
    if loss_agg_mode == "token-mean":
        return policy_loss(logps, old_logps, advantages, mask, epsilon, loss_agg_mode)
    ratio = jnp.exp(logps - old_logps)
    adv = jnp.asarray(advantages)[:, None]
    per_token = jnp.maximum(-adv * ratio, -adv * jnp.clip(ratio, 1 - epsilon, 1 + epsilon))
    return ((per_token * mask).sum(-1) / jnp.maximum(mask.sum(-1), 1)).mean()  # empty ones count as 0


def policy_nan_for_an_empty_completion(logps, old_logps, advantages, mask, epsilon, loss_agg_mode):
    if loss_agg_mode == "token-mean":
        return policy_loss(logps, old_logps, advantages, mask, epsilon, loss_agg_mode)
    ratio = jnp.exp(logps - old_logps)
    adv = jnp.asarray(advantages)[:, None]
    per_token = jnp.maximum(-adv * ratio, -adv * jnp.clip(ratio, 1 - epsilon, 1 + epsilon))
    rows = mask.sum(-1)
    return ((per_token * mask).sum(-1) / rows).sum() / (rows > 0).sum()  # 0 / 0 for an empty row


def policy_unguarded_token_mean(logps, old_logps, advantages, mask, epsilon, loss_agg_mode):  # 0 / 0 if empty
    if loss_agg_mode != "token-mean":
        return policy_loss(logps, old_logps, advantages, mask, epsilon, loss_agg_mode)
    ratio = jnp.exp(logps - old_logps)
    adv = jnp.asarray(advantages)[:, None]
    per_token = jnp.maximum(-adv * ratio, -adv * jnp.clip(ratio, 1 - epsilon, 1 + epsilon))
    return (per_token * mask).sum() / mask.sum()


def policy_fixed_epsilon(logps, old_logps, advantages, mask, epsilon, loss_agg_mode):  # 0.2, not the argument
    return policy_loss(logps, old_logps, advantages, mask, 0.2, loss_agg_mode)


def policy_rows_over_t(logps, old_logps, advantages, mask, epsilon, loss_agg_mode):  # row sums / T
    if loss_agg_mode == "token-mean":
        return policy_loss(logps, old_logps, advantages, mask, epsilon, loss_agg_mode)
    ratio = jnp.exp(logps - old_logps)
    adv = jnp.asarray(advantages)[:, None]
    per_token = jnp.maximum(-adv * ratio, -adv * jnp.clip(ratio, 1 - epsilon, 1 + epsilon))
    return (per_token * mask).mean(-1).mean()


def policy_token_mean_over_every_position(logps, old_logps, advantages, mask, epsilon, loss_agg_mode):
    if loss_agg_mode != "token-mean":
        return policy_loss(logps, old_logps, advantages, mask, epsilon, loss_agg_mode)
    return policy_loss(logps, old_logps, advantages, mask, epsilon, loss_agg_mode) * mask.sum() / mask.size


def kl_k1_reversed(logps, ref_logps, method):
    sign = -1 if method == "kl" else 1
    return sign * kl_divergence(logps, ref_logps, method)


def kl_k2_without_half(logps, ref_logps, method):
    return (logps - ref_logps) ** 2 if method == "mse_kl" else kl_divergence(logps, ref_logps, method)


def kl_k3_reversed(logps, ref_logps, method):  # estimates KL(reference || policy) instead
    return kl_divergence(ref_logps, logps, method) if method == "low_var_kl" else kl_divergence(
        logps, ref_logps, method)


def kl_k1_absolute(logps, ref_logps, method):  # |k1|: "a KL is never negative"
    return jnp.abs(kl_divergence(logps, ref_logps, method)) if method == "kl" else kl_divergence(
        logps, ref_logps, method)


def kl_k3_without_one(logps, ref_logps, method):  # e^d - d
    return kl_divergence(logps, ref_logps, method) + (method == "low_var_kl")


def kl_mean_over_tokens(logps, ref_logps, method):  # one number instead of one per token
    return kl_divergence(logps, ref_logps, method).mean()


def kl_matches_a_substring(logps, ref_logps, method):  # "kl" in method: every method is k1
    return kl_divergence(logps, ref_logps, "kl" if "kl" in method else method)


# Fresh wrong answers (issue 38).

def loss_sum_not_mean(logits, tokens, prompt_lengths, lengths):  # summed over the answer tokens
    T = tokens.shape[1]
    positions = jnp.arange(T)[None, :]
    mask = (positions >= jnp.asarray(prompt_lengths)[:, None]) & (positions < jnp.asarray(lengths)[:, None])
    logp = jax.nn.log_softmax(jnp.asarray(logits)[:, :-1], axis=-1)
    picked = jnp.take_along_axis(logp, jnp.asarray(tokens)[:, 1:, None], axis=-1)[..., 0]
    return -(picked * mask[:, 1:]).sum()


def dpo_accuracy_with_ties_half(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, beta,
                                label_smoothing):
    loss, metrics = dpo_loss(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, beta,
                             label_smoothing)
    chosen = beta * (chosen_logps - ref_chosen_logps)
    rejected = beta * (rejected_logps - ref_rejected_logps)
    accuracy = ((chosen > rejected) + 0.5 * (chosen == rejected)).mean()
    return loss, dict(metrics, **{"rewards/accuracy": accuracy})


def advantages_without_epsilon(rewards, num_generations):  # std alone: inf/NaN where a group is flat
    if num_generations < 2 or len(rewards) % num_generations:
        raise ValueError("bad group")
    grouped = np.asarray(rewards, np.float64).reshape(-1, num_generations)
    with np.errstate(divide="ignore", invalid="ignore"):
        return ((grouped - grouped.mean(-1, keepdims=True)) / grouped.std(-1, ddof=1, keepdims=True)).ravel()


def policy_ratio_of_probabilities_clipped_at_advantage_sign(logps, old_logps, advantages, mask, epsilon,
                                                             loss_agg_mode):  # clips only positive advantages
    ratio = jnp.exp(logps - old_logps)
    adv = jnp.asarray(advantages)[:, None]
    clipped = jnp.where(adv > 0, jnp.clip(ratio, 1 - epsilon, 1 + epsilon), ratio)
    return _aggregate(jnp.maximum(-adv * ratio, -adv * clipped), mask, loss_agg_mode)


def kl_k3_of_log_space(logps, ref_logps, method):  # k3 with the ratio's log where the ratio belongs
    if method == "low_var_kl":
        diff = ref_logps - logps
        return diff ** 2 / 2
    return kl_divergence(logps, ref_logps, method)


def kl_k2_half_inside_the_square(logps, ref_logps, method):  # (0.5 * d) ** 2: a quarter, not a half
    if method == "mse_kl":
        return (0.5 * (ref_logps - logps)) ** 2
    return kl_divergence(logps, ref_logps, method)


def kl_summed_over_tokens(logps, ref_logps, method):  # one KL per sequence, not one per token
    return kl_divergence(logps, ref_logps, method).sum(axis=-1)


def kl_in_numpy(logps, ref_logps, method):  # right values, but NumPy cannot be differentiated
    d = np.asarray(ref_logps) - np.asarray(logps)
    if method == "kl":
        return -d
    if method == "mse_kl":
        return 0.5 * d**2
    return np.exp(d) - d - 1


def kl_k3_ratio_inverted(logps, ref_logps, method):  # e^(-d) - d - 1: the ratio and its log disagree
    if method == "low_var_kl":
        d = ref_logps - logps
        return jnp.exp(-d) - d - 1
    return kl_divergence(logps, ref_logps, method)


# Fresh wrong answers a learner writes (issue 38).
FRESH = [
    ("13.kl_estimator", kl_k2_half_inside_the_square, 3, "k2 as (d / 2)²"),
    ("13.kl_estimator", kl_summed_over_tokens, 0, "summed over each sequence's tokens"),
    ("13.kl_estimator", kl_in_numpy, 2, "NumPy: k3 cannot be differentiated"),
    ("13.kl_estimator", kl_k3_ratio_inverted, 2, "k3 with e^(-d)"),
]


# (exercise, planted wrong answer, points it should still get, why)
WRONG = [
    ("13.completion_loss", loss_with_prompt, 1, "prompt tokens in the loss"),
    ("13.completion_loss", loss_without_shift, 0, "logits at t scored against token t"),
    ("13.completion_loss", loss_with_padding, 0, "padding after the end in the loss"),
    ("13.completion_loss", loss_mean_of_means, 2, "a mean of per-sequence means"),
    ("13.completion_loss", loss_without_the_first_answer_token, 2, "the first answer token left out"),
    ("13.completion_loss", loss_without_the_last_answer_token, 2, "the last answer token left out"),
    ("13.completion_loss", loss_mask_not_shifted, 0, "the mask not shifted with the targets"),
    ("13.completion_loss", loss_over_every_position, 2, "divides by every position"),
    ("13.completion_loss", loss_fixed_prompt_length, 1, "row 0's prompt length for every row"),
    ("13.completion_loss", loss_padding_from_token_zero, 6, "padding found as token 0, not from lengths"),
    ("13.dpo_loss", dpo_without_reference, 0, "no reference model"),
    ("13.dpo_loss", dpo_smoothing_swapped, 4, "label smoothing on the wrong term"),
    ("13.dpo_loss", dpo_without_beta, 2, "beta left out of the loss"),
    ("13.dpo_loss", dpo_ties_win, 4, "a tie counts as a win"),
    ("13.dpo_loss", dpo_ignores_smoothing, 4, "label_smoothing ignored"),
    ("13.dpo_loss", dpo_smoothing_sign, 4, "label smoothing's term added with the wrong sign"),
    ("13.dpo_loss", dpo_fixed_beta, 2, "beta fixed at 0.1"),
    ("13.dpo_loss", dpo_rewards_without_beta, 4, "rewards without beta"),
    ("13.dpo_loss", dpo_accuracy_of_the_mean, 4, "accuracy of the mean margin"),
    ("13.group_advantages", advantages_population_std, 2, "population std (ddof=0)"),
    ("13.group_advantages", advantages_over_the_batch, 2, "one baseline for the whole batch"),
    ("13.group_advantages", advantages_unchecked, 4, "a group of one is not refused"),
    ("13.group_advantages", advantages_guarded_without_epsilon, 5, "no + 1e-6, 0 where std is 0"),
    ("13.group_advantages", advantages_epsilon_as_a_floor, 5, "max(std, 1e-6)"),
    ("13.group_advantages", advantages_interleaved_groups, 2, "groups taken across prompts"),
    ("13.group_advantages", advantages_whole_groups_only, 5, "a ragged tail dropped, not refused"),
    ("13.group_advantages", advantages_refuses_one_only, 5, "num_generations=0 not refused"),
    ("13.group_advantages", advantages_in_place, 2, "overwrites the caller's rewards"),
    ("13.clipped_objective", policy_optimistic, 1, "min of the two losses, not max"),
    ("13.clipped_objective", policy_unclipped, 1, "no clipping"),
    ("13.clipped_objective", policy_always_token_mean, 4, "ignores loss_agg_mode"),
    ("13.clipped_objective", policy_mean_over_every_completion, 8, "empty completions averaged in"),
    ("13.clipped_objective", policy_nan_for_an_empty_completion, 8, "NaN for an empty completion"),
    ("13.clipped_objective", policy_fixed_epsilon, 8, "epsilon fixed at 0.2"),
    ("13.clipped_objective", policy_unguarded_token_mean, 8, "token-mean of an empty batch is NaN"),
    ("13.clipped_objective", policy_rows_over_t, 4, "each completion divided by T"),
    ("13.clipped_objective", policy_token_mean_over_every_position, 6, "token-mean over padding too"),
    ("13.kl_estimator", kl_k1_reversed, 3, "k1 with the sign reversed"),
    ("13.kl_estimator", kl_k2_without_half, 3, "k2 without the 1/2"),
    ("13.kl_estimator", kl_k3_reversed, 2, "k3 of KL(reference || policy)"),
    ("13.kl_estimator", kl_k1_absolute, 3, "k1 made non-negative"),
    ("13.kl_estimator", kl_k3_without_one, 2, "k3 without the - 1"),
    ("13.kl_estimator", kl_mean_over_tokens, 0, "one number, not one per token"),
    ("13.kl_estimator", kl_matches_a_substring, 1, "every method matched as 'kl'"),
    ("13.completion_loss", loss_sum_not_mean, 2, "summed, not averaged"),
    ("13.dpo_loss", dpo_accuracy_with_ties_half, 4, "a tie counts half"),
    ("13.group_advantages", advantages_without_epsilon, 4, "no + 1e-6: NaN for a flat group"),
    ("13.clipped_objective", policy_ratio_of_probabilities_clipped_at_advantage_sign, 5,
     "clips only where the advantage is positive"),
    ("13.kl_estimator", kl_k3_of_log_space, 2, "k3 as d² / 2"),
    *FRESH,
]


@pytest.mark.parametrize("exercise_id, answer, points, why", WRONG, ids=[w[3] for w in WRONG])
def test_a_planted_wrong_answer_loses_points(exercise_id, answer, points, why):
    result = grade(exercise_id, answer)
    assert result.points == points, [(c.name, c.status, c.points, c.message) for c in result.cases]
    assert result.points < result.max_points
