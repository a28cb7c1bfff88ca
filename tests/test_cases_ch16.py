"""Chapter 16's exercise cases: right answers score full marks, planted wrong ones lose points."""

import statistics

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


def ours_over_theirs(ours_seconds, theirs_seconds):
    return float(statistics.median(ours_seconds[1:]) / statistics.median(theirs_seconds[1:]))


def keeps_the_compiling_step(ours_seconds, theirs_seconds):
    return float(statistics.median(theirs_seconds) / statistics.median(ours_seconds))


def mean_not_median(ours_seconds, theirs_seconds):
    return float(statistics.mean(theirs_seconds[1:]) / statistics.mean(ours_seconds[1:]))


# (exercise, planted wrong answer, points it should still get, why)
WRONG = [
    ("16.lost_work", resumes_from_the_last_listed, 4, "the last listed checkpoint, not the latest"),
    ("16.lost_work", seconds_off_by_one, 1, "the seconds of steps r+2..k+1"),
    ("16.lost_work", needs_a_checkpoint, 4, "raises when no checkpoint was committed"),
    ("16.time_shares", drops_unknown_ops, 4, "ops missing from groups are dropped"),
    ("16.time_shares", omits_empty_groups, 3, "groups with no time are left out"),
    ("16.time_shares", microseconds_not_shares, 0, "microseconds instead of shares"),
    ("16.swap_verdict", absolute_tolerance, 3, "an absolute tolerance"),
    ("16.swap_verdict", final_loss_only, 3, "compares the final loss only"),
    ("16.swap_verdict", never_bitwise, 4, "never says bitwise"),
    ("16.step_time_ratio", ours_over_theirs, 0, "the ratio inverted"),
    ("16.step_time_ratio", keeps_the_compiling_step, 3, "the compiling first step kept"),
    ("16.step_time_ratio", mean_not_median, 4, "the mean instead of the median"),
]


@pytest.mark.parametrize("exercise_id, answer, points, why", WRONG, ids=[w[3] for w in WRONG])
def test_a_planted_wrong_answer_loses_points(exercise_id, answer, points, why):
    result = grade(exercise_id, answer)
    assert result.points == points, [(c.name, c.status, c.message) for c in result.cases]
    assert result.points < result.max_points
