"""stacklib.align against google-tunix 0.1.7 on the same random inputs.

Compared, each with its own case table: per-token log-probs (from the same logits, through
tunix's `compute_per_token_logps` with a model that returns them), completion masks, the KL
estimators, `aggregate_loss` in every mode, the DPO loss and its metrics, GRPO's
advantages, and the GRPO policy loss (with and without a pi_old and a reference) for every
`loss_agg_mode` we support, plus its gradient with respect to the logits.

Tolerances: everything is float32 on both sides and computed by the same formulas in a
different order, so values agree to a few ulps of their size; `rtol=1e-5, atol=1e-6`
(about 80 ulps at 1.0) leaves room for the summation order of XLA's reductions and for
`exp`/`log1p` implementations, and nothing looser is needed. Advantages are float64 NumPy
on both sides (tunix's formula on our rewards): exact to 1e-12.

The LoRA SFT step. Tunix's bundled toy model (tunix/tests/test_common.py `ToyTransformer`)
cannot be matched with ours: it has non-causal `nnx.MultiHeadAttention`, biased MLPs and
head, and no norms or RoPE, while ours (`stacklib.llm.Transformer`) is Llama's decoder.
So the step is compared on chapter 12's flax.nnx twin of our model (`stacklib.llm.twin`,
the same architecture and parameter paths, written with flax layers), run by tunix's own
`PeftTrainer` with qwix's LoRA and tunix's default loss, against our `PeftTrainer` with
`stacklib.quant` LoRA on our model: same weights, same adapters, one SGD step, same
adapters after (to 1e-5: two different float32 programs of a whole transformer step; the base
weights are bit-identical on both sides).

PITFALLS honoured: tunix's GRPO wants NumPy prompts, and an Explicit-axes mesh crashes it;
nothing here builds a mesh.
"""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import optax as real_optax
import pytest
import qwix
from flax import nnx as fnnx
from tunix.rl import algo_core
from tunix.rl import common as tcommon
from tunix.rl.grpo import grpo_learner as tgrpo
from tunix.sft import peft_trainer as tpeft
from tunix.sft.dpo import dpo_trainer as tdpo

import stacklib.nn as nnx
import stacklib.optim as optax
import stacklib.quant as sq
from stacklib.align import common, tasks
from stacklib.align.dpo_trainer import dpo_loss_fn
from stacklib.align.grpo_learner import GRPOConfig, compute_advantages, grpo_policy_loss
from stacklib.align.peft_trainer import PeftTrainer, TrainingConfig
from stacklib.llm import ByteTokenizer, Transformer, load_config, twin

TOL = dict(rtol=1e-5, atol=1e-6)
B, P, C, V = 6, 5, 4, 11


class LogitsModel(fnnx.Module):
    """A flax model whose output is a fixed logits array, with the call signature tunix expects."""

    def __init__(self, logits):
        self.logits = fnnx.Param(jnp.asarray(logits))

    def __call__(self, tokens, positions=None, cache=None, attention_mask=None):
        return self.logits[...], cache


@pytest.fixture(scope="module")
def rollout():
    keys = jax.random.split(jax.random.key(0), 6)
    logits = 3 * jax.random.normal(keys[0], (B, P + C, V))
    prompt = jax.random.randint(keys[1], (B, P), 1, V)
    completion = jax.random.randint(keys[2], (B, C), 1, V)
    mask = jnp.array([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    old = jax.random.normal(keys[3], (B, C)) * 0.3  # added to the policy's log-probs: ratios 0.4 .. 2.5
    ref = jax.random.normal(keys[4], (B, C)) * 0.5
    rewards = np.asarray(jax.random.bernoulli(keys[5], 0.4, (B,)), np.float64)
    return dict(logits=logits, prompt=prompt, completion=completion, mask=mask, old=old, ref=ref,
                rewards=rewards)


def ours_logps(r, temperature=1.0):
    tokens = jnp.concatenate([r["prompt"], r["completion"]], axis=1)
    return common.logps_from_logits(r["logits"], tokens, C, temperature)


# -- log-probs and masks ------------------------------------------------------------------------

@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_per_token_logps_equal_tunix(rollout, temperature):
    graphdef, state = fnnx.split(LogitsModel(rollout["logits"]))
    theirs = tcommon.compute_per_token_logps(graphdef, state, rollout["prompt"], rollout["completion"],
                                             pad_id=0, eos_id=1, temperature=temperature)
    np.testing.assert_allclose(ours_logps(rollout, temperature), theirs, **TOL)
    x = rollout["logits"][:, :C]
    np.testing.assert_allclose(common.selective_log_softmax(x, rollout["completion"]),
                               tcommon.selective_log_softmax(x, rollout["completion"]), **TOL)


def test_completion_mask_equals_tunix():
    ids = jax.random.randint(jax.random.key(3), (16, 7), 0, 4)  # eos 0 appears often, or not at all
    np.testing.assert_array_equal(common.make_completion_mask(ids, eos_tok=0),
                                  tcommon.make_completion_mask(ids, 0))
    np.testing.assert_array_equal(common.np_make_completion_mask(np.asarray(ids), 2),
                                  tcommon.np_make_completion_mask(np.asarray(ids), 2))


@pytest.mark.parametrize("method", ["kl", "mse_kl", "low_var_kl"])
@pytest.mark.parametrize("clamp_value", [None, 0.5])
def test_kl_estimators_equal_tunix(rollout, method, clamp_value):
    logps, ref = ours_logps(rollout), ours_logps(rollout) + rollout["ref"]
    np.testing.assert_allclose(common.compute_kl_divergence(logps, ref, method, clamp_value),
                               tcommon.compute_kl_divergence(logps, ref, method, clamp_value), **TOL)


@pytest.mark.parametrize("mode", common.LOSS_AGG_MODES)
def test_aggregate_loss_equals_tunix(rollout, mode):
    per_token = jax.random.normal(jax.random.key(4), (B, C))
    np.testing.assert_allclose(common.aggregate_loss(per_token, rollout["mask"], mode),
                               tcommon.aggregate_loss(per_token, rollout["mask"], mode), **TOL)


# -- DPO ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("beta, label_smoothing, with_reference", [(0.1, 0.0, True), (0.5, 0.2, True),
                                                                   (0.1, 0.0, False)])
def test_dpo_loss_and_metrics_equal_tunix(rollout, beta, label_smoothing, with_reference):
    half = B // 2
    mask = rollout["mask"].astype(jnp.float32)
    tokens = jnp.concatenate([rollout["prompt"], rollout["completion"]], axis=1)
    sums = (ours_logps(rollout) * mask).sum(-1)
    ref = (rollout["ref"] * mask).sum(-1) - 4.0
    ref_chosen, ref_rejected = (ref[:half], ref[half:]) if with_reference else (None, None)
    example = tdpo.TrainExample(input_ids=tokens, positions=None, attention_mask=None,
                                ref_chosen_logps=ref_chosen, ref_rejected_logps=ref_rejected,
                                completion_mask=mask, logits_to_keep=C)
    theirs_loss, theirs = tdpo.dpo_loss_fn(LogitsModel(rollout["logits"]), example, beta=beta,
                                           label_smoothing=label_smoothing)
    loss, ours = dpo_loss_fn(sums[:half], sums[half:], ref_chosen, ref_rejected, beta, label_smoothing)
    np.testing.assert_allclose(loss, theirs_loss, **TOL)
    assert set(ours) == set(theirs)
    for name in ours:
        np.testing.assert_allclose(ours[name], theirs[name], err_msg=name, **TOL)


# -- GRPO -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("G", [2, 3, 6])
def test_advantages_equal_tunix(rollout, G):
    np.testing.assert_allclose(compute_advantages(rollout["rewards"], G),
                               algo_core.compute_advantages(rollout["rewards"], G), rtol=1e-12, atol=1e-12)


def _tunix_grpo(rollout, advantages, old, ref, **config):
    algo = tgrpo.GRPOConfig(num_generations=2, **config)
    algo.temperature = 1.0  # GRPOLearner sets it from the rollout config
    example = tgrpo.TrainExample(prompt_ids=rollout["prompt"], prompt_mask=jnp.ones((B, P), bool),
                                 completion_ids=rollout["completion"], completion_mask=rollout["mask"],
                                 advantages=advantages, ref_per_token_logps=ref, old_per_token_logps=old)

    def loss(logits):
        return algo_core.grpo_loss_fn(LogitsModel(logits), example, algo, pad_id=0, eos_id=1)

    return loss


@pytest.mark.parametrize("mode", common.LOSS_AGG_MODES)
@pytest.mark.parametrize("with_old, beta, kl_loss_mode", [(False, 0.0, "kl"), (True, 0.0, "kl"),
                                                          (True, 0.04, "low_var_kl"), (False, 0.1, "mse_kl")])
def test_grpo_policy_loss_and_gradient_equal_tunix(rollout, mode, with_old, beta, kl_loss_mode):
    advantages = jnp.asarray(compute_advantages(rollout["rewards"], 2), jnp.float32)
    logps = ours_logps(rollout)
    old = logps + rollout["old"] if with_old else None
    ref = logps + rollout["ref"] if beta else None
    settings = dict(beta=beta, epsilon=0.2, loss_agg_mode=mode, kl_loss_mode=kl_loss_mode)
    theirs = _tunix_grpo(rollout, advantages, old, ref, **settings)
    config = GRPOConfig(num_generations=2, **settings)

    def ours(logits):
        logps = ours_logps({**rollout, "logits": logits})
        return grpo_policy_loss(logps, old, ref, advantages, rollout["mask"], config)

    (loss, aux), grad = jax.value_and_grad(ours, has_aux=True)(rollout["logits"])
    (their_loss, their_aux), their_grad = jax.value_and_grad(theirs, has_aux=True)(rollout["logits"])
    np.testing.assert_allclose(loss, their_loss, **TOL)
    np.testing.assert_allclose(grad, their_grad, **TOL)
    for name in ("pg_loss", "kl", "kl_loss", "pg_clipfrac", "ppo_kl", "advantage/abs_mean"):
        np.testing.assert_allclose(aux[name], their_aux[name], err_msg=name, **TOL)


# -- one LoRA SFT step, tunix's PeftTrainer vs ours ------------------------------------------------

class TunixSignature(fnnx.Module):
    """The flax twin of our model, called the way tunix's default SFT loss calls a model."""

    def __init__(self, model):
        self.model = model

    def __call__(self, tokens, positions, cache, attention_mask):
        return self.model(tokens), cache


def test_one_lora_sft_step_equals_tunix_peft_trainer_on_the_same_weights():
    config = load_config(None, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64,
                         max_seq_len=16, seq_len=16, progress=False)
    ours = Transformer(config, rngs=nnx.Rngs(0))
    graphdef, params = twin.copy_params(nnx.state(ours, nnx.Param), config)
    theirs = TunixSignature(fnnx.merge(graphdef, params))
    train, _ = tasks.make_problems(seed=0, heldout=8)
    batch = tasks.sft_batch(train[:8], ByteTokenizer())
    tokens, input_mask = jnp.asarray(batch["input_tokens"]), jnp.asarray(batch["input_mask"])
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    attention_mask = tcommon.make_causal_attn_mask(jnp.ones_like(tokens))

    ours = sq.apply_lora_to_model(ours, sq.LoraProvider(module_path=".*", rank=4, alpha=8.0), tokens,
                                  rngs=nnx.Rngs(1))
    theirs = qwix.apply_lora_to_model(theirs, qwix.LoraProvider(module_path=".*", rank=4, alpha=8.0), tokens,
                                      positions, None, attention_mask)
    # The same adapters on both sides, with B nonzero so that A gets a gradient too.
    ours_adapters = nnx.to_pure_dict(nnx.state(ours, sq.LoRAParam))
    flat = {path: value for path, value in nnx.to_flat_state(nnx.state(ours, sq.LoRAParam))}
    for path, variable in flat.items():
        if path[-1].endswith("_lora_b"):
            seed = zlib.crc32(repr(path).encode()) % 1000  # the same in every process, unlike hash(path)
            variable[...] = 0.05 * jax.random.normal(jax.random.key(seed), variable.shape)
    ours_adapters = nnx.to_pure_dict(nnx.state(ours, sq.LoRAParam))
    their_state = fnnx.state(theirs, fnnx.LoRAParam)
    fnnx.replace_by_pure_dict(their_state, {"model": jax.tree.map(lambda x: jnp.array(x, copy=True),
                                                                  ours_adapters)})
    fnnx.update(theirs, their_state)

    mine = PeftTrainer(ours, optax.sgd(0.5), TrainingConfig(eval_every_n_steps=10, max_steps=1))
    mine.train([batch])
    reference = tpeft.PeftTrainer(theirs, real_optax.sgd(0.5), tpeft.TrainingConfig(eval_every_n_steps=10,
                                                                                     max_steps=1))
    extra = {"positions": positions, "attention_mask": attention_mask}
    reference.with_gen_model_input_fn(lambda x: {**x, **extra})
    reference.train([{"input_tokens": tokens, "input_mask": input_mask}])

    after = nnx.to_pure_dict(nnx.state(ours, sq.LoRAParam))
    their_after = fnnx.to_pure_dict(fnnx.state(theirs, fnnx.LoRAParam))["model"]
    moved = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), after, ours_adapters)
    assert min(jax.tree.leaves(moved)) > 0  # both A and B moved
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), after, their_after)
