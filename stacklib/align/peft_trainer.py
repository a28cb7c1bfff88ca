"""Supervised fine-tuning, full or LoRA: `PeftTrainer`, `TrainingConfig`, `TrainingInput`.

Mirrors `tunix.sft.peft_trainer` (google-tunix 0.1.7):

    trainer = PeftTrainer(model, optax.adam(1e-3), TrainingConfig(eval_every_n_steps=50, max_steps=300))
    trainer.with_gen_model_input_fn(lambda x: {"input_tokens": x["input_tokens"],
                                               "input_mask": x["input_mask"]})
    trainer.train(train_ds, eval_ds)
    trainer.metrics_logger.get_metric_history("", "loss", "train")   # one loss per step

The objective of supervised fine-tuning is the next-token cross-entropy of the target
tokens only:

    L(theta) = - sum_t m_t log p_theta(x_t | x_<t) / sum_t m_t

with `m_t = input_mask[t]`: 1 on the answer, 0 on the prompt and the padding. The
prompt is given, not generated, so it is masked out (`next_token_loss`).

If the model has LoRA adapters (`stacklib.quant.LoRAParam`, from `apply_lora_to_model`),
only they are differentiated and updated: the step splits the model into
`(graphdef, trainable, frozen)` and the frozen part is passed through untouched, so the
base weights stay bit-identical (tests/test_align.py asserts it). With a `LoraRule` that
has a `weight_qtype` the frozen base is int8/int4 (QLoRA) and nothing changes here.

The step is `jax.jit` of a pure function of (trainable, optimizer state, frozen, batch);
`gen_model_input_fn` runs inside it (as in tunix) to map a batch to the loss's keyword
arguments. Gradient accumulation wraps the optimizer in `optax.MultiSteps`: one
*training step* is `gradient_accumulation_steps` batches, and `max_steps` and
`eval_every_n_steps` count training steps, as in tunix.

Differences from tunix:
- No checkpointing, profiler, progress bar, hooks, sharding or sequence packing; the
  metrics logger is in memory only (`MetricsLogger.get_metric(_history)` as in tunix).
- The default loss takes `(model, input_tokens, input_mask)`: our Transformer builds
  its own causal mask and positions, so there are no `positions`/`attention_mask` inputs.
- `train()` leaves the trained weights in `trainer.model` when it returns; the
  step does not donate buffers.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import stacklib.nn as nnx
import stacklib.optim as optax
from stacklib.align.common import selective_log_softmax
from stacklib.quant.lora import LoRAParam


@dataclasses.dataclass(slots=True, kw_only=True)
class TrainingConfig:
    """How long to train and when to evaluate (tunix's field names and defaults).

    Attributes:
      eval_every_n_steps: evaluate on `eval_ds` every this many training steps.
      max_steps: stop after this many training steps (None: when `train_ds` ends).
      gradient_accumulation_steps: batches per training step (None: 1).
      metrics_prefix: prefix of the metric names in the logger.
    """

    eval_every_n_steps: int
    max_steps: int | None = None
    gradient_accumulation_steps: int | None = None
    metrics_prefix: str = ""

    def __post_init__(self):
        for name in ("eval_every_n_steps", "max_steps", "gradient_accumulation_steps"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"TrainingConfig({name}={value!r}): must be a positive integer"
                                 + (" or None." if name != "eval_every_n_steps" else "."))

    def get_with_default(self, key: str, default: Any) -> Any:
        value = getattr(self, key)
        return default if value is None else value


class TrainingInput(NamedTuple):
    """A supervised batch: token ids and which of them the loss counts (1) or ignores (0)."""

    input_tokens: Any  # (B, T) int
    input_mask: Any  # (B, T): 1 on target tokens, 0 on the prompt and padding


class MetricsLogger:
    """Metrics in memory by (prefix, mode, name): tunix's `get_metric` / `get_metric_history`."""

    def __init__(self):
        self._metrics: dict[tuple[str, str, str], list[tuple[int, float]]] = {}

    def log(self, metrics_prefix: str, metric_name: str, value: Any, mode: str, step: int) -> None:
        key = (metrics_prefix, str(mode), metric_name)
        self._metrics.setdefault(key, []).append((int(step), float(value)))

    def metric_exists(self, metrics_prefix: str, metric_name: str, mode: str) -> bool:
        return (metrics_prefix, str(mode), metric_name) in self._metrics

    def _values(self, metrics_prefix: str, metric_name: str, mode: str) -> list[tuple[int, float]]:
        if not self.metric_exists(metrics_prefix, metric_name, mode):
            known = sorted(name for prefix, m, name in self._metrics
                           if prefix == metrics_prefix and m == str(mode))
            raise ValueError(f"Metric '{metrics_prefix}/{mode}/{metric_name}' not found. "
                             f"Available metrics for mode '{mode}': {known}")
        return self._metrics[(metrics_prefix, str(mode), metric_name)]

    def get_metric(self, metrics_prefix: str, metric_name: str, mode: str) -> float:
        """The latest value."""
        return self._values(metrics_prefix, metric_name, mode)[-1][1]

    def get_metric_history(self, metrics_prefix: str, metric_name: str, mode: str) -> np.ndarray:
        """Every value, in the order logged."""
        return np.array([v for _, v in self._values(metrics_prefix, metric_name, mode)])

    def get_metric_steps(self, metrics_prefix: str, metric_name: str, mode: str) -> np.ndarray:
        """The training step of each value (for plotting eval curves against train curves)."""
        return np.array([s for s, _ in self._values(metrics_prefix, metric_name, mode)])


def next_token_loss(model: Any, input_tokens: jax.Array, input_mask: jax.Array) -> jax.Array:
    """Mean cross-entropy of the tokens where `input_mask` is 1, each predicted from the ones before.

    Position t's logits predict token t+1, so the logits drop the last position and the
    targets and mask drop the first (as in tunix's `_default_loss_fn`).
    """
    logits = model(input_tokens)[:, :-1, :]  # (B, T-1, vocab)
    logps = selective_log_softmax(logits, input_tokens[:, 1:])  # (B, T-1)
    mask = input_mask[:, 1:].astype(jnp.float32)
    return -(logps * mask).sum() / (mask.sum() + 1e-8)


def _as_mapping(inputs: Any) -> Mapping[str, Any]:
    if isinstance(inputs, Mapping):
        return inputs
    if hasattr(inputs, "_asdict"):
        return inputs._asdict()
    if dataclasses.is_dataclass(inputs):
        return {f.name: getattr(inputs, f.name) for f in dataclasses.fields(inputs)}
    raise TypeError("A batch must be a dict, a NamedTuple or a dataclass of arrays, got "
                    f"{type(inputs).__name__}; or give with_gen_model_input_fn(fn) a fn that maps it "
                    "to the loss's keyword arguments.")


def is_lora_enabled(model: Any) -> bool:
    """True if the model has LoRA adapters (any `LoRAParam`)."""
    return len(jax.tree.leaves(nnx.state(model, LoRAParam))) > 0


class PeftTrainer:
    """Trains `model` (its LoRA adapters only, if it has any) on `train_ds` with `optimizer`."""

    def __init__(self, model: Any, optimizer: optax.GradientTransformation, training_config: TrainingConfig):
        self.model = model
        self.config = training_config
        self._lora_enabled = is_lora_enabled(model)
        self._wrt = LoRAParam if self._lora_enabled else nnx.Param
        accumulate = training_config.gradient_accumulation_steps
        self.optimizer = optax.MultiSteps(optimizer, accumulate) if accumulate else optimizer
        self.graphdef, params, self.frozen = nnx.split(model, self._wrt, ...)
        self.opt_state = self.optimizer.init(params)
        self.loss_fn: Callable = next_token_loss
        self.eval_loss_fn: Callable = next_token_loss
        self.gen_model_input_fn: Callable = _as_mapping
        self._has_aux = False
        self.metrics_logger = MetricsLogger()
        self.metrics_prefix = training_config.metrics_prefix
        self._train_steps = 0
        self._iter_steps = 0
        self.train_time = 0.0  # seconds in train(), evaluation excluded
        self._jitted = None
        self.is_managed_externally = False  # True: a learner decides when to stop (tunix's flag)

    # -- the tunix builder methods ------------------------------------------------------------
    def with_loss_fn(self, loss_fn: Callable, has_aux: bool = False) -> PeftTrainer:
        """`loss_fn(model, **model_inputs)` -> loss, or (loss, aux dict) with `has_aux=True`."""
        self.loss_fn = self.eval_loss_fn = loss_fn
        self._has_aux = has_aux
        self._jitted = None
        return self

    def with_gen_model_input_fn(self, gen_model_input_fn: Callable[[Any], Mapping[str, Any]]) -> PeftTrainer:
        """`fn(batch)` -> the keyword arguments of the loss function (runs inside the jitted step)."""
        self.gen_model_input_fn = gen_model_input_fn
        self._jitted = None
        return self

    # -- properties -------------------------------------------------------------------------------
    @property
    def train_steps(self) -> int:
        """Optimizer steps taken (each `gradient_accumulation_steps` batches)."""
        return self._train_steps

    @property
    def iter_steps(self) -> int:
        """Batches consumed."""
        return self._iter_steps

    @property
    def trainable_params(self) -> int:
        """How many numbers this trainer updates (the adapters' only, with LoRA)."""
        return sum(int(x.size) for x in jax.tree.leaves(nnx.state(self.model, self._wrt)))

    # -- the step ---------------------------------------------------------------------------------
    def _loss(self, params, frozen, inputs, loss_fn):
        model = nnx.merge(self.graphdef, params, frozen)
        out = loss_fn(model, **self.gen_model_input_fn(inputs))
        return out if self._has_aux else (out, {})

    def _build(self):
        def train_step(params, opt_state, frozen, inputs):
            grad_fn = jax.value_and_grad(self._loss, has_aux=True)
            (loss, aux), grads = grad_fn(params, frozen, inputs, self.loss_fn)
            updates, opt_state = self.optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss, aux, optax.global_norm(grads)

        def eval_step(params, frozen, inputs):
            return self._loss(params, frozen, inputs, self.eval_loss_fn)

        self._jitted = (jax.jit(train_step), jax.jit(eval_step))
        return self._jitted

    def _prepare_inputs(self, input_data: Any) -> Any:
        """Override for additional preparation outside the step (DPO adds the reference's log-probs)."""
        return input_data

    def _post_process_train_step(self, aux: Any) -> None:
        """Override to log the loss's aux metrics; the default logs each scalar one."""
        for name, value in (aux or {}).items():
            if jnp.ndim(value) == 0:
                self.metrics_logger.log(self.metrics_prefix, name, value, "train", self._train_steps)

    def _post_process_eval_step(self, aux: Any) -> None:
        pass

    # -- the loop ---------------------------------------------------------------------------------
    def train(self, train_ds: Iterable[Any], eval_ds: Iterable[Any] | None = None) -> None:
        """Train until `max_steps` training steps or the end of `train_ds`, evaluating on `eval_ds`.

        `eval_ds` is iterated again at each evaluation, so give a list (or another re-iterable).
        Metrics: 'loss', 'perplexity', 'grad_norm' per training step (mode 'train'), the loss's
        aux scalars, and 'loss'/'perplexity' per evaluation (mode 'eval').
        """
        train_step, eval_step = self._jitted or self._build()
        params = nnx.state(self.model, self._wrt)
        accumulate = self.config.get_with_default("gradient_accumulation_steps", 1)
        if eval_ds is not None:
            self._run_eval(eval_ds, eval_step, params)
        micro_losses: list[jax.Array] = []
        start = time.perf_counter()
        eval_time = 0.0
        for example in train_ds:
            if (not self.is_managed_externally and self.config.max_steps is not None
                    and self._train_steps >= self.config.max_steps):
                break
            example = self._prepare_inputs(example)
            params, self.opt_state, loss, aux, grad_norm = train_step(
                params, self.opt_state, self.frozen, example)
            micro_losses.append(loss)
            self._iter_steps += 1
            if self._iter_steps % accumulate:
                continue
            self._train_steps += 1
            loss = float(np.mean([float(x) for x in micro_losses]))
            micro_losses = []
            log = self.metrics_logger.log
            log(self.metrics_prefix, "loss", loss, "train", self._train_steps)
            log(self.metrics_prefix, "perplexity", np.exp(min(loss, 50.0)), "train", self._train_steps)
            log(self.metrics_prefix, "grad_norm", grad_norm, "train", self._train_steps)
            self._post_process_train_step(aux)
            if eval_ds is not None and self._train_steps % self.config.eval_every_n_steps == 0:
                eval_start = time.perf_counter()
                self._run_eval(eval_ds, eval_step, params)
                eval_time += time.perf_counter() - eval_start
        nnx.update(self.model, params)
        self.train_time += time.perf_counter() - start - eval_time

    def _run_eval(self, eval_ds: Iterable[Any], eval_step: Callable, params) -> None:
        losses = []
        for example in eval_ds:
            loss, aux = eval_step(params, self.frozen, self._prepare_inputs(example))
            losses.append(float(loss))
            self._post_process_eval_step(aux)
        if not losses:
            return
        loss = float(np.mean(losses))
        self.metrics_logger.log(self.metrics_prefix, "loss", loss, "eval", self._train_steps)
        self.metrics_logger.log(self.metrics_prefix, "perplexity", np.exp(min(loss, 50.0)), "eval",
                                self._train_steps)


__all__ = ["MetricsLogger", "PeftTrainer", "TrainingConfig", "TrainingInput", "is_lora_enabled",
           "next_token_loss"]
