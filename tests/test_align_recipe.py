"""The book's recipe on the real model: brief SFT of stdlib-bytes, then GRPO, +20 points held out.

Slow the first time on a machine (SFT ~20 s, GRPO ~1-3 min on 2 shared cores), then the
models come from `stacklib.align.zoo`'s cache and the test takes seconds. Training is
deterministic for a given device setup (fixed seeds): seed 0 gives 26.8 % -> 53.3 % held out in
a plain process and 25.3 % -> 53.3 % in one that simulates 8 CPU devices, as this test process
does (XLA rounds a little differently); the assertions keep a margin below both.
"""

import pytest

from stacklib.align import recipes, tasks, zoo


@pytest.mark.slow
def test_grpo_raises_heldout_accuracy_by_20_points_over_its_brief_sft_start():
    recipe = recipes.Recipe(seed=0)
    heldout = recipes.problems(recipe).heldout
    base, tokenizer = recipes.base_model(recipe)
    assert tasks.heldout_accuracy(base, tokenizer, heldout) < 0.02  # the base model cannot add
    start_model, _, start = zoo.sft_start(seed=0)
    assert 0.15 <= start["heldout_accuracy"] <= 0.5  # modest on purpose ...
    assert start["validation_accuracy"] >= recipe.sft_target_accuracy
    # ... while sampling often finds the answer: the room GRPO has to work in.
    sampled = tasks.pass_at_k(start_model, tokenizer, heldout[:64], 8, seed=0)
    assert sampled >= start["heldout_accuracy"] + 0.2
    model, _, info = zoo.grpo(seed=0)
    assert info["start_heldout_accuracy"] == start["heldout_accuracy"]
    assert info["heldout_accuracy"] >= start["heldout_accuracy"] + 0.20
    # Re-measured here: XLA's CPU code may round differently with another device count (this process
    # simulates 8 devices, the one that trained may not have), so a greedy tie could flip: 2 % slack.
    measured = tasks.heldout_accuracy(model, tokenizer, heldout)
    assert measured == pytest.approx(info["heldout_accuracy"], abs=0.02)
    assert info["eval_steps"][0] == 0 and info["eval_steps"][-1] == recipe.grpo_steps
    assert info["trainable_params"] > 200_000  # full fine-tuning
