"""Chapter 07: scaling out. An all-reduce's cost, an all-gather from ppermute, a data-parallel
step with collectives, a tensor-parallel MLP, the GPipe schedule and its bubble.

The multi-device cases need 8 devices; the exercise notebook creates 8 simulated CPU
devices in its first cells (`stacklib.hw.simulate_cpu_devices(8)`).
"""

import functools
import inspect
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from stacklib import parallel
from stacklib.grading import CaseFailure, Exercise, call_on_copies, expect, expect_close, forbidding


def _mesh(num_devices: int, axis: str):
    """A 1-D Auto mesh, or a case failure that says how to get enough devices."""
    try:
        return parallel.make_mesh((num_devices,), (axis,), (AxisType.Auto,))
    except ValueError:
        expect(False, f"this case needs {num_devices} devices and JAX has {jax.device_count()}: run "
                      "stacklib.hw.simulate_cpu_devices(8) at the top of the notebook, before any "
                      "other JAX operation, then restart and run all")


# Which checks an answer passed in this exercise's earlier cases, so that a later case's hint can
# name the mistake: "Nothing may depend on there being 4 devices" only helps an answer that is
# right on 4 devices; one that is wrong everywhere was already told why by the first case.
_PASSED: "weakref.WeakKeyDictionary[object, set[str]]" = weakref.WeakKeyDictionary()


def _remembering(answer, check: str, run) -> None:
    """Run `run()`; remember whether `answer` passed `check`."""
    try:
        run()
    except CaseFailure:
        _remember(answer, check, False)
        raise
    _remember(answer, check, True)


def _remember(answer, check: str, passed: bool) -> None:
    try:
        checks = _PASSED.setdefault(inspect.unwrap(answer), set())
    except TypeError:  # not weakly referenceable: nothing remembered, the generic hint is shown
        return
    (checks.add if passed else checks.discard)(check)
    checks.add(f"ran {check}")


def _hint_if_passed(answer, check: str, hint: str) -> str:
    """`hint` if `answer` passed `check` (or it was not run), else none: the earlier failure said why."""
    try:
        checks = _PASSED.get(inspect.unwrap(answer), set())
    except TypeError:
        return hint
    return hint if check in checks or f"ran {check}" not in checks else ""


# ---- 07.all_reduce_time
all_reduce_time = Exercise("07.all_reduce_time", "The time of a ring all-reduce, from first principles")


def _ring_all_reduce(num_bytes, num_devices, bandwidth, latency):
    return 2 * (num_devices - 1) * (latency + num_bytes / num_devices / bandwidth)


_COST = "the chapter's section 'What collectives cost'"


@all_reduce_time.case(hint="With one device there is nobody to talk to: count the hops.")
def one_device_communicates_nothing(time_fn):
    expect_close(time_fn(1e9, 1, 4.5e10, 1e-6), 0.0, atol=1e-12, what="all_reduce_time(1 GB, 1 device)")


@all_reduce_time.case(points=2, hint=f"Count the hops of a reduce-scatter and of an all-gather on a ring, "
                                     f"and the bytes each hop carries: see {_COST}.")
def matches_the_ring_model_when_bandwidth_dominates(time_fn):
    for num_devices in (2, 3, 4, 16, 256):
        expect_close(time_fn(2e9, num_devices, 4.5e10, 0.0), _ring_all_reduce(2e9, num_devices, 4.5e10, 0.0),
                     rtol=1e-6, what=f"all_reduce_time(2 GB, {num_devices} devices, latency 0)")
    expect_close(time_fn(1000.0, 3, 1.0, 0.0), _ring_all_reduce(1000.0, 3, 1.0, 0.0), rtol=1e-6,
                 what="all_reduce_time(1000 bytes, 3 devices, 1 byte/s, latency 0): chunks of 333.3 bytes")


@all_reduce_time.case(points=2, hint="Every hop pays the latency, however few bytes it carries.")
def counts_the_latency_of_every_hop(time_fn):
    expect_close(time_fn(0.0, 8, 4.5e10, 1e-6), 14e-6, rtol=1e-6, atol=0.0,
                 what="all_reduce_time(0 bytes, 8 devices, latency 1 µs)")
    expect_close(time_fn(8e6, 8, 1e9, 1e-5), _ring_all_reduce(8e6, 8, 1e9, 1e-5), rtol=1e-6,
                 what="all_reduce_time(8 MB, 8 devices, 1 GB/s, latency 10 µs)")


# ---- 07.ring_all_gather
ring_all_gather = Exercise("07.ring_all_gather", "An all-gather built from ppermute")

# Primitives that would do the gathering for you.
_COLLECTIVES = ("all_gather", "psum", "reduce_scatter", "all_to_all", "pmax", "pmin", "pbroadcast")


_RING = "the chapter's section 'Collectives from a ring of `ppermute`s'"


def _gather_with(answer, num_devices, dtype=jnp.float32):
    mesh = _mesh(num_devices, "i")
    x = (jnp.arange(num_devices * 2 * 3, dtype=jnp.float32).reshape(num_devices * 2, 3) ** 1.5).astype(dtype)
    # Every device gets all N blocks of shape (2, 3); out_specs=P("i") glues the N results.
    expected = np.tile(np.asarray(x).reshape(num_devices, 2, 3), (num_devices, 1, 1))
    run = jax.jit(jax.shard_map(lambda block: answer(block, "i"), mesh=mesh, in_specs=P("i"),
                                out_specs=P("i"), check_vma=False))
    return run, x, expected


def _primitives(jaxpr) -> set[str]:
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for value in eqn.params.values():
            for inner in value if isinstance(value, list | tuple) else [value]:
                inner = getattr(inner, "jaxpr", inner)  # a ClosedJaxpr wraps a Jaxpr
                if hasattr(inner, "eqns"):
                    names |= _primitives(inner)
    return names


def _expect_only_ppermute(run, x):
    used = _primitives(jax.make_jaxpr(run)(x).jaxpr)
    forbidden = sorted(name for name in used if any(c in name for c in _COLLECTIVES))
    expect(not forbidden, f"the function uses {forbidden}: the exercise is to build the all-gather from "
                          "jax.lax.ppermute alone")


def _expect_gathered(answer, num_devices, dtype=jnp.float32):
    run, x, expected = _gather_with(answer, num_devices, dtype)
    _expect_only_ppermute(run, x)
    got = np.asarray(run(x))
    per_device = (got.shape[0] // num_devices, *got.shape[1:])
    expect(got.shape == expected.shape,
           f"each device returned shape {per_device}, expected ({num_devices}, 2, 3): one row per device "
           "holding that device's (2, 3) block, as jax.lax.all_gather(x, axis_name) returns it (stacked, "
           "not concatenated)")
    expect_close(got, expected, rtol=0, atol=0, check_dtype=True, what="every device's gathered blocks")


@ring_all_gather.case(points=2, hint=f"Row d of the result is device d's block: work out which device the "
                                     f"block you hold after k hops came from. See {_RING}.")
def matches_all_gather_on_4_devices(gather):
    _remembering(gather, "4 devices", lambda: _expect_gathered(gather, 4))


@ring_all_gather.case(hint="Nothing may depend on there being 4 devices: ask the axis for its size.")
def matches_all_gather_on_8_devices(gather):
    try:
        _expect_gathered(gather, 8)
    except CaseFailure as failure:
        hint = _hint_if_passed(gather, "4 devices", "Nothing may depend on there being 4 devices: ask the "
                                                    "axis for its size.")
        raise CaseFailure(str(failure), hint=hint) from None


@ring_all_gather.case(hint="The result has x's dtype, as jax.lax.all_gather's does: mind the dtype of any "
                           "buffer you start from.")
def keeps_the_dtype_of_the_blocks(gather):
    _expect_gathered(gather, 4, jnp.int32)


# ---- 07.dp_step
dp_step = Exercise("07.dp_step", "A data-parallel SGD step with collectives")
_DATA_PARALLEL = "the chapter's section 'Data parallel'"


def _regression(num_rows=32, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(num_rows, 5)).astype(np.float32)
    y = (x @ rng.normal(size=(5,)) + 0.3).astype(np.float32)
    params = {"w": rng.normal(size=(5,)).astype(np.float32), "b": np.float32(-0.2)}
    return params, x, y


def _reference_step(params, x, y, learning_rate):
    """One SGD step on the whole batch, in float64 NumPy (no accelerator rounding), and its loss.

    `learning_rate` may be negative: the cases use that to recognise a step up the gradient.
    """
    x, y = x.astype(np.float64), y.astype(np.float64)
    error = x @ params["w"] + params["b"] - y  # (rows,)
    grads = {"w": 2 * x.T @ error / len(y), "b": 2 * error.mean()}  # d/dp mean(error^2)
    new = {name: params[name] - learning_rate * grads[name] for name in params}
    return new, np.mean(error**2)


def _close_to(got, expected):
    try:
        expect_close(got, expected, rtol=1e-5, atol=1e-6)
    except Exception:  # a CaseFailure, or a structure the comparison cannot walk
        return False
    return True


def _expect_diagnosed(got, expected, mistakes, what):
    """expect_close, and when `got` is what a known mistake gives, name that mistake in the failure."""
    if _close_to(got, expected):
        return
    named = [why for value, why in mistakes if _close_to(got, value)]
    try:
        expect_close(got, expected, rtol=1e-5, atol=1e-6, what=what)
    except CaseFailure as failure:
        raise CaseFailure(f"{failure}: {'; or '.join(named)}" if named else str(failure)) from None


def _expect_dp_step(step_fn, num_devices, learning_rate, check):
    mesh = _mesh(num_devices, "data")
    params, x, y = _regression()
    # Before the learner's code runs: the right step and loss, and what known mistakes give.
    expected, expected_loss = _reference_step(params, x, y, learning_rate)
    too_far, _ = _reference_step(params, x, y, num_devices * learning_rate)
    uphill, _ = _reference_step(params, x, y, -learning_rate)
    run = jax.jit(jax.shard_map(functools.partial(step_fn, learning_rate=learning_rate), mesh=mesh,
                                in_specs=(P(), P("data"), P("data")), out_specs=(P(), P())))
    new_params, loss = run(params, x, y)
    if check == "params":
        mistakes = [(too_far, f"that is a step {num_devices} times too long, as if the gradient were summed "
                              f"over the {num_devices} devices rather than averaged"),
                    (uphill, "the parameters moved up the gradient, not down")]
        _expect_diagnosed(new_params, expected, mistakes, f"the new parameters on {num_devices} devices, "
                                                          f"learning rate {learning_rate}")
    else:
        mistakes = [(num_devices * expected_loss, f"that is {num_devices} times the mean: a sum over the "
                                                  "devices")]
        _expect_diagnosed(loss, expected_loss, mistakes, f"the loss on {num_devices} devices")


@dp_step.case(points=2, hint=f"The step must equal one SGD step on the whole batch: which loss do you "
                             f"differentiate, and how does shard_map combine the gradient of a replicated "
                             f"parameter? See {_DATA_PARALLEL}.")
def matches_one_device_sgd_on_8_devices(step_fn):
    _remembering(step_fn, "8 devices", lambda: _expect_dp_step(step_fn, 8, 0.05, "params"))


@dp_step.case(hint="Nothing may depend on there being 8 devices, nor on one learning rate.")
def matches_one_device_sgd_on_2_devices(step_fn):
    try:
        _expect_dp_step(step_fn, 2, 0.2, "params")
    except CaseFailure as failure:
        hint = _hint_if_passed(step_fn, "8 devices",
                               "Nothing may depend on there being 8 devices, nor on one learning rate.")
        raise CaseFailure(str(failure), hint=hint) from None


@dp_step.case(hint="Return the mean loss over the whole batch, the same on every device.")
def returns_the_global_mean_loss(step_fn):
    _expect_dp_step(step_fn, 8, 0.05, "loss")


# ---- 07.tp_mlp
tp_mlp = Exercise("07.tp_mlp", "A tensor-parallel MLP with shard_map")
_TENSOR_PARALLEL = "the chapter's section 'Tensor parallel'"


def _mlp_inputs(seed=0, batch=8, features=6, hidden=16, classes=3):
    rng = np.random.default_rng(seed)
    shapes = [(batch, features), (features, hidden), (hidden,), (hidden, classes), (classes,)]
    return [rng.normal(size=shape).astype(np.float32) for shape in shapes]


def _mlp_reference(x, w1, b1, w2, b2):
    return np.maximum(x @ w1 + b1, 0.0) @ w2 + b2


def _tp_run(mlp_fn, num_devices):
    mesh = _mesh(num_devices, "model")
    inputs = _mlp_inputs()
    run = jax.jit(functools.partial(mlp_fn, mesh=mesh))
    return run, inputs, _mlp_reference(*inputs)


def _expect_tp_output(mlp_fn, num_devices):
    run, inputs, expected = _tp_run(mlp_fn, num_devices)
    b2 = inputs[4]
    partial_sums = expected - b2
    mistakes = [(expected + (num_devices - 1) * b2, f"that is the output with b2 added {num_devices} times: "
                                                    "once on every device, before the sum"),
                (partial_sums / num_devices + b2, f"that is the sum of the devices' partial outputs divided "
                                                  f"by {num_devices}: a mean, not a sum")]
    _expect_diagnosed(run(*inputs), expected, mistakes, f"the output on {num_devices} devices")


@tp_mlp.case(points=2, hint=f"Each device's second matmul gives a partial sum of the output; think about "
                            f"what is added once and what once per device. See {_TENSOR_PARALLEL}.")
def matches_one_device_on_2_devices(mlp_fn):
    _remembering(mlp_fn, "2 devices", lambda: _expect_tp_output(mlp_fn, 2))


@tp_mlp.case(hint="The same specs must work on any size of the 'model' axis that divides hidden.")
def matches_one_device_on_8_devices(mlp_fn):
    try:
        _expect_tp_output(mlp_fn, 8)
    except CaseFailure as failure:
        raise CaseFailure(str(failure), hint=_hint_if_passed(
            mlp_fn, "2 devices", "The same specs must work on any size of the 'model' axis that divides "
                                 "hidden.")) from None


@tp_mlp.case(hint=f"Write the per-device program with jax.shard_map, in Megatron's layout: w1 and b1 split "
                  f"by hidden unit (w1's columns), w2 by its rows; x and b2 whole on every device. See "
                  f"{_TENSOR_PARALLEL}.")
def each_device_holds_its_slice_of_the_weights(mlp_fn):
    run, inputs, _ = _tp_run(mlp_fn, 8)
    expect("shard_map" in _primitives(jax.make_jaxpr(run)(*inputs).jaxpr),
           "tp_mlp does not call jax.shard_map: the exercise asks for the per-device program written by hand")
    shardings = run.lower(*inputs).compile().input_shardings[0]
    names = ("x", "w1", "b1", "w2", "b2")
    batch, features = inputs[0].shape
    hidden, classes = inputs[3].shape
    share = hidden // 8
    expected = [(batch, features), (features, share), (share,), (share, classes), (classes,)]
    for name, sharding, array, shape in zip(names, shardings, inputs, expected, strict=True):
        got = tuple(sharding.shard_shape(array.shape))
        expect(got == shape, f"{name} {array.shape}: each of the 8 devices holds a block of shape {got}, "
                             f"expected {shape}")


@tp_mlp.case(points=2, hint="Tensor parallelism never gathers the weights or the hidden layer: the only "
                            "message is one all-reduce of the (batch, classes) output.")
def communicates_one_all_reduce_of_the_output(mlp_fn):
    run, inputs, _ = _tp_run(mlp_fn, 8)
    found = parallel.collectives(run.lower(*inputs).compile().as_text())
    summary = [(c.kind, c.num_bytes) for c in found]
    output_bytes = inputs[0].shape[0] * inputs[4].shape[0] * 4
    expect(summary == [("all-reduce", output_bytes)],
           f"expected one all-reduce of {output_bytes} bytes, the compiled program has {summary or 'none'}")


# ---- 07.gpipe_schedule
gpipe_schedule = Exercise("07.gpipe_schedule", "The GPipe schedule table")
_SCHEDULE = "the chapter's section 'The schedule'"


def _is_action(entry) -> bool:
    return (isinstance(entry, tuple | list) and len(entry) == 2 and entry[0] in ("F", "B")
            and isinstance(entry[1], int | np.integer))


# The library's own schedules: the exercise is to write the table, not to call them.
_LIBRARY_SCHEDULES = (parallel.gpipe_schedule, parallel.one_f_one_b_schedule, parallel.schedule_from_orders)


def _table(schedule_fn, p, m):
    """The learner's table for p stages and m microbatches, as Actions, or a failure naming its shape."""
    call = f"gpipe_schedule({p}, {m})"
    with forbidding(*_LIBRARY_SCHEDULES, why="the exercise is to build GPipe's table yourself"):
        table = schedule_fn(p, m)
    expect(isinstance(table, list | tuple) and all(isinstance(row, list | tuple) for row in table),
           f"{call} returned {type(table).__name__}: expected a list of rows, one per tick, each with one "
           "entry per stage")
    ticks = 2 * (m + p - 1)
    expect(not (len(table) == p != ticks and all(len(row) == ticks for row in table)),
           f"{call} has {p} rows of {ticks}: it looks indexed [stage][tick]; the table is "
           "schedule[tick][stage]")
    for tick, row in enumerate(table):
        for stage, entry in enumerate(row):
            expect(entry is None or _is_action(entry), f"{call}, tick {tick}, stage {stage} holds {entry!r}: "
                                                       "each entry is None (idle) or a pair like ('F', 0)")
    return [[None if a is None else parallel.Action(a[0], int(a[1])) for a in row] for row in table]


def _show_action(action) -> str:
    return "idle (None)" if action is None else f"('{action[0]}', {action[1]})"


def _ticks(table, kind):
    """{(stage, microbatch): tick} of the table's actions of one kind."""
    return {(s, a[1]): t for t, row in enumerate(table) for s, a in enumerate(row) if a and a[0] == kind}


def _expect_ticks(table, kind, expected, call):
    got = _ticks(table, kind)
    for (stage, i), tick in sorted(expected.items(), key=lambda item: item[1]):
        when = "never" if (stage, i) not in got else f"at tick {got[stage, i]}"
        expect(got.get((stage, i)) == tick,
               f"{call}: stage {stage} should run {kind}{i} at tick {tick}; it runs it {when}")
    for stage, i in sorted(set(got) - set(expected)):
        expect(False, f"{call}: stage {stage} runs {kind}{i}, which is not a microbatch of this pipeline")


@gpipe_schedule.case(points=2, hint=f"Stage s can forward microbatch i only after stage s - 1 has, and it "
                                    f"runs as early as it can. See {_SCHEDULE}.")
def forwards_form_a_staircase(schedule_fn):
    p, m = 4, 6
    table = _table(schedule_fn, p, m)
    staircase = {(s, i): s + i for s in range(p) for i in range(m)}
    _expect_ticks(table, "F", staircase, f"gpipe_schedule({p}, {m})")


@gpipe_schedule.case(points=2, hint="The backward half mirrors the forward half: which microbatch's backward "
                                    "can start first, and on which stage?")
def backwards_mirror_the_forwards(schedule_fn):
    p, m = 4, 6
    table = _table(schedule_fn, p, m)
    right_at_4_6 = table == parallel.gpipe_schedule(p, m)
    _remember(schedule_fn, "p=4, m=6", right_at_4_6)
    in_forward_order = {(s, i): m + p - 1 + (p - 1 - s) + i for s in range(p) for i in range(m)}
    expect(_ticks(table, "B") != in_forward_order,
           "the backwards run in forward order (B0 first); GPipe's backward half takes the microbatches in "
           "reverse, as autodiff of the forward loop does")
    _expect_ticks(table, "B", _ticks(parallel.gpipe_schedule(p, m), "B"), f"gpipe_schedule({p}, {m})")


@gpipe_schedule.case(hint="The table has 2(m + p - 1) ticks, and every action runs after what it needs.")
def is_a_valid_schedule_of_the_right_length(schedule_fn):
    p, m = 3, 5
    table = _table(schedule_fn, p, m)
    expect(len(table) == 2 * (m + p - 1),
           f"gpipe_schedule({p}, {m}) has {len(table)} ticks, expected {2 * (m + p - 1)}")
    try:
        parallel.check_schedule(table, m)
    except ValueError as error:
        raise CaseFailure(f"gpipe_schedule({p}, {m}) is not a valid schedule: {error}") from None


@gpipe_schedule.case(hint="Nothing may depend on one number of stages or microbatches: use the arguments.")
def matches_gpipe_for_any_stages_and_microbatches(schedule_fn):
    # The hint is for a table right at p = 4, m = 6 (the cases above) and wrong elsewhere; any
    # other wrong table was told its mistake by the case above that it failed.
    hint = _hint_if_passed(schedule_fn, "p=4, m=6", "Nothing may depend on one number of stages or "
                                                    "microbatches: use the arguments.")
    for p, m in [(1, 1), (2, 5), (5, 2), (8, 3)]:
        reference = parallel.gpipe_schedule(p, m)
        table = _table(schedule_fn, p, m)
        expect(len(table) == len(reference),
               f"gpipe_schedule({p}, {m}) has {len(table)} ticks, expected {len(reference)}", hint=hint)
        for tick, (row, expected) in enumerate(zip(table, reference, strict=True)):
            for stage, (got, want) in enumerate(zip(row, expected, strict=True)):
                expect(got == want, f"gpipe_schedule({p}, {m}), tick {tick}, stage {stage}: expected "
                                    f"{_show_action(want)}, got {_show_action(got)}", hint=hint)


# ---- 07.bubble_fraction
bubble_fraction = Exercise("07.bubble_fraction", "The bubble, counted from a schedule")


def _expect_bubble(bubble_fn, schedule, expected, what):
    with forbidding(parallel.bubble_fraction, why="the exercise is to count the idle slots yourself"):
        got = call_on_copies(bubble_fn, schedule, what="bubble_fraction")
    expect(np.ndim(got) == 0 and np.asarray(got).dtype.kind in "fiu",
           f"bubble_fraction returned {type(got).__name__}: expected a number between 0 and 1")
    expect_close(float(got), expected, rtol=1e-9, atol=1e-12, what=f"the bubble share of {what}")


def _one_microbatch_at_a_time(num_stages, num_microbatches):
    """No pipelining: each microbatch's forward and backward pass through all stages before the next."""
    order = [parallel.Action(kind, i) for i in range(num_microbatches) for kind in "FB"]
    return parallel.schedule_from_orders([order] * num_stages)


@bubble_fraction.case(hint=f"Count the idle (None) slots and divide by all the slots. See {_SCHEDULE}.")
def is_p_minus_1_over_m_plus_p_minus_1_for_gpipe(bubble_fn):
    for p, m in [(1, 1), (2, 3), (4, 8), (8, 2)]:
        _expect_bubble(bubble_fn, parallel.gpipe_schedule(p, m), (p - 1) / (m + p - 1), f"GPipe p={p}, m={m}")


@bubble_fraction.case(hint="The function receives any schedule: count what its table holds.")
def counts_the_idle_slots_of_1f1b(bubble_fn):
    for p, m in [(4, 8), (3, 5)]:
        schedule = parallel.one_f_one_b_schedule(p, m)
        _expect_bubble(bubble_fn, schedule, (p - 1) / (m + p - 1), f"1F1B p={p}, m={m}")


@bubble_fraction.case(hint="A formula for GPipe does not hold for other schedules: count the table's slots.")
def counts_the_idle_slots_without_pipelining(bubble_fn):
    _expect_bubble(bubble_fn, _one_microbatch_at_a_time(4, 3), 3 / 4,
                   "4 stages running one microbatch at a time (each stage busy 1 tick in 4)")


@bubble_fraction.case(hint="Every slot of the table counts: the last ticks too, and every stage's.")
def counts_idle_ticks_at_the_end(bubble_fn):
    padded = parallel.gpipe_schedule(4, 4) + [[None] * 4, [None] * 4]
    _expect_bubble(bubble_fn, padded, 32 / 64, "GPipe p=4, m=4 followed by two idle ticks")
    # The stages of this table are not idle alike: one stage's share is not the table's.
    uneven = parallel.gpipe_schedule(2, 2) + [[parallel.Action("F", 0), None]]
    _expect_bubble(bubble_fn, uneven, 5 / 14, "GPipe p=2, m=2, then stage 0 alone starts the next step")
