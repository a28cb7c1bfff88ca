"""Stage 4: post-training with GRPO on chapter 13's arithmetic task (`stacklib.align`).

Chapter 13's recipe starts from the `stdlib-bytes` model, fine-tunes it briefly (SFT) until
sampling finds right answers often enough for GRPO to learn from, then runs GRPO with an
exact-match reward. Both models are cached per machine by `stacklib.align.zoo`; the
capstone loads them (it never trains again what that zoo caches), then:

1. runs a few GRPO steps live from the SFT start, on a copy, to show the learner at work
   here (rollouts, rewards, the clipped update) without paying for the whole run;
2. scores the SFT start and the cached GRPO model on the recipe's held-out problems
   (greedy, exact match), which no training step ever saw.

The GRPO model is then the model stages 5 and 6 quantize and serve.

This stage runs only where `stacklib.align` is importable (`available()`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import time
from typing import Any

import numpy as np

from stacklib.capstone.claims import claim

LIVE_STEPS = 2  # GRPO steps run here, from the SFT start
LIVE_PROMPTS = 8  # prompts per live step (the recipe uses 64): the demonstration, not the result
MIN_GAIN = 20.0  # points of held-out accuracy GRPO must add (the book's bar for chapter 13)


def available() -> bool:
    """Whether `stacklib.align` (chapter 13) is installed alongside this package."""
    return importlib.util.find_spec("stacklib.align") is not None


@dataclasses.dataclass
class GrpoStage:
    """What stage 4 measured, and the model it hands on."""

    name: str  # the served model's name
    model: Any  # the GRPO model (stacklib.llm.Transformer)
    tokenizer: Any
    heldout: list  # the recipe's held-out problems (stacklib.align.tasks.Problem)
    accuracy_before: float  # % held out, the SFT start
    accuracy_after: float  # % held out, after GRPO
    live_rewards: list[float]  # mean reward of each live GRPO step
    live_seconds: float
    info: dict  # how the cached GRPO model was made (align.zoo)
    prompts: list[str]  # stage 6's prompts: held-out problems

    def accuracy(self, model) -> float:
        """% of the held-out problems `model` answers exactly (greedy): stage 5's second score."""
        if model is self.model:  # scored already, greedy decoding is deterministic: do not pay twice
            return self.accuracy_after
        from stacklib.align import tasks

        return 100 * tasks.heldout_accuracy(model, self.tokenizer, self.heldout)

    @property
    def answer_tokens(self) -> int:
        """Tokens of a completion: up to three digits and the newline."""
        from stacklib.align import tasks

        return tasks.ANSWER_TOKENS

    def prompt_ids(self) -> list[list[int]]:
        """The prompts as the task lays them out (left-padded token ids), for the server."""
        from stacklib.align import tasks

        return tasks.encode_prompts(self.prompts, self.tokenizer).tolist()

    def summary(self) -> dict:
        return {"heldout_accuracy_before": self.accuracy_before,
                "heldout_accuracy_after": self.accuracy_after,
                "gain_points": self.accuracy_after - self.accuracy_before,
                "grpo_steps": self.info.get("steps"),
                "live_steps": len(self.live_rewards), "live_rewards": self.live_rewards}

    def check(self) -> None:
        """Check stage 4's claims, under `python -O` too.

        Raises:
          ClaimFailed: naming the claim that failed, what it expected and what was measured.
        """
        gain = self.accuracy_after - self.accuracy_before
        claim(gain >= MIN_GAIN, "GRPO adds the held-out accuracy the recipe promises",
              expected=f"at least {MIN_GAIN} points",
              measured=f"{gain:.1f} points ({self.accuracy_before:.1f}% -> {self.accuracy_after:.1f}%)")
        claim(len(self.live_rewards) == LIVE_STEPS, "stage 4 logged a mean reward for each live GRPO step",
              expected=f"{LIVE_STEPS} rewards", measured=f"{len(self.live_rewards)}")
        claim(all(0 <= r <= 1 for r in self.live_rewards), "each live step's mean reward is in [0, 1]",
              expected="rewards in [0, 1]", measured=f"{self.live_rewards}")


def run_grpo(seed: int = 0, *, prompts: int = 3) -> GrpoStage:
    """Stage 4: load chapter 13's cached models, run `LIVE_STEPS` GRPO steps, score both."""
    import stacklib.nn as nnx
    from stacklib.align import recipes, tasks, zoo

    recipe = recipes.Recipe(seed=seed)
    start, tokenizer, _ = zoo.sft_start(recipe=recipe)
    model, _, info = zoo.grpo(recipe=recipe)
    heldout = recipes.problems(recipe).heldout

    began = time.perf_counter()
    live = recipes.grpo(nnx.clone(start), dataclasses.replace(recipe, grpo_prompts=LIVE_PROMPTS), tokenizer,
                        steps=LIVE_STEPS)
    seconds = time.perf_counter() - began
    rewards = live.learner.rl_cluster.metrics_logger.get_metric_history("", "rewards/mean", "train")

    before = 100 * tasks.heldout_accuracy(start, tokenizer, heldout)
    after = 100 * tasks.heldout_accuracy(model, tokenizer, heldout)
    return GrpoStage("grpo-arithmetic", model, tokenizer, heldout, before, after,
                     [float(r) for r in np.asarray(rewards)], seconds, info,
                     [p.prompt for p in heldout[:prompts]])
