"""Chapter 13 exercises: the pure functions of post-training, each a few lines of arrays.

The prompt/completion loss mask of SFT, the DPO loss and its metrics, GRPO's
group-relative advantages, the clipped policy objective, and the per-token KL estimators.
Every expected answer comes from `stacklib.align` (which matches tunix's functions, see
tests/test_align_parity.py) and is computed before the learner's code runs; arrays are
handed over as copies (`call_on_copies`). Small arrays only: each case runs in well under
a second.
"""

import jax
import jax.numpy as jnp
import numpy as np

from stacklib.align.common import compute_kl_divergence
from stacklib.align.dpo_trainer import dpo_loss_fn
from stacklib.align.grpo_learner import GRPOConfig, compute_advantages, grpo_policy_loss
from stacklib.align.peft_trainer import next_token_loss
from stacklib.grading import Exercise, call_on_copies, expect, expect_close

# The references are stacklib.align's own functions; each equals tunix 0.1.7's on the same
# inputs (tests/test_align_parity.py).


def _random(seed: int, shape, scale: float = 1.0) -> np.ndarray:
    return scale * np.asarray(jax.random.normal(jax.random.key(seed), shape), np.float32)


def _reference_completion_loss(logits, tokens, prompt_lengths, lengths):
    T = tokens.shape[1]
    positions = np.arange(T)[None, :]  # (1, T)
    mask = (positions >= np.asarray(prompt_lengths)[:, None]) & (positions < np.asarray(lengths)[:, None])
    return float(next_token_loss(lambda _: jnp.asarray(logits), jnp.asarray(tokens), jnp.asarray(mask)))


def _reference_dpo(chosen, rejected, ref_chosen, ref_rejected, beta, label_smoothing):
    loss, metrics = dpo_loss_fn(chosen, rejected, ref_chosen, ref_rejected, beta, label_smoothing)
    return float(loss), {k: float(metrics[k]) for k in _DPO_METRICS}


def _reference_advantages(rewards, num_generations):
    return np.asarray(compute_advantages(np.asarray(rewards, np.float64), num_generations))


def _reference_policy_loss(logps, old_logps, advantages, mask, epsilon, loss_agg_mode):
    config = GRPOConfig(num_generations=2, epsilon=epsilon, beta=0.0, loss_agg_mode=loss_agg_mode)
    loss, _ = grpo_policy_loss(jnp.asarray(logps), jnp.asarray(old_logps), None, jnp.asarray(advantages),
                               jnp.asarray(mask), config)
    return float(loss)


def _reference_kl(logps, ref_logps, method):
    return np.asarray(compute_kl_divergence(jnp.asarray(logps), jnp.asarray(ref_logps), method), np.float64)


# ---------------------------------------------------------------- 13.completion_loss

completion_loss = Exercise("13.completion_loss", "The SFT loss on completion tokens only")


def _check_completion_loss(loss_fn, logits, tokens, prompt_lengths, lengths, what):
    expected = _reference_completion_loss(logits, tokens, prompt_lengths, lengths)
    got = call_on_copies(loss_fn, logits, tokens, prompt_lengths, lengths, what="completion_loss")
    expect(np.ndim(got) == 0, f"{what}: expected one number (the mean over completion tokens), "
                              f"got shape {np.shape(got)}")
    expect_close(float(got), expected, rtol=1e-5, atol=1e-6, what=what)


def _padded_batch(seed):
    """Three sequences of different prompt and completion lengths, padded with 0 to T = 9."""
    tokens = np.array(jax.random.randint(jax.random.key(seed), (3, 9), 1, 12), np.int32)
    prompt_lengths, lengths = np.array([3, 5, 2], np.int32), np.array([6, 9, 4], np.int32)
    tokens[np.arange(9)[None, :] >= lengths[:, None]] = 0  # padding
    return tokens, prompt_lengths, lengths


@completion_loss.case(points=2, hint="The loss of a padded batch differs. Check which logits score each "
                                     "target (the exercise says which position predicts which), which "
                                     "positions are answer targets, and what the mean is taken over. See "
                                     "'Supervised fine-tuning'.")
def matches_the_reference_on_a_padded_batch(loss_fn):
    tokens, prompt_lengths, lengths = _padded_batch(0)
    _check_completion_loss(loss_fn, _random(1, (3, 9, 12)), tokens, prompt_lengths, lengths,
                           "the loss of three padded sequences")


@completion_loss.case(hint="A model sure of every answer token should cost nothing, however badly it "
                           "predicts the prompt: check which positions your loss counts, and which logits "
                           "score them.")
def a_perfect_answer_costs_nothing(loss_fn):
    tokens, prompt_lengths, lengths = _padded_batch(2)
    logits = _random(3, (3, 9, 12))
    for b in range(3):
        for p in range(prompt_lengths[b], lengths[b]):  # logits at p - 1 predict the completion token at p
            logits[b, p - 1, tokens[b, p]] = 60.0
    _check_completion_loss(loss_fn, logits, tokens, prompt_lengths, lengths,
                           "the loss of a model that is sure of every completion token")


@completion_loss.case(hint="What the model predicts after a sequence's last real token changed your loss: "
                           "padding is not part of the answer, and only `lengths` says where it starts "
                           "(the pad token here is not 0).")
def padding_does_not_count(loss_fn):
    tokens, prompt_lengths, lengths = _padded_batch(4)
    tokens[np.arange(9)[None, :] >= lengths[:, None]] = 3  # a pad token that also occurs in the answers
    logits = _random(5, (3, 9, 12))
    noisy = logits.copy()
    noisy[np.arange(9)[None, :] >= lengths[:, None] - 1] += _random(6, (3, 9, 12), 5.0)[
        np.arange(9)[None, :] >= lengths[:, None] - 1]
    clean = float(call_on_copies(loss_fn, logits, tokens, prompt_lengths, lengths, what="completion_loss"))
    padded = float(call_on_copies(loss_fn, noisy, tokens, prompt_lengths, lengths, what="completion_loss"))
    expect(abs(clean - padded) <= 1e-5 * max(1.0, abs(clean)),
           f"changing the logits after the last real token changed the loss from {clean:.6f} to {padded:.6f}")


@completion_loss.case(points=2, hint="The model is sure of every answer token except the first and the last "
                                     "of each answer, and your loss differs: check that both ends of the "
                                     "answer count, the first answer token included (it sits at position "
                                     "prompt_length).")
def the_first_and_the_last_answer_token_count(loss_fn):
    tokens, prompt_lengths, lengths = _padded_batch(8)
    logits = _random(9, (3, 9, 12))
    for b in range(3):
        for p in range(prompt_lengths[b] + 1, lengths[b] - 1):  # the answer's inner tokens only
            logits[b, p - 1, tokens[b, p]] = 60.0
    _check_completion_loss(loss_fn, logits, tokens, prompt_lengths, lengths,
                           "the loss when only the first and last answer tokens are uncertain")


@completion_loss.case(hint="Answers of 1, 6 and 0 tokens: every answer token of the batch weighs the same, "
                           "and an empty answer adds nothing (no NaN). The exercise's formula is one mean "
                           "over the tokens of the batch.")
def every_answer_token_weighs_the_same(loss_fn):
    tokens = np.array(jax.random.randint(jax.random.key(12), (3, 9), 1, 12), np.int32)
    prompt_lengths, lengths = np.array([4, 2, 5], np.int32), np.array([5, 8, 5], np.int32)  # the last: empty
    tokens[np.arange(9)[None, :] >= lengths[:, None]] = 0
    _check_completion_loss(loss_fn, _random(13, (3, 9, 12)), tokens, prompt_lengths, lengths,
                           "the loss of answers of 1, 6 and 0 tokens")


# ---------------------------------------------------------------- 13.dpo_loss

dpo_loss = Exercise("13.dpo_loss", "The DPO loss and its reward metrics")

_DPO_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy")


def _dpo_inputs(seed):
    chosen, rejected = _random(seed, (6,), 3.0) - 10.0, _random(seed + 1, (6,), 3.0) - 12.0
    ref_chosen, ref_rejected = _random(seed + 2, (6,), 3.0) - 10.0, _random(seed + 3, (6,), 3.0) - 12.0
    return chosen, rejected, ref_chosen, ref_rejected


def _check_dpo(dpo_fn, inputs, beta, label_smoothing, what, check_metrics):
    expected_loss, expected_metrics = _reference_dpo(*map(jnp.asarray, inputs), beta, label_smoothing)
    got = call_on_copies(dpo_fn, *inputs, beta, label_smoothing, what="dpo_loss")
    expect(isinstance(got, tuple) and len(got) == 2, f"expected (loss, metrics), got {type(got).__name__}")
    loss, metrics = got
    if not check_metrics:
        expect_close(float(loss), expected_loss, rtol=1e-5, atol=1e-6, what=f"the loss, {what}")
    else:
        expect(isinstance(metrics, dict), f"the metrics: expected a dict, got {type(metrics).__name__}")
        missing = [k for k in _DPO_METRICS if k not in metrics]
        expect(not missing, f"the metrics have no {missing}")
        expect_close({k: float(metrics[k]) for k in _DPO_METRICS}, expected_metrics, rtol=1e-5, atol=1e-6,
                     what=f"the metrics, {what}")


@dpo_loss.case(points=2, hint="The loss without label smoothing differs: check that each answer's "
                              "log-probability is taken relative to the reference's, and where beta "
                              "goes. See 'DPO: learning from pairs'.")
def the_loss_matches_the_reference(dpo_fn):
    _check_dpo(dpo_fn, _dpo_inputs(0), 0.1, 0.0, "beta 0.1", check_metrics=False)


@dpo_loss.case(points=2, hint="With label_smoothing > 0 the loss differs: a share label_smoothing of the "
                              "pairs is assumed to have its labels swapped. Check the weight and the sign "
                              "of each of the two terms in the exercise's formula.")
def label_smoothing_mixes_in_the_flipped_label(dpo_fn):
    _check_dpo(dpo_fn, _dpo_inputs(10), 0.5, 0.2, "beta 0.5, label smoothing 0.2", check_metrics=False)
    _check_dpo(dpo_fn, _dpo_inputs(30), 0.1, 0.4, "beta 0.1, label smoothing 0.4", check_metrics=False)


@dpo_loss.case(points=2, hint="The metrics differ: check that the implicit rewards include beta, and that "
                              "the accuracy is a share of pairs, where a pair whose two rewards tie is not "
                              "a win. The exercise defines each key.")
def the_metrics_match_the_reference(dpo_fn):
    chosen, rejected, ref_chosen, ref_rejected = _dpo_inputs(20)
    chosen[0], ref_chosen[0], rejected[0], ref_rejected[0] = -5.0, -5.0, -7.0, -7.0  # a tie: both rewards 0
    _check_dpo(dpo_fn, (chosen, rejected, ref_chosen, ref_rejected), 0.25, 0.0, "beta 0.25, one tie",
               check_metrics=True)


# ---------------------------------------------------------------- 13.group_advantages

group_advantages = Exercise("13.group_advantages", "GRPO's group-relative advantages")


def _check_advantages(advantages_fn, rewards, num_generations, what):
    expected = _reference_advantages(rewards, num_generations)
    got = call_on_copies(advantages_fn, rewards, num_generations, what="compute_advantages")
    expect_close(np.asarray(got, np.float64), expected, rtol=1e-4, atol=1e-5, what=what)


@group_advantages.case(points=2, hint="The advantages differ: check which rewards form a group (the exercise "
                                      "says in what order they come) and which standard deviation it asks "
                                      "for. See 'GRPO: reinforcement learning from a checker'.")
def three_groups_of_four(advantages_fn):
    rewards = np.array([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.5, 0.0], np.float32)
    _check_advantages(advantages_fn, rewards, 4, "advantages of 3 prompts x 4 completions")


@group_advantages.case(hint="A group whose completions all earn the same reward teaches nothing: every "
                            "advantage in it should be 0, not NaN and not moved by the other groups.")
def a_group_of_equal_rewards_has_zero_advantages(advantages_fn):
    rewards = np.array([1.0, 1.0, 1.0, 0.0, 1.0, 0.0], np.float32)
    _check_advantages(advantages_fn, rewards, 3, "advantages when prompt 0's completions all score 1")


@group_advantages.case(hint="On rewards about 1e-5 apart the advantages differ. At this scale the 1e-6 that "
                            "the formula adds to the standard deviation matters: add it as the formula does "
                            "(not as a floor, nor only where the deviation is 0).")
def the_epsilon_is_added_to_the_std(advantages_fn):
    step = 2.0**-17  # 7.6e-6, exact in float32: a group's std is about as small as the 1e-6
    rewards = np.array([0.0, 0.0, 0.0, step, step, 0.0, 2 * step, step], np.float32)
    _check_advantages(advantages_fn, rewards, 4, "advantages of rewards about 1e-5 apart")


def _expect_value_error(advantages_fn, rewards, num_generations):
    try:
        call_on_copies(advantages_fn, rewards, num_generations, what="compute_advantages")
    except ValueError:
        return
    expect(False, f"compute_advantages({len(rewards)} rewards, num_generations={num_generations}) "
                  "returned instead of raising ValueError")


@group_advantages.case(hint="With fewer than two completions per prompt there is nothing to compare with: "
                            "the exercise asks for a ValueError, for num_generations 1 and 0 alike.")
def a_group_of_one_is_refused(advantages_fn):
    _expect_value_error(advantages_fn, np.array([1.0, 0.0, 0.5, 1.0], np.float32), 1)
    _expect_value_error(advantages_fn, np.array([1.0, 0.0, 0.5, 1.0], np.float32), 0)


@group_advantages.case(hint="Rewards that do not split into whole groups are a caller's mistake to report, "
                            "not a tail to drop: the exercise asks for a ValueError.")
def rewards_that_do_not_split_into_groups_are_refused(advantages_fn):
    _expect_value_error(advantages_fn, np.array([1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.5], np.float32), 3)


# ---------------------------------------------------------------- 13.clipped_objective

clipped_objective = Exercise("13.clipped_objective", "GRPO's clipped policy loss")


def _policy_inputs(seed):
    """Four completions of up to 6 tokens; ratios both inside and outside [0.8, 1.2]."""
    old = _random(seed, (4, 6), 0.5) - 2.0
    logps = old + _random(seed + 1, (4, 6), 0.4)  # log-ratios of about +-0.4: many clip at epsilon 0.2
    advantages = np.array([1.2, -0.7, 0.4, -1.5], np.float32)
    mask = np.array([[1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 0, 0, 0, 0, 0]],
                    np.int32)
    return logps, old, advantages, mask


def _check_policy_loss(loss_fn, inputs, epsilon, mode, what):
    expected = _reference_policy_loss(*inputs, epsilon, mode)
    got = call_on_copies(loss_fn, *inputs, epsilon, mode, what="policy_loss")
    expect(np.ndim(got) == 0, f"{what}: expected one number, got shape {np.shape(got)}")
    expect_close(float(got), expected, rtol=1e-5, atol=1e-6, what=what)


@clipped_objective.case(points=2, hint="The loss differs in 'sequence-mean-token-mean' mode. Check the ratio "
                                       "(new over old), which of the two per-token losses is kept, and that "
                                       "each completion is averaged over its own tokens. See 'GRPO: "
                                       "reinforcement learning from a checker'.")
def sequence_mean_token_mean(loss_fn):
    _check_policy_loss(loss_fn, _policy_inputs(0), 0.2, "sequence-mean-token-mean",
                       "the loss with loss_agg_mode='sequence-mean-token-mean'")


@clipped_objective.case(points=2, hint="The loss differs in 'token-mean' mode: every completion token of the "
                                       "batch weighs the same, and padding is neither summed nor counted.")
def token_mean(loss_fn):
    _check_policy_loss(loss_fn, _policy_inputs(10), 0.2, "token-mean",
                       "the loss with loss_agg_mode='token-mean'")


@clipped_objective.case(hint="The gradient is 0 where it should not be, or the other way round: the clip "
                             "may only make the objective more pessimistic, so it stops a token's gradient "
                             "only where its ratio moved past the range in the direction its advantage "
                             "favours. Use jax.numpy so jax.grad works.")
def the_clip_stops_the_gradient_only_on_the_favoured_side(loss_fn):
    old = np.zeros((2, 2), np.float32)
    logps = np.array([[0.5, -0.5], [0.5, -0.5]], np.float32)  # ratios e^0.5 (past 1.2) and e^-0.5 (past 0.8)
    advantages, mask = np.array([1.0, -1.0], np.float32), np.ones((2, 2), np.int32)
    grad = np.asarray(jax.grad(lambda lp: loss_fn(lp, old, advantages, mask, 0.2, "token-mean"))(
        jnp.asarray(logps)))
    # A > 0: pushed up past 1.2 -> clipped (0); pushed down past 0.8 -> not clipped. A < 0: the mirror image.
    expected_zero = np.array([[True, False], [False, True]])
    expect(np.all(np.abs(grad[expected_zero]) < 1e-7) and np.all(np.abs(grad[~expected_zero]) > 1e-3),
           f"the gradient with respect to logps is {np.round(grad, 4).tolist()}; expected 0 exactly where "
           f"the clip is active ({expected_zero.tolist()}) and not 0 elsewhere")


@clipped_objective.case(hint="A padded token's log-prob (here a huge one) changed your loss: only "
                             "completion tokens may count.")
def padded_tokens_do_not_count(loss_fn):
    logps, old, advantages, mask = _policy_inputs(20)
    noisy = logps.copy()
    noisy[mask == 0] += 30.0
    clean = float(call_on_copies(loss_fn, logps, old, advantages, mask, 0.2, "sequence-mean-token-mean",
                                 what="policy_loss"))
    padded = float(call_on_copies(loss_fn, noisy, old, advantages, mask, 0.2, "sequence-mean-token-mean",
                                  what="policy_loss"))
    expect(abs(clean - padded) <= 1e-5 * max(1.0, abs(clean)),
           f"changing the log-probs of padded tokens changed the loss from {clean:.6f} to {padded:.6f}")


@clipped_objective.case(points=2, hint="Empty completions (mask all 0) here. The exercise averages the "
                                       "per-completion means over the completions that have any token, and "
                                       "gives a batch without any completion token a loss of 0: no NaN.")
def empty_completions_are_not_averaged_in(loss_fn):
    logps, old, advantages, mask = _policy_inputs(30)
    mask[2] = 0  # the model ended its answer at once
    for mode in ("sequence-mean-token-mean", "token-mean"):
        _check_policy_loss(loss_fn, (logps, old, advantages, mask), 0.2, mode,
                           f"the loss with one empty completion, loss_agg_mode='{mode}'")
        _check_policy_loss(loss_fn, (logps, old, advantages, 0 * mask), 0.2, mode,
                           f"the loss when every completion is empty, loss_agg_mode='{mode}'")


@clipped_objective.case(points=2, hint="This case passes epsilon=0.3, not 0.2: the clip range must come from "
                                       "the epsilon argument.")
def epsilon_is_the_argument(loss_fn):
    _check_policy_loss(loss_fn, _policy_inputs(40), 0.3, "sequence-mean-token-mean",
                       "the loss with epsilon=0.3")


# ---------------------------------------------------------------- 13.kl_estimator

kl_estimator = Exercise("13.kl_estimator", "Per-token estimators of KL(policy || reference)")


def _check_kl(kl_fn, method, what, seed):
    logps = _random(seed, (3, 5), 0.7) - 2.0
    ref_logps = logps + _random(seed + 1, (3, 5), 0.5)
    expected = _reference_kl(logps, ref_logps, method)
    got = call_on_copies(kl_fn, logps, ref_logps, method, what="kl_divergence")
    expect_close(np.asarray(got, np.float64), expected, rtol=1e-4, atol=1e-6, what=what)


@kl_estimator.case(hint="'kl' (k1) differs: it is the log-ratio itself, signed (negative about half the "
                        "time), one value per token. Check its sign against the exercise's d.")
def k1(kl_fn):
    _check_kl(kl_fn, "kl", "method='kl'", 0)


@kl_estimator.case(hint="'mse_kl' (k2) differs: compare your factor with the exercise's list.")
def k2(kl_fn):
    _check_kl(kl_fn, "mse_kl", "method='mse_kl'", 10)


@kl_estimator.case(points=2, hint="'low_var_kl' (k3) differs: check the direction of the log-ratio d (the "
                                  "reference over the policy, as the exercise defines it) and every term "
                                  "of the formula; it is 0 where the two log-probs agree.")
def k3(kl_fn):
    _check_kl(kl_fn, "low_var_kl", "method='low_var_kl'", 20)
    # The estimate is a term of the GRPO loss that jax.grad differentiates (beta * KL), so it must
    # trace: a NumPy estimator gives the right values above and cannot be differentiated.
    logps = _random(20, (3, 5), 0.7) - 2.0  # the inputs of the value check above
    ref_logps = logps + _random(21, (3, 5), 0.5)
    expected = 1.0 - np.exp(ref_logps.astype(np.float64) - logps)  # d/dlogp of e^d - d - 1, d = ref - logp
    grad = jax.grad(lambda lp: jnp.sum(kl_fn(lp, jnp.asarray(ref_logps), "low_var_kl")))(jnp.asarray(logps))
    expect_close(np.asarray(grad, np.float64), expected, rtol=1e-4, atol=1e-6,
                 what="jax.grad of sum(low_var_kl) with respect to logps",
                 hint="The KL penalty is part of the loss jax.grad differentiates: build the estimate with "
                      "jax.numpy operations on the arrays you are given.")
