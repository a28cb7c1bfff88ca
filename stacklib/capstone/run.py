"""The capstone run: every stage in order, one report, one figure.

    report = run.run_all(workdir)           # stages 1-6
    report.check()                          # every claim, asserted
    dashboard.plot(report)

The stages (each a function the chapter also calls on its own):

1. `training.train_run`: chapter 12's sharded trainer on 8 devices, async checkpoints;
2. `training.run_and_kill` + `training.resume`: SIGKILL a child mid-run that also checkpoints to a
   local tier, resume from the newest copy, compare bitwise, count the work lost with and without it;
3. `profiling.profile_step`: the op table, MFU, where the time goes;
4. `post_training`: GRPO on chapter 13's task (where `stacklib.align` is installed);
5. `quantization.quantize_and_score`: int8 PTQ, held-out loss (and accuracy) within a margin;
6. `serving.serve_with_openai` + `serving.export_and_load_elsewhere`: the OpenAI-compatible
   server queried with the `openai` client; the exported artifact in a fresh process.

Stages 5 and 6 start from a trained model: chapter 13's GRPO model where stage 4 ran,
otherwise chapter 12's cached `stdlib-bytes` (trained once per machine, `llm.pretrained`).
The model trained in stages 1-2 is deliberately tiny and short-trained: those stages
show that the machinery (sharding, checkpoints, resumption) works, not a good model.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import tempfile
from typing import Any

import numpy as np

from stacklib import llm
from stacklib.capstone import post_training, profiling, quantization, serving, training
from stacklib.llm import data, zoo

PROMPTS = ["def main(", "import os\n", "class Config"]  # stage 6, for the stdlib-bytes model


@dataclasses.dataclass
class ServedModel:
    """What stages 5 and 6 work on: the model, how to score it, and what to ask it."""

    name: str
    model: Any
    tokenizer: Any
    prompts: list  # stage 6's prompts: text, or token ids laid out as the model was trained
    max_tokens: int  # tokens per completion
    export_tokens: np.ndarray  # (B, T) ids the exported artifact is checked on
    accuracy: Any = None  # accuracy(model) -> % on a held-out task, or None


def served_model(stage4=None) -> ServedModel:
    """Stage 4's GRPO model with its task where it ran; otherwise chapter 12's cached `stdlib-bytes`."""
    if stage4 is not None:
        ids = stage4.prompt_ids()
        return ServedModel(stage4.name, stage4.model, stage4.tokenizer, ids, stage4.answer_tokens,
                           np.asarray(ids, np.int32), stage4.accuracy)
    model, tokenizer = llm.pretrained("stdlib-bytes")
    return ServedModel("stdlib-bytes", model, tokenizer, PROMPTS, 24, export_tokens(tokenizer, PROMPTS))


@dataclasses.dataclass
class CapstoneReport:
    """Everything the six stages measured."""

    training: Any  # train.TrainResult of stage 1
    killed: training.KilledRun
    resumed: Any  # train.TrainResult of stage 2
    profile: profiling.StepProfile
    post_training: Any | None  # stage 4's result, or None where stacklib.align is missing
    quant: quantization.QuantResult
    serving: serving.ServeResult
    export: serving.ExportResult
    served_model: str  # which model stages 5-6 used

    @property
    def resumed_bitwise(self) -> bool:
        return training.bitwise_equal(self.resumed.params, self.training.params)

    @property
    def steps_lost_with_local_tier(self) -> int:
        """Steps computed twice: from the checkpoint the run resumed from (the local tier's) to the kill."""
        return self.killed.killed_at - self.resumed.start_step

    @property
    def steps_lost_without_local_tier(self) -> int:
        """Steps a run with the persistent tier alone would compute twice: back to its last checkpoint."""
        return self.killed.killed_at - self.killed.last_persistent_step

    def quality_rows(self) -> list[tuple[str, float, str]]:
        """(label, held-out bits per byte, unit) after each stage that changes weights."""
        bits = 1 / math.log(2)
        return [("1. trained here", self.training.eval_loss * bits, "bits/byte"),
                ("2. killed + resumed", self.resumed.eval_loss * bits, "bits/byte"),
                (f"5. {self.served_model}, float", self.quant.float_loss * bits, "bits/byte"),
                (f"5. {self.served_model}, int8", self.quant.int8_loss * bits, "bits/byte")]

    def accuracy_rows(self) -> list[tuple[str, float]]:
        """(label, held-out task accuracy in %) before and after GRPO and after int8; [] without stage 4."""
        if self.post_training is None:
            return []
        return [("before GRPO", self.post_training.accuracy_before),
                ("4. after GRPO", self.post_training.accuracy_after),
                ("5. after GRPO, int8", self.quant.int8_accuracy)]

    def throughput_rows(self) -> list[tuple[str, float]]:
        """(label, tokens per second): training (stages 1, 3) and serving (stage 6)."""
        config = self.training.config
        tokens = config.batch_size * config.seq_len
        median = float(np.median([r["tokens_per_s"] for r in self.training.history[1:]]))
        return [("1. training, median step", median),
                ("3. training, profiled step", tokens / self.profile.step_seconds),
                ("6. served (openai burst)", self.serving.tokens_per_second)]

    def check(self) -> None:
        """Assert every claim the capstone makes (no timing is asserted).

        Raises:
          AssertionError: naming the claim that failed.
        """
        kill_at, tiers = self.killed.killed_at, self.resumed.config
        assert self.killed.returncode == -9, f"the child was not killed by SIGKILL ({self.killed.returncode})"
        assert tiers.local_checkpoint_dir, "stage 2's run has no local tier (local_checkpoint_dir)"
        assert self.resumed.start_step == kill_at - kill_at % tiers.local_checkpoint_every, \
            f"resumed from step {self.resumed.start_step}, not the local tier's last step before {kill_at}"
        assert self.steps_lost_without_local_tier == kill_at % tiers.checkpoint_every, \
            f"the persistent tier's last step before step {kill_at} is {self.killed.last_persistent_step}"
        assert self.steps_lost_with_local_tier < self.steps_lost_without_local_tier, \
            "the local tier did not shorten the work lost to the kill"
        assert self.resumed_bitwise, "the resumed run's final weights differ from the uninterrupted run's"
        assert self.resumed.losses == self.training.losses[self.resumed.start_step:], "loss curves differ"
        assert [r["loss"] for r in self.killed.records] == self.training.losses[:kill_at], \
            "the killed child's losses differ from the uninterrupted run's"
        assert self.training.losses[-1] < self.training.losses[0], "stage 1 did not learn"
        assert self.profile.steps >= 1 and abs(sum(self.profile.groups.values()) - 1) < 1e-9
        assert 0 < self.profile.mfu < 1, f"MFU {self.profile.mfu} is not a fraction"
        quant = self.quant
        assert quant.within_margin, (
            f"int8 lost more than the margin: loss {quant.float_loss:.4f} -> {quant.int8_loss:.4f} (margin "
            f"{quantization.LOSS_MARGIN}), accuracy {quant.float_accuracy} -> {quant.int8_accuracy}")
        assert self.quant.int8_bytes < self.quant.float_bytes / 2.5, "int8 weights are not ~4x smaller"
        assert self.serving.completions == self.serving.engine_completions, \
            "greedy completions through the server differ from the engine's"
        assert self.export.bitwise, "the artifact's logits in a fresh process differ from the jitted model's"
        assert self.export.generated_equal, "greedy tokens from the artifact differ from llm.generate's"
        assert not self.export.model_code_imported, f"the artifact needed {self.export.model_code_imported}"
        if self.post_training is not None:
            self.post_training.check()


def heldout_batches(name: str = "stdlib-bytes", batches: int = 4) -> list[np.ndarray]:
    """Held-out records of the standard-library corpus at the zoo model's sequence length."""
    return data.heldout_batches(zoo.zoo_config(name).replace(eval_batches=batches))


def export_tokens(tokenizer, prompts: list[str], length: int = 16) -> np.ndarray:
    """(len(prompts), length) token ids for the artifact check: prompts cut or padded with spaces."""
    return np.stack([tokenizer.encode((p + " " * length)[:length]) for p in prompts]).astype(np.int32)


def run_all(workdir: str | pathlib.Path | None = None) -> CapstoneReport:
    """Run stages 1-6 in order and return their report (see the module docstring)."""
    workdir = pathlib.Path(workdir or tempfile.mkdtemp(prefix="capstone-"))
    config = training.capstone_config(workdir / "uninterrupted")
    whole = training.train_run(config)
    killed_config = training.capstone_config(workdir / "killed", local_checkpoint_dir=workdir / "local")
    killed = training.run_and_kill(killed_config, training.kill_after())
    resumed = training.resume(killed_config)
    step_profile = profiling.profile_step(whole, log_dir=str(workdir / "profile"))
    stage4 = post_training.run_grpo() if post_training.available() else None
    target = served_model(stage4)
    quant = quantization.quantize_and_score(target.model, heldout_batches(), target.accuracy)
    served = serving.serve_with_openai(target.model, target.prompts, max_tokens=target.max_tokens,
                                       quantization="int8")
    exported = serving.export_and_load_elsewhere(target.model, target.export_tokens, target.max_tokens,
                                                 workdir / "export" / "1")
    return CapstoneReport(whole, killed, resumed, step_profile, stage4, quant, served, exported, target.name)
