"""Direct preference optimisation: `DPOTrainer`, `DPOTrainingConfig`, `dpo_loss_fn`.

Mirrors `tunix.sft.dpo.dpo_trainer` (google-tunix 0.1.7). DPO trains on pairs (a
prompt x, a chosen answer y_w, a rejected answer y_l) without a reward model and
without sampling: with the log-ratios of policy to frozen reference

    h_w = log pi(y_w | x) - log pi_ref(y_w | x),   h_l = the same for y_l,

the loss is a logistic regression on their difference (Rafailov et al. 2023, eq. 7):

    L = -(1 - s) log sigmoid(beta (h_w - h_l)) - s log sigmoid(-beta (h_w - h_l))

with label smoothing s (0 in the paper; > 0 assumes a share s of the labels are flipped,
"conservative DPO"). beta sets how far the policy may move from the reference: the
implicit reward of an answer is `beta * h`. Metrics, as tunix logs them:
rewards/chosen = mean beta h_w, rewards/rejected = mean beta h_l, rewards/margin = their
difference, rewards/accuracy = the share of pairs with beta h_w > beta h_l, and
log_probs/chosen, log_probs/rejected.

    trainer = DPOTrainer(policy, reference, optax.adam(1e-4), DPOTrainingConfig(eval_every_n_steps=10,
                                                                                 max_steps=100, beta=0.1))
    trainer.train([tasks.preference_batch(problems, tokenizer)])   # TrainingInput fields

`dpo_loss_fn` is the pure function of the four sequence log-probabilities; the trainer's
loss (`dpo_model_loss`) computes them with one forward pass over chosen and rejected
rows stacked, as tunix does.

Differences from tunix:
- `dpo_loss_fn(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, beta,
  label_smoothing)` is the pure loss; tunix's `dpo_loss_fn(model, train_example, ...)` is
  our `dpo_model_loss`.
- DPO only: no ORPO (`algorithm="orpo"` raises), no string inputs (tokenize with
  `tasks.preference_batch`), no images.
- Inputs use our fixed layout (tasks.py): prompts left-padded with id 0 and no attention
  mask; `prompt_mask` is checked for shape but the model attends to the padding.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import stacklib.nn as nnx
from stacklib.align.common import logps_from_logits
from stacklib.align.peft_trainer import PeftTrainer, TrainingConfig


@dataclasses.dataclass(slots=True, kw_only=True)
class DPOTrainingConfig(TrainingConfig):
    """`TrainingConfig` plus DPO's beta and label smoothing (tunix's defaults)."""

    algorithm: str = "dpo"
    beta: float = 0.1
    label_smoothing: float = 0.0

    def __post_init__(self):
        TrainingConfig.__post_init__(self)
        if self.algorithm != "dpo":
            raise ValueError(f"algorithm={self.algorithm!r}: stacklib.align implements DPO only; "
                             "use algorithm='dpo' (or tunix's DPOTrainer for ORPO).")
        if not self.beta > 0:
            raise ValueError(f"beta={self.beta!r} must be positive (e.g. 0.1): it scales the log-ratios.")
        if not 0 <= self.label_smoothing < 0.5:
            raise ValueError(f"label_smoothing={self.label_smoothing!r} must lie in [0, 0.5): "
                             "the share of preference labels assumed flipped.")


class TrainingInput(NamedTuple):
    """Tokenized pairs (tunix's fields): prompts left-padded, answers right-padded, masks 1 on real tokens."""

    prompt_ids: Any  # (B, P)
    prompt_mask: Any  # (B, P)
    chosen_ids: Any  # (B, C)
    chosen_mask: Any  # (B, C)
    rejected_ids: Any  # (B, C)
    rejected_mask: Any  # (B, C)


class TrainExample(NamedTuple):
    """What the step sees: chosen rows then rejected rows, and the reference's log-probs."""

    input_ids: jax.Array  # (2B, P + C): [prompt, chosen] rows, then [prompt, rejected] rows
    completion_mask: jax.Array  # (2B, C)
    ref_chosen_logps: jax.Array | None  # (B,)
    ref_rejected_logps: jax.Array | None  # (B,)


def dpo_loss_fn(chosen_logps: jax.Array, rejected_logps: jax.Array, ref_chosen_logps: jax.Array | None,
                ref_rejected_logps: jax.Array | None, beta: float = 0.1,
                label_smoothing: float = 0.0) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The DPO loss and tunix's metrics from sequence log-probabilities, each (B,).

    With no reference (None) the log-ratios are the policy's log-probs alone, as in tunix.

    Returns:
      (mean loss, {"rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy",
      "log_probs/chosen", "log_probs/rejected"}).
    """
    chosen_ratio = chosen_logps if ref_chosen_logps is None else chosen_logps - ref_chosen_logps
    rejected_ratio = rejected_logps if ref_rejected_logps is None else rejected_logps - ref_rejected_logps
    delta = chosen_ratio - rejected_ratio  # (B,)
    losses = -(jax.nn.log_sigmoid(beta * delta) * (1 - label_smoothing)
               + jax.nn.log_sigmoid(-beta * delta) * label_smoothing)
    chosen_rewards, rejected_rewards = beta * chosen_ratio, beta * rejected_ratio
    aux = {
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/margin": (chosen_rewards - rejected_rewards).mean(),
        "rewards/accuracy": (chosen_rewards > rejected_rewards).mean(),
        "log_probs/chosen": chosen_logps.mean(),
        "log_probs/rejected": rejected_logps.mean(),
    }
    return losses.mean(), aux


def compute_logps(model: Any, input_ids: jax.Array,
                  completion_mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Sequence log-probs of the completions in `input_ids` (chosen rows first), split in two halves."""
    C = completion_mask.shape[1]
    token_logps = logps_from_logits(model(input_ids), input_ids, C)  # (2B, C)
    sums = (token_logps * completion_mask).sum(axis=-1)  # (2B,)
    B = sums.shape[0] // 2
    return sums[:B], sums[B:]


@functools.partial(jax.jit, static_argnums=0)
def _reference_logps(graphdef, state, input_ids, completion_mask):
    return compute_logps(nnx.merge(graphdef, state), input_ids, completion_mask)


def dpo_model_loss(model: Any, train_example: TrainExample, beta: float = 0.1,
                   label_smoothing: float = 0.0) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The trainer's loss (tunix's `dpo_loss_fn`): one forward pass over both halves, then `dpo_loss_fn`."""
    chosen, rejected = compute_logps(model, train_example.input_ids, train_example.completion_mask)
    return dpo_loss_fn(chosen, rejected, train_example.ref_chosen_logps, train_example.ref_rejected_logps,
                       beta, label_smoothing)


def _check_pairs(batch: TrainingInput) -> None:
    B, P = np.shape(batch.prompt_ids)
    shapes = {name: np.shape(getattr(batch, name)) for name in TrainingInput._fields}
    if shapes["prompt_mask"] != (B, P):
        raise ValueError(f"prompt_mask has shape {shapes['prompt_mask']} but prompt_ids has {(B, P)}; "
                         "give one mask entry per prompt token.")
    for side in ("chosen", "rejected"):
        ids, mask = shapes[f"{side}_ids"], shapes[f"{side}_mask"]
        if ids[0] != B:
            raise ValueError(f"{side}_ids has {ids[0]} rows but there are {B} prompts: chosen and rejected "
                             "batches must pair one-to-one with the prompts (row i of each is prompt i's).")
        if mask != ids:
            raise ValueError(f"{side}_mask has shape {mask} but {side}_ids has {ids}; "
                             "give one mask entry per token.")
    if shapes["chosen_ids"] != shapes["rejected_ids"]:
        raise ValueError(f"chosen_ids {shapes['chosen_ids']} and rejected_ids {shapes['rejected_ids']} "
                         "differ in width; right-pad both to the same number of tokens "
                         "(tasks.encode_completions does).")


class DPOTrainer(PeftTrainer):
    """Trains `model` on preference pairs against the frozen `ref_model` (None: no reference term)."""

    def __init__(self, model: Any, ref_model: Any | None, optimizer, training_config: DPOTrainingConfig):
        if not isinstance(training_config, DPOTrainingConfig):
            raise TypeError("DPOTrainer needs a DPOTrainingConfig (it carries beta and label_smoothing), got "
                            f"{type(training_config).__name__}.")
        super().__init__(model, optimizer, training_config)
        self.ref_model = ref_model
        self.dpo_config = training_config
        self.with_loss_fn(dpo_model_loss, has_aux=True)
        self.with_gen_model_input_fn(lambda x: {"train_example": x, "beta": training_config.beta,
                                                "label_smoothing": training_config.label_smoothing})

    def _prepare_inputs(self, training_input: Any) -> TrainExample:
        if isinstance(training_input, TrainExample):
            return training_input
        if isinstance(training_input, dict):
            missing = set(TrainingInput._fields) - set(training_input)
            if missing:
                raise ValueError(f"A DPO batch needs the fields {TrainingInput._fields}; "
                                 f"missing {sorted(missing)}.")
            training_input = TrainingInput(**{k: training_input[k] for k in TrainingInput._fields})
        _check_pairs(training_input)
        prompts = np.concatenate([training_input.prompt_ids, training_input.prompt_ids])  # (2B, P)
        completions = np.concatenate([training_input.chosen_ids, training_input.rejected_ids])  # (2B, C)
        mask = np.concatenate([training_input.chosen_mask, training_input.rejected_mask]).astype(np.float32)
        input_ids = jnp.asarray(np.concatenate([prompts, completions], axis=1), jnp.int32)
        mask = jnp.asarray(mask)
        ref_chosen = ref_rejected = None
        if self.ref_model is not None:
            graphdef, state = nnx.split(self.ref_model)
            ref_chosen, ref_rejected = _reference_logps(graphdef, state, input_ids, mask)
        return TrainExample(input_ids, mask, ref_chosen, ref_rejected)


__all__ = ["DPOTrainer", "DPOTrainingConfig", "TrainExample", "TrainingInput", "compute_logps", "dpo_loss_fn",
           "dpo_model_loss"]
