"""Post-training: the method table of chapter 13 across seeds, and our GRPO loss step against tunix's.

- The method table: greedy held-out accuracy on the recipe's 256 held-out problems of the
  base model (stdlib-bytes), the brief SFT start, GRPO on top of it (the recipe), and DPO
  on top of it (right vs plausible-wrong answers), for seeds 0, 1, 2, with each method's
  training time and trainable parameter count. SFT and GRPO models come from
  `stacklib.align.zoo` (trained on the first run, then loaded: the times are those of
  the training run, stored with the model); DPO is trained here. At `--scale` < 1 the
  recipe shrinks and runs in a temporary cache, so a tiny-scale test run never touches
  the real one.
- The GRPO loss and its gradient (jitted) on the same logits: ours against tunix's
  `grpo_loss_fn` (target: parity, >= 0.9x).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

import stacklib.optim as optax
from benchmarks.timing import median_seconds, print_ratio
from stacklib.checkpoint import zoo as checkpoint_zoo


def _dpo(model, tokenizer, recipe, steps: int):
    """DPO from `model` (trained in place) against a frozen copy: (seconds, trainable params, margin)."""
    import stacklib.nn as nnx
    from stacklib.align import recipes, tasks
    from stacklib.align.dpo_trainer import DPOTrainer, DPOTrainingConfig

    data = recipes.problems(recipe)
    rng = np.random.default_rng(recipe.seed)
    batches = []
    for step in range(steps):
        chosen = [data.train[i] for i in rng.choice(len(data.train), 64, replace=False)]
        batches.append(tasks.preference_batch(chosen, tokenizer, seed=recipe.seed * 1000 + step))
    trainer = DPOTrainer(model, nnx.clone(model), optax.adam(1e-4),
                         DPOTrainingConfig(eval_every_n_steps=steps, max_steps=steps, beta=0.1))
    trainer.train(batches)
    margin = trainer.metrics_logger.get_metric_history("", "rewards/margin", "train")
    return trainer.train_time, trainer.trainable_params, float(margin[-10:].mean())


def method_table(scale: float) -> None:
    from stacklib.align import recipes, tasks, zoo

    seeds = [0, 1, 2] if scale >= 1 else [0]
    recipe_changes = {} if scale >= 1 else dict(
        sft_max_steps=4, sft_eval_every=4, grpo_steps=2, grpo_prompts=8, validation=16, heldout=16)
    dpo_steps = max(2, int(100 * scale))
    rows: dict[str, dict[str, list]] = {}

    def add(method, accuracy, seconds, params):
        row = rows.setdefault(method, {"accuracy": [], "seconds": [], "params": []})
        row["accuracy"].append(accuracy)
        row["seconds"].append(seconds)
        row["params"].append(params)

    for seed in seeds:
        recipe = dataclasses.replace(recipes.Recipe(seed=seed), **recipe_changes)
        base, tokenizer = recipes.base_model(recipe)
        heldout = recipes.problems(recipe).heldout
        add("base (stdlib-bytes)", tasks.heldout_accuracy(base, tokenizer, heldout), 0.0, 0)
        model, tokenizer, start = zoo.sft_start(recipe=recipe)
        add("SFT, brief (full)", start["heldout_accuracy"], start["seconds"], start["trainable_params"])
        _, _, grpo = zoo.grpo(recipe=recipe)
        add("SFT + GRPO", grpo["heldout_accuracy"], start["seconds"] + grpo["seconds"],
            grpo["trainable_params"])
        seconds, params, margin = _dpo(model, tokenizer, recipe, dpo_steps)
        add(f"SFT + DPO ({dpo_steps} steps)", tasks.heldout_accuracy(model, tokenizer, heldout),
            start["seconds"] + seconds, params)
        print(f"seed {seed}: SFT {start['steps']} steps, GRPO {grpo['steps']} steps, "
              f"DPO final margin {margin:.2f}", flush=True)

    print(f"\nheld-out accuracy (greedy, {len(heldout)} problems), seeds {seeds}")
    print(f"{'method':26} {'accuracy per seed':28} {'mean':>6} {'train s (mean)':>15} {'trainable':>10}")
    for method, row in rows.items():
        per_seed = " ".join(f"{a:6.1%}" for a in row["accuracy"])
        print(f"{method:26} {per_seed:28} {np.mean(row['accuracy']):6.1%} {np.mean(row['seconds']):15.1f} "
              f"{row['params'][0]:>10,d}")
    gains = [g - s for g, s in zip(rows["SFT + GRPO"]["accuracy"], rows["SFT, brief (full)"]["accuracy"],
                                   strict=True)]
    print("GRPO gain over its start, per seed: " + ", ".join(f"{g:+.1%}" for g in gains))


def loss_speed(scale: float) -> None:
    from flax import nnx as flax_nnx
    from tunix.rl import algo_core
    from tunix.rl.grpo import grpo_learner as tgrpo

    from stacklib.align import common
    from stacklib.align.grpo_learner import GRPOConfig, grpo_policy_loss

    B, P, C, V = max(8, int(512 * scale)), 6, 4, 256
    keys = jax.random.split(jax.random.key(0), 3)
    logits = jax.random.normal(keys[0], (B, P + C, V))
    prompt, completion = jax.random.randint(keys[1], (B, P), 1, V), jax.random.randint(keys[2], (B, C), 1, V)
    mask = jnp.ones((B, C), jnp.int32)
    advantages = jax.random.normal(keys[0], (B,))
    tokens = jnp.concatenate([prompt, completion], axis=1)
    config = GRPOConfig(num_generations=8, beta=0.0)
    algo = tgrpo.GRPOConfig(num_generations=8, beta=0.0)
    algo.temperature = 1.0

    class LogitsModel(flax_nnx.Module):
        def __init__(self, x):
            self.x = flax_nnx.Param(x)

        def __call__(self, tokens, positions=None, cache=None, attention_mask=None):
            return self.x[...], cache

    example = tgrpo.TrainExample(prompt_ids=prompt, prompt_mask=jnp.ones((B, P), bool),
                                 completion_ids=completion, completion_mask=mask, advantages=advantages,
                                 ref_per_token_logps=None, old_per_token_logps=None)
    ours = jax.jit(jax.grad(lambda x: grpo_policy_loss(common.logps_from_logits(x, tokens, C), None, None,
                                                       advantages, mask, config)[0]))
    theirs = jax.jit(jax.grad(lambda x: algo_core.grpo_loss_fn(LogitsModel(x), example, algo, 0, 1)[0]))
    print(f"\nGRPO loss + gradient, {B} completions of {C} tokens, vocab {V}")
    ours_s = median_seconds(lambda: jax.block_until_ready(ours(logits)), repeats=20)
    theirs_s = median_seconds(lambda: jax.block_until_ready(theirs(logits)), repeats=20)
    print_ratio("GRPO loss + grad (jit)", ours_s, theirs_s, "tunix", target=0.9)


def main(scale: float = 1.0) -> None:
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    with tempfile.TemporaryDirectory(prefix="bench-align-") as throwaway_cache:
        if scale < 1:  # a shrunken recipe: keep its models out of the real cache
            os.environ["STACKLIB_CACHE"] = throwaway_cache
            # Throwaway models: train them here, not in the zoo's fixed build process (three
            # fresh Pythons). The build process itself is tested in tests/test_llm.py.
            os.environ[checkpoint_zoo.BUILDER_ENV] = "1"
            from stacklib.llm import zoo as llm_zoo

            llm_zoo.ZOO["stdlib-bytes"] = {**llm_zoo.ZOO["stdlib-bytes"], "steps": 3}
        start = time.perf_counter()
        method_table(scale)
        loss_speed(scale)
        print(f"\n(bench_align: {time.perf_counter() - start:.0f} s)")
