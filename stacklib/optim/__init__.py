"""stacklib.optim: composable gradient transformations, a documented subset of Optax.

Use it where you would use optax (0.2.8): `import stacklib.optim as optax`.

    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, weight_decay=1e-2))
    opt_state = tx.init(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)

The subset, file by file:
  base.py       GradientTransformation(init, update), identity, set_to_zero, apply_updates
  combine.py    chain, masked
  transform.py  scale, scale_by_learning_rate, scale_by_schedule, scale_by_adam,
                scale_by_rms, scale_by_lion, add_decayed_weights
  clipping.py   clip, clip_by_global_norm, global_norm
  accumulate.py trace (momentum), MultiSteps (gradient accumulation)
  alias.py      sgd, adam, adamw, rmsprop, lion
  schedule.py   constant, polynomial, linear, cosine_decay, warmup_cosine_decay, join
  inject.py     inject_hyperparams
  losses.py     softmax_cross_entropy(_with_integer_labels)

State classes keep optax's names and fields (`ScaleByAdamState(count, mu, nu)`, ...), so
an optimizer state built by one library has the tree layout of the other's. Each file's
docstring lists its differences from optax.
"""

from stacklib.optim.accumulate import MultiSteps, MultiStepsState, TraceState, trace
from stacklib.optim.alias import adam, adamw, lion, rmsprop, sgd
from stacklib.optim.base import (
    EmptyState,
    GradientTransformation,
    GradientTransformationExtraArgs,
    OptState,
    Params,
    ScalarOrSchedule,
    Schedule,
    Updates,
    apply_updates,
    identity,
    safe_increment,
    set_to_zero,
    with_extra_args_support,
)
from stacklib.optim.clipping import clip, clip_by_global_norm, global_norm
from stacklib.optim.combine import MaskedNode, MaskedState, chain, masked
from stacklib.optim.inject import InjectHyperparamsState, inject_hyperparams
from stacklib.optim.losses import softmax_cross_entropy, softmax_cross_entropy_with_integer_labels
from stacklib.optim.schedule import (
    constant_schedule,
    cosine_decay_schedule,
    join_schedules,
    linear_schedule,
    polynomial_schedule,
    warmup_cosine_decay_schedule,
)
from stacklib.optim.transform import (
    ScaleByAdamState,
    ScaleByLionState,
    ScaleByRmsState,
    ScaleByRmsWithCountState,
    ScaleByScheduleState,
    WeightDecaySchedule,
    add_decayed_weights,
    scale,
    scale_by_adam,
    scale_by_learning_rate,
    scale_by_lion,
    scale_by_rms,
    scale_by_schedule,
)

__all__ = [
    "EmptyState", "GradientTransformation", "GradientTransformationExtraArgs", "InjectHyperparamsState",
    "MaskedNode", "MaskedState", "MultiSteps", "MultiStepsState", "OptState", "Params", "ScalarOrSchedule",
    "ScaleByAdamState", "ScaleByLionState", "ScaleByRmsState", "ScaleByRmsWithCountState",
    "ScaleByScheduleState", "Schedule", "TraceState", "Updates", "WeightDecaySchedule",
    "adam", "adamw", "add_decayed_weights", "apply_updates", "chain", "clip", "clip_by_global_norm",
    "constant_schedule", "cosine_decay_schedule", "global_norm", "identity", "inject_hyperparams",
    "join_schedules", "linear_schedule", "lion", "masked", "polynomial_schedule", "rmsprop",
    "safe_increment", "scale", "scale_by_adam", "scale_by_learning_rate", "scale_by_lion",
    "scale_by_rms", "scale_by_schedule", "set_to_zero", "sgd", "softmax_cross_entropy",
    "softmax_cross_entropy_with_integer_labels", "trace", "warmup_cosine_decay_schedule",
    "with_extra_args_support",
]
