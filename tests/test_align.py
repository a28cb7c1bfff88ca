"""stacklib.align: the task, the pure loss pieces, SFT (full, LoRA, QLoRA), DPO, GRPO, bad input.

Models are tiny (d_model 32, 2 layers, max_seq_len 16) and randomly initialised, so every
test compiles a few small steps; the recipe on the real zoo model is tested in
tests/test_align_recipe.py (slow, cached).
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stacklib.nn as nnx
import stacklib.optim as optax
import stacklib.quant as qwix
from stacklib.align import common, recipes, tasks
from stacklib.align import zoo as align_zoo
from stacklib.align.dpo_trainer import DPOTrainer, DPOTrainingConfig, dpo_loss_fn
from stacklib.align.grpo_learner import GRPOConfig, GRPOLearner, compute_advantages, grpo_policy_loss
from stacklib.align.peft_trainer import PeftTrainer, TrainingConfig, TrainingInput, next_token_loss
from stacklib.align.rl_cluster import ClusterConfig, Mode, RLCluster, RLTrainingConfig, RolloutConfig
from stacklib.llm import ByteTokenizer, Transformer, load_config
from stacklib.llm import zoo as llm_zoo

TINY = dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64, max_seq_len=16, seq_len=16,
            progress=False)
TOKENIZER = ByteTokenizer()


def tiny_model(seed: int = 0, **changes) -> Transformer:
    return Transformer(load_config(None, **{**TINY, **changes}), rngs=nnx.Rngs(seed))


@pytest.fixture(scope="module")
def problems():
    return tasks.make_problems(seed=0, heldout=64)


# -- tasks ---------------------------------------------------------------------------------------

def test_train_and_heldout_share_no_problem_in_either_order(problems):
    train, heldout = problems
    assert len({(p.a, p.b) for p in train}) == len(train)
    unordered = lambda ps: {frozenset((p.a, p.b)) for p in ps}  # noqa: E731
    assert not unordered(train) & unordered(heldout)
    assert len(train) + len(heldout) == 100 * 100
    assert tasks.make_problems(seed=0, heldout=64) == problems  # seeded
    assert tasks.make_problems(seed=1, heldout=64)[1] != heldout


def test_a_problem_reads_as_text():
    problem = tasks.Problem(37, 45)
    assert (problem.prompt, problem.answer, problem.completion) == ("37+45=", "82", "82\n")


def test_sft_batch_masks_the_prompt_and_keeps_the_answer_and_its_newline():
    batch = tasks.sft_batch([tasks.Problem(3, 4), tasks.Problem(99, 99)], TOKENIZER)
    tokens, mask = batch["input_tokens"], batch["input_mask"]
    assert tokens.shape == mask.shape == (2, tasks.PROMPT_WIDTH + tasks.ANSWER_TOKENS)
    assert TOKENIZER.decode(tokens[0]) == "\x00\x003+4=7\n\x00\x00"
    assert TOKENIZER.decode(tokens[1]) == "99+99=198\n"
    assert TOKENIZER.decode(tokens[0][mask[0] == 1]) == "7\n"
    assert TOKENIZER.decode(tokens[1][mask[1] == 1]) == "198\n"


@pytest.mark.parametrize("completion, parsed", [
    ("82\n", "82"), ("82\nxyz", "82"), ("082\n", "82"), ("82", None), ("8 2\n", None), ("\n", None),
    ("1234\n", None), ("-3\n", None),
])
def test_parse_answer_reads_digits_up_to_the_newline(completion, parsed):
    assert tasks.parse_answer(completion) == parsed


def test_rewards_score_exact_answers_and_well_formed_ones():
    completions = ["7\n", "8\n", "7", "seven\n"]
    prompts = ["3+4="] * 4
    assert tasks.exact_match_reward(prompts, completions, answer=["7"] * 4) == [1.0, 0.0, 0.0, 0.0]
    assert tasks.format_reward(prompts, completions) == [0.1, 0.1, 0.0, 0.0]


def test_preference_pairs_reject_a_plausible_wrong_answer(problems):
    train, _ = problems
    batch = tasks.preference_batch(train[:50], TOKENIZER, seed=0)
    for row, problem in enumerate(train[:50]):
        chosen = TOKENIZER.decode(batch["chosen_ids"][row][batch["chosen_mask"][row] == 1])
        rejected = TOKENIZER.decode(batch["rejected_ids"][row][batch["rejected_mask"][row] == 1])
        assert chosen == problem.completion
        assert rejected.endswith("\n") and rejected != chosen
        assert abs(int(rejected) - int(problem.answer)) in (1, 10)
    assert batch["prompt_mask"].sum(1).tolist() == [len(p.prompt) for p in train[:50]]


def test_heldout_accuracy_is_zero_for_a_random_model_and_one_for_an_oracle(problems, monkeypatch):
    _, heldout = problems
    model = tiny_model()
    assert tasks.heldout_accuracy(model, TOKENIZER, heldout[:8]) == 0.0
    oracle = lambda m, t, prompts, **kw: [str(eval(p[:-1])) + "\n" for p in prompts]  # noqa: E731
    monkeypatch.setattr(tasks, "complete", oracle)
    assert tasks.heldout_accuracy(model, TOKENIZER, heldout) == 1.0


def test_a_prompt_wider_than_the_layout_is_named():
    with pytest.raises(ValueError, match=r"Prompt 1 \('100\+100='\) has 8 tokens.*width 6"):
        tasks.encode_prompts(["1+1=", "100+100="], TOKENIZER)


# -- common --------------------------------------------------------------------------------------

def test_selective_log_softmax_is_the_log_softmax_entry():
    logits = jax.random.normal(jax.random.key(0), (3, 5, 11)) * 3
    ids = jax.random.randint(jax.random.key(1), (3, 5), 0, 11)
    expected = jnp.take_along_axis(jax.nn.log_softmax(logits), ids[..., None], -1)[..., 0]
    np.testing.assert_allclose(common.selective_log_softmax(logits, ids), expected, rtol=1e-6, atol=1e-6)


def test_per_token_logps_score_each_completion_token_from_the_position_before():
    model = tiny_model()
    prompt = jnp.array([[0, 51, 43, 52, 61]])  # "\03+4="
    completion = jnp.array([[55, 10, 0]])
    logps = common.per_token_logps(model, prompt, completion)
    full = jax.nn.log_softmax(model(jnp.concatenate([prompt, completion], 1)))
    expected = [full[0, 4, 55], full[0, 5, 10], full[0, 6, 0]]
    np.testing.assert_allclose(logps[0], expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(common.compute_per_token_logps(model, prompt, completion), logps, atol=1e-5)
    hot = common.compute_per_token_logps(model, prompt, completion, temperature=2.0)
    expected_hot = common.per_token_logps(model, prompt, completion, temperature=2.0)
    np.testing.assert_allclose(hot, expected_hot, atol=1e-5)


def test_completion_mask_stops_after_the_first_stop_token():
    ids = np.array([[5, 10, 7, 10], [5, 6, 7, 8], [10, 1, 1, 1]])
    expected = [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    np.testing.assert_array_equal(common.make_completion_mask(jnp.asarray(ids), eos_tok=10), expected)
    np.testing.assert_array_equal(common.np_make_completion_mask(ids, eos_tok=10), expected)


def test_kl_estimators_are_zero_at_equal_policies_and_k3_is_never_negative():
    logp = jax.random.normal(jax.random.key(0), (4, 6))
    ref = logp + jax.random.normal(jax.random.key(1), (4, 6))
    for method in common.KL_METHODS:
        np.testing.assert_allclose(common.compute_kl_divergence(logp, logp, method), 0.0, atol=1e-7)
    assert float(common.compute_kl_divergence(logp, ref, "low_var_kl").min()) >= 0.0
    np.testing.assert_allclose(common.compute_kl_divergence(logp, ref, "kl"), logp - ref, rtol=1e-6)
    assert float(common.compute_kl_divergence(logp, ref - 100, "low_var_kl", clamp_value=5.0).max()) <= 5.0
    with pytest.raises(ValueError, match="method='forward'.*low_var_kl"):
        common.compute_kl_divergence(logp, ref, "forward")


def test_aggregate_loss_modes_weigh_tokens_and_sequences_as_documented():
    loss = jnp.array([[1.0, 2.0, 3.0, 4.0], [10.0, 0.0, 0.0, 0.0], [5.0, 5.0, 5.0, 5.0]])
    mask = jnp.array([[1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0]])  # the third row is empty
    agg = lambda mode, **kw: float(common.aggregate_loss(loss, mask, mode, **kw))  # noqa: E731
    assert agg("token-mean") == pytest.approx(20 / 5)
    assert agg("sequence-mean-token-mean") == pytest.approx((2.5 + 10) / 2)
    assert agg("sequence-mean-token-scale") == pytest.approx((10 / 4 + 10 / 4) / 2)
    assert agg("seq-mean-token-sum") == pytest.approx((10 + 10) / 2)
    assert agg("sequence-mean-token-sum-norm", norm=4) == pytest.approx(20 / 4)
    with pytest.raises(ValueError, match="loss_agg_mode='mean'.*token-mean"):
        agg("mean")
    with pytest.raises(ValueError, match="norm=0"):
        agg("sequence-mean-token-scale", norm=0)


# -- SFT -------------------------------------------------------------------------------------------

def _sft_batches(problems, n, batch=8):
    return list(tasks.sft_batches(problems, TOKENIZER, batch, seed=0, num_batches=n))


def test_next_token_loss_ignores_the_prompt():
    model = tiny_model()
    batch = tasks.sft_batch([tasks.Problem(3, 4)], TOKENIZER)
    tokens = jnp.asarray(batch["input_tokens"])
    changed = tokens.at[0, 3].set(ord("-"))  # "3-4=": a prompt token
    base = float(next_token_loss(model, tokens, batch["input_mask"]))
    full = jax.nn.log_softmax(model(tokens))
    expected = -(full[0, 5, ord("7")] + full[0, 6, 10]) / 2  # '7' predicted at '=' (5), '\n' at '7' (6)
    assert base == pytest.approx(float(expected), rel=1e-5)
    assert float(next_token_loss(model, changed, batch["input_mask"])) != base  # the prompt conditions ...
    ones = np.ones_like(batch["input_mask"])
    assert float(next_token_loss(model, tokens, ones)) != base  # ... but is not a target


def test_full_sft_lowers_the_loss_and_logs_a_loss_per_step(problems):
    train, heldout = problems
    model = tiny_model()
    trainer = PeftTrainer(model, optax.adam(3e-3), TrainingConfig(eval_every_n_steps=5, max_steps=20))
    batches = [TrainingInput(b["input_tokens"], b["input_mask"]) for b in _sft_batches(train, 40)]
    trainer.train(batches, _sft_batches(heldout, 2))  # NamedTuple batches (tunix's TrainingInput), dict ones
    history = trainer.metrics_logger.get_metric_history("", "loss", "train")
    assert len(history) == trainer.train_steps == 20
    assert history[-5:].mean() < 0.7 * history[:5].mean()
    assert trainer.metrics_logger.get_metric_steps("", "loss", "eval").tolist() == [0, 5, 10, 15, 20]
    evals = trainer.metrics_logger.get_metric_history("", "loss", "eval")
    assert evals[-1] < evals[0]
    assert trainer.trainable_params == sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    with pytest.raises(ValueError, match="Metric '/train/acc' not found.*'loss'"):
        trainer.metrics_logger.get_metric("", "acc", "train")


def test_gradient_accumulation_of_k_batches_is_one_step_on_their_union(problems):
    train, _ = problems
    batches = _sft_batches(train, 2, batch=4)
    # MultiSteps applies the mean of the two batches' gradients.
    one, two = tiny_model(), tiny_model()
    accumulated = PeftTrainer(one, optax.sgd(0.5), TrainingConfig(eval_every_n_steps=10,
                                                                   gradient_accumulation_steps=2))
    accumulated.train(batches)
    assert (accumulated.train_steps, accumulated.iter_steps) == (1, 2)
    graphdef, params = nnx.split(two, nnx.Param)
    grad = jax.jit(jax.grad(lambda p, b: next_token_loss(nnx.merge(graphdef, p), **b)))
    grads = [grad(params, b) for b in batches]
    expected = jax.tree.map(lambda p, g1, g2: p - 0.5 * (g1 + g2) / 2, params, *grads)
    for got, want in zip(jax.tree.leaves(nnx.state(one, nnx.Param)), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("weight_qtype", [None, jnp.int8], ids=["lora", "qlora"])
def test_lora_sft_trains_only_the_adapters_and_the_base_stays_bit_identical(problems, weight_qtype):
    train, _ = problems
    base = tiny_model()
    batches = _sft_batches(train, 15)
    rule = qwix.LoraRule(module_path=".*", rank=4, alpha=8.0, weight_qtype=weight_qtype)
    provider = qwix.LoraProvider([rule])
    lora = qwix.apply_lora_to_model(base, provider, jnp.asarray(batches[0]["input_tokens"]), rngs=nnx.Rngs(1))
    _, adapters_before, frozen_before = nnx.split(lora, qwix.LoRAParam, ...)
    frozen_before = [np.array(x) for x in jax.tree.leaves(frozen_before)]
    adapters_before = [np.array(x) for x in jax.tree.leaves(adapters_before)]
    trainer = PeftTrainer(lora, optax.adam(1e-2), TrainingConfig(eval_every_n_steps=100, max_steps=15))
    trainer.train(batches)
    _, adapters_after, frozen_after = nnx.split(lora, qwix.LoRAParam, ...)
    assert trainer.trainable_params == sum(x.size for x in jax.tree.leaves(adapters_after)) > 0
    assert trainer.trainable_params < sum(x.size for x in jax.tree.leaves(frozen_after)) / 5
    for before, after in zip(frozen_before, jax.tree.leaves(frozen_after), strict=True):
        assert before.dtype == after.dtype
        np.testing.assert_array_equal(before, after)
    moved = [float(jnp.abs(a - b).max()) for a, b in zip(adapters_before,
                                                          jax.tree.leaves(adapters_after), strict=True)]
    assert min(moved) > 0
    history = trainer.metrics_logger.get_metric_history("", "loss", "train")
    assert history[-3:].mean() < history[:3].mean()


def test_training_config_rejects_nonpositive_counts():
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps=0.*positive integer"):
        TrainingConfig(eval_every_n_steps=1, gradient_accumulation_steps=0)


# -- DPO -------------------------------------------------------------------------------------------

def test_dpo_loss_is_log2_at_the_reference_and_falls_as_the_margin_grows():
    zeros = jnp.zeros(4)
    loss, aux = dpo_loss_fn(zeros - 3, zeros - 5, zeros - 3, zeros - 5, beta=0.1)
    assert float(loss) == pytest.approx(np.log(2))
    assert float(aux["rewards/margin"]) == 0.0 and float(aux["rewards/accuracy"]) == 0.0
    loss2, aux2 = dpo_loss_fn(zeros - 2, zeros - 6, zeros - 3, zeros - 5, beta=0.1)
    assert float(loss2) < float(loss)
    assert float(aux2["rewards/margin"]) == pytest.approx(0.1 * 2)
    assert float(aux2["rewards/accuracy"]) == 1.0
    smoothed, _ = dpo_loss_fn(zeros + 50, zeros - 50, None, None, beta=1.0, label_smoothing=0.2)
    assert float(smoothed) == pytest.approx(0.2 * 100, rel=1e-3)  # a flipped label pays for a huge margin


def test_dpo_training_raises_the_margin_and_the_reference_stays_frozen(problems):
    train, _ = problems
    policy, reference = tiny_model(), tiny_model()
    before = [np.array(x) for x in jax.tree.leaves(nnx.state(reference))]
    pairs = [tasks.preference_batch(train[i * 16:(i + 1) * 16], TOKENIZER, seed=i) for i in range(3)]
    trainer = DPOTrainer(policy, reference, optax.adam(3e-3),
                         DPOTrainingConfig(eval_every_n_steps=100, max_steps=12, beta=0.5))
    trainer.train(pairs * 4)
    margins = trainer.metrics_logger.get_metric_history("", "rewards/margin", "train")
    assert len(margins) == 12 and margins[0] == pytest.approx(0.0, abs=1e-6)  # policy == reference at step 0
    assert margins[-3:].mean() > 0.5
    assert trainer.metrics_logger.get_metric("", "rewards/accuracy", "train") > 0.9
    for old, new in zip(before, jax.tree.leaves(nnx.state(reference)), strict=True):
        np.testing.assert_array_equal(old, new)


def test_mismatched_chosen_and_rejected_batches_are_named(problems):
    train, _ = problems
    pairs = tasks.preference_batch(train[:4], TOKENIZER)
    trainer = DPOTrainer(tiny_model(), None, optax.sgd(0.1), DPOTrainingConfig(eval_every_n_steps=1))
    short = {**pairs, "rejected_ids": pairs["rejected_ids"][:3], "rejected_mask": pairs["rejected_mask"][:3]}
    with pytest.raises(ValueError, match="rejected_ids has 3 rows but there are 4 prompts"):
        trainer.train([short])
    narrow = {**pairs, "chosen_mask": pairs["chosen_mask"][:, :2]}
    with pytest.raises(ValueError, match=r"chosen_mask has shape \(4, 2\) but chosen_ids has \(4, 4\)"):
        trainer.train([narrow])
    with pytest.raises(ValueError, match="missing \\['rejected_ids'"):
        trainer.train([{k: v for k, v in pairs.items() if k != "rejected_ids"}])
    with pytest.raises(ValueError, match="DPO only"):
        DPOTrainingConfig(eval_every_n_steps=1, algorithm="orpo")


# -- GRPO: the pure pieces --------------------------------------------------------------------------

def test_advantages_standardise_rewards_within_each_group():
    rewards = np.array([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0])
    adv = compute_advantages(rewards, 4)
    first = (rewards[:4] - 0.25) / (np.std(rewards[:4], ddof=1) + 1e-6)
    np.testing.assert_allclose(adv[:4], first)
    np.testing.assert_array_equal(adv[4:], 0.0)  # a group with equal rewards teaches nothing
    assert adv[:4].sum() == pytest.approx(0.0, abs=1e-9)


@pytest.mark.parametrize("rewards, generations, message", [
    (np.ones(4), 1, "num_generations=1: a group needs at least 2"),
    (np.ones(0), 4, "No rewards: the batch has no prompts"),
    (np.ones(6), 4, "6 rewards do not split into groups of num_generations=4"),
])
def test_advantages_reject_groups_that_cannot_be_compared(rewards, generations, message):
    with pytest.raises(ValueError, match=message):
        compute_advantages(rewards, generations)


def test_grpo_config_needs_two_generations_and_known_modes():
    with pytest.raises(ValueError, match="num_generations=1: GRPO compares completions within a group"):
        GRPOConfig(num_generations=1)
    with pytest.raises(ValueError, match="loss_agg_mode='mean'"):
        GRPOConfig(num_generations=2, loss_agg_mode="mean")
    with pytest.raises(ValueError, match="kl_loss_mode='k2'"):
        GRPOConfig(num_generations=2, kl_loss_mode="k2")


def test_policy_loss_at_ratio_one_is_minus_the_mean_advantage_and_its_gradient_is_reinforce():
    logps = jax.random.normal(jax.random.key(0), (4, 3)) - 2.0
    adv = jnp.array([1.0, -1.0, 0.5, -0.5])
    mask = jnp.array([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]])
    config = GRPOConfig(num_generations=2, beta=0.0)
    loss, aux = grpo_policy_loss(logps, None, None, adv, mask, config)
    assert float(loss) == pytest.approx(-float(adv.mean()), abs=1e-6)
    grad = jax.grad(lambda lp: grpo_policy_loss(lp, None, None, adv, mask, config)[0])(logps)
    expected = -adv[:, None] * mask / mask.sum(1, keepdims=True) / 4  # d/dlogp of -A * exp(logp - sg(logp))
    np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=1e-7)
    assert float(aux["pg_clipfrac"]) == 0.0 and float(aux["kl"]) == 0.0


def test_policy_loss_clips_a_ratio_outside_the_trust_region():
    old = jnp.zeros((2, 1)) - 1.0
    logps = old + jnp.log(jnp.array([[1.5], [0.5]]))  # ratios 1.5 and 0.5
    adv, mask = jnp.array([1.0, -1.0]), jnp.ones((2, 1))
    config = GRPOConfig(num_generations=2, beta=0.0, epsilon=0.2)
    loss, aux = grpo_policy_loss(logps, old, None, adv, mask, config)
    # A > 0 and ratio 1.5: capped at 1.2; A < 0 and ratio 0.5: capped at 0.8. Both pessimistic.
    assert float(loss) == pytest.approx((-1.2 + 0.8) / 2)
    assert float(aux["pg_clipfrac"]) == 1.0
    grad = jax.grad(lambda lp: grpo_policy_loss(lp, old, None, adv, mask, config)[0])(logps)
    np.testing.assert_array_equal(grad, 0.0)  # clipped: no push further out


def test_policy_loss_adds_beta_times_the_kl_to_the_reference():
    logps = jnp.array([[-1.0, -2.0]])
    ref = jnp.array([[-1.5, -1.0]])
    mask = jnp.ones((1, 2))
    config = GRPOConfig(num_generations=2, beta=0.1, kl_loss_mode="low_var_kl")
    loss, aux = grpo_policy_loss(logps, None, ref, jnp.zeros(1), mask, config)
    kl = common.compute_kl_divergence(logps, ref, "low_var_kl").mean()
    assert float(aux["kl"]) == pytest.approx(float(kl), rel=1e-6)
    assert float(loss) == pytest.approx(0.1 * float(kl), rel=1e-6)


# -- GRPO: the cluster and the learner, on a tiny model ---------------------------------------------

def tiny_cluster(model=None, reference="clone", temperature=1.0, max_prompt_length=6, max_steps=8, lr=1e-2):
    model = model or tiny_model()
    reference = nnx.clone(model) if reference == "clone" else reference
    rollout = RolloutConfig(max_tokens_to_generate=4, temperature=temperature,
                            max_prompt_length=max_prompt_length, eos_tokens=[10], seed=0)
    greedy = RolloutConfig(max_tokens_to_generate=4, temperature=0.0, max_prompt_length=max_prompt_length,
                           eos_tokens=[10])
    training = RLTrainingConfig(actor_optimizer=optax.adam(lr), eval_every_n_steps=4, max_steps=max_steps)
    config = ClusterConfig(training_config=training, rollout_config={Mode.TRAIN: rollout, Mode.EVAL: greedy})
    return RLCluster(actor=model, reference=reference, tokenizer=TOKENIZER, cluster_config=config)


def test_rollouts_stop_at_the_first_eos_and_keep_it_in_the_text():
    cluster = tiny_cluster()
    out = cluster.generate(["1+2="] * 64)
    assert out.tokens.shape == out.completion_mask.shape == (64, 4)
    assert out.left_padded_prompt_tokens.shape == (64, 6)
    for text, ids, mask in zip(out.text, out.tokens, out.completion_mask, strict=True):
        assert TOKENIZER.decode(ids[mask == 1]) == text
        assert "\n" not in text[:-1]  # nothing after the first stop
        assert (ids[mask == 0] == 0).all()
    assert any(t.endswith("\n") for t in out.text) or all(m.all() for m in out.completion_mask)


def test_the_cluster_refuses_a_reference_that_shares_the_actors_weights():
    model = tiny_model()
    graphdef, state = nnx.split(model)
    with pytest.raises(ValueError, match=r"shares weights.*reference=nnx.clone\(actor\)"):
        tiny_cluster(nnx.merge(graphdef, state), reference=nnx.merge(graphdef, state))


def test_prompts_longer_than_the_context_are_named():
    with pytest.raises(ValueError, match=r"max_prompt_length=14 \+ max_tokens_to_generate=4 exceeds the "
                                          "actor's "
                                         r"context \(max_seq_len=16\)"):
        tiny_cluster(max_prompt_length=14)
    cluster = tiny_cluster()
    with pytest.raises(ValueError, match=r"Prompt 1 \('123\+456='\) has 8 tokens, more than "
                                          "max_prompt_length=6"):
        cluster.generate(["1+1=", "123+456="])


def digit_reward(prompts, completions, **kwargs):
    return [float(c[:1].isdigit()) for c in completions]


def test_grpo_raises_the_reward_of_a_tiny_model_and_logs_reward_and_kl():
    cluster = tiny_cluster(max_steps=7)
    learner = GRPOLearner(cluster, GRPOConfig(num_generations=8, beta=0.04), [digit_reward])
    batches = [{"prompts": np.array(["1+2=", "3+4=", "5+6=", "7+8="] * 4)}] * 10
    learner.train(batches, eval_ds=batches[:1])
    logger = cluster.metrics_logger
    rewards = logger.get_metric_history("", "rewards/mean", "train")
    assert len(rewards) == 7 and cluster.global_steps == 7  # max_steps, though the data has 10 batches
    assert rewards[-3:].mean() > 2 * rewards[:3].mean() + 0.05
    kl = logger.get_metric_history("", "kl", "train")
    assert kl[0] == pytest.approx(0.0, abs=1e-6) and kl[-1] > 0  # the actor moved away from the reference
    assert logger.get_metric_steps("", "rewards/digit_reward", "eval").tolist() == [0, 4]
    assert learner.train_time > 0


def test_the_older_argument_order_and_grpo_config_keyword_work():
    config = GRPOConfig(num_generations=2)
    assert GRPOLearner(tiny_cluster(), [digit_reward], config).algo_config.num_generations == 2
    learner = GRPOLearner(tiny_cluster(), grpo_config=config, reward_fns=digit_reward)
    assert learner.reward_fns == [digit_reward]


def broken_reward(prompts, completions, **kwargs):
    raise KeyError("answer")


def short_reward(prompts, completions, **kwargs):
    return [1.0]


def nan_reward(prompts, completions, **kwargs):
    return [float("nan")] * len(completions)


@pytest.mark.parametrize("reward_fn, error, message", [
    (broken_reward, RuntimeError, r"Reward function 'broken_reward' raised KeyError: 'answer'.*other "
                                   "columns are "
                                  r"\['answer'\]"),
    (short_reward, ValueError, "Reward function 'short_reward' returned 1 values for 4 completions"),
    (nan_reward, ValueError, "Reward function 'nan_reward' returned a non-finite reward"),
])
def test_a_bad_reward_function_is_named(reward_fn, error, message):
    learner = GRPOLearner(tiny_cluster(), GRPOConfig(num_generations=2), [reward_fn])
    with pytest.raises(error, match=message):
        learner.train([{"prompts": np.array(["1+2=", "3+4="]), "answer": np.array(["3", "7"])}])


def test_an_empty_batch_is_named():
    learner = GRPOLearner(tiny_cluster(), GRPOConfig(num_generations=2), [digit_reward])
    with pytest.raises(ValueError, match="no prompts"):
        learner.train([{"prompts": np.array([], dtype=str)}])


# -- the zoo: trained once, cached ---------------------------------------------------------------

def test_the_zoo_trains_once_in_the_build_process_and_loads_after(tmp_path, monkeypatch, capfd):
    # The cache protocol (lock, partial writes, a corrupt cache rebuilt into the same files) is
    # stacklib.llm.zoo's and is tested in tests/test_llm.py; this is what the align zoo adds.
    monkeypatch.setenv("STACKLIB_CACHE", str(tmp_path))
    # A tiny base model of its own: the build process trains it too, from the config in the request.
    monkeypatch.setitem(llm_zoo.ZOO, "tiny-base",
                        dict(TINY, steps=2, batch_size=4, max_corpus_bytes=100_000, eval_batches=0))
    recipe = recipes.Recipe(base_model="tiny-base", heldout=16, validation=16,
                            sft_batch_size=8, sft_eval_every=2, sft_max_steps=2,
                            grpo_steps=2, grpo_prompts=2, num_generations=2)
    model, _, info = align_zoo.grpo(recipe=recipe)
    assert (info["method"], info["steps"], len(info["reward"])) == ("grpo", 2, 2)
    assert info["recipe"] == recipe.to_dict() and 0.0 <= info["heldout_accuracy"] <= 1.0
    assert info["seconds"] > 0
    again, _, info_again = align_zoo.grpo(recipe=recipe)
    assert info_again == info  # loaded, not trained
    assert capfd.readouterr().err.count("Training 'grpo-") == 1
    params = [jax.tree.leaves(nnx.state(m, nnx.Param)) for m in (model, again)]
    for a, b in zip(*params, strict=True):
        np.testing.assert_array_equal(a, b)
    names = sorted(p.name for p in (tmp_path / "align").iterdir() if not p.name.endswith(".lock"))
    assert [n.split("-")[0] for n in names] == ["grpo", "sft"]
    step = tmp_path / "align" / names[0] / "0"  # the one thing two builds do not share is kept apart:
    assert json.loads((step / "timing" / "item.json").read_text()) == {"seconds": info["seconds"]}
    assert "seconds" not in json.loads((step / "info" / "item.json").read_text())


