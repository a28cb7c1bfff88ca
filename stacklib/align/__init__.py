"""stacklib.align: post-training (SFT, LoRA, DPO, GRPO), a documented subset of Tunix.

Use it where you would use google-tunix (0.1.7) on a small model:

    from stacklib import align
    trainer = align.PeftTrainer(model, optax.adam(1e-3), align.TrainingConfig(eval_every_n_steps=50))
    trainer.train(align.tasks.sft_batches(train, tokenizer, 64, num_batches=300))
    align.tasks.heldout_accuracy(model, tokenizer, heldout)      # greedy exact match

    start = align.recipes.sft_start(align.recipes.Recipe(seed=0))   # the book's recipe: SFT a little,
    result = align.recipes.grpo(start.model)                          # then GRPO (+20 points held out)

The pieces, one file each:
  tasks.py         the verifiable task (addition up to 99), its splits, layout, rewards,
                   preference pairs and held-out accuracy
  common.py        pure functions: per-token log-probs, completion masks, KL estimators,
                   aggregate_loss (tunix.rl.common)
  peft_trainer.py  PeftTrainer, TrainingConfig, TrainingInput: SFT with the prompt masked out,
                   gradient accumulation, LoRA/QLoRA adapters only (tunix.sft.peft_trainer)
  dpo_trainer.py   DPOTrainer, DPOTrainingConfig, dpo_loss_fn: preference pairs against a
                   frozen reference (tunix.sft.dpo.dpo_trainer)
  rl_cluster.py    RLCluster, Role, ClusterConfig, RolloutConfig, RLTrainingConfig: the actor,
                   the frozen reference and the rollout model, kept apart (tunix.rl.rl_cluster)
  grpo_learner.py  GRPOLearner, GRPOConfig, compute_advantages, grpo_policy_loss: group-relative
                   advantages, the clipped objective, the KL penalty (tunix.rl.grpo)
  recipes.py       the book's SFT -> GRPO recipe, its settings and why
  zoo.py           the recipe's models, trained once per machine and cached

Layer 4: it imports llm, quant, nn, optim (never infer, serve or the capstone). Each
file's docstring lists its differences from tunix.
"""

from stacklib.align import common, recipes, tasks
from stacklib.align.dpo_trainer import DPOTrainer, DPOTrainingConfig, dpo_loss_fn
from stacklib.align.grpo_learner import GRPOConfig, GRPOLearner, compute_advantages, grpo_policy_loss
from stacklib.align.peft_trainer import MetricsLogger, PeftTrainer, TrainingConfig, TrainingInput
from stacklib.align.rl_cluster import ClusterConfig, Mode, RLCluster, RLTrainingConfig, Role, RolloutConfig

__all__ = [
    "ClusterConfig", "DPOTrainer", "DPOTrainingConfig", "GRPOConfig", "GRPOLearner", "MetricsLogger", "Mode",
    "PeftTrainer", "RLCluster", "RLTrainingConfig", "Role", "RolloutConfig", "TrainingConfig",
    "TrainingInput",
    "common", "compute_advantages", "dpo_loss_fn", "grpo_policy_loss", "recipes", "tasks",
]
