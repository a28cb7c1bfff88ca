"""The capstone run: every stage in order, one report, one figure.

    report = run.run_all(workdir)           # stages 1-6
    report.check()                          # every claim; ClaimFailed names the first that fails
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
from stacklib.capstone.claims import claim, first_difference
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
        """Check every claim the capstone makes (no timing is checked), under `python -O` too.

        Raises:
          ClaimFailed: naming the claim that failed, what it expected and what was measured.
        """
        kill_at, tiers = self.killed.killed_at, self.resumed.config
        claim(self.killed.returncode == -9, "stage 2's child was killed by SIGKILL",
              expected="return code -9", measured=f"return code {self.killed.returncode}")
        claim(bool(tiers.local_checkpoint_dir), "stage 2's run has a local tier",
              expected="a local_checkpoint_dir", measured=repr(tiers.local_checkpoint_dir))
        local_step = kill_at - kill_at % tiers.local_checkpoint_every
        claim(self.resumed.start_step == local_step,
              f"stage 2 resumed from the local tier's last step before the kill at step {kill_at}",
              expected=f"step {local_step}", measured=f"step {self.resumed.start_step}")
        persistent_step = kill_at - kill_at % tiers.checkpoint_every
        claim(self.killed.last_persistent_step == persistent_step,
              f"the persistent tier's last step before the kill at step {kill_at}",
              expected=f"step {persistent_step}", measured=f"step {self.killed.last_persistent_step}")
        lost_with, lost_without = self.steps_lost_with_local_tier, self.steps_lost_without_local_tier
        claim(lost_with < lost_without, "the local tier shortens the work lost to the kill",
              expected=f"fewer than {lost_without} steps lost", measured=f"{lost_with} steps lost")
        claim(self.resumed_bitwise,
              "the resumed run's final weights equal the uninterrupted run's, bit for bit",
              expected="equal bits", measured="different bits")
        start = self.resumed.start_step
        expected_losses = self.training.losses[start:]
        claim(self.resumed.losses == expected_losses,
              "the resumed run's losses equal the uninterrupted run's",
              expected=f"the uninterrupted run's losses from step {start + 1}",
              measured=first_difference(self.resumed.losses, expected_losses))
        killed_losses = [r["loss"] for r in self.killed.records]
        claim(killed_losses == self.training.losses[:kill_at],
              "the killed child's losses equal the uninterrupted run's",
              expected=f"the uninterrupted run's first {kill_at} losses",
              measured=first_difference(killed_losses, self.training.losses[:kill_at]))
        claim(self.training.losses[-1] < self.training.losses[0], "stage 1 learned",
              expected=f"a final loss below the first, {self.training.losses[0]:.4f}",
              measured=f"{self.training.losses[-1]:.4f}")
        claim(self.profile.steps >= 1, "stage 3 profiled a step",
              expected="at least 1 step", measured=f"{self.profile.steps} steps")
        shares = sum(self.profile.groups.values())
        claim(abs(shares - 1) < 1e-9, "stage 3's time shares per op group add up to 1",
              expected="1 (within 1e-9)", measured=f"{shares!r}")
        claim(0 < self.profile.mfu < 1, "stage 3's MFU is a fraction",
              expected="0 < MFU < 1", measured=f"{self.profile.mfu!r}")
        quant = self.quant
        claim(quant.within_margin, "int8 PTQ stays within its margins",
              expected=f"a loss increase <= {quantization.LOSS_MARGIN} and an accuracy drop <= "
                       f"{quantization.ACCURACY_MARGIN} points",
              measured=f"loss {quant.float_loss:.4f} -> {quant.int8_loss:.4f}, "
                       f"accuracy {quant.float_accuracy} -> {quant.int8_accuracy}")
        claim(quant.int8_bytes < quant.float_bytes / 2.5, "int8 weights are about 4x smaller",
              expected=f"fewer than {quant.float_bytes / 2.5:.0f} bytes (float: {quant.float_bytes})",
              measured=f"{quant.int8_bytes} bytes")
        claim(self.serving.completions == self.serving.engine_completions,
              "greedy completions through the server equal the engine's",
              expected="the engine's completions",
              measured=first_difference(self.serving.completions, self.serving.engine_completions))
        claim(self.export.bitwise,
              "the artifact's logits in a fresh process equal the jitted model's, bit for bit",
              expected="equal bits", measured="different bits")
        claim(self.export.generated_equal, "greedy tokens from the artifact equal llm.generate's",
              expected="the same tokens", measured="different tokens")
        claim(not self.export.model_code_imported, "the artifact runs without the model's code",
              expected="no model module imported", measured=f"{self.export.model_code_imported}")
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
