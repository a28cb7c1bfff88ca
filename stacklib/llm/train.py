"""The training loop: a config in, a trained model, checkpoints and metrics out.

    python -m stacklib.llm.train stacklib/llm/configs/base.yml steps=300 d_model=128

Every part comes from an earlier chapter, imported under the real library's name:

    import stacklib.nn as nnx              # chapter 02: the model (model.py)
    import stacklib.optim as optax         # chapter 03: AdamW, warmup-cosine, clipping
    import stacklib.data as grain          # chapter 04: the input pipeline (data.py)
    import stacklib.checkpoint as ocp      # chapter 05: async, keep-N, with the data iterator
    from stacklib import compile           # chapter 06: the step's FLOPs, counted from its jaxpr
    from stacklib import parallel          # chapter 07: mesh, logical-axis rules
    from stacklib import profile           # chapter 08: the measured matmul peak, MFU

What a step does: `nnx.merge` the model inside `jax.jit`, compute the mean next-token
cross-entropy, its gradient, one optimizer update; the whole step is compiled ahead of
time (`jit(...).lower(...).compile()`) on a `(data, fsdp, tensor)` mesh with the
parameters, optimizer state and batch placed by `SHARDING_RULES`, so the compile time
is measured on its own. With `pipeline_parallelism` > 1 the mesh gains a leading
`pipeline` axis and the step runs the decoder layers as a pipeline (pipeline.py); between
steps the state holds the layers stacked in stages, and checkpoints unstack them.

Checkpoints go to `checkpoint_dir` every `checkpoint_every` steps. With a
`local_checkpoint_dir` too, chapter 05's two-tier manager (`ocp.multitier`) also saves
every `local_checkpoint_every` steps to that local tier; a restart resumes from the newest
intact copy in either tier, and SIGTERM (a preemption notice) saves the step in progress
locally and ends the loop.

The loop records, per step, one JSON line: loss, tokens/s, step time, MFU (the step's
FLOPs over step time times the measured peak) and the running goodput. Goodput is the
share of wall time spent in training steps; the rest is itemised (`Goodput`): compile,
checkpoint (saving blocks only for the snapshot; restoring; the final wait), input
(waiting for the next batch), eval, init, and other (logging, the progress bar).

Several hosts: the same command runs once per host (multihost.py): `main` joins the
job with `jax.distributed` from the environment, the mesh spans every process's
devices, each process feeds its own rows of each batch, all write one checkpoint
(process 0 commits it), and only process 0 writes metrics and the summary.

Mirrors MaxText's `train.py` (config-driven loop, logical-axis sharding, per-step MFU
and TFLOP/s logs, a goodput recorder). Differences: goodput is computed
locally from timers, not from MaxText's cloud-logging goodput package; no gradient
accumulation, profiler hooks or TensorBoard (the JSON lines are plotted in chapter 12).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import pathlib
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding

import stacklib.checkpoint as ocp
import stacklib.nn as nnx
import stacklib.optim as optax
from stacklib import compile as compile_tools
from stacklib import parallel, profile
from stacklib.flat_config import CheckpointMismatchError
from stacklib.llm import data, multihost, pipeline
from stacklib.llm.config import Config, ConfigError
from stacklib.llm.model import Transformer

MESH_AXES = ("data", "fsdp", "tensor")

# Logical axis -> mesh axes (MaxText's logical_axis_rules, abridged). The batch is split
# over data and fsdp; FSDP also splits every weight along d_model ("embed"); tensor
# parallelism splits heads, the MLP's hidden units and the vocabulary.
SHARDING_RULES = (
    ("batch", ("data", "fsdp")),
    ("vocab", "tensor"),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("embed", "fsdp"),
)


ArchitectureMismatchError = CheckpointMismatchError
"""A checkpoint was written by a model with other shapes than the one configured (chapter 12's
name for `stacklib.flat_config.CheckpointMismatchError`, which chapter 17's trainer raises too)."""


# -- building blocks -----------------------------------------------------------------------

def make_model(config: Config) -> Transformer:
    return Transformer(config, rngs=nnx.Rngs(params=config.seed))


def learning_rate_schedule(config: Config, optax_module: Any = optax) -> Callable:
    """Linear warmup to `learning_rate`, then cosine decay to `end_learning_rate_fraction` of it."""
    return optax_module.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=config.learning_rate,
        warmup_steps=min(config.warmup_steps, config.steps - 1), decay_steps=config.steps,
        end_value=config.learning_rate * config.end_learning_rate_fraction)


def decay_mask(params: Any) -> Any:
    """Weight decay on matrices only: norms' scales (1-D) are not decayed."""
    return jax.tree.map(lambda p: p.ndim > 1, params)


def make_optimizer(config: Config, optax_module: Any = optax) -> Any:
    """Clip the global gradient norm, then AdamW on the warmup-cosine schedule.

    `optax_module` lets the flax+optax twin (twin.py) build the same optimizer from the
    real optax: the call is identical, which is the book's drop-in principle.
    """
    schedule = learning_rate_schedule(config, optax_module)
    mask = decay_mask if config.pipeline_parallelism == 1 else pipeline.staged_decay_mask
    return optax_module.chain(
        optax_module.clip_by_global_norm(config.clip_norm),
        optax_module.adamw(schedule, b1=config.b1, b2=config.b2, weight_decay=config.weight_decay,
                           mask=mask),
    )


def next_token_loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean cross-entropy of predicting `targets` (B, T) from `logits` (B, T, vocab), in nats."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def make_loss_fn(graphdef: nnx.GraphDef, forward: Callable | None = None) -> Callable:
    """`loss(params, batch)` for a batch of (B, T + 1) token records.

    `forward(params, tokens) -> logits` stands in for the model's own call: the pipelined
    model's (`pipeline.make_forward`), whose params hold the layers staged.
    """

    def loss_fn(params, batch):
        inputs, targets = batch[:, :-1], batch[:, 1:]  # (B, T) each: predict token t+1 from 0..t
        logits = nnx.merge(graphdef, params)(inputs) if forward is None else forward(params, inputs)
        return next_token_loss(logits, targets)

    return loss_fn


def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, *,
                    forward: Callable | None = None) -> Callable:
    """A pure step `(params, opt_state, batch) -> (params, opt_state, metrics)`, not jitted."""
    loss_fn = make_loss_fn(graphdef, forward)

    def train_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, {"loss": loss, "grad_norm": optax.global_norm(grads)}

    return train_step


def make_mesh(config: Config) -> jax.sharding.Mesh:
    """The (data, fsdp, tensor) mesh of `config`, with Auto axes (the compiler places activations).

    With pipeline_parallelism > 1, a (pipeline, data, fsdp, tensor) mesh.

    Raises:
      ConfigError: the mesh needs more devices than there are, naming the settings.
    """
    needed = int(np.prod(config.mesh_shape))
    axes = MESH_AXES if config.pipeline_parallelism == 1 else (pipeline.PIPELINE_AXIS, *MESH_AXES)
    product = " * ".join(f"{axis}_parallelism" for axis in axes)
    if jax.process_count() > 1 and needed != jax.device_count():
        raise ConfigError(
            f"{product} = {needed}, but this job of "
            f"{jax.process_count()} processes has {jax.device_count()} devices: with several processes the "
            "mesh must span them all (every process must hold part of it). Make the product "
            f"{jax.device_count()}."
        )
    try:
        return parallel.make_mesh(config.mesh_shape, axes, (AxisType.Auto,) * len(axes))
    except ValueError as error:
        raise ConfigError(
            f"{product} = {needed} devices, but "
            f"this process has {len(jax.devices())}. Lower the mesh sizes, or simulate CPU devices "
            f"with stacklib.hw.simulate_cpu_devices({needed}) before JAX starts (on the command line: "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={needed} python -m stacklib.llm.train ...). "
            f"({error})"
        ) from None


@dataclasses.dataclass
class ShardedStep:
    """A train step compiled for a mesh, with the shardings its inputs must have."""

    compiled: Any  # jax.stages.Compiled
    mesh: jax.sharding.Mesh
    params_sharding: Any
    opt_state_sharding: Any
    batch_sharding: NamedSharding
    compile_seconds: float
    loss_fn: Callable | None = None  # `loss(params, batch)` on the step's params, for evaluation
    num_stages: int = 1  # pipeline stages; above 1 the step's params and opt_state hold the layers staged

    def __call__(self, params, opt_state, batch):
        return self.compiled(params, opt_state, batch)

    def place(self, params, opt_state):
        """Put a state as built or restored (per layer) on the mesh, its layers staged for a pipeline."""
        if self.num_stages > 1:
            params, opt_state = pipeline.stage_layers((params, opt_state), self.num_stages)
        return (jax.device_put(params, self.params_sharding),
                jax.device_put(opt_state, self.opt_state_sharding))

    def unstage(self, tree):
        """`tree` (the step's params, opt_state or both) per layer again, as checkpoints hold it."""
        return tree if self.num_stages == 1 else pipeline.unstage_layers(tree)


def compile_step(config: Config, graphdef, params, opt_state, tx, *, donate: bool = True) -> ShardedStep:
    """Compile the train step ahead of time for `config`'s mesh and logical-axis rules.

    With pipeline_parallelism > 1 the step is another program (pipeline.py): its layers run
    as a pipeline, and its state holds them staged, sharded over the `pipeline` axis.
    `ShardedStep.place` stages a per-layer state; `ShardedStep.unstage` undoes it.
    """
    mesh = make_mesh(config)
    rules, forward = SHARDING_RULES, None
    if config.pipeline_parallelism > 1:
        rules = SHARDING_RULES + pipeline.PIPELINE_RULES
        forward = pipeline.make_forward(graphdef, params, config, mesh)
        params, opt_state = pipeline.stage_layers((params, opt_state), config.pipeline_parallelism)
    params_sharding = parallel.get_named_sharding(params, mesh, rules)
    opt_state_sharding = parallel.get_named_sharding(opt_state, mesh, rules)
    batch_sharding = NamedSharding(mesh, parallel.logical_to_mesh_axes(("batch", None), rules))
    replicated = NamedSharding(mesh, jax.sharding.PartitionSpec())
    jitted = jax.jit(
        make_train_step(graphdef, tx, forward=forward),
        in_shardings=(params_sharding, opt_state_sharding, batch_sharding),
        out_shardings=(params_sharding, opt_state_sharding, replicated),
        donate_argnums=(0, 1) if donate else (),
    )
    batch = jax.ShapeDtypeStruct((config.batch_size, config.seq_len + 1), jnp.int32)
    start = time.perf_counter()
    # Arguments committed elsewhere (a restored checkpoint sits on one device) must be moved
    # first: lowering refuses a committed argument whose sharding differs from in_shardings.
    params, opt_state = jax.device_put((params, opt_state), (params_sharding, opt_state_sharding))
    compiled = jitted.lower(params, opt_state, batch).compile()
    return ShardedStep(compiled, mesh, params_sharding, opt_state_sharding, batch_sharding,
                       time.perf_counter() - start, make_loss_fn(graphdef, forward),
                       config.pipeline_parallelism)


def step_flops(config: Config, graphdef, params, opt_state, tx) -> float:
    """FLOPs of one step counted by `stacklib.compile` (chapter 06) from the step's jaxpr."""
    batch = jax.ShapeDtypeStruct((config.batch_size, config.seq_len + 1), jnp.int32)
    return compile_tools.cost_analysis(make_train_step(graphdef, tx), params, opt_state, batch)["flops"]


@functools.lru_cache(maxsize=1)
def measured_peak_flops() -> float:
    """This machine's float32 matmul peak (chapter 08's `measure_matmul_peak`), once per process."""
    from stacklib import hw

    return profile.measure_matmul_peak(hw.sizes("profile_peaks").matmul_n, repeats=5)


def evaluate(loss_fn: Callable, params, batches: list[np.ndarray]) -> float:
    """Mean loss (nats per byte) over held-out batches; bits per byte is this / ln 2.

    `loss_fn` should be jitted once by the caller: a new `jax.jit` per evaluation compiles anew.
    """
    return float(np.mean([float(loss_fn(params, batch)) for batch in batches]))


# -- goodput ------------------------------------------------------------------------------

class Goodput:
    """Wall time split into what it was spent on; goodput = step time / wall time.

    MaxText's goodput recorder logs events (job start, step start, checkpoint, ...) to a
    cloud logging service and computes the split afterwards; here the same categories are
    timers in the process.
    """

    CATEGORIES = ("step", "compile", "checkpoint", "input", "eval", "init")

    def __init__(self):
        self.start = time.perf_counter()
        self.seconds = dict.fromkeys(self.CATEGORIES, 0.0)

    @contextlib.contextmanager
    def time(self, category: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[category] += time.perf_counter() - start

    def add(self, category: str, seconds: float) -> None:
        self.seconds[category] += seconds

    def wall(self) -> float:
        return time.perf_counter() - self.start

    def breakdown(self) -> dict[str, float]:
        """Seconds per category, plus `other` (the rest of the wall time) and `wall`."""
        wall = self.wall()
        result = dict(self.seconds)
        result["other"] = max(0.0, wall - sum(self.seconds.values()))
        result["wall"] = wall
        return result

    def goodput(self) -> float:
        return self.seconds["step"] / self.wall()


# -- checkpoints ----------------------------------------------------------------------------

AnyCheckpointManager = ocp.CheckpointManager | ocp.multitier.CheckpointManager


def make_checkpoint_manager(config: Config) -> AnyCheckpointManager | None:
    """The run's checkpoint manager: none, one directory, or two tiers with `local_checkpoint_dir`.

    Both kinds answer `should_save`, `save`, `latest_step` and `restore` alike, so the loop
    does not ask which one it has. Each tier keeps `max_to_keep` steps.

    Raises:
      ConfigError: `local_checkpoint_dir` in a job of several processes: there every process
        writes its own shards into one checkpoint (multihost.py), which the two-tier manager,
        a single writer, does not do.
    """
    if not config.checkpoint_dir:
        return None
    if config.local_checkpoint_dir:
        if jax.process_count() > 1:
            raise ConfigError(
                f"local_checkpoint_dir={config.local_checkpoint_dir!r} works in a single process only, and "
                f"this job has {jax.process_count()}: with several processes each writes its shards of one "
                "checkpoint_dir, which the two-tier manager does not do. Set local_checkpoint_dir= (empty) "
                "and rely on checkpoint_dir, or train in one process.")
        tiers = ocp.multitier
        options = tiers.CheckpointManagerOptions(
            local=tiers.LocalCheckpointOptions(save_interval_steps=config.local_checkpoint_every,
                                               max_to_keep=config.max_to_keep),
            persistent=tiers.PersistentCheckpointOptions(save_interval_steps=config.checkpoint_every,
                                                         max_to_keep=config.max_to_keep),
            enable_async_checkpointing=config.async_checkpointing)
        return tiers.CheckpointManager(config.local_checkpoint_dir, config.checkpoint_dir, options=options)
    if jax.process_count() > 1:  # every process opens the directory; none may race to create it
        pathlib.Path(config.checkpoint_dir).mkdir(parents=True, exist_ok=True)
    return ocp.CheckpointManager(config.checkpoint_dir, options=ocp.CheckpointManagerOptions(
        max_to_keep=config.max_to_keep, save_interval_steps=config.checkpoint_every,
        enable_async_checkpointing=config.async_checkpointing))


def save_checkpoint(manager: AnyCheckpointManager, step: int, params, opt_state, iterator,
                    config: Config, *, force: bool = False) -> None:
    """Save the state, the data iterator's position and the config as `step`, if due or `force`d."""
    manager.save(step, force=force, args=ocp.args.Composite(
        state=ocp.args.StandardSave({"params": params, "opt_state": opt_state}),
        data=ocp.args.JsonSave(iterator.get_state()),
        config=ocp.args.JsonSave(config.to_dict())))


def restore_checkpoint(manager: AnyCheckpointManager, params, opt_state, config: Config):
    """(step, params, opt_state, data iterator state) of the newest checkpoint, architecture checked.

    With two tiers, the newest intact copy in either: a damaged copy is skipped with a
    warning and the next one read, so the step may be older than `latest_step()`.
    """
    tiered = isinstance(manager, ocp.multitier.CheckpointManager)
    step = None if tiered else manager.latest_step()
    saved = manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore())).config
    where = (f"{manager.local.directory} or {manager.persistent.directory}" if tiered
             else str(manager.directory))
    config.check_checkpoint(saved, where)  # the MODEL_KEYS; chapter 17's trainer shares the check
    restored = manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore({"params": params, "opt_state": opt_state}),
        data=ocp.args.JsonRestore()))
    if tiered:
        step = manager.last_restore.step
    return step, restored.state["params"], restored.state["opt_state"], restored.data


def install_preemption_handler(manager: AnyCheckpointManager | None) -> Callable[[], None]:
    """Let SIGTERM ask a two-tier `manager` to save the next step locally; return the undo.

    Only for two tiers, and only from the main thread (Python delivers signals there). The
    undo puts the previous handler back: the notebook or test process that called `train`
    keeps its own once the loop is over.
    """
    if (not isinstance(manager, ocp.multitier.CheckpointManager)
            or threading.current_thread() is not threading.main_thread()):
        return lambda: None
    previous = ocp.multitier.install_preemption_handler(manager)
    return lambda: signal.signal(signal.SIGTERM, previous)


def reached_preemption(manager: AnyCheckpointManager | None, step: int) -> bool:
    """Whether a preemption notice made `manager` save `step` (or an earlier one): time to stop."""
    return isinstance(manager, ocp.multitier.CheckpointManager) and manager.reached_preemption(step)


# -- the loop -----------------------------------------------------------------------------

@dataclasses.dataclass
class TrainResult:
    """What `train` returns: the trained model's pieces and the run's records."""

    config: Config
    graphdef: nnx.GraphDef
    params: Any
    history: list[dict]  # one dict per step of this call (the JSON lines)
    goodput: dict[str, float]  # seconds per category (see Goodput.breakdown)
    eval_loss: float | None  # held-out nats per byte at the end (None if eval_batches=0)
    flops_per_step: float
    peak_flops: float
    start_step: int  # 0, or the checkpoint step this call resumed from
    preempted_at: int | None = None  # the step saved on a preemption notice (SIGTERM); the loop stopped there

    @property
    def model(self) -> Transformer:
        return nnx.merge(self.graphdef, self.params)

    @property
    def losses(self) -> list[float]:
        return [record["loss"] for record in self.history]


def train(config: Config, *, root: str | None = None, stop_after: int | None = None,
          log: Callable[[dict], None] | None = None) -> TrainResult:
    """Train `config.steps` steps, resuming from the newest checkpoint if any (either tier's).

    With a local tier, SIGTERM saves the step in progress there and ends the loop early
    (`TrainResult.preempted_at`); the same call again resumes from that step.

    Args:
      config: the run.
      root: the corpus directory (default: this Python's standard library).
      stop_after: return after step `stop_after` of the run (not of this call), as if the job
        were killed there: checkpoints already written are kept, the step itself is saved only
        if due, and the next call resumes from the last checkpoint (for resumption tests).
        Chapter 17's trainer (`stacklib.diffusion.train`) means the same.
      log: called with each step's record.

    Returns:
      A `TrainResult`.

    Raises:
      ArchitectureMismatchError: `checkpoint_dir` holds a checkpoint of another model.
      ConfigError: the mesh does not fit the devices, or a local tier in a job of several processes.
    """
    clock = Goodput()
    with clock.time("init"):
        graphdef, params, tx, opt_state = _initial_state(config)
        iterator = iter(data.train_dataset(config, root, shard_index=jax.process_index(),
                                           shard_count=jax.process_count()))
        heldout = data.heldout_batches(config, root) if config.eval_batches else []
        peak = config.peak_flops or measured_peak_flops()
    manager, start, preempted_at = make_checkpoint_manager(config), 0, None
    if manager is not None and manager.latest_step() is not None:
        with clock.time("checkpoint"):
            start, params, opt_state = _resume(manager, params, opt_state, iterator, config)
    with clock.time("compile"):  # after the restore: a wrong checkpoint fails before compiling
        step_fn = compile_step(config, graphdef, params, opt_state, tx)
        flops = step_flops(config, graphdef, params, opt_state, tx)
    params, opt_state = step_fn.place(params, opt_state)
    evaluate_heldout = _heldout_evaluator(step_fn, heldout)

    primary = multihost.is_primary()  # metrics, logs and the progress bar: process 0 only
    metrics_file = open(config.metrics_file, "a") if config.metrics_file and primary else None  # noqa: SIM115
    history: list[dict] = []
    progress = _progress(range(start + 1, last_step(config, stop_after) + 1),
                         config if primary else config.replace(progress=False))
    uninstall_preemption_handler = install_preemption_handler(manager)
    try:
        for step in progress:
            with clock.time("input"):
                batch = multihost.process_batch(next(iterator), step_fn.batch_sharding)
            began = time.perf_counter()
            params, opt_state, metrics = step_fn(params, opt_state, batch)
            loss = _wait_for_loss(metrics, step)  # waits for the step to finish
            seconds = time.perf_counter() - began
            clock.add("step", seconds)
            if manager is not None and (step == config.steps or manager.should_save(step)):
                with clock.time("checkpoint"):  # the finished run is saved whatever the interval
                    _save_step(manager, step, step_fn, params, opt_state, iterator, config)
            record = _step_record(config, step, loss, metrics, seconds, flops, peak, clock)
            if evaluate_heldout is not None and config.eval_every and step % config.eval_every == 0:
                with clock.time("eval"):
                    record["eval_loss"] = evaluate_heldout(params)
            history.append(record)
            _publish(record, metrics_file, log, progress)
            if reached_preemption(manager, step):  # the grace period is short: no final evaluation
                preempted_at = step
                _announce_preemption(config, step)
                break
        if manager is not None:
            with clock.time("checkpoint"):
                manager.wait_until_finished()
                manager.close()
        eval_loss = None
        if evaluate_heldout is not None and preempted_at is None:
            with clock.time("eval"):
                eval_loss = evaluate_heldout(params)
    finally:
        uninstall_preemption_handler()
        if metrics_file is not None:
            metrics_file.close()
    breakdown = clock.breakdown()
    return TrainResult(config, graphdef, step_fn.unstage(params), history, breakdown, eval_loss, flops, peak,
                       start, preempted_at)


def last_step(config: Config, stop_after: int | None) -> int:
    """The step a call of `train` ends at: `config.steps`, or `stop_after` if earlier (a simulated kill)."""
    return config.steps if stop_after is None else min(config.steps, stop_after)


def _initial_state(config: Config):
    """(graphdef, params, tx, opt_state) of a fresh run: the model split, the optimizer initialised."""
    graphdef, params = nnx.split(make_model(config), nnx.Param)
    tx = make_optimizer(config)
    return graphdef, params, tx, tx.init(params)


def _resume(manager: AnyCheckpointManager, params, opt_state, iterator, config: Config):
    """(step, params, opt_state) of the newest checkpoint, the data iterator moved to its position."""
    if jax.process_count() > 1:  # restore to host arrays: device_put then keeps each process's shards
        params, opt_state = jax.tree.map(np.asarray, (params, opt_state))
    step, params, opt_state, data_state = restore_checkpoint(manager, params, opt_state, config)
    iterator.set_state(data_state)
    return step, params, opt_state


def _heldout_evaluator(step_fn: ShardedStep, heldout: list[np.ndarray]) -> Callable | None:
    """`evaluate(params)` on the held-out batches placed on the step's mesh; None without any."""
    replicated = NamedSharding(step_fn.mesh, jax.sharding.PartitionSpec())
    loss_fn = jax.jit(step_fn.loss_fn, out_shardings=replicated)
    batches = [multihost.process_batch(multihost.process_rows(b), step_fn.batch_sharding) for b in heldout]
    if not batches:
        return None
    return lambda params: evaluate(loss_fn, params, batches)


def _save_step(manager: AnyCheckpointManager, step: int, step_fn: ShardedStep, params, opt_state, iterator,
               config: Config) -> None:
    """Save `step` per layer (unstaged), with the data iterator's position and the config.

    With several processes each writes its shards of one checkpoint (multihost.py), and the
    manager learns of the step from the directory.
    """
    if jax.process_count() > 1:
        state = step_fn.unstage({"params": params, "opt_state": opt_state})
        multihost.save_checkpoint(config.checkpoint_dir, step, state, iterator.get_state(), config.to_dict(),
                                  max_to_keep=config.max_to_keep)
        manager.reload()
    else:
        save_checkpoint(manager, step, *step_fn.unstage((params, opt_state)), iterator, config,
                        force=step == config.steps)


def _step_record(config: Config, step: int, loss: float, metrics: dict, seconds: float, flops: float,
                 peak: float, clock: Goodput) -> dict:
    """One step's JSON line: loss, gradient norm, step time, tokens/s, MFU and the running goodput."""
    tokens = config.batch_size * config.seq_len
    return {"step": step, "loss": loss, "grad_norm": float(metrics["grad_norm"]),
            "step_time": seconds, "tokens_per_s": tokens / seconds,
            "mfu": profile.mfu(flops, seconds, peak), "goodput": clock.goodput()}


def _publish(record: dict, metrics_file, log: Callable[[dict], None] | None, progress) -> None:
    """Hand a step's record to the metrics file, the `log` callback and the progress bar, where there are."""
    if metrics_file is not None:
        metrics_file.write(json.dumps(record) + "\n")
    if log is not None:
        log(record)
    if hasattr(progress, "set_postfix"):
        progress.set_postfix(loss=f"{record['loss']:.3f}", refresh=False)


def _announce_preemption(config: Config, step: int) -> None:
    print(f"train: preemption notice (SIGTERM): step {step} is saved in local_checkpoint_dir="
          f"{config.local_checkpoint_dir}; stopping. The same command resumes from it.",
          file=sys.stderr, flush=True)


def _wait_for_loss(metrics: dict, step: int) -> float:
    """The step's loss as a float; with several processes, a lost peer becomes a PeerLostError."""
    if jax.process_count() == 1:
        return float(metrics["loss"])
    try:
        return float(metrics["loss"])
    except Exception as error:  # XlaRuntimeError from gloo or the coordination service
        raise multihost.PeerLostError(
            f"process {jax.process_index()} of {jax.process_count()}: step {step} failed because "
            "another process of the job stopped answering (it died, or the network failed). The job "
            "cannot continue with a process missing: restart every process; training resumes from "
            f"the last checkpoint. ({type(error).__name__}: {str(error)[:300]})"
        ) from None


def _progress(steps: range, config: Config):
    if not config.progress:
        return steps
    from tqdm.auto import tqdm

    return tqdm(steps, desc="train", unit="step")


USAGE_EXAMPLE = "python -m stacklib.llm.train stacklib/llm/configs/base.yml steps=300 d_model=128"


def _command_line_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m stacklib.llm.train",
        usage="%(prog)s [CONFIG.yml] key=value [key=value ...]",
        description="Train a decoder-only language model from one flat config, as MaxText's train.py "
                    "does: a YAML file (default: the base config) and key=value overrides.",
        epilog=f"example: {USAGE_EXAMPLE}\n\nkeys (see stacklib/llm/configs/base.yml): "
               + ", ".join(Config.keys()),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    return parser


def parse_command_line(argv: list[str]) -> Config:
    """The config a command line asks for; a user mistake exits with status 2 and one message.

    A run needs at least one argument (a config file or an override): with none, the
    command prints its usage instead of silently starting a minutes-long default run.
    """
    return Config.from_command_line(argv, _command_line_parser(), USAGE_EXAMPLE)


def main(argv: list[str] | None = None) -> int:
    """`python -m stacklib.llm.train [CONFIG.yml] key=value ...`; returns the exit status."""
    config = parse_command_line(list(sys.argv[1:] if argv is None else argv))
    distributed = multihost.initialize()  # from the environment, before any JAX operation
    try:
        result = train(config)
    except ConfigError as error:  # the mesh, or a checkpoint of other weights (CheckpointMismatchError)
        print(f"{_command_line_parser().prog}: error: {error}", file=sys.stderr)
        return 2
    if not multihost.is_primary():
        jax.distributed.shutdown()
        return 0
    last = result.history[-1] if result.history else {}
    summary = {
        "steps": config.steps, "final_loss": last.get("loss"),
        "heldout_bits_per_byte": None if result.eval_loss is None else result.eval_loss / np.log(2),
        "median_step_time": float(np.median([r["step_time"] for r in result.history[1:] or result.history])),
        "mfu": float(np.median([r["mfu"] for r in result.history])),
        "goodput": result.goodput["step"] / result.goodput["wall"],
        "seconds": {key: round(value, 3) for key, value in result.goodput.items()},
    }
    print(json.dumps(summary, indent=1), flush=True)
    if distributed:
        jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
