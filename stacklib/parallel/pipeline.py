"""Pipeline parallelism: stages of layers on a `pipeline` mesh axis, fed microbatch by microbatch.

Mirrors the design of MaxText's pipeline layer (`MaxText/layers/pipeline.py`, switched on
by `ici_pipeline_parallelism` / `dcn_pipeline_parallelism`): the layers are stacked with a
leading *stage* axis sharded over the pipeline mesh axis, every stage runs the same
program on its own layers each tick, and a `ppermute` shifts each stage's output to the
next stage. The schedules are GPipe's (Huang et al. 2019, all forwards, then all
backwards) and 1F1B (PipeDream-Flush, Narayanan et al. 2021, a backward as soon as one
is possible), and the bubble is the share of idle (stage, tick) slots:

    GPipe, p stages, m microbatches, unit-time forward and backward: (p - 1) / (m + p - 1)

Three parts:

  * schedules: `Action`s per tick and stage, built from each stage's order of work and
    the two dependencies (stage s forwards microbatch i after stage s - 1 did; it runs
    the backward after its own forward and after stage s + 1's backward);
  * `pipeline_loss`: the forward loop over m + p - 1 ticks inside `shard_map`; `jax.grad`
    of it runs the ticks in reverse, which is exactly GPipe's backward half
    (`pipeline_apply` is the same loop returning the outputs, for a model with layers of
    its own around the pipeline: chapter 12's language model);
  * `pipeline_value_and_grad`: an executor of any schedule (GPipe or 1F1B): each stage
    stashes the inputs of its microbatches in flight and recomputes its forward in the
    backward (MaxText's default remat policy saves the same "iteration_input"), so its
    memory follows the schedule's peak number of live microbatches.

Differences from MaxText:
  * One pipeline axis and no circular pipelines (`num_pipeline_repeats`), no forwarding
    delay. `pipeline_loss` and `pipeline_value_and_grad` replicate the batch over stages;
    `pipeline_apply` leaves the other mesh axes to the compiler (data, FSDP, tensor).
  * A stage is a stack of `layer(params, x)` calls on one array (a toy dense layer by
    default; chapter 12 passes a decoder layer), not a Flax module with segment ids.
  * The schedule executor is ours: MaxText differentiates its pipeline loop with
    `jax.grad`, which gives the GPipe order. Both are SPMD (one program, every stage);
    Pathways can also run MPMD pipelines, a different program per stage.
  * A tick is one forward or one backward of one microbatch on one stage; real backwards
    take about twice as long as forwards.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P


class Action(NamedTuple):
    """What one stage does in one tick: the forward ("F") or backward ("B") of a microbatch."""

    kind: str
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}"


Schedule = list[list[Action | None]]  # schedule[tick][stage]; None is an idle slot (the bubble)


def _check_counts(num_stages: int, num_microbatches: int) -> None:
    if num_stages < 1 or num_microbatches < 1:
        raise ValueError(f"A pipeline needs num_stages >= 1 and num_microbatches >= 1; got "
                         f"num_stages={num_stages}, num_microbatches={num_microbatches}.")


def _ready(action: Action, stage: int, done: dict, num_stages: int, tick: int) -> bool:
    """Whether `action` may run on `stage` at `tick`: what it needs finished in an earlier tick."""
    i = action.microbatch
    if action.kind == "F":
        needs = [] if stage == 0 else [("F", stage - 1, i)]
    else:
        needs = [("F", stage, i)] + ([] if stage == num_stages - 1 else [("B", stage + 1, i)])
    return all(done.get(need, tick) < tick for need in needs)


def schedule_from_orders(orders: list[list[Action]]) -> Schedule:
    """Run each stage's order of work as early as its dependencies allow, one action per tick.

    Raises:
      ValueError: the orders deadlock (no stage can move, but work is left).
    """
    num_stages, done, position, schedule = len(orders), {}, [0] * len(orders), []
    while any(position[s] < len(orders[s]) for s in range(num_stages)):
        tick = len(schedule)
        row = [orders[s][position[s]] if position[s] < len(orders[s]) else None for s in range(num_stages)]
        row = [a if a and _ready(a, s, done, num_stages, tick) else None for s, a in enumerate(row)]
        if not any(row):
            raise ValueError(f"The stage orders deadlock at tick {tick}: every stage waits on another.")
        for stage, action in enumerate(row):
            if action is not None:
                done[(action.kind, stage, action.microbatch)] = tick
                position[stage] += 1
        schedule.append(row)
    return schedule


def gpipe_schedule(num_stages: int, num_microbatches: int) -> Schedule:
    """GPipe: every stage forwards all m microbatches, then runs their backwards in reverse.

    Stage s forwards microbatch i at tick s + i and runs its backward at tick
    2 (m + p - 1) - 1 - s - i, the mirror image: reverse-mode autodiff of the forward
    loop (`pipeline_loss`) runs the ticks in exactly this order.
    """
    _check_counts(num_stages, num_microbatches)
    order = [Action("F", i) for i in range(num_microbatches)]
    order += [Action("B", i) for i in reversed(range(num_microbatches))]
    return schedule_from_orders([order] * num_stages)


def one_f_one_b_schedule(num_stages: int, num_microbatches: int) -> Schedule:
    """1F1B (PipeDream-Flush): p - 1 - s warm-up forwards, then alternate forward and backward.

    A stage starts a microbatch's backward as soon as it can, so at most p - s microbatches
    are in flight on stage s (GPipe: all m), with the same bubble as GPipe.
    """
    _check_counts(num_stages, num_microbatches)
    orders = []
    for stage in range(num_stages):
        warmup = min(num_stages - 1 - stage, num_microbatches)
        order = [Action("F", i) for i in range(warmup)]
        for i in range(num_microbatches - warmup):
            order += [Action("F", warmup + i), Action("B", i)]
        order += [Action("B", i) for i in range(num_microbatches - warmup, num_microbatches)]
        orders.append(order)
    return schedule_from_orders(orders)


def check_schedule(schedule: Schedule, num_microbatches: int) -> None:
    """Raise ValueError, naming the tick and stage, unless `schedule` is a valid pipeline schedule.

    Valid: every row has one slot per stage; every stage runs the forward and the backward
    of every microbatch exactly once; each action's dependencies (see `_ready`) finished
    in an earlier tick.
    """
    if not schedule or not schedule[0]:
        raise ValueError("The schedule is empty: it needs at least one tick with one slot per stage.")
    num_stages = len(schedule[0])
    done: dict[tuple[str, int, int], int] = {}
    for tick, row in enumerate(schedule):
        if len(row) != num_stages:
            raise ValueError(f"Tick {tick} has {len(row)} slots, tick 0 {num_stages}: one slot per stage.")
        for stage, action in enumerate(row):
            if action is None:
                continue
            try:
                action = Action(*action)
            except TypeError:
                raise ValueError(f"Tick {tick}, stage {stage}: {action!r} is not None or a pair like "
                                 "Action('F', 0).") from None
            key = (action.kind, stage, action.microbatch)
            if action.kind not in ("F", "B") or not 0 <= action.microbatch < num_microbatches or key in done:
                raise ValueError(f"Tick {tick}, stage {stage}: {action} is not a forward or backward of a "
                                 f"microbatch 0..{num_microbatches - 1} that has not run yet.")
            if not _ready(action, stage, done, num_stages, tick):
                raise ValueError(f"Tick {tick}, stage {stage}: {action} runs before what it needs (the "
                                 "previous stage's forward, its own forward, the next stage's backward).")
        for stage, action in enumerate(row):
            if action is not None:
                done[(action[0], stage, action[1])] = tick
    if len(done) != 2 * num_stages * num_microbatches:
        raise ValueError(f"The schedule runs {len(done)} actions; {num_stages} stages x {num_microbatches} "
                         "microbatches need a forward and a backward each.")


def bubble_fraction(schedule: Schedule) -> float:
    """The share of (tick, stage) slots in which a stage is idle."""
    slots = [action for row in schedule for action in row]
    return sum(action is None for action in slots) / len(slots)


def peak_live_microbatches(schedule: Schedule) -> list[int]:
    """Per stage, the most microbatches forwarded but not yet backwarded at once.

    Each of them holds its activations on that stage until its backward: this is the
    activation memory a schedule needs, in microbatches.
    """
    peaks = []
    for stage in range(len(schedule[0])):
        live = peak = 0
        for row in schedule:
            action = row[stage]
            live += action is not None and action[0] == "F"
            peak = max(peak, live)
            live -= action is not None and action[0] == "B"
        peaks.append(peak)
    return peaks


# ---- the model: a stack of layers, cut into stages
def dense_layer(params: dict, x: jax.Array) -> jax.Array:
    """tanh(x @ kernel + bias): (rows, width) -> (rows, width)."""
    return jnp.tanh(x @ params["kernel"] + params["bias"])


def init_layers(key: jax.Array, num_layers: int, width: int) -> dict:
    """`num_layers` dense layers stacked on a leading layer axis: kernel (L, D, D), bias (L, D)."""
    kernel = jax.random.normal(key, (num_layers, width, width)) / np.sqrt(width)
    return {"kernel": kernel, "bias": jnp.zeros((num_layers, width))}


def stack_stages(layers: Any, num_stages: int) -> Any:
    """Cut a stack of L layers into `num_stages` stages of L / p consecutive layers each.

    Raises:
      ValueError: L is not a multiple of num_stages.
    """
    num_layers = jax.tree.leaves(layers)[0].shape[0]
    if num_stages < 1 or num_layers % num_stages:
        raise ValueError(f"stack_stages: {num_layers} layers do not split into {num_stages} equal stages; "
                         f"use a number of stages that divides {num_layers}.")
    # (L, ...) -> (stages, L / stages, ...): stage s holds layers s L/p .. (s + 1) L/p - 1
    return jax.tree.map(lambda a: a.reshape(num_stages, num_layers // num_stages, *a.shape[1:]), layers)


def apply_layers(layers: Any, x: jax.Array, layer: Callable = dense_layer) -> jax.Array:
    """Apply a stack of layers (leading layer axis) to x, in order."""
    for j in range(jax.tree.leaves(layers)[0].shape[0]):
        x = layer(jax.tree.map(lambda a, j=j: a[j], layers), x)
    return x


def sequential_loss(layers: Any, x: jax.Array, y: jax.Array, layer: Callable = dense_layer) -> jax.Array:
    """The one-device reference: the mean squared error of all layers on the whole batch."""
    return jnp.mean((apply_layers(layers, x, layer) - y) ** 2)


# ---- executing a pipeline with shard_map
def _check(stages: Any, batch: int, mesh: Mesh, axis_name: str, num_microbatches: int) -> int:
    """The number of stages, after checking that stages, mesh and batch fit together."""
    if axis_name not in mesh.shape:
        raise ValueError(f"The mesh has axes {tuple(mesh.shape)}, no {axis_name!r}: build it with "
                         f"make_mesh((num_stages,), ({axis_name!r},), (AxisType.Auto,)) or pass axis_name=.")
    if AxisType.Explicit in mesh.axis_types:
        # shard_map over Explicit axes would not move the stages onto their devices for us.
        raise ValueError(f"The mesh has Explicit axes {mesh.axis_types}: build it with axis_types="
                         f"(AxisType.Auto,) * {len(mesh.axis_types)}, so that shard_map places the stages.")
    num_stages = jax.tree.leaves(stages)[0].shape[0]
    if num_stages != mesh.shape[axis_name]:
        size = mesh.shape[axis_name]
        raise ValueError(f"stages has {num_stages} stages on its leading axis, but mesh axis {axis_name!r} "
                         f"has {size} devices: build them with stack_stages(layers, {size}) or a mesh "
                         f"whose {axis_name!r} axis has size {num_stages}.")
    if num_microbatches < 1 or batch % num_microbatches:
        raise ValueError(f"The batch of {batch} rows does not split into num_microbatches={num_microbatches} "
                         f"equal microbatches: use a divisor of {batch}, or pad the batch.")
    return num_stages


def _split(stages: Any, x: jax.Array, y: jax.Array, mesh: Mesh, axis_name: str, num_microbatches: int):
    """Check the arguments and cut the batch into microbatches: (m, B / m, ...)."""
    num_stages, batch = _check(stages, x.shape[0], mesh, axis_name, num_microbatches), x.shape[0]
    # (B, ...) -> (microbatches, B / microbatches, ...)
    return num_stages, *(a.reshape(num_microbatches, batch // num_microbatches, *a.shape[1:]) for a in (x, y))


def _varying(tree: Any, axis_name: str) -> Any:
    """Mark values as differing across stages, as the carries of a per-stage loop do."""
    return jax.tree.map(lambda a: lax.pcast(a, axis_name, to="varying"), tree)


def _gpipe_forward(stage: Any, xs: jax.Array, num_stages: int, axis_name: str, layer: Callable) -> jax.Array:
    """One stage's program for GPipe's forward pass, run inside `shard_map` by every stage.

    Each of the m + p - 1 ticks, every stage applies its layers to what it holds, and one
    ppermute passes every stage's output to the next stage; stage 0 takes microbatch t
    instead, and the last stage keeps its output for microbatch t - (p - 1). In the ticks
    where a stage holds no microbatch (the bubble) it computes values that nothing keeps.

    Args:
      stage: this stage's layers, leaves (1, L / p, ...).
      xs: every microbatch, (m, B / m, ...); each layer keeps the shape of its input.

    Returns:
      (m, B / m, ...): the stack's outputs on the last stage, zeros on the others.
    """
    num_microbatches = xs.shape[0]
    to_next = [(s, s + 1) for s in range(num_stages - 1)]
    stage = jax.tree.map(lambda a: a[0], stage)  # (1, L / p, ...) -> (L / p, ...): this stage's layers
    me = lax.axis_index(axis_name)

    def tick(carry, t):
        held, outputs = carry
        h = apply_layers(stage, jnp.where(me == 0, xs[jnp.minimum(t, num_microbatches - 1)], held), layer)
        finished = t - (num_stages - 1)  # the microbatch the last stage holds at tick t
        keep = (me == num_stages - 1) & (finished >= 0)
        slot = jnp.maximum(finished, 0)
        outputs = lax.dynamic_update_index_in_dim(outputs, jnp.where(keep, h, outputs[slot]), slot, 0)
        return (lax.ppermute(h, axis_name, to_next), outputs), None

    start = _varying((jnp.zeros_like(xs[0]), jnp.zeros_like(xs)), axis_name)
    (_, outputs), _ = lax.scan(tick, start, jnp.arange(num_microbatches + num_stages - 1))
    return outputs


def pipeline_loss(stages: Any, x: jax.Array, y: jax.Array, *, mesh: Mesh, num_microbatches: int,
                  axis_name: str = "pipeline", layer: Callable = dense_layer) -> jax.Array:
    """The mean squared error of the whole stack, run as a GPipe forward pass over the stages.

    Every stage runs `_gpipe_forward` (m + p - 1 ticks of "apply my layers, pass the result
    right"); the last stage then holds every microbatch's output and computes the loss.
    Differentiate it from outside with `jax.grad`: the loss leaves `shard_map` through a
    `psum`, so each stage's gradient is its own and nothing is counted twice.

    Args:
      stages: the layers' parameters with a leading stage axis (`stack_stages`).
      x, y: inputs and targets, (batch, width); the batch splits into `num_microbatches`.
      mesh: a mesh with an axis `axis_name` of one device per stage (Auto axes).

    Raises:
      ValueError: no such mesh axis, a stage count that is not its size, or a batch that
        does not split into equal microbatches.
    """
    num_stages, xs, ys = _split(stages, x, y, mesh, axis_name, num_microbatches)

    def per_stage(stage, xs, ys):
        outputs = _gpipe_forward(stage, xs, num_stages, axis_name, layer)
        local = jnp.mean((outputs - ys) ** 2)  # meaningful on the last stage only
        last = lax.axis_index(axis_name) == num_stages - 1
        return lax.psum(jnp.where(last, local, 0.0), axis_name)

    run = jax.shard_map(per_stage, mesh=mesh, in_specs=(P(axis_name), P(), P()), out_specs=P())
    return run(stages, xs, ys)


def pipeline_apply(stages: Any, x: jax.Array, *, mesh: Mesh, num_microbatches: int,
                   axis_name: str = "pipeline", layer: Callable = dense_layer) -> jax.Array:
    """The stack's output for `x`, by GPipe's forward pass over the stages: `pipeline_loss` without a loss.

    For a model with more around its stack of layers, such as a language model's embedding
    before it and final norm, head and loss after it: those run outside on the whole
    batch, and `jax.grad` flows through this function as through `pipeline_loss`. The
    output leaves the last stage through a `psum` to which the other stages add zeros.

    Only the pipeline axis is manual inside `shard_map`; the mesh's other axes stay Auto,
    so the compiler splits each stage's work over data, FSDP and tensor axes as it does
    without a pipeline. Microbatch i is rows i, i + m, i + 2m, ... of the batch: when the
    batch is split into contiguous blocks over a data axis and each block's rows are a
    multiple of m, every device already holds its share of every microbatch.

    Args:
      stages: the layers' parameters with a leading stage axis (`stack_stages`).
      x: (batch, ...), of the shape each layer takes and returns; the batch splits into
        `num_microbatches`.
      mesh: a mesh with an axis `axis_name` of one device per stage (Auto axes).

    Returns:
      (batch, ...): the last layer's output, rows in the order of `x`.

    Raises:
      ValueError: as `pipeline_loss`.
    """
    batch, m = x.shape[0], num_microbatches
    num_stages = _check(stages, batch, mesh, axis_name, m)
    # (B, ...) -> (B / m, m, ...) -> (m, B / m, ...): microbatch i is rows i, i + m, i + 2m, ...
    xs = jnp.swapaxes(x.reshape(batch // m, m, *x.shape[1:]), 0, 1)

    def per_stage(stage, xs):
        outputs = _gpipe_forward(stage, xs, num_stages, axis_name, layer)
        last = lax.axis_index(axis_name) == num_stages - 1
        return lax.psum(jnp.where(last, outputs, 0), axis_name)

    run = jax.shard_map(per_stage, mesh=mesh, in_specs=(P(axis_name), P()), out_specs=P(),
                        axis_names={axis_name})
    # (m, B / m, ...) -> (B / m, m, ...) -> (B, ...): the rows back in their order
    return jnp.swapaxes(run(stages, xs), 0, 1).reshape(x.shape)


def _stash_size(schedule: Schedule, arrivals: np.ndarray, num_microbatches: int) -> int:
    """The fewest stash slots that keep each arriving value until its backward (microbatch i: slot i % n).

    `arrivals[t, s]` is the microbatch whose value reaches stage s at the end of tick t
    (-1: none). A backward frees its slot before that tick's arrivals are stored.
    """
    for size in range(1, num_microbatches + 1):
        ok = True
        for stage in range(len(schedule[0])):
            held: dict[int, int] = {}  # slot -> microbatch
            for tick, row in enumerate(schedule):
                action = row[stage]
                if action is not None and action[0] == "B":
                    held.pop(action[1] % size, None)
                i = int(arrivals[tick, stage])
                if i >= 0:
                    ok = ok and held.setdefault(i % size, i) == i
        if ok:
            return size
    return num_microbatches


def _receive(stash: jax.Array, received: jax.Array, microbatch: jax.Array) -> jax.Array:
    """Put what arrived into microbatch's slot of the stash, if a microbatch arrived (>= 0)."""
    slot = jnp.maximum(microbatch, 0) % stash.shape[0]
    return lax.dynamic_update_index_in_dim(stash, jnp.where(microbatch >= 0, received, stash[slot]), slot, 0)


def pipeline_value_and_grad(
    stages: Any, x: jax.Array, y: jax.Array, *, mesh: Mesh, schedule: Schedule, axis_name: str = "pipeline",
    layer: Callable = dense_layer,
) -> tuple[jax.Array, Any]:
    """The loss of `pipeline_loss` and its gradient, running `schedule` tick by tick.

    Each tick a stage runs the action its column says: a forward sends its output right,
    a backward recomputes the forward from the stashed stage input (`jax.vjp`), adds to
    the stage's gradient and sends the input's cotangent left. Arriving activations wait
    in a stash until their backward, arriving cotangents until theirs; the stash sizes
    are the schedule's, so 1F1B holds about p microbatches per stage and GPipe m.

    Returns:
      (loss, grads), grads with the stages' structure and sharding.

    Raises:
      ValueError: as `pipeline_loss`, and for an invalid schedule (`check_schedule`).
    """
    num_microbatches = 1 + max((a[1] for row in schedule for a in row if a is not None), default=0)
    check_schedule(schedule, num_microbatches)
    num_stages, xs, ys = _split(stages, x, y, mesh, axis_name, num_microbatches)
    if len(schedule[0]) != num_stages:
        raise ValueError(f"The schedule has {len(schedule[0])} stages, but stages and mesh axis "
                         f"{axis_name!r} have {num_stages}: build the schedule for {num_stages} stages.")
    kind = np.array([[0 if a is None else 1 + (a[0] == "B") for a in row] for row in schedule])  # (T, p)
    microbatch = np.array([[0 if a is None else a[1] for a in row] for row in schedule])  # (T, p)
    from_left = np.full_like(kind, -1)  # the microbatch stage s - 1 forwards to s at tick t
    from_left[:, 1:] = np.where(kind[:, :-1] == 1, microbatch[:, :-1], -1)
    from_right = np.full_like(kind, -1)  # the microbatch whose cotangent stage s + 1 sends at tick t
    from_right[:, :-1] = np.where(kind[:, 1:] == 2, microbatch[:, 1:], -1)
    num_acts, num_cots = (_stash_size(schedule, table, num_microbatches) for table in (from_left, from_right))
    to_next = [(s, s + 1) for s in range(num_stages - 1)]
    to_previous = [(s + 1, s) for s in range(num_stages - 1)]

    def per_stage(stage, xs, ys):
        stage = jax.tree.map(lambda a: a[0], stage)  # this stage's layers
        me = lax.axis_index(axis_name)
        last = me == num_stages - 1

        def stage_and_loss(params, h, i):
            out = apply_layers(params, h, layer)
            return out, jnp.mean((out - ys[i]) ** 2) / num_microbatches

        def tick(carry, t):
            acts, cots, grads, loss = carry
            i = jnp.asarray(microbatch)[t, me]
            h = jnp.where(me == 0, xs[i], acts[i % num_acts])  # this microbatch's stage input
            zero = jnp.zeros_like(h)

            def idle():
                return zero, zero, grads, loss

            def forward():
                return apply_layers(stage, h, layer), zero, grads, loss

            def backward():
                (_, value), vjp = jax.vjp(lambda p, a: stage_and_loss(p, a, i), stage, h)
                d_stage, d_h = vjp((jnp.where(last, zero, cots[i % num_cots]), jnp.where(last, 1.0, 0.0)))
                return zero, d_h, jax.tree.map(jnp.add, grads, d_stage), loss + jnp.where(last, value, 0.0)

            right, left, grads, loss = lax.switch(jnp.asarray(kind)[t, me], (idle, forward, backward))
            acts = _receive(acts, lax.ppermute(right, axis_name, to_next), jnp.asarray(from_left)[t, me])
            cots = _receive(cots, lax.ppermute(left, axis_name, to_previous), jnp.asarray(from_right)[t, me])
            return (acts, cots, grads, loss), None

        rows = xs.shape[1:]
        start = (jnp.zeros((num_acts, *rows), xs.dtype), jnp.zeros((num_cots, *rows), xs.dtype),
                 jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), stage), jnp.zeros(()))
        (_, _, grads, loss), _ = lax.scan(tick, _varying(start, axis_name), jnp.arange(len(schedule)))
        return lax.psum(loss, axis_name), jax.tree.map(lambda g: g[None], grads)  # (1, L / p, ...)

    run = jax.shard_map(per_stage, mesh=mesh, in_specs=(P(axis_name), P(), P()),
                        out_specs=(P(), P(axis_name)))
    return run(stages, xs, ys)
