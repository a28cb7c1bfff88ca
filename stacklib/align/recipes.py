"""The book's recipes, in one place: brief SFT to a modest accuracy, then GRPO on top.

Chapter 13, the capstone, the tests and `make bench ONLY=align` all call these, so they
measure the same thing. Expensive results are cached per machine by zoo.py.

    recipe = Recipe(seed=0)
    start = sft_start(recipe)            # stdlib-bytes, SFT until validation accuracy >= 30 %
    result = grpo(start.model, recipe)   # ~150 GRPO steps: held-out accuracy rises by 20+ points

Why these settings (measured on the 2-core CPU; tests/test_align_recipe.py checks the outcome):

* **SFT only a little.** The pretrained byte-level model has never seen arithmetic (0 %
  held out). Full SFT at lr 1e-3 learns addition in ~800 steps, through a sharp
  transition around steps 350-500. We stop on the way up, as soon as greedy accuracy on
  a validation slice of the *training* problems reaches 30 %: there, sampling finds a right
  answer for most prompts within 8 tries (pass@8 well above greedy pass@1), which is what
  GRPO needs: a group with one right answer among wrong ones is a learning signal; a group
  of all-wrong (or all-right) answers is not (its advantages are all 0).
* **GRPO:** 8 generations per prompt at temperature 1, 64 prompts per step (512
  completions), Adam at 2e-4, beta 0 (no reference pass; the clip is inactive with one
  iteration per batch), exact-match reward only. Adam at 1e-3 made the first steps lose
  half the accuracy; 32 prompts per step learned about half as fast per step.
* **The task is easy enough:** answers are 1-3 digits and end with "\\n", so a
  completion is 4 tokens and a rollout is one prefill and three decode steps.

Measured (the zoo's models, trained in its fixed process: one CPU device, one core; greedy
accuracy on the 257 held-out problems):

    seed                 0       1       2
    base              0.0 %   0.0 %   0.0 %
    SFT start        31.9 %  30.7 %  29.6 %   (400, 375, 350 steps, ~10 s each)
    SFT + GRPO       63.4 %  53.7 %  63.0 %   (+31.5, +23.0, +33.5 points in 150 steps)

A GRPO step costs about 0.4 s on one core (512 completions sampled, scored and trained on),
80 % of it the update: 150 steps took 59-65 s.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import numpy as np

import stacklib.nn as nnx
import stacklib.optim as optax
from stacklib.align import tasks
from stacklib.align.grpo_learner import GRPOConfig, GRPOLearner
from stacklib.align.peft_trainer import PeftTrainer, TrainingConfig
from stacklib.align.rl_cluster import ClusterConfig, Mode, RLCluster, RLTrainingConfig, RolloutConfig


@dataclasses.dataclass(frozen=True)
class Recipe:
    """Every setting of the SFT -> GRPO recipe. `seed` varies the run; `split_seed` fixes the problems."""

    seed: int = 0
    split_seed: int = 0
    heldout: int = 256
    validation: int = 256
    base_model: str = "stdlib-bytes"
    # SFT to a modest accuracy
    sft_learning_rate: float = 1e-3
    sft_batch_size: int = 64
    sft_eval_every: int = 25
    sft_target_accuracy: float = 0.3
    sft_max_steps: int = 1000
    # GRPO
    grpo_learning_rate: float = 2e-4
    grpo_prompts: int = 64
    num_generations: int = 8
    grpo_steps: int = 150
    temperature: float = 1.0
    beta: float = 0.0
    epsilon: float = 0.2
    loss_agg_mode: str = "sequence-mean-token-mean"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class Problems(NamedTuple):
    """The recipe's problems: SFT trains on `sft`, stops on `validation`; GRPO's prompts are `sft` +
    `validation` (all training problems); `heldout` is only ever evaluated."""

    sft: list[tasks.Problem]
    validation: list[tasks.Problem]
    heldout: list[tasks.Problem]

    @property
    def train(self) -> list[tasks.Problem]:
        return self.sft + self.validation


def problems(recipe: Recipe = Recipe()) -> Problems:
    train, heldout = tasks.make_problems(seed=recipe.split_seed, heldout=recipe.heldout)
    return Problems(train[recipe.validation:], train[:recipe.validation], heldout)


class SftResult(NamedTuple):
    model: Any
    steps: int
    validation_accuracy: float
    seconds: float  # training steps only (validation checks excluded)
    trainer: PeftTrainer


def base_model(recipe: Recipe = Recipe()):
    """A fresh copy of the pretrained base model, and its tokenizer (chapter 12's zoo)."""
    from stacklib import llm

    model, tokenizer = llm.pretrained(recipe.base_model)
    return nnx.clone(model), tokenizer


def sft_start(recipe: Recipe = Recipe(), model=None, tokenizer=None) -> SftResult:
    """Full SFT of the base model until greedy validation accuracy reaches `sft_target_accuracy`.

    Checks every `sft_eval_every` steps; stops at `sft_max_steps` regardless. `model` (default:
    a copy of the base) is trained in place.
    """
    if model is None:
        model, tokenizer = base_model(recipe)
    data = problems(recipe)
    config = TrainingConfig(eval_every_n_steps=recipe.sft_eval_every, max_steps=recipe.sft_eval_every)
    trainer = PeftTrainer(model, optax.adam(recipe.sft_learning_rate), config)
    batches = tasks.sft_batches(data.sft, tokenizer, recipe.sft_batch_size, seed=recipe.seed)
    accuracy = 0.0
    while trainer.train_steps < recipe.sft_max_steps:
        trainer.config.max_steps = trainer.train_steps + recipe.sft_eval_every
        trainer.train(batches)
        accuracy = tasks.heldout_accuracy(model, tokenizer, data.validation)
        trainer.metrics_logger.log("", "validation_accuracy", accuracy, "eval", trainer.train_steps)
        if accuracy >= recipe.sft_target_accuracy:
            break
    return SftResult(model, trainer.train_steps, accuracy, trainer.train_time, trainer)


class GrpoResult(NamedTuple):
    model: Any
    learner: GRPOLearner
    seconds: float  # rollouts and updates (evaluations excluded)


def grpo_cluster(model, tokenizer, recipe: Recipe = Recipe(), *, max_steps: int | None = None,
                 eval_every_n_steps: int = 25) -> RLCluster:
    """The RLCluster of the recipe: `model` is the actor, a clone of it the reference."""
    rollout = RolloutConfig(max_tokens_to_generate=tasks.ANSWER_TOKENS, temperature=recipe.temperature,
                            max_prompt_length=tasks.PROMPT_WIDTH, eos_tokens=[tasks.STOP_ID],
                            seed=recipe.seed)
    greedy = dataclasses.replace(rollout, temperature=0.0)
    training = RLTrainingConfig(actor_optimizer=optax.adam(recipe.grpo_learning_rate),
                                eval_every_n_steps=eval_every_n_steps,
                                max_steps=recipe.grpo_steps if max_steps is None else max_steps)
    config = ClusterConfig(training_config=training, rollout_config={Mode.TRAIN: rollout, Mode.EVAL: greedy})
    return RLCluster(actor=model, reference=nnx.clone(model), tokenizer=tokenizer, cluster_config=config)


def eval_batches(problem_list, batch_size: int = 512) -> list[dict[str, np.ndarray]]:
    """Held-out problems as GRPO eval batches (greedy rollouts score them: accuracy)."""
    return [{"prompts": np.array([p.prompt for p in problem_list[i:i + batch_size]]),
             "answer": np.array([p.answer for p in problem_list[i:i + batch_size]])}
            for i in range(0, len(problem_list), batch_size)]


def grpo(model, recipe: Recipe = Recipe(), tokenizer=None, *, steps: int | None = None,
         eval_every_n_steps: int | None = None, reward_fns=None) -> GrpoResult:
    """GRPO on `model` (trained in place) with the recipe's settings.

    With `eval_every_n_steps`, held-out accuracy is logged as 'rewards/exact_match_reward'
    in mode 'eval' of `result.learner.rl_cluster.metrics_logger` (before training and every n steps).
    """
    if tokenizer is None:
        from stacklib.llm import ByteTokenizer

        tokenizer = ByteTokenizer()
    data = problems(recipe)
    cluster = grpo_cluster(model, tokenizer, recipe, max_steps=steps,
                           eval_every_n_steps=eval_every_n_steps or 1)
    config = GRPOConfig(num_generations=recipe.num_generations, beta=recipe.beta, epsilon=recipe.epsilon,
                        loss_agg_mode=recipe.loss_agg_mode)
    learner = GRPOLearner(cluster, config, reward_fns or [tasks.exact_match_reward])
    learner.train(tasks.prompt_batches(data.train, recipe.grpo_prompts, seed=recipe.seed + 1),
                  eval_batches(data.heldout) if eval_every_n_steps else None)
    return GrpoResult(model, learner, learner.train_time)


__all__ = ["GrpoResult", "Problems", "Recipe", "SftResult", "base_model", "eval_batches", "grpo",
           "grpo_cluster", "problems", "sft_start"]
