"""Chapter 08's exercise cases: right answers score full marks, planted wrong ones lose points."""

import time

import jax
import pytest

from stacklib.grading import grade


def top_op(events, module):
    totals = {}
    for event in events:
        if event.module == module:
            totals[event.name] = totals.get(event.name, 0.0) + event.duration_us
    return max(totals, key=totals.get)


def mlp_train_mfu(batch, d_in, d_hidden, d_out, step_seconds, peak_flops):
    flops = 2 * batch * (d_in * d_hidden + d_hidden * d_out) + 4 * batch * d_hidden * d_out \
        + 2 * batch * d_in * d_hidden
    return flops / (step_seconds * peak_flops)


def predict_seconds(costs, peak_flops, peak_bandwidth):
    return sum(max(f / peak_flops, b / peak_bandwidth) for f, b in costs.values())


def step_time(fn, *args, repeats=10):
    jax.block_until_ready(fn(*args))
    total = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        total += time.perf_counter() - start
    return total / repeats


RIGHT = {
    "08.top_op": top_op,
    "08.mlp_mfu": mlp_train_mfu,
    "08.roofline_time": predict_seconds,
    "08.step_time": step_time,
}


@pytest.mark.parametrize("exercise_id", sorted(RIGHT))
def test_a_right_answer_scores_full_marks(exercise_id):
    result = grade(exercise_id, RIGHT[exercise_id])
    assert result.points == result.max_points, [c.message for c in result.cases]


def longest_single_event(events, module):
    return max((e for e in events if e.module == module), key=lambda e: e.duration_us).name


def ignores_module(events, module):
    totals = {}
    for event in events:
        totals[event.name] = totals.get(event.name, 0.0) + event.duration_us
    return max(totals, key=totals.get)


def six_n_d(batch, d_in, d_hidden, d_out, step_seconds, peak_flops):
    return 6 * batch * (d_in * d_hidden + d_hidden * d_out) / (step_seconds * peak_flops)


def forward_only(batch, d_in, d_hidden, d_out, step_seconds, peak_flops):
    return 2 * batch * (d_in * d_hidden + d_hidden * d_out) / (step_seconds * peak_flops)


def times_the_time(batch, d_in, d_hidden, d_out, step_seconds, peak_flops):
    return mlp_train_mfu(batch, d_in, d_hidden, d_out, 1.0, peak_flops) * step_seconds


def max_of_sums(costs, peak_flops, peak_bandwidth):
    flops = sum(f for f, _ in costs.values())
    nbytes = sum(b for _, b in costs.values())
    return max(flops / peak_flops, nbytes / peak_bandwidth)


def no_block(fn, *args, repeats=10):
    fn(*args)
    start = time.perf_counter()
    for _ in range(repeats):
        fn(*args)
    return (time.perf_counter() - start) / repeats


def no_warmup(fn, *args, repeats=10):
    start = time.perf_counter()
    for _ in range(repeats):
        jax.block_until_ready(fn(*args))
    return (time.perf_counter() - start) / repeats


# (exercise, planted wrong answer, points it should still get, why)
WRONG = [
    ("08.top_op", longest_single_event, 3, "the longest single event, not the largest total"),
    ("08.top_op", ignores_module, 3, "sums every module's ops"),
    ("08.mlp_mfu", six_n_d, 1, "6 x params x tokens counts a gradient into the data"),
    ("08.mlp_mfu", forward_only, 1, "forward matmuls only"),
    ("08.mlp_mfu", times_the_time, 2, "multiplies by the time instead of dividing"),
    ("08.roofline_time", max_of_sums, 1, "max of the sums lets compute hide memory"),
    ("08.roofline_time", lambda c, p, w: sum(f / p for f, _ in c.values()), 0, "ignores the bytes"),
    ("08.step_time", no_block, 2, "stops the clock before the work is done"),
    ("08.step_time", no_warmup, 2, "times the compilation too"),
]


@pytest.mark.parametrize("exercise_id, answer, points, why", WRONG, ids=[w[3] for w in WRONG])
def test_a_planted_wrong_answer_loses_points(exercise_id, answer, points, why):
    result = grade(exercise_id, answer)
    assert result.points == points, [(c.name, c.status, c.message) for c in result.cases]
    assert result.points < result.max_points
