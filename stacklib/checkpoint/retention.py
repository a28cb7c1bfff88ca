"""Which steps to save and which to keep: the interval, keep-N and keep-best policies.

Mirrors the decisions orbax's `CheckpointManager` makes with its default policies
(`save_decision_policy.py` and `preservation_policy.py` in orbax): the same inputs give
the same saved and kept steps, which the parity tests check.

Saving (`should_save`): a step is saved if it is newer than the latest saved step and
either it is a multiple of `save_interval_steps`, it is listed in `save_on_steps`, or
nothing has been saved yet (so a fresh run always gets a first checkpoint).

Keeping (`steps_to_keep`), applied after every save:

* no `best_fn`: the latest `max_to_keep` steps (all if None);
* with `best_fn`: the `max_to_keep` steps whose `best_fn(metrics)` is highest
  (`best_mode="max"`) or lowest ("min"), plus every step saved without metrics unless
  `keep_checkpoints_without_metrics=False`. Ties go to the later step. The latest step
  is *not* protected: a new checkpoint worse than the best N is deleted at once.

Differences from orbax: no time-based (`keep_time_interval`) or period-based
(`keep_period`) preservation, no preemption-triggered saves.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence
from typing import Any


def should_save(
    step: int,
    saved_steps: Sequence[int],
    *,
    save_interval_steps: int | None = 1,
    save_on_steps: Container[int] | None = None,
) -> bool:
    """Whether the step is due for a checkpoint (orbax's default save decision)."""
    if saved_steps and max(saved_steps) >= step:
        return False
    if not saved_steps:
        return True
    on_interval = save_interval_steps is not None and step % save_interval_steps == 0
    return on_interval or (save_on_steps is not None and step in save_on_steps)


def steps_to_keep(
    steps: Sequence[int],
    metrics: Sequence[Any],
    *,
    max_to_keep: int | None = None,
    best_fn: Callable[[Any], float] | None = None,
    best_mode: str = "max",
    keep_checkpoints_without_metrics: bool = True,
) -> list[int]:
    """The steps to keep, in ascending order.

    Args:
      steps: the saved steps, ascending.
      metrics: the metrics saved with each step (None where none were given).
      max_to_keep: how many to keep (all if None).
      best_fn: maps a step's metrics to a number; if None, keep the latest steps.
      best_mode: "max" keeps the highest `best_fn` values, "min" the lowest.
      keep_checkpoints_without_metrics: with `best_fn`, never delete steps without metrics.

    Raises:
      ValueError: `best_mode` is neither "max" nor "min".
    """
    if best_mode not in ("max", "min"):
        raise ValueError(f"best_mode must be 'max' or 'min', got {best_mode!r}.")
    if max_to_keep is None or len(steps) <= max_to_keep:
        return list(steps)
    if best_fn is None:
        return list(steps)[len(steps) - max_to_keep:] if max_to_keep else []
    if max_to_keep == 0:
        return []
    scored = [(step, m) for step, m in zip(steps, metrics, strict=True) if m is not None]
    # Stable sort, then the last max_to_keep: on ties the later step wins, as in orbax.
    ranked = sorted(scored, key=lambda pair: best_fn(pair[1]), reverse=best_mode == "min")
    keep = {step for step, _ in ranked[-max_to_keep:]}
    if keep_checkpoints_without_metrics:
        keep |= {step for step, m in zip(steps, metrics, strict=True) if m is None}
    return [step for step in steps if step in keep]
