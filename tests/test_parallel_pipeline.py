"""stacklib.parallel.pipeline: GPipe and 1F1B schedules, their bubble and memory, and pipelined
steps over 4 simulated devices that take the one-device step."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from stacklib import parallel
from stacklib.parallel import pipeline
from stacklib.parallel.pipeline import Action

NUM_STAGES, NUM_MICROBATCHES, NUM_LAYERS, WIDTH, ROWS = 4, 8, 8, 16, 4  # ROWS per microbatch
SCHEDULES = {"gpipe": pipeline.gpipe_schedule, "1f1b": pipeline.one_f_one_b_schedule}
SIZES = [(1, 1), (1, 4), (2, 1), (2, 4), (3, 5), (4, 4), (4, 8), (8, 2), (8, 32)]


def pipeline_mesh(num_stages=NUM_STAGES):
    return parallel.make_mesh((num_stages,), ("pipeline",), (AxisType.Auto,))


def ticks_of(schedule):
    """{(kind, stage, microbatch): tick}, read straight from the table."""
    return {(a[0], s, a[1]): t for t, row in enumerate(schedule) for s, a in enumerate(row) if a is not None}


@pytest.fixture(scope="module")
def problem():
    layers = pipeline.init_layers(jax.random.key(0), NUM_LAYERS, WIDTH)
    x = jax.random.normal(jax.random.key(1), (NUM_MICROBATCHES * ROWS, WIDTH))
    y = jnp.sin(x)
    loss, grads = jax.jit(jax.value_and_grad(pipeline.sequential_loss))(layers, x, y)
    return layers, x, y, loss, pipeline.stack_stages(grads, NUM_STAGES)


# ---- schedules
@pytest.mark.parametrize("p, m", SIZES)
def test_the_gpipe_bubble_counted_from_the_schedule_is_p_minus_1_over_m_plus_p_minus_1(p, m):
    schedule = pipeline.gpipe_schedule(p, m)
    idle = sum(action is None for row in schedule for action in row)
    assert len(schedule) == 2 * (m + p - 1)  # a forward half and a backward half
    assert idle == 2 * p * (p - 1)
    assert pipeline.bubble_fraction(schedule) == pytest.approx((p - 1) / (m + p - 1), abs=1e-15)


@pytest.mark.parametrize("p, m", SIZES)
def test_one_f_one_b_has_the_same_length_and_bubble_as_gpipe(p, m):
    gpipe, one_f_one_b = pipeline.gpipe_schedule(p, m), pipeline.one_f_one_b_schedule(p, m)
    assert len(one_f_one_b) == len(gpipe)
    assert pipeline.bubble_fraction(one_f_one_b) == pipeline.bubble_fraction(gpipe)


def test_gpipe_forwards_microbatch_i_on_stage_s_at_tick_s_plus_i_and_mirrors_it_backwards():
    p, m = 4, 6
    last_tick = 2 * (m + p - 1) - 1
    for (kind, s, i), tick in ticks_of(pipeline.gpipe_schedule(p, m)).items():
        assert tick == (s + i if kind == "F" else last_tick - s - i), (kind, s, i)


@pytest.mark.parametrize("p, m", SIZES)
def test_gpipe_keeps_all_m_microbatches_live_on_every_stage(p, m):
    assert pipeline.peak_live_microbatches(pipeline.gpipe_schedule(p, m)) == [m] * p


@pytest.mark.parametrize("p, m", SIZES)
def test_one_f_one_b_keeps_at_most_p_minus_s_microbatches_live_on_stage_s(p, m):
    peaks = pipeline.peak_live_microbatches(pipeline.one_f_one_b_schedule(p, m))
    assert peaks == [min(p - s, m) for s in range(p)]
    assert max(peaks) <= p


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("p, m", SIZES)
def test_every_forward_follows_the_previous_stage_and_precedes_its_backward(name, p, m):
    schedule = SCHEDULES[name](p, m)
    tick = ticks_of(schedule)
    assert all(len(row) == p for row in schedule)
    assert sum(a is not None for row in schedule for a in row) == len(tick) == 2 * p * m  # each once
    for s in range(p):
        for i in range(m):
            assert tick["F", s, i] < tick["B", s, i]
            if s > 0:
                assert tick["F", s - 1, i] < tick["F", s, i]
            if s < p - 1:
                assert tick["B", s + 1, i] < tick["B", s, i]
    pipeline.check_schedule(schedule, m)  # and the module's own check agrees


def test_a_schedule_is_plain_data_that_prints_as_a_table():
    schedule = pipeline.gpipe_schedule(2, 2)
    assert [[str(a) if a else "." for a in row] for row in schedule] == [
        ["F0", "."], ["F1", "F0"], [".", "F1"], [".", "B1"], ["B1", "B0"], ["B0", "."]]
    assert schedule[0][0] == ("F", 0)  # an Action is a tuple, so hand-written tables compare equal


@pytest.mark.parametrize("schedule, m, words", [
    ([[("F", 0), ("F", 0)], [("B", 0), None], [None, ("B", 0)]], 1, "Tick 0, stage 1: F0 runs before"),
    ([[("F", 0), None], [None, ("F", 0)], [("B", 0), ("B", 0)]], 1, "Tick 2, stage 0: B0 runs before"),
    ([[("F", 0), None], [None, ("F", 0)], [None, ("B", 0)]], 1, "runs 3 actions; 2 stages x 1"),
    ([[("F", 0), None], [("F", 0), None]], 1, "Tick 1, stage 0: F0 is not"),
    ([[("F", 0), None], [None]], 1, "Tick 1 has 1 slots"),
    ([[("F", 2)]], 2, "microbatch 0..1"),
    ([[("F", 0, "extra")]], 1, "is not None or a pair"),
    ([], 1, "The schedule is empty"),
])
def test_check_schedule_names_the_tick_the_stage_and_the_problem(schedule, m, words):
    with pytest.raises(ValueError, match=words):
        pipeline.check_schedule(schedule, m)


def test_orders_that_wait_on_each_other_are_reported_as_a_deadlock():
    backward_first = [[Action("B", 0), Action("F", 0)]] * 2
    with pytest.raises(ValueError, match="deadlock at tick 0"):
        pipeline.schedule_from_orders(backward_first)


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("p, m", [(0, 4), (4, 0)])
def test_a_schedule_needs_a_stage_and_a_microbatch(name, p, m):
    with pytest.raises(ValueError, match="num_stages >= 1 and num_microbatches >= 1"):
        SCHEDULES[name](p, m)


# ---- pipelined steps
# Tolerances: each device runs the same float32 matmuls on its microbatch's rows as one
# device does on the whole batch; only the mean is summed in another order (per microbatch,
# then over microbatches), a few float32 ulps (measured: loss 1e-7, gradients 2e-8).
def assert_same_as_one_device(loss, grads, problem):
    *_, reference_loss, reference_grads = problem
    np.testing.assert_allclose(loss, reference_loss, rtol=1e-6)
    for ours, reference in zip(jax.tree.leaves(grads), jax.tree.leaves(reference_grads), strict=True):
        np.testing.assert_allclose(ours, reference, rtol=1e-5, atol=1e-7)


def test_pipelined_loss_and_its_jax_grad_equal_the_one_device_step(problem):
    layers, x, y, *_ = problem
    mesh = pipeline_mesh()

    def loss_fn(stages):
        return pipeline.pipeline_loss(stages, x, y, mesh=mesh, num_microbatches=NUM_MICROBATCHES)

    step = jax.jit(jax.value_and_grad(loss_fn))
    stages = pipeline.stack_stages(layers, NUM_STAGES)
    loss, grads = step(stages)
    assert_same_as_one_device(loss, grads, problem)
    assert grads["kernel"].sharding.spec == P("pipeline")  # each stage's gradient stays on its device

    # What crosses between devices: one microbatch's activations each way per tick, and the scalar loss.
    found = [(c.kind, c.num_bytes) for c in parallel.collectives(step.lower(stages).compile().as_text())]
    activation_bytes = ROWS * WIDTH * 4
    assert sorted(found) == [("all-reduce", 4), ("collective-permute", activation_bytes),
                             ("collective-permute", activation_bytes)]


@pytest.mark.parametrize("name", SCHEDULES)
def test_running_a_schedule_tick_by_tick_equals_the_one_device_step(name, problem):
    layers, x, y, *_ = problem
    schedule = SCHEDULES[name](NUM_STAGES, NUM_MICROBATCHES)
    run = jax.jit(lambda stages: pipeline.pipeline_value_and_grad(stages, x, y, mesh=pipeline_mesh(),
                                                                  schedule=schedule))
    loss, grads = run(pipeline.stack_stages(layers, NUM_STAGES))
    assert_same_as_one_device(loss, grads, problem)


def test_gpipe_stashes_one_more_activation_per_microbatch_and_1f1b_does_not(stages):
    """XLA's own memory analysis of the compiled step (temporary bytes on one device)."""
    activation_bytes = ROWS * WIDTH * 4

    def temp_bytes(name, m):
        x = jnp.zeros((m * ROWS, WIDTH))
        run = jax.jit(lambda s, x: pipeline.pipeline_value_and_grad(
            s, x, x, mesh=pipeline_mesh(), schedule=SCHEDULES[name](NUM_STAGES, m)))
        return run.lower(stages, x).compile().memory_analysis().temp_size_in_bytes

    gpipe = temp_bytes("gpipe", 8) - temp_bytes("gpipe", 4)
    one_f_one_b = temp_bytes("1f1b", 8) - temp_bytes("1f1b", 4)
    assert 4 * activation_bytes <= gpipe <= 4 * activation_bytes + 256  # 4 more microbatches stashed
    assert one_f_one_b < activation_bytes // 2  # still p of them


# ---- bad input: the error says what and how to fix it
@pytest.fixture(scope="module")
def stages(problem):
    return pipeline.stack_stages(problem[0], NUM_STAGES)


def loss_with(stages, *, batch=32, num_microbatches=4, mesh=None, axis_name="pipeline"):
    x = jnp.zeros((batch, WIDTH))
    return pipeline.pipeline_loss(stages, x, x, mesh=mesh or pipeline_mesh(),
                                  num_microbatches=num_microbatches, axis_name=axis_name)


def test_a_batch_that_does_not_split_into_the_microbatches_is_rejected(stages):
    with pytest.raises(ValueError, match=r"batch of 30 rows does not split into num_microbatches=4 .* "
                                         r"use a divisor of 30"):
        loss_with(stages, batch=30)


def test_a_stage_count_that_is_not_the_mesh_axis_size_is_rejected(stages):
    fix = r"stack_stages\(layers, 2\)"
    with pytest.raises(ValueError, match=rf"4 stages .* 'pipeline' has 2 devices: .*{fix}"):
        loss_with(stages, mesh=pipeline_mesh(2))


def test_a_mesh_without_the_pipeline_axis_is_rejected(stages):
    mesh = parallel.make_mesh((4,), ("data",), (AxisType.Auto,))
    with pytest.raises(ValueError, match=r"axes \('data',\), no 'pipeline': build it with make_mesh"):
        loss_with(stages, mesh=mesh)


def test_an_explicit_mesh_is_rejected_with_the_auto_fix(stages):
    with pytest.raises(ValueError, match=r"Explicit axes .* axis_types=\(AxisType.Auto,\) \* 1"):
        loss_with(stages, mesh=parallel.make_mesh((4,), ("pipeline",)))


def test_layers_that_do_not_split_into_equal_stages_are_rejected():
    with pytest.raises(ValueError, match="6 layers do not split into 4 equal stages"):
        pipeline.stack_stages({"kernel": np.zeros((6, WIDTH, WIDTH)), "bias": np.zeros((6, WIDTH))}, 4)


def test_a_schedule_for_another_number_of_stages_is_rejected(stages):
    x = jnp.zeros((32, WIDTH))
    with pytest.raises(ValueError, match="schedule has 2 stages, but stages and mesh axis 'pipeline' have 4"):
        pipeline.pipeline_value_and_grad(stages, x, x, mesh=pipeline_mesh(),
                                         schedule=pipeline.gpipe_schedule(2, 4))


def test_an_invalid_schedule_is_rejected_before_anything_runs(stages):
    x = jnp.zeros((32, WIDTH))
    swapped = pipeline.gpipe_schedule(NUM_STAGES, 4)[::-1]  # every backward before its forward
    with pytest.raises(ValueError, match="runs before what it needs"):
        pipeline.pipeline_value_and_grad(stages, x, x, mesh=pipeline_mesh(), schedule=swapped)
