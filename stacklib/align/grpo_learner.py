"""Group relative policy optimisation: `GRPOLearner`, `GRPOConfig`, and its pure pieces.

Mirrors `tunix.rl.grpo.grpo_learner` and the GRPO parts of `tunix.rl.algo_core`
(google-tunix 0.1.7). For each prompt q the rollout model samples a group of G
completions o_1..o_G, reward functions score them, and each completion's advantage is
its reward standardised within its group (no value model):

    A_i = (r_i - mean(r_1..r_G)) / (std(r_1..r_G) + 1e-6)        (std with ddof=1)

Then every token t of o_i is pushed along A_i by PPO's clipped objective, with the ratio
of the current policy to the one that sampled (pi_old), and pulled back towards the
frozen reference by a KL penalty (Shao et al. 2024, eq. 3):

    rho_it = exp(log pi(o_it) - log pi_old(o_it))
    loss_it = max(-A_i rho_it, -A_i clip(rho_it, 1 - eps, 1 + eps_high)) + beta KL_it

aggregated over the completion tokens by `loss_agg_mode` (common.aggregate_loss). With
`num_iterations` = 1 the policy that sampled is the one being differentiated, so pi_old
is pi with its gradient stopped and rho = 1 (the clip only matters from the second
iteration on a batch).

    learner = GRPOLearner(rl_cluster, GRPOConfig(num_generations=8, beta=0.0), [tasks.exact_match_reward])
    learner.train(tasks.prompt_batches(train, 64))        # {"prompts": ..., "answer": ...} batches

Reward functions are `fn(prompts, completions, **kwargs) -> list[float]`, one number per
completion; every prompt arrives once per completion of its group, and so does each other
column of the batch (e.g. `answer`). Rewards of several functions are summed.

Differences from tunix:
- `grpo_policy_loss(per_token_logps, old_per_token_logps, ref_per_token_logps, advantages,
  completion_mask, config)` is the pure loss; tunix computes it inside `grpo_loss_fn(model,
  train_example, algo_config, pad_id, eos_id)`, which is ours with the log-probs computed first.
- No dual-clip (`epsilon_c`), GSPO, sampler importance weights, entropy metric,
  asynchronous rollouts or mini-batches; `advantage_estimator` "grpo" only.
- `GRPOLearner(rl_cluster, algo_config, reward_fns)` is tunix 0.1.7's order; the older
  `GRPOLearner(rl_cluster, reward_fns, grpo_config)` is accepted too.
- A reward function that raises, returns the wrong number of rewards or a non-finite one
  stops training with an error naming it (tunix raises for None or a wrong length).
- Evaluation (`eval_ds`) samples each prompt once with the `Mode.EVAL` rollout config (set
  temperature=0 for greedy) and logs each reward function's mean as 'rewards/<name>'
  in mode 'eval': with exact match and greedy decoding, that is held-out accuracy.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from stacklib.align.common import (
    KL_METHODS,
    LOSS_AGG_MODES,
    aggregate_loss,
    compute_kl_divergence,
    masked_mean,
    per_token_logps,
)
from stacklib.align.rl_cluster import Mode, RLCluster

RewardFn = Callable[..., Sequence[float]]


@dataclasses.dataclass(kw_only=True)
class GRPOConfig:
    """GRPO's hyperparameters (tunix's names and defaults).

    Attributes:
      num_generations: G, completions per prompt (>= 2: advantages compare within a group).
      num_iterations: mu, optimizer steps on each rollout batch (> 1 makes the clip matter).
      beta: weight of the KL penalty to the reference (0 disables it, and the reference pass).
      epsilon, epsilon_high: the ratio is clipped to [1 - epsilon, 1 + epsilon_high]
        (epsilon_high None: epsilon).
      loss_agg_mode: how per-token losses become one number (common.LOSS_AGG_MODES).
      kl_loss_mode: the KL estimator (common.KL_METHODS); tunix's default is "kl".
      kl_clamp_value: clip each token's KL to +-this (None: no clip).
      temperature: the rollout temperature; GRPOLearner sets it from the rollout config so
        that the log-probs are those of the distribution that sampled.
    """

    num_generations: int = 2
    num_iterations: int = 1
    beta: float = 0.04
    epsilon: float = 0.2
    epsilon_high: float | None = None
    loss_agg_mode: str = "sequence-mean-token-mean"
    kl_loss_mode: str = "kl"
    kl_clamp_value: float | None = None
    temperature: float = 1.0
    advantage_estimator: str = "grpo"

    def __post_init__(self):
        if not isinstance(self.num_generations, int) or self.num_generations < 2:
            raise ValueError(f"num_generations={self.num_generations!r}: GRPO compares completions within a "
                             "group, so it needs at least 2 per prompt (e.g. num_generations=8).")
        if not isinstance(self.num_iterations, int) or self.num_iterations < 1:
            raise ValueError(f"num_iterations={self.num_iterations!r} must be a positive integer.")
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"loss_agg_mode={self.loss_agg_mode!r} is not supported; use one of "
                             f"{LOSS_AGG_MODES}.")
        if self.kl_loss_mode not in KL_METHODS:
            raise ValueError(f"kl_loss_mode={self.kl_loss_mode!r} is not a KL estimator; use one of "
                             f"{KL_METHODS}.")
        if self.advantage_estimator != "grpo":
            raise ValueError(f"advantage_estimator={self.advantage_estimator!r}: only 'grpo' is "
                             "implemented.")
        if not self.epsilon > 0 or self.beta < 0:
            raise ValueError(f"epsilon={self.epsilon} must be > 0 and beta={self.beta} >= 0.")


GrpoConfig = GRPOConfig


def compute_advantages(rewards: np.ndarray, num_generations: int) -> np.ndarray:
    """Group-relative advantages: each reward standardised within its group of `num_generations`.

    Args:
      rewards: (N,) with N = prompts * num_generations, a group's completions adjacent.

    Returns:
      (N,) (r - group mean) / (group std with ddof=1 + 1e-6); 0 for a group whose rewards are equal.

    Raises:
      ValueError: num_generations < 2, no rewards, or N not a multiple of num_generations.
    """
    rewards = np.asarray(rewards)
    if num_generations < 2:
        raise ValueError(f"num_generations={num_generations}: a group needs at least 2 completions to "
                         "compare.")
    if rewards.size == 0:
        raise ValueError("No rewards: the batch has no prompts (an empty group). Give each step at least "
                         "one prompt.")
    if rewards.ndim != 1 or rewards.size % num_generations:
        raise ValueError(f"{rewards.size} rewards do not split into groups of "
                         f"num_generations={num_generations}; "
                         "give one reward per completion, each prompt's completions adjacent.")
    grouped = rewards.reshape(-1, num_generations)
    mean = grouped.mean(axis=-1).repeat(num_generations)
    std = grouped.std(axis=-1, ddof=1).repeat(num_generations)
    return (rewards - mean) / (std + 1e-6)


class TrainExample(NamedTuple):
    """One rollout batch, ready for the loss (tunix's fields)."""

    prompt_ids: jax.Array  # (N, P)
    prompt_mask: jax.Array  # (N, P)
    completion_ids: jax.Array  # (N, C)
    completion_mask: jax.Array  # (N, C)
    advantages: jax.Array  # (N,)
    ref_per_token_logps: jax.Array | None  # (N, C), None when beta == 0
    old_per_token_logps: jax.Array | None  # (N, C), None when num_iterations == 1


def grpo_policy_loss(per_token_logps: jax.Array, old_per_token_logps: jax.Array | None,
                     ref_per_token_logps: jax.Array | None, advantages: jax.Array, completion_mask: jax.Array,
                     config: GRPOConfig) -> tuple[jax.Array, dict[str, jax.Array]]:
    """GRPO's loss from log-probs and masks, as in tunix's `grpo_loss_fn`.

    Args:
      per_token_logps: (N, C) log pi(o_t) of the policy being trained (differentiable).
      old_per_token_logps: (N, C) of the policy that sampled; None: `per_token_logps` with its
        gradient stopped (num_iterations == 1).
      ref_per_token_logps: (N, C) of the reference; None: no KL term.
      advantages: (N,) one per completion.
      completion_mask: (N, C) 1 on completion tokens.

    Returns:
      (loss, aux) with aux "pg_loss", "kl" (mean per-token KL), "kl_loss", "pg_clipfrac",
      "ppo_kl", "advantage/abs_mean".
    """
    mask = completion_mask.astype(jnp.float32)
    logps = per_token_logps.astype(jnp.float32)
    old = (jax.lax.stop_gradient(logps) if old_per_token_logps is None
           else old_per_token_logps.astype(jnp.float32))
    log_ratio = logps - old
    ppo_kl = masked_mean(-log_ratio, mask)
    ratio = jnp.exp(jnp.clip(log_ratio, -20.0, 20.0))  # (N, C)
    adv = advantages.astype(jnp.float32)[:, None]  # (N, 1): one advantage for every token of a completion
    epsilon_high = config.epsilon if config.epsilon_high is None else config.epsilon_high
    unclipped = -adv * ratio
    clipped = -adv * jnp.clip(ratio, 1 - config.epsilon, 1 + epsilon_high)
    per_token_loss = jnp.maximum(unclipped, clipped)  # pessimistic: the worse of the two
    loss = aggregate_loss(per_token_loss, mask, config.loss_agg_mode)
    aux = {"pg_loss": loss, "pg_clipfrac": masked_mean((clipped > unclipped).astype(jnp.float32), mask),
           "ppo_kl": ppo_kl, "kl": jnp.float32(0.0), "kl_loss": jnp.float32(0.0),
           "advantage/abs_mean": masked_mean(jnp.abs(jnp.broadcast_to(adv, mask.shape)), mask)}
    if ref_per_token_logps is not None:
        kl = compute_kl_divergence(logps, ref_per_token_logps, config.kl_loss_mode,
                                   clamp_value=config.kl_clamp_value)
        aux["kl"] = (kl * mask).sum() / jnp.clip(mask.sum(), min=1)
        aux["kl_loss"] = aggregate_loss(kl, mask, config.loss_agg_mode)
        if config.beta:
            loss = loss + config.beta * aux["kl_loss"]
    return loss, aux


def grpo_loss_fn(model: Any, train_example: TrainExample, algo_config: GRPOConfig) -> tuple[jax.Array, dict]:
    """The actor's loss: its per-token log-probs of the rollout, then `grpo_policy_loss`."""
    logps = per_token_logps(model, train_example.prompt_ids, train_example.completion_ids,
                            temperature=algo_config.temperature or 1.0, stop_gradient=False)
    return grpo_policy_loss(logps, train_example.old_per_token_logps, train_example.ref_per_token_logps,
                            train_example.advantages, train_example.completion_mask, algo_config)


def _name(fn: Callable) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


class GRPOLearner:
    """Samples groups from the cluster's rollout model, scores them, and trains its actor with GRPO."""

    def __init__(self, rl_cluster: RLCluster, algo_config: GRPOConfig | None = None,
                 reward_fns: RewardFn | Sequence[RewardFn] | None = None, metric_fns: Sequence[Callable] = (),
                 *, grpo_config: GRPOConfig | None = None):
        if isinstance(reward_fns, GRPOConfig) and not isinstance(algo_config, GRPOConfig):
            # the older (rl_cluster, reward_fns, grpo_config) order
            algo_config, reward_fns = reward_fns, algo_config
        algo_config = algo_config if grpo_config is None else grpo_config
        if not isinstance(algo_config, GRPOConfig):
            raise TypeError(f"GRPOLearner needs a GRPOConfig, got {type(algo_config).__name__}: "
                            "GRPOLearner(rl_cluster, GRPOConfig(num_generations=8), [reward_fn]).")
        reward_fns = [reward_fns] if callable(reward_fns) else list(reward_fns or [])
        if not reward_fns:
            raise ValueError("GRPOLearner needs at least one reward function fn(prompts, completions, "
                             "**kwargs).")
        self.rl_cluster = rl_cluster
        self.algo_config = dataclasses.replace(algo_config)
        self.algo_config.temperature = rl_cluster.get_rollout_config(Mode.TRAIN).temperature
        self.reward_fns = reward_fns
        self.metric_fns = list(metric_fns)
        self.train_time = 0.0
        trainer = rl_cluster.actor_trainer
        trainer.with_loss_fn(grpo_loss_fn, has_aux=True)
        config = self.algo_config
        trainer.with_gen_model_input_fn(lambda x: {"train_example": x, "algo_config": config})
        trainer.metrics_prefix = ""
        trainer.is_managed_externally = True  # max_steps counts rollout batches, which the learner counts

    # -- rewards ---------------------------------------------------------------------------------
    def _compute_rewards(self, prompts: list[str], completions: list[str], mode: Mode = Mode.TRAIN,
                         **kwargs: Any) -> np.ndarray:
        """The sum of the reward functions, (N,); each one's mean is logged as 'rewards/<name>'."""
        total = np.zeros(len(prompts))
        for fn in self.reward_fns:
            try:
                values = fn(prompts=prompts, completions=completions, **kwargs)
            except Exception as error:
                raise RuntimeError(
                    f"Reward function {_name(fn)!r} raised {type(error).__name__}: {error}. It is called as "
                    "fn(prompts=..., completions=..., **columns) with one entry per completion; the batch's "
                    f"other columns are {sorted(kwargs)}.") from error
            if values is None or len(values) != len(prompts):
                got = "None" if values is None else f"{len(values)} values"
                raise ValueError(f"Reward function {_name(fn)!r} returned {got} for {len(prompts)} "
                                 "completions; return one float per completion, in order.")
            values = np.asarray(values, dtype=np.float64)
            if not np.all(np.isfinite(values)):
                raise ValueError(f"Reward function {_name(fn)!r} returned a non-finite reward "
                                 f"({values[~np.isfinite(values)][:3]}); rewards must be finite numbers.")
            total += values
            self.rl_cluster.buffer_metrics({f"rewards/{_name(fn)}": float(values.mean())}, mode)
        return total

    def _split_batch(self, batch: Any) -> tuple[list[str], dict[str, Any]]:
        if not isinstance(batch, dict) or "prompts" not in batch:
            raise ValueError("Each GRPO batch must be a dict with a 'prompts' entry (and any columns the "
                             "reward functions need), e.g. {'prompts': np.array([...]), "
                             "'answer': np.array([...])}.")
        prompts = [str(p) for p in np.asarray(batch["prompts"]).reshape(-1)]
        if not prompts:
            raise ValueError("A batch has no prompts (an empty group); give every step at least one prompt.")
        columns = {k: list(np.asarray(v).reshape(len(prompts), *np.shape(v)[1:])) for k, v in batch.items()
                   if k != "prompts"}
        return prompts, columns

    def _generate_and_compute_advantage(self, batch: Any, mode: Mode = Mode.TRAIN) -> TrainExample:
        prompts, columns = self._split_batch(batch)
        G = self.algo_config.num_generations
        prompts = [p for p in prompts for _ in range(G)]  # each prompt G times, a group adjacent
        columns = {k: [v for v in values for _ in range(G)] for k, values in columns.items()}
        cluster = self.rl_cluster
        rollout = cluster.generate(prompts, mode)
        rewards = self._compute_rewards(prompts, rollout.text, mode, **columns)
        advantages = compute_advantages(rewards, G)
        prompt_ids = jnp.asarray(rollout.left_padded_prompt_tokens)
        completion_ids = jnp.asarray(rollout.tokens)
        ref = old = None
        if self.algo_config.beta != 0.0:
            ref = cluster.get_ref_per_token_logps(prompt_ids, completion_ids)
        if self.algo_config.num_iterations > 1:
            old = cluster.get_old_per_token_logps(prompt_ids, completion_ids)
        lengths = rollout.completion_mask.sum(axis=-1)
        cluster.buffer_metrics({"rewards/mean": float(rewards.mean()), "rewards/max": float(rewards.max()),
                                "rewards/min": float(rewards.min()),
                                "completions/mean_length": float(lengths.mean())}, mode)
        for metric_fn in self.metric_fns:
            cluster.buffer_metrics(metric_fn(prompts=prompts, completions=rollout.text, rewards=rewards,
                                             advantages=advantages, **columns), mode)
        return TrainExample(prompt_ids, prompt_ids != cluster.pad_id(), completion_ids,
                            jnp.asarray(rollout.completion_mask), jnp.asarray(advantages, jnp.float32),
                            ref, old)

    # -- the loop ----------------------------------------------------------------------------------
    def evaluate(self, eval_ds: Iterable[Any]) -> dict[str, float]:
        """Each reward function's mean over `eval_ds`, one completion per prompt (Mode.EVAL rollouts)."""
        sums: dict[str, float] = {}
        count = 0
        for batch in eval_ds:
            prompts, columns = self._split_batch(batch)
            rollout = self.rl_cluster.generate(prompts, Mode.EVAL)
            for fn in self.reward_fns:
                values = fn(prompts=prompts, completions=rollout.text, **columns)
                sums[_name(fn)] = sums.get(_name(fn), 0.0) + float(np.sum(values))
            count += len(prompts)
        results = {f"rewards/{name}": total / max(count, 1) for name, total in sums.items()}
        self.rl_cluster.buffer_metrics(results, Mode.EVAL)
        return results

    def train(self, train_ds: Iterable[Any], eval_ds: Iterable[Any] | None = None) -> None:
        """Until `max_steps` rollout batches (or the end of `train_ds`): sample, score, update.

        `eval_ds` (a list of batches) is evaluated before training and every `eval_every_n_steps`.
        """
        cluster = self.rl_cluster
        training = cluster.cluster_config.training_config
        max_steps = training.max_steps if training.max_steps is not None else math.inf
        if eval_ds is not None:
            self.evaluate(eval_ds)
        start, eval_time = time.perf_counter(), 0.0
        for batch in train_ds:
            if cluster.global_steps >= max_steps:
                break
            example = self._generate_and_compute_advantage(batch)
            cluster.global_steps += 1
            cluster.actor_trainer.train([example] * self.algo_config.num_iterations)
            if eval_ds is not None and cluster.global_steps % training.eval_every_n_steps == 0:
                eval_start = time.perf_counter()
                self.evaluate(eval_ds)
                eval_time += time.perf_counter() - eval_start
        self.train_time += time.perf_counter() - start - eval_time


GrpoLearner = GRPOLearner

__all__ = ["GRPOConfig", "GRPOLearner", "GrpoConfig", "GrpoLearner", "TrainExample", "compute_advantages",
           "grpo_loss_fn", "grpo_policy_loss"]
