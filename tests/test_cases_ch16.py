"""Chapter 16's exercise cases: right answers score full marks, planted wrong ones lose points."""

import statistics

import numpy as np
import pytest

from stacklib.grading import grade

GROUPS = ("matmul", "collective", "elementwise", "data movement")


def lost_work(killed_at, committed_steps, step_seconds):
    resume = max([s for s in committed_steps if s <= killed_at], default=0)
    return killed_at - resume, float(sum(step_seconds[resume:killed_at]))


def time_shares(events, groups):
    totals = dict.fromkeys(GROUPS, 0.0)
    for name, duration in events:
        totals[groups.get(name, "data movement")] += duration
    whole = sum(totals.values())
    return {group: total / whole for group, total in totals.items()}


def swap_verdict(ours, theirs, rtol):
    if list(ours) == list(theirs):
        return "bitwise"
    if all(abs(t - o) <= rtol * abs(o) for o, t in zip(ours, theirs, strict=True)):
        return "within tolerance"
    return "disagrees"


def step_time_ratio(ours_seconds, theirs_seconds):
    return float(statistics.median(theirs_seconds[1:]) / statistics.median(ours_seconds[1:]))


RIGHT = {
    "16.lost_work": lost_work,
    "16.time_shares": time_shares,
    "16.swap_verdict": swap_verdict,
    "16.step_time_ratio": step_time_ratio,
}


@pytest.mark.parametrize("exercise_id", sorted(RIGHT))
def test_a_right_answer_scores_full_marks(exercise_id):
    result = grade(exercise_id, RIGHT[exercise_id])
    assert result.points == result.max_points, [c.message for c in result.cases]


# Planted wrong answers.

def resumes_from_the_last_listed(killed_at, committed_steps, step_seconds):  # the list is not sorted
    resume = committed_steps[-1] if committed_steps else 0
    return killed_at - resume, float(sum(step_seconds[resume:killed_at]))


def seconds_off_by_one(killed_at, committed_steps, step_seconds):  # steps r+2..k+1
    resume = max([s for s in committed_steps if s <= killed_at], default=0)
    return killed_at - resume, float(sum(step_seconds[resume + 1:killed_at + 1]))


def needs_a_checkpoint(killed_at, committed_steps, step_seconds):  # max() of an empty list raises
    resume = max(committed_steps)
    return killed_at - resume, float(sum(step_seconds[resume:killed_at]))


def resumes_from_a_later_checkpoint(killed_at, committed_steps, step_seconds):  # no filter on killed_at
    resume = max(committed_steps, default=0)
    return killed_at - resume, float(sum(step_seconds[resume:killed_at]))


def strictly_before_the_kill(killed_at, committed_steps, step_seconds):  # < where the text says not after
    resume = max([s for s in committed_steps if s < killed_at], default=0)
    return killed_at - resume, float(sum(step_seconds[resume:killed_at]))


def counts_the_checkpoint_step(killed_at, committed_steps, step_seconds):  # steps r..k, one too many
    steps, seconds = lost_work(killed_at, committed_steps, step_seconds)
    return steps + 1, seconds


def seconds_shifted_back(killed_at, committed_steps, step_seconds):  # steps r..k-1
    resume = max([s for s in committed_steps if s <= killed_at], default=0)
    return killed_at - resume, float(sum(step_seconds[max(resume - 1, 0):killed_at - 1]))


def every_second_up_to_the_kill(killed_at, committed_steps, step_seconds):
    steps, _ = lost_work(killed_at, committed_steps, step_seconds)
    return steps, float(sum(step_seconds[:killed_at]))


def returns_a_list(killed_at, committed_steps, step_seconds):
    return list(lost_work(killed_at, committed_steps, step_seconds))


def sorts_in_place(killed_at, committed_steps, step_seconds):  # the caller's list changes
    committed_steps.sort()
    return lost_work(killed_at, committed_steps, step_seconds)


def earliest_checkpoint(killed_at, committed_steps, step_seconds):
    resume = min([s for s in committed_steps if s <= killed_at], default=0)
    return killed_at - resume, float(sum(step_seconds[resume:killed_at]))


def seconds_to_the_end(killed_at, committed_steps, step_seconds):  # steps after the kill counted too
    resume = max([s for s in committed_steps if s <= killed_at], default=0)
    return killed_at - resume, float(sum(step_seconds[resume:]))


def drops_unknown_ops(events, groups):
    totals = dict.fromkeys(GROUPS, 0.0)
    for name, duration in events:
        if name in groups:
            totals[groups[name]] += duration
    whole = sum(totals.values())
    return {group: total / whole for group, total in totals.items()}


def omits_empty_groups(events, groups):
    shares = time_shares(events, groups)
    return {group: share for group, share in shares.items() if share > 0}


def microseconds_not_shares(events, groups):
    totals = dict.fromkeys(GROUPS, 0.0)
    for name, duration in events:
        totals[groups.get(name, "data movement")] += duration
    return totals


def counts_events(events, groups):  # one per execution, whatever its duration
    return time_shares([(name, 1.0) for name, _ in events], groups)


def last_duration_per_op(events, groups):  # a dict keeps an op's last duration only
    return time_shares(list(dict(events).items()), groups)


def unknown_ops_under_other(events, groups):
    totals = dict.fromkeys(GROUPS, 0.0)
    for name, duration in events:
        group = groups.get(name, "other")
        totals[group] = totals.get(group, 0.0) + duration
    whole = sum(totals.values())
    return {group: total / whole for group, total in totals.items()}


def key_error_on_unknown_ops(events, groups):
    totals = dict.fromkeys(GROUPS, 0.0)
    for name, duration in events:
        totals[groups[name]] += duration
    whole = sum(totals.values())
    return {group: total / whole for group, total in totals.items()}


def percentages(events, groups):
    return {group: 100 * share for group, share in time_shares(events, groups).items()}


def mean_duration_shares(events, groups):  # each group's mean op time, normalised
    sums, counts = dict.fromkeys(GROUPS, 0.0), dict.fromkeys(GROUPS, 0)
    for name, duration in events:
        group = groups.get(name, "data movement")
        sums[group] += duration
        counts[group] += 1
    means = {group: sums[group] / counts[group] if counts[group] else 0.0 for group in GROUPS}
    whole = sum(means.values())
    return {group: mean / whole for group, mean in means.items()}


def unknown_ops_in_the_total_only(events, groups):
    whole = sum(duration for _, duration in events)
    totals = dict.fromkeys(GROUPS, 0.0)
    for name, duration in events:
        if name in groups:
            totals[groups[name]] += duration
    return {group: total / whole for group, total in totals.items()}


def absolute_tolerance(ours, theirs, rtol):
    if list(ours) == list(theirs):
        return "bitwise"
    if all(abs(t - o) <= rtol for o, t in zip(ours, theirs, strict=True)):
        return "within tolerance"
    return "disagrees"


def final_loss_only(ours, theirs, rtol):
    if ours[-1] == theirs[-1]:
        return "bitwise"
    return "within tolerance" if abs(theirs[-1] - ours[-1]) <= rtol * abs(ours[-1]) else "disagrees"


def never_bitwise(ours, theirs, rtol):
    agree = all(abs(t - o) <= rtol * abs(o) for o, t in zip(ours, theirs, strict=True))
    return "within tolerance" if agree else "disagrees"


def mean_relative_difference(ours, theirs, rtol):
    if list(ours) == list(theirs):
        return "bitwise"
    mean = statistics.mean(abs(t - o) / abs(o) for o, t in zip(ours, theirs, strict=True))
    return "within tolerance" if mean <= rtol else "disagrees"


def most_steps_agree(ours, theirs, rtol):
    if list(ours) == list(theirs):
        return "bitwise"
    agree = sum(abs(t - o) <= rtol * abs(o) for o, t in zip(ours, theirs, strict=True))
    return "within tolerance" if agree > len(ours) / 2 else "disagrees"


def any_step_agrees(ours, theirs, rtol):
    if list(ours) == list(theirs):
        return "bitwise"
    if any(abs(t - o) <= rtol * abs(o) for o, t in zip(ours, theirs, strict=True)):
        return "within tolerance"
    return "disagrees"


def numpy_allclose(ours, theirs, rtol):  # np.allclose's default atol=1e-8 loosens the test
    if list(ours) == list(theirs):
        return "bitwise"
    return "within tolerance" if np.allclose(theirs, ours, rtol=rtol) else "disagrees"


def relative_to_theirs(ours, theirs, rtol):
    if list(ours) == list(theirs):
        return "bitwise"
    if all(abs(t - o) <= rtol * abs(t) for o, t in zip(ours, theirs, strict=True)):
        return "within tolerance"
    return "disagrees"


def strictly_below_the_tolerance(ours, theirs, rtol):  # < where the text says <=
    if list(ours) == list(theirs):
        return "bitwise"
    if all(abs(t - o) < rtol * abs(o) for o, t in zip(ours, theirs, strict=True)):
        return "within tolerance"
    return "disagrees"


def bitwise_to_1e_12(ours, theirs, rtol):  # "equal" as close enough
    if all(abs(t - o) < 1e-12 for o, t in zip(ours, theirs, strict=True)):
        return "bitwise"
    return swap_verdict(ours, theirs, rtol)


def worst_against_the_largest_loss(ours, theirs, rtol):
    if list(ours) == list(theirs):
        return "bitwise"
    worst = max(abs(t - o) for o, t in zip(ours, theirs, strict=True))
    return "within tolerance" if worst <= rtol * max(abs(o) for o in ours) else "disagrees"


def ours_over_theirs(ours_seconds, theirs_seconds):
    return float(statistics.median(ours_seconds[1:]) / statistics.median(theirs_seconds[1:]))


def keeps_the_compiling_step(ours_seconds, theirs_seconds):
    return float(statistics.median(theirs_seconds) / statistics.median(ours_seconds))


def mean_not_median(ours_seconds, theirs_seconds):
    return float(statistics.mean(theirs_seconds[1:]) / statistics.mean(ours_seconds[1:]))


def upper_middle(ours_seconds, theirs_seconds):  # sorted(x)[n // 2]: not the median of an even count
    def middle(x):
        return sorted(x)[len(x) // 2]
    return float(middle(theirs_seconds[1:]) / middle(ours_seconds[1:]))


def fastest_steps(ours_seconds, theirs_seconds):
    return float(min(theirs_seconds[1:]) / min(ours_seconds[1:]))


def drops_the_first_and_last(ours_seconds, theirs_seconds):
    return float(statistics.median(theirs_seconds[1:-1]) / statistics.median(ours_seconds[1:-1]))


def median_of_step_ratios(ours_seconds, theirs_seconds):  # pairs up steps of two unrelated runs
    ratios = [t / o for o, t in zip(ours_seconds[1:], theirs_seconds[1:], strict=True)]
    return float(statistics.median(ratios))


def numpy_array(ours_seconds, theirs_seconds):  # a 0-d array, not a float
    return np.asarray(step_time_ratio(ours_seconds, theirs_seconds))


def drops_the_slowest_step(ours_seconds, theirs_seconds):  # the slowest, not the first
    theirs, ours = sorted(theirs_seconds)[:-1], sorted(ours_seconds)[:-1]
    return float(statistics.median(theirs) / statistics.median(ours))


# (exercise, planted wrong answer, points it should still get, why)
WRONG = [
    ("16.lost_work", resumes_from_the_last_listed, 12, "the last listed checkpoint, not the latest"),
    ("16.lost_work", seconds_off_by_one, 9, "the seconds of steps r+2..k+1"),
    ("16.lost_work", needs_a_checkpoint, 11, "raises when no checkpoint was committed"),
    ("16.lost_work", resumes_from_a_later_checkpoint, 12, "resumes from a checkpoint written after the kill"),
    ("16.lost_work", strictly_before_the_kill, 12, "a checkpoint at the killed step not used"),
    ("16.lost_work", counts_the_checkpoint_step, 5, "the checkpoint's own step counted as redone"),
    ("16.lost_work", seconds_shifted_back, 8, "the seconds of steps r..k-1"),
    ("16.lost_work", every_second_up_to_the_kill, 7, "every step's seconds up to the kill"),
    ("16.lost_work", returns_a_list, 0, "a list, not a tuple"),
    ("16.lost_work", sorts_in_place, 10, "sorts the caller's list"),
    ("16.lost_work", earliest_checkpoint, 4, "the earliest checkpoint, not the latest"),
    ("16.lost_work", seconds_to_the_end, 10, "the seconds of every step after the checkpoint"),
    ("16.time_shares", drops_unknown_ops, 4, "ops missing from groups are dropped"),
    ("16.time_shares", omits_empty_groups, 3, "groups with no time are left out"),
    ("16.time_shares", microseconds_not_shares, 0, "microseconds instead of shares"),
    ("16.time_shares", counts_events, 0, "events counted, not their time"),
    ("16.time_shares", last_duration_per_op, 4, "each op's last duration only"),
    ("16.time_shares", unknown_ops_under_other, 4, "unknown ops under a fifth group"),
    ("16.time_shares", key_error_on_unknown_ops, 4, "KeyError on an op missing from groups"),
    ("16.time_shares", percentages, 0, "percentages, not shares"),
    ("16.time_shares", mean_duration_shares, 4, "each group's mean op time"),
    ("16.time_shares", unknown_ops_in_the_total_only, 4, "unknown ops in the total but no group"),
    ("16.swap_verdict", absolute_tolerance, 8, "an absolute tolerance"),
    ("16.swap_verdict", final_loss_only, 3, "compares the final loss only"),
    ("16.swap_verdict", never_bitwise, 11, "never says bitwise"),
    ("16.swap_verdict", mean_relative_difference, 10, "the mean relative difference"),
    ("16.swap_verdict", most_steps_agree, 8, "most steps agree"),
    ("16.swap_verdict", any_step_agrees, 7, "any step agrees"),
    ("16.swap_verdict", numpy_allclose, 11, "np.allclose with its default atol"),
    ("16.swap_verdict", relative_to_theirs, 11, "relative to theirs, not ours"),
    ("16.swap_verdict", strictly_below_the_tolerance, 11, "< where the text says <="),
    ("16.swap_verdict", bitwise_to_1e_12, 10, "bitwise when within 1e-12"),
    ("16.swap_verdict", worst_against_the_largest_loss, 10, "the worst step against the largest loss"),
    ("16.step_time_ratio", ours_over_theirs, 0, "the ratio inverted"),
    ("16.step_time_ratio", keeps_the_compiling_step, 2, "the compiling first step kept"),
    ("16.step_time_ratio", mean_not_median, 7, "the mean instead of the median"),
    ("16.step_time_ratio", upper_middle, 8, "the upper middle of an even count"),
    ("16.step_time_ratio", fastest_steps, 4, "the fastest step instead of the median"),
    ("16.step_time_ratio", drops_the_first_and_last, 3, "the last step dropped too"),
    ("16.step_time_ratio", median_of_step_ratios, 8, "the median of step-by-step ratios"),
    ("16.step_time_ratio", numpy_array, 0, "a NumPy array, not a float"),
    ("16.step_time_ratio", drops_the_slowest_step, 8, "the slowest step dropped, not the first"),
]


@pytest.mark.parametrize("exercise_id, answer, points, why", WRONG, ids=[w[3] for w in WRONG])
def test_a_planted_wrong_answer_loses_points(exercise_id, answer, points, why):
    result = grade(exercise_id, answer)
    assert result.points == points, [(c.name, c.status, c.message) for c in result.cases]
    assert result.points < result.max_points
