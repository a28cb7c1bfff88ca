"""Chapter 16 exercises: reading the capstone's dashboard and its swap table.

Four small functions over the numbers the capstone reports: the work a kill costs, where
a step's time goes, whether a swap agrees as promised, and a step-time ratio. Expected
answers are computed here, in closed form, before the learner's code runs; lists and
dicts are handed over as copies (`call_on_copies`).
"""

import statistics

from stacklib.grading import Exercise, call_on_copies, expect, expect_close

GROUPS = ("matmul", "collective", "elementwise", "data movement")  # stacklib.capstone.profiling.GROUPS

# ---------------------------------------------------------------- 16.lost_work

lost_work = Exercise("16.lost_work", "The work a kill costs: steps and seconds computed twice")


def _lost_work(killed_at, committed_steps, step_seconds):
    resume = max([s for s in committed_steps if s <= killed_at], default=0)
    return killed_at - resume, sum(step_seconds[resume:killed_at])


def _check_lost(fn, killed_at, committed, seconds):
    expected_steps, expected_seconds = _lost_work(killed_at, committed, seconds)
    got = call_on_copies(fn, killed_at, committed, seconds, what="lost_work")
    expect(isinstance(got, tuple) and len(got) == 2, f"return (steps, seconds), got {got!r}")
    expect(got[0] == expected_steps, f"steps computed twice: expected {expected_steps}, got {got[0]}")
    expect_close(got[1], expected_seconds, rtol=1e-9, atol=1e-12, what="seconds lost")


@lost_work.case(points=2, hint="The run resumes from the latest committed step; the steps after it, up to "
                               "the kill, are computed again.")
def the_dashboards_run_loses_four_steps(fn):
    _check_lost(fn, 12, [1, 8], [0.5 + 0.01 * i for i in range(12)])


@lost_work.case(points=1, hint="`committed_steps` is a list in any order: take the largest, not the last.")
def committed_steps_in_any_order(fn):
    _check_lost(fn, 27, [20, 25, 10], [0.1 * (i % 3 + 1) for i in range(27)])


@lost_work.case(points=1, hint="step_seconds[0] is step 1's time: steps r+1..k are step_seconds[r:k].")
def the_seconds_are_those_of_the_redone_steps(fn):
    _check_lost(fn, 7, [4], [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0])


@lost_work.case(points=1, hint="With no checkpoint committed, the run starts again from step 0.")
def no_checkpoint_loses_everything(fn):
    _check_lost(fn, 5, [], [1.0] * 6)


# ---------------------------------------------------------------- 16.time_shares

time_shares = Exercise("16.time_shares", "Where a step's time goes: shares of op time per group")


def _shares(events, groups):
    totals = dict.fromkeys(GROUPS, 0.0)
    for name, duration in events:
        totals[groups.get(name, "data movement")] += duration
    whole = sum(totals.values())
    return {group: total / whole for group, total in totals.items()}


def _check_shares(fn, events, groups):
    expected = _shares(events, groups)
    got = call_on_copies(fn, events, groups, what="time_shares")
    expect(isinstance(got, dict), f"return a dict from group to share, got {type(got).__name__}")
    expect(set(got) == set(GROUPS), f"expected one entry per group {list(GROUPS)}, got keys {sorted(got)}")
    for group in GROUPS:
        expect_close(got[group], expected[group], rtol=1e-9, atol=1e-12, what=f"the share of {group!r}")


_GROUPS_OF = {"dot.1": "matmul", "fusion.3": "matmul", "all-reduce.7": "collective",
              "fusion.9": "elementwise", "copy.2": "data movement"}


@time_shares.case(points=2, hint="Add up durations (not events) per group and divide by the total.")
def shares_weigh_time_not_calls(fn):
    events = [("dot.1", 500.0), ("all-reduce.7", 20.0), ("all-reduce.7", 30.0), ("all-reduce.7", 10.0),
              ("fusion.9", 40.0), ("copy.2", 400.0)]
    _check_shares(fn, events, _GROUPS_OF)


@time_shares.case(points=1, hint="An op missing from `groups` is data movement; its time still counts.")
def unknown_ops_are_data_movement(fn):
    events = [("dot.1", 300.0), ("transpose.4", 100.0), ("fusion.9", 100.0)]
    _check_shares(fn, events, _GROUPS_OF)


@time_shares.case(points=1, hint="Every group gets an entry, 0.0 when none of its ops ran.")
def every_group_is_listed(fn):
    _check_shares(fn, [("fusion.3", 75.0), ("all-reduce.7", 25.0)], _GROUPS_OF)


@time_shares.case(points=1, hint="Shares, not microseconds: they sum to 1.")
def shares_sum_to_one(fn):
    events = [("fusion.3", 3.0), ("fusion.9", 1.0), ("copy.2", 4.0), ("all-reduce.7", 2.0)]
    _check_shares(fn, events, _GROUPS_OF)


# ---------------------------------------------------------------- 16.swap_verdict

swap_verdict = Exercise("16.swap_verdict", "Does a swap agree with ours as promised?")


def _verdict(ours, theirs, rtol):
    if list(ours) == list(theirs):
        return "bitwise"
    if all(abs(t - o) <= rtol * abs(o) for o, t in zip(ours, theirs, strict=True)):
        return "within tolerance"
    return "disagrees"


def _check_verdict(fn, ours, theirs, rtol):
    expected = _verdict(ours, theirs, rtol)
    got = call_on_copies(fn, ours, theirs, rtol, what="swap_verdict")
    expect(got == expected, f"expected {expected!r}, got {got!r} (rtol={rtol})")


_OURS = [6.3615980, 6.6454873, 5.8482022, 5.3107419, 5.0511250, 4.8412743, 4.7301006, 4.6549153]


@swap_verdict.case(points=1, hint="Equal with == at every step: 'bitwise'.")
def identical_losses_are_bitwise(fn):
    _check_verdict(fn, _OURS, list(_OURS), 1e-5)


@swap_verdict.case(points=2, hint="Relative: |theirs - ours| <= rtol * |ours| at every step.")
def a_relative_tolerance_scales_with_the_loss(fn):
    theirs = [o + 4e-5 for o in _OURS]  # 4e-5 absolute is < 1e-5 of a loss of 4.6 or more
    _check_verdict(fn, _OURS, theirs, 1e-5)


@swap_verdict.case(points=2, hint="Every step must agree, not only the last (or the mean).")
def one_step_out_of_tolerance_disagrees(fn):
    theirs = list(_OURS)
    theirs[3] += 0.01  # step 4 only
    _check_verdict(fn, _OURS, theirs, 1e-5)


# ---------------------------------------------------------------- 16.step_time_ratio

step_time_ratio = Exercise("16.step_time_ratio", "The swap table's step-time ratio")


def _ratio(ours, theirs):
    return statistics.median(theirs[1:]) / statistics.median(ours[1:])


def _check_ratio(fn, ours, theirs):
    expected = _ratio(ours, theirs)
    got = call_on_copies(fn, ours, theirs, what="step_time_ratio")
    expect(isinstance(got, float), f"return a float, got {type(got).__name__}")
    expect_close(got, expected, rtol=1e-9, atol=0, what="the ratio theirs / ours")


@step_time_ratio.case(points=2, hint="The ratio is the real library's time over ours: above 1 means slower.")
def theirs_over_ours(fn):
    _check_ratio(fn, [1.0, 0.010, 0.010, 0.010], [1.0, 0.020, 0.020, 0.020])


@step_time_ratio.case(points=2, hint="Drop the first step of each run: it includes compiling.")
def the_compiling_step_is_dropped(fn):
    _check_ratio(fn, [2.5, 0.010, 0.011, 0.012], [0.9, 0.020, 0.021, 0.022])


@step_time_ratio.case(points=1, hint="The median, not the mean: one stalled step must not move it.")
def one_stalled_step_does_not_move_the_median(fn):
    _check_ratio(fn, [1.0, 0.010, 0.010, 0.500, 0.010], [1.0, 0.012, 0.012, 0.012, 0.012])
