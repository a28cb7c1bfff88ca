"""Chapter 08's exercise cases: right answers score full marks, planted wrong ones lose points."""

import dataclasses
import itertools
import statistics
import time
import timeit
from time import perf_counter

import jax
import pytest

from stacklib.cases import ch08
from stacklib.grading import grade
from stacklib.profile import op_table


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
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


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


def first_event_of_the_module(events, module):
    return next(e for e in events if e.module == module).name


def most_calls(events, module):
    counts = {}
    for event in events:
        if event.module == module:
            counts[event.name] = counts.get(event.name, 0) + 1
    return max(counts, key=counts.get)


def longest_mean(events, module):
    durations = {}
    for event in events:
        if event.module == module:
            durations.setdefault(event.name, []).append(event.duration_us)
    return max(durations, key=lambda name: statistics.mean(durations[name]))


def ignores_module(events, module):
    totals = {}
    for event in events:
        totals[event.name] = totals.get(event.name, 0.0) + event.duration_us
    return max(totals, key=totals.get)


def uses_op_table(events, module):
    return op_table(events, module=module)[0].key


def sorts_the_callers_list(events, module):
    events.sort(key=lambda e: e.duration_us)  # changes the list it was given
    return top_op(events, module)


def six_n_d(batch, d_in, d_hidden, d_out, step_seconds, peak_flops):
    return 6 * batch * (d_in * d_hidden + d_hidden * d_out) / (step_seconds * peak_flops)


def forward_only(batch, d_in, d_hidden, d_out, step_seconds, peak_flops):
    return 2 * batch * (d_in * d_hidden + d_hidden * d_out) / (step_seconds * peak_flops)


def times_the_time(batch, d_in, d_hidden, d_out, step_seconds, peak_flops):
    return mlp_train_mfu(batch, d_in, d_hidden, d_out, 1.0, peak_flops) * step_seconds


def in_percent(batch, d_in, d_hidden, d_out, step_seconds, peak_flops):
    return 100 * mlp_train_mfu(batch, d_in, d_hidden, d_out, step_seconds, peak_flops)


def max_of_sums(costs, peak_flops, peak_bandwidth):
    flops = sum(f for f, _ in costs.values())
    nbytes = sum(b for _, b in costs.values())
    return max(flops / peak_flops, nbytes / peak_bandwidth)


def sum_of_both_terms(costs, peak_flops, peak_bandwidth):
    return sum(f / peak_flops + b / peak_bandwidth for f, b in costs.values())


def no_block(fn, *args, repeats=10):
    fn(*args)
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def no_warmup(fn, *args, repeats=10):
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def in_milliseconds(fn, *args, repeats=10):
    return 1e3 * step_time(fn, *args, repeats=repeats)


def the_mean(fn, *args, repeats=10):
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(repeats):
        jax.block_until_ready(fn(*args))
    return (time.perf_counter() - start) / repeats


def the_fastest(fn, *args, repeats=10):
    jax.block_until_ready(fn(*args))
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        seconds.append(time.perf_counter() - start)
    return min(seconds)


def ten_calls_always(fn, *args, repeats=10):
    return step_time(fn, *args, repeats=10)


def unblocked_warm_up(fn, *args, repeats=10):
    fn(*args)  # compiles, but its work is still running when the clock starts
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def step_time_with_a_bound_clock(fn, *args, repeats=10):
    jax.block_until_ready(fn(*args))
    seconds = []
    for _ in range(repeats):
        start = perf_counter()
        jax.block_until_ready(fn(*args))
        seconds.append(perf_counter() - start)
    return statistics.median(seconds)


def wall_clock(fn, *args, repeats=10):
    jax.block_until_ready(fn(*args))
    seconds = []
    for _ in range(repeats):
        start = time.time()
        jax.block_until_ready(fn(*args))
        seconds.append(time.time() - start)
    return statistics.median(seconds)


def groupby_without_sorting(events, module):
    mine = [e for e in events if e.module == module]
    totals = {name: sum(e.duration_us for e in group)  # a later group of the same op replaces an earlier one
              for name, group in itertools.groupby(mine, key=lambda e: e.name)}
    return max(totals, key=totals.get)


def the_first_stretch_of_the_module(events, module):
    for name, group in itertools.groupby(events, key=lambda e: e.module):
        if name == module:  # stops at the module's first run of contiguous events
            return top_op(list(group), module)
    raise ValueError(module)


def the_name_that_sorts_last(events, module):
    return max(name for name in {e.name for e in events if e.module == module})


def most_time_in_one_run(events, module):
    totals = {}
    for event in events:
        if event.module == module:
            key = (event.name, event.run_id)
            totals[key] = totals.get(key, 0.0) + event.duration_us
    return max(totals, key=totals.get)[0]


def modules_that_contain_the_name(events, module):
    widened = [dataclasses.replace(e, module=module) if module in e.module else e for e in events]
    return top_op(widened, module)


def weights_gradients_only(batch, d_in, d_hidden, d_out, step_seconds, peak_flops):
    return 2 * forward_only(batch, d_in, d_hidden, d_out, step_seconds, peak_flops)


def slowest_op_only(costs, peak_flops, peak_bandwidth):
    return max(max(f / peak_flops, b / peak_bandwidth) for f, b in costs.values())


def upper_median(fn, *args, repeats=10):
    jax.block_until_ready(fn(*args))
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        seconds.append(time.perf_counter() - start)
    return sorted(seconds)[repeats // 2]


def warm_up_among_the_timings(fn, *args, repeats=10):
    seconds = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)



# (exercise, planted wrong answer, points it should still get, why)
# Fresh wrong answers a learner writes (issue 38).


def top_by_start_times(events, module):
    totals = {}
    for event in events:
        if event.module == module:
            totals[event.name] = totals.get(event.name, 0.0) + event.start_us  # start, not duration
    return max(totals, key=totals.get)


def top_event_itself(events, module):
    totals = {}
    for event in events:
        if event.module == module:
            totals[event.name] = totals.get(event.name, 0.0) + event.duration_us
    top = max(totals, key=totals.get)
    return next(event for event in events if event.name == top)  # the OpEvent, not its name


def top_per_thread(events, module):
    totals = {}
    for event in events:
        if event.module == module:
            key = (event.name, event.thread)
            totals[key] = totals.get(key, 0.0) + event.duration_us
    return max(totals, key=totals.get)[0]


def mfu_counting_a_multiply_add_as_one(batch, d_in, d_hidden, d_out, step_seconds, peak_flops):
    forward = batch * (d_in * d_hidden + d_hidden * d_out)
    return (2 * forward + batch * d_hidden * d_out) / (step_seconds * peak_flops)


def mfu_without_the_time(batch, d_in, d_hidden, d_out, step_seconds, peak_flops):
    forward = 2 * batch * (d_in * d_hidden + d_hidden * d_out)
    return (2 * forward + 2 * batch * d_hidden * d_out) / peak_flops


def roofline_with_the_faster_resource(costs, peak_flops, peak_bandwidth):
    return sum(min(f / peak_flops, b / peak_bandwidth) for f, b in costs.values())


def roofline_in_milliseconds(costs, peak_flops, peak_bandwidth):
    return 1e3 * sum(max(f / peak_flops, b / peak_bandwidth) for f, b in costs.values())


def blocks_once_after_the_loop(fn, *args, repeats=10):
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(repeats):
        out = fn(*args)
    jax.block_until_ready(out)  # one wait for all: the mean of the calls, not each call's time
    return (time.perf_counter() - start) / repeats


def the_lower_median(fn, *args, repeats=10):
    jax.block_until_ready(fn(*args))
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        seconds.append(time.perf_counter() - start)
    return statistics.median_low(seconds)



def roofline_mean_over_ops(costs, peak_flops, peak_bandwidth):
    return sum(max(f / peak_flops, b / peak_bandwidth) for f, b in costs.values()) / len(costs)


def roofline_with_the_peaks_swapped(costs, peak_flops, peak_bandwidth):
    return sum(max(f / peak_bandwidth, b / peak_flops) for f, b in costs.values())


def mfu_of_one_layer(batch, d_in, d_hidden, d_out, step_seconds, peak_flops):
    return 6 * batch * d_in * d_out / (step_seconds * peak_flops)  # as if one (d_in, d_out) layer


def mfu_with_the_relu(batch, d_in, d_hidden, d_out, step_seconds, peak_flops):
    relu = batch * d_hidden  # one comparison per hidden unit: not a matmul FLOP
    return mlp_train_mfu(batch, d_in, d_hidden, d_out, step_seconds, peak_flops) + relu / (
        step_seconds * peak_flops)


def mfu_input_gradient_on_the_first_layer(batch, d_in, d_hidden, d_out, step_seconds, peak_flops):
    forward = 2 * batch * (d_in * d_hidden + d_hidden * d_out)
    first_layer_backward = 2 * (2 * batch * d_in * d_hidden)  # dW1 and a gradient into x, which nothing needs
    second_layer_backward = 2 * batch * d_hidden * d_out  # dW2 only: but the first layer needs the gradient
    return (forward + first_layer_backward + second_layer_backward) / (step_seconds * peak_flops)


def roofline_skipping_ops_without_flops(costs, peak_flops, peak_bandwidth):
    return sum(max(f / peak_flops, b / peak_bandwidth) for f, b in costs.values() if f)  # a copy is free?


def roofline_with_the_bytes_twice(costs, peak_flops, peak_bandwidth):
    return sum(max(f / peak_flops, 2 * b / peak_bandwidth) for f, b in costs.values())  # "read and write"


def top_op_family(events, module):
    totals = {}
    for event in events:
        if event.module == module:
            family = event.name.split(".")[0]  # "ynn_fusion.3" and "ynn_fusion.1" are different ops
            totals[family] = totals.get(family, 0.0) + event.duration_us
    return max(totals, key=totals.get)


def step_time_from_one_start(fn, *args, repeats=10):
    jax.block_until_ready(fn(*args))
    seconds = []
    start = time.perf_counter()  # once, before the loop: each time includes the calls before it
    for _ in range(repeats):
        jax.block_until_ready(fn(*args))
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


FRESH = [
    ("08.top_op", top_by_start_times, 0, "adds up start times"),
    ("08.top_op", top_event_itself, 0, "returns the OpEvent, not its name"),
    ("08.top_op", top_per_thread, 4, "the most time on one thread"),
    ("08.top_op", top_op_family, 0, "adds up op families: the name before its '.N'"),
    ("08.mlp_mfu", mfu_counting_a_multiply_add_as_one, 1, "a multiply-add as one FLOP"),
    ("08.mlp_mfu", mfu_without_the_time, 0, "divides by the peak only"),
    ("08.roofline_time", roofline_with_the_faster_resource, 0, "each op's faster resource"),
    ("08.roofline_time", roofline_in_milliseconds, 0, "milliseconds"),
    ("08.step_time", blocks_once_after_the_loop, 2, "one wait after the loop: the mean"),
    ("08.step_time", the_lower_median, 8, "the lower middle time of an even number"),
    ("08.step_time", step_time_from_one_start, 2, "starts the clock once, before the loop"),
    ("08.roofline_time", roofline_mean_over_ops, 1, "the mean over ops, not the sum"),
    ("08.roofline_time", roofline_with_the_peaks_swapped, 0, "F / bandwidth and B / peak_flops"),
    ("08.mlp_mfu", mfu_of_one_layer, 1, "one (d_in, d_out) layer"),
    ("08.mlp_mfu", mfu_with_the_relu, 1, "counts the relu's FLOPs too"),
    ("08.mlp_mfu", mfu_input_gradient_on_the_first_layer, 1, "the input gradient in layer 1, not layer 2"),
    ("08.roofline_time", roofline_skipping_ops_without_flops, 2, "leaves out the ops without FLOPs"),
    ("08.roofline_time", roofline_with_the_bytes_twice, 0, "counts each op's bytes twice"),
]


WRONG = [
    ("08.top_op", longest_single_event, 2, "the longest single event, not the largest total"),
    ("08.top_op", first_event_of_the_module, 0, "the first event of the module"),
    ("08.top_op", most_calls, 0, "the op with the most calls"),
    ("08.top_op", longest_mean, 2, "the op with the longest mean"),
    ("08.top_op", ignores_module, 2, "sums every module's ops"),
    ("08.top_op", uses_op_table, 0, "calls op_table"),
    ("08.top_op", sorts_the_callers_list, 0, "sorts the caller's list in place"),
    ("08.top_op", groupby_without_sorting, 4, "groupby without sorting keeps the last group"),
    ("08.top_op", the_first_stretch_of_the_module, 2, "stops at the module's first stretch of events"),
    ("08.top_op", the_name_that_sorts_last, 2, "max of the names"),
    ("08.top_op", most_time_in_one_run, 4, "the most time within one run"),
    ("08.top_op", modules_that_contain_the_name, 4, "counts modules whose name contains the one asked for"),
    ("08.mlp_mfu", six_n_d, 1, "6 x params x tokens counts a gradient into the data"),
    ("08.mlp_mfu", forward_only, 1, "forward matmuls only"),
    ("08.mlp_mfu", weights_gradients_only, 1, "no gradient into the first layer's output"),
    ("08.mlp_mfu", times_the_time, 0, "multiplies by the time instead of dividing"),
    ("08.mlp_mfu", in_percent, 1, "a percentage, not a fraction"),
    ("08.roofline_time", max_of_sums, 1, "max of the sums lets compute hide memory"),
    ("08.roofline_time", sum_of_both_terms, 0, "adds each op's compute and memory time"),
    ("08.roofline_time", lambda c, p, w: sum(f / p for f, _ in c.values()), 0, "ignores the bytes"),
    ("08.roofline_time", slowest_op_only, 1, "only the slowest op's bound"),
    ("08.step_time", no_block, 0, "stops the clock before the work is done"),
    ("08.step_time", no_warmup, 0, "times the compilation too"),
    ("08.step_time", in_milliseconds, 0, "milliseconds"),
    ("08.step_time", the_mean, 6, "the mean, not the median"),
    ("08.step_time", the_fastest, 6, "the fastest call, not the median"),
    ("08.step_time", ten_calls_always, 0, "ignores repeats"),
    ("08.step_time", unblocked_warm_up, 7, "does not wait for the warm-up"),
    ("08.step_time", wall_clock, 0, "time.time, which the check cannot control"),
    ("08.step_time", upper_median, 8, "the upper middle time of an even number"),
    ("08.step_time", warm_up_among_the_timings, 4, "times the warm-up call too"),
    *FRESH,
]


@pytest.mark.parametrize("exercise_id, answer, points, why", WRONG, ids=[w[3] for w in WRONG])
def test_a_planted_wrong_answer_loses_points(exercise_id, answer, points, why):
    result = grade(exercise_id, answer)
    assert result.points == points, [(c.name, c.status, c.message) for c in result.cases]
    assert result.points < result.max_points


# (exercise, planted wrong answer, words its first failing case's message must hold)
DIAGNOSED = [
    ("08.step_time", in_milliseconds, "milliseconds"),
    ("08.step_time", no_block, "stops before the work is done"),
    ("08.step_time", no_warmup, "the first call (compilation) is in the timing"),
    ("08.step_time", the_mean, "that is the mean"),
    ("08.step_time", the_fastest, "that is the fastest call"),
    ("08.step_time", wall_clock, "never read time.perf_counter()"),
    ("08.roofline_time", sum_of_both_terms, "added each op's compute time and memory time"),
    ("08.roofline_time", max_of_sums, "took the max of the summed"),
    ("08.top_op", longest_single_event, "the op picked by the longest single execution"),
    ("08.mlp_mfu", six_n_d, "6 x parameters x tokens"),
    ("08.mlp_mfu", weights_gradients_only, "not the gradient that flows from the second layer"),
    ("08.mlp_mfu", in_percent, "that is a percentage"),
    ("08.step_time", upper_median, "the higher of the two middle times"),
    ("08.top_op", sorts_the_callers_list, "changed its input in place"),
    ("08.top_op", uses_op_table, "called stacklib.profile.op_table"),
    ("08.step_time", step_time_from_one_start, "start it again before each call"),
    ("08.roofline_time", roofline_skipping_ops_without_flops, "left out the ops without FLOPs"),
]


@pytest.mark.parametrize("exercise_id, answer, words", DIAGNOSED, ids=[d[2] for d in DIAGNOSED])
def test_a_planted_wrong_answer_is_told_its_own_mistake(exercise_id, answer, words):
    failed = [c for c in grade(exercise_id, answer).cases if c.points < c.max_points]
    assert words in failed[0].message, failed[0].message


def test_a_timer_that_imports_perf_counter_by_name_is_timed_on_the_fake_clock_too():
    result = grade("08.step_time", step_time_with_a_bound_clock)
    assert result.points == result.max_points, [c.message for c in result.cases]
    assert perf_counter is time.perf_counter  # the case put the real clock back


def step_time_on_timeits_clock(fn, *args, repeats=10):
    jax.block_until_ready(fn(*args))
    seconds = []
    for _ in range(repeats):
        start = timeit.default_timer()  # time.perf_counter, by timeit's name for it
        jax.block_until_ready(fn(*args))
        seconds.append(timeit.default_timer() - start)
    return statistics.median(seconds)


def test_a_timer_on_timeits_default_timer_is_timed_on_the_fake_clock_too():
    result = grade("08.step_time", step_time_on_timeits_clock)
    assert result.points == result.max_points, [c.message for c in result.cases]
    assert timeit.default_timer is time.perf_counter  # the case put the real clock back


def test_the_recorded_capture_tells_every_planted_top_op_apart():
    """The point of the recorded capture: each plausible wrong answer names a different op."""
    events = ch08._recorded_capture()
    answers = {f.__name__: f(events, "jit_train_step") for f in
               (top_op, longest_single_event, first_event_of_the_module, most_calls, longest_mean,
                ignores_module)}
    assert answers["top_op"] == op_table(events, module="jit_train_step")[0].key
    assert all(name != answers["top_op"] for key, name in answers.items() if key != "top_op"), answers
