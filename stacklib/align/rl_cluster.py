"""The models of reinforcement learning and their roles: `RLCluster`, `Role`, the configs.

Mirrors `tunix.rl.rl_cluster` (google-tunix 0.1.7) without its meshes. RL from verifiable
rewards keeps three models apart, and so does this class:

* the **actor** (`Role.ACTOR`), the policy being trained, by `actor_trainer` (a PeftTrainer);
* the **reference** (`Role.REFERENCE`), a frozen copy of the starting policy: the KL
  penalty keeps the actor near it;
* the **rollout** model (`Role.ROLLOUT`), which samples completions. It must hold the
  actor's current weights. Tunix can put it on other chips (or in vLLM) and copies the
  weights over after each update; here it *is* the actor object, so it is always in sync.

    cluster = RLCluster(actor=policy, reference=frozen_copy, tokenizer=tokenizer,
                        cluster_config=ClusterConfig(
                            training_config=RLTrainingConfig(actor_optimizer=optax.adam(3e-4),
                                                             eval_every_n_steps=25, max_steps=150),
                            rollout_config=RolloutConfig(max_tokens_to_generate=4, temperature=1.0,
                                                         max_prompt_length=6, eos_tokens=[10])))
    out = cluster.generate(["2+3=", "2+3="])          # RolloutOutput: text, tokens, prompt tokens

Rollouts sample with chapter 12's sampler (`stacklib.llm.generate`, temperature and a
key), prompts left-padded to `max_prompt_length` with the tokenizer's document separator
(id 0) and `max_tokens_to_generate` new tokens. Everything after the first EOS token is
replaced by padding and masked out.

Differences from tunix:
- One process, one device, no meshes: `role_to_mesh` must be empty; no offloading, no
  vLLM/SGLang engines, no critic or reward models (reward functions only).
- The rollout model is the actor object itself (no weight sync).
- Sampling has temperature only (`top_p` must be None or 1.0, `top_k` None); the sampler
  always writes `max_tokens_to_generate` tokens and stops are applied afterwards.
- `RolloutOutput.text` keeps the EOS character (here the answer's "\\n") so that a
  reward can check that the answer ended.
- No mini-batches or micro-batches in `RLTrainingConfig`: one optimizer step per rollout
  batch per GRPO iteration.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

import stacklib.nn as nnx
import stacklib.optim as optax
from stacklib.align.common import compute_per_token_logps, np_make_completion_mask
from stacklib.align.peft_trainer import PeftTrainer, TrainingConfig
from stacklib.llm.sample import generate


class Mode(enum.Enum):
    """Which rollout config applies: training rollouts or evaluation ones."""

    TRAIN = "train"
    EVAL = "eval"

    def __str__(self):
        return self.value


class Role(enum.Enum):
    """The role of a model in RL (tunix's names; no critic or reward model here)."""

    ACTOR = "actor"
    REFERENCE = "reference"
    ROLLOUT = "rollout"


@dataclasses.dataclass(slots=True, kw_only=True)
class RolloutConfig:
    """How completions are sampled (tunix's field names and defaults).

    Attributes:
      max_tokens_to_generate: new tokens per completion.
      temperature: softmax temperature; 0 is greedy.
      top_p, top_k: not supported beyond None / 1.0 (plain temperature sampling).
      seed: seed of the sampling keys (None: 0).
      max_prompt_length: prompts are left-padded to this many tokens; longer ones are an error.
      eos_tokens: ids that end a completion (None: the tokenizer's eos_id).
    """

    max_tokens_to_generate: int = 64
    temperature: float = 0.9
    top_p: float | None = 1.0
    top_k: int | None = None
    seed: int | None = None
    max_prompt_length: int = 64
    eos_tokens: list[int] | None = None

    def __post_init__(self):
        if self.top_p not in (None, 1.0) or self.top_k is not None:
            raise ValueError(f"top_p={self.top_p}, top_k={self.top_k}: stacklib's sampler has temperature "
                             "only; use top_p=1.0 (or None) and top_k=None.")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 is greedy).")
        for name in ("max_tokens_to_generate", "max_prompt_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"RolloutConfig({name}={getattr(self, name)}) must be at least 1.")


@dataclasses.dataclass(slots=True, kw_only=True)
class RLTrainingConfig(TrainingConfig):
    """`TrainingConfig` plus the actor's optimizer; `max_steps` counts rollout batches."""

    actor_optimizer: optax.GradientTransformation


@dataclasses.dataclass(kw_only=True)
class ClusterConfig:
    """The cluster's configs: training, and rollouts (one, or one per `Mode`)."""

    training_config: RLTrainingConfig
    rollout_config: RolloutConfig | dict[Mode, RolloutConfig]
    role_to_mesh: dict | None = None

    def __post_init__(self):
        if self.role_to_mesh:
            raise ValueError("stacklib.align.RLCluster runs every role on one device: leave role_to_mesh "
                             "empty (tunix's RLCluster places roles on meshes).")


class RolloutOutput(NamedTuple):
    """Sampled completions: their text (up to and including the EOS), ids and the prompts' ids."""

    text: list[str]
    tokens: np.ndarray  # (N, max_tokens_to_generate): after the first EOS, pad ids
    left_padded_prompt_tokens: np.ndarray  # (N, max_prompt_length)
    completion_mask: np.ndarray  # (N, max_tokens_to_generate): 1 up to and including the first EOS


def _variable_ids(model: Any) -> set[int]:
    return {id(v) for _, v in nnx.to_flat_state(nnx.state(model))}


class RLCluster:
    """The actor, the frozen reference and the rollout model, with the actor's trainer."""

    def __init__(self, actor: Any, reference: Any | None, tokenizer: Any, cluster_config: ClusterConfig):
        if reference is not None and _variable_ids(actor) & _variable_ids(reference):
            raise ValueError(
                "The reference shares weights (Variable objects) with the actor, so it would move as the "
                "actor trains and the KL penalty would always be 0. Pass a frozen copy: "
                "reference=nnx.clone(actor) (two nnx.merge calls on one State share its Variables).")
        self.cluster_config = cluster_config
        self.tokenizer = tokenizer
        self.models = {Role.ACTOR: actor, Role.REFERENCE: reference, Role.ROLLOUT: actor}
        training = cluster_config.training_config
        self.actor_trainer = PeftTrainer(actor, training.actor_optimizer, training)
        self.metrics_logger = self.actor_trainer.metrics_logger
        self.global_steps = 0
        self._rollouts = 0
        for mode in Mode:
            config = self.get_rollout_config(mode)
            limit = actor.config.max_seq_len
            if config.max_prompt_length + config.max_tokens_to_generate > limit:
                raise ValueError(
                    f"Rollout config for {mode}: max_prompt_length={config.max_prompt_length} + "
                    f"max_tokens_to_generate={config.max_tokens_to_generate} exceeds the actor's context "
                    f"(max_seq_len={limit}); lower one of them to fit.")

    @property
    def actor(self) -> Any:
        return self.models[Role.ACTOR]

    @property
    def reference(self) -> Any | None:
        return self.models[Role.REFERENCE]

    @property
    def rollout_model(self) -> Any:
        return self.models[Role.ROLLOUT]

    def get_rollout_config(self, mode: Mode = Mode.TRAIN) -> RolloutConfig:
        config = self.cluster_config.rollout_config
        return config[mode] if isinstance(config, dict) else config

    def pad_id(self) -> int:
        return int(self.tokenizer.eos_id)

    def eos_id(self) -> int:
        eos = self.get_rollout_config().eos_tokens
        return int(eos[0]) if eos else int(self.tokenizer.eos_id)

    # -- rollouts --------------------------------------------------------------------------------
    def encode_prompts(self, prompts: Sequence[str], mode: Mode = Mode.TRAIN) -> np.ndarray:
        """(N, max_prompt_length) ids, left-padded.

        Raises:
          ValueError: a prompt is longer than max_prompt_length (named, with the fix).
        """
        width = self.get_rollout_config(mode).max_prompt_length
        out = np.full((len(prompts), width), self.pad_id(), np.int32)
        for row, prompt in enumerate(prompts):
            ids = self.tokenizer.encode(prompt)
            if len(ids) > width:
                limit = self.actor.config.max_seq_len
                raise ValueError(
                    f"Prompt {row} ({prompt[:40]!r}) has {len(ids)} tokens, more than "
                    f"max_prompt_length={width} (the actor's context is {limit} tokens, of which the rollout "
                    f"keeps {self.get_rollout_config(mode).max_tokens_to_generate} for the completion). "
                    "Shorten the prompt, or raise RolloutConfig.max_prompt_length within the context.")
            if len(ids):
                out[row, width - len(ids):] = ids
        return out

    def generate(self, prompts: Sequence[str], mode: Mode = Mode.TRAIN) -> RolloutOutput:
        """Sample one completion per prompt from the rollout model (repeat a prompt for a group)."""
        config = self.get_rollout_config(mode)
        prompt_ids = self.encode_prompts(prompts, mode)
        key = None
        if config.temperature > 0:
            key = jax.random.fold_in(jax.random.key(config.seed or 0), self._rollouts)
        self._rollouts += 1
        out = generate(self.rollout_model, prompt_ids, config.max_tokens_to_generate,
                       temperature=config.temperature, key=key)
        completions = np.asarray(out[:, prompt_ids.shape[1]:])  # (N, max_tokens_to_generate)
        eos = config.eos_tokens or [self.tokenizer.eos_id]
        masks = [np_make_completion_mask(completions, e) for e in eos]  # the earliest stop of any eos
        mask = np.min(np.stack(masks), axis=0) if len(masks) > 1 else masks[0]
        tokens = np.where(mask == 1, completions, self.pad_id()).astype(np.int32)
        text = [self.tokenizer.decode(row[m == 1]) for row, m in zip(completions, mask, strict=True)]
        return RolloutOutput(text, tokens, prompt_ids, mask)

    def get_ref_per_token_logps(self, prompt_tokens, completion_tokens) -> jax.Array:
        """The frozen reference's log-probs of the completion tokens, (N, C)."""
        if self.reference is None:
            raise ValueError("This RLCluster has no reference model; pass reference=... (a frozen copy of "
                             "the starting policy) or use beta=0.0.")
        return compute_per_token_logps(self.reference, prompt_tokens, completion_tokens,
                                       temperature=self.get_rollout_config().temperature)

    def get_old_per_token_logps(self, prompt_tokens, completion_tokens) -> jax.Array:
        """The actor's log-probs now, before this batch's updates (GRPO's pi_old), (N, C)."""
        return compute_per_token_logps(self.actor, prompt_tokens, completion_tokens,
                                       temperature=self.get_rollout_config().temperature)

    def buffer_metrics(self, metrics: dict[str, Any], mode: Mode = Mode.TRAIN) -> None:
        """Log scalar metrics at the current global step."""
        for name, value in metrics.items():
            value = value[0] if isinstance(value, tuple) else value  # tunix passes (value, aggregation)
            self.metrics_logger.log("", name, value, str(mode), self.global_steps)


__all__ = ["ClusterConfig", "Mode", "RLCluster", "RLTrainingConfig", "Role", "RolloutConfig", "RolloutOutput"]
