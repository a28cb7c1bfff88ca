"""Chapter 16 exercises: reading the capstone's dashboard and its swap table.

Four small functions over the numbers the capstone reports: the work a kill costs, where
a step's time goes, whether a swap agrees as promised, and a step-time ratio. Expected
answers are computed here, in closed form, before the learner's code runs; lists and
dicts are handed over as copies (`call_on_copies`).
"""

import math
import statistics

from stacklib.grading import Exercise, call_on_copies, expect, expect_close

GROUPS = ("matmul", "collective", "elementwise", "data movement")  # stacklib.capstone.profiling.GROUPS

# ---------------------------------------------------------------- 16.lost_work

lost_work = Exercise("16.lost_work", "The work a kill costs: steps and seconds computed twice")


def _lost_work(killed_at, committed_steps, step_seconds):
    resume = max([s for s in committed_steps if s <= killed_at], default=0)
    return killed_at - resume, sum(step_seconds[resume:killed_at])


def _lost(fn, killed_at, committed, seconds):
    """The learner's (steps, seconds), after checking its form, and the expected pair."""
    expected = _lost_work(killed_at, committed, seconds)
    got = call_on_copies(fn, killed_at, committed, seconds, what="lost_work")
    expect(isinstance(got, tuple) and len(got) == 2, f"return (steps, seconds), got {got!r}")
    return got, expected


def _check_steps(fn, killed_at, committed, seconds):
    (got, _), (expected, _) = _lost(fn, killed_at, committed, seconds)
    expect(got == expected, f"lost_work({killed_at}, {committed}, ...): expected {expected} steps computed "
                            f"twice, got {got}")


def _check_seconds(fn, killed_at, committed, seconds):
    (_, got), (_, expected) = _lost(fn, killed_at, committed, seconds)
    expect_close(got, expected, rtol=1e-9, atol=1e-12,
                 what=f"the seconds lost by lost_work({killed_at}, {committed}, {seconds})")


_DASHBOARD_SECONDS = [round(0.5 + 0.01 * i, 2) for i in range(14)]  # rounded: the messages print them


@lost_work.case(points=2, hint="Count the steps after the checkpoint the run resumed from, up to and "
                               "including killed_at (section '2. Killed, then resumed, bit for bit').")
def the_dashboards_run_loses_six_steps_without_the_local_tier(fn):
    _check_steps(fn, 14, [1, 8], _DASHBOARD_SECONDS)


@lost_work.case(points=2, hint="`committed_steps` comes in any order: the run resumed from the latest "
                               "checkpoint not after the kill, wherever it stands in the list.")
def committed_steps_in_any_order(fn):
    _check_steps(fn, 27, [20, 25, 10], [0.1 * (i % 3 + 1) for i in range(27)])


@lost_work.case(points=2, hint="A checkpoint at killed_at itself is not after the kill: the run resumed from "
                               "it and computed nothing twice.")
def a_checkpoint_at_the_killed_step_loses_nothing(fn):
    _check_steps(fn, 14, [4, 14], _DASHBOARD_SECONDS)
    _check_seconds(fn, 14, [4, 14], _DASHBOARD_SECONDS)


@lost_work.case(points=2, hint="A checkpoint after killed_at was written later, by the resumed run: the run "
                               "cannot have resumed from it.")
def a_checkpoint_after_the_kill_is_not_resumed_from(fn):
    _check_steps(fn, 14, [4, 16, 8], _DASHBOARD_SECONDS)


@lost_work.case(points=3, hint="The seconds are the killed run's times of the redone steps; step_seconds[i] "
                               "is step i + 1's time, so work out which entries those steps are.")
def the_seconds_are_those_of_the_redone_steps(fn):
    _check_seconds(fn, 7, [4], [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0])


@lost_work.case(points=2, hint="With its local tier, the dashboard's run redoes steps 13 and 14: add the "
                               "killed run's times of those steps (step_seconds[i] is step i + 1's time).")
def the_seconds_of_the_dashboards_run(fn):
    _check_seconds(fn, 14, [1, 8, 8, 12], _DASHBOARD_SECONDS)


@lost_work.case(hint="With no checkpoint committed, the run starts again from step 0 and redoes every step "
                     "up to the kill.")
def no_checkpoint_loses_everything(fn):
    _check_steps(fn, 5, [], [1.0] * 6)
    _check_seconds(fn, 5, [], [1.0] * 6)


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


@time_shares.case(points=2, hint="An op missing from `groups` is data movement; its time still counts.")
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


@swap_verdict.case(points=2, hint="The tolerance is relative: it grows with the size of our loss (the "
                                  "exercise's rule).")
def a_relative_tolerance_scales_with_the_loss(fn):
    theirs = [o + 4e-5 for o in _OURS]  # 4e-5 absolute is < 1e-5 of a loss of 4.6 or more
    _check_verdict(fn, _OURS, theirs, 1e-5)


@swap_verdict.case(points=2, hint="Every step must agree, not only the last (or the mean).")
def one_step_out_of_tolerance_disagrees(fn):
    theirs = list(_OURS)
    theirs[3] += 0.01  # step 4 only
    _check_verdict(fn, _OURS, theirs, 1e-5)


@swap_verdict.case(points=2, hint="One step out of tolerance is enough to disagree, however many steps "
                                  "agree: not an average, a majority or the largest loss.")
def one_step_just_out_among_many_disagrees(fn):
    ours = [6.0 - 0.03 * step for step in range(64)]
    theirs = list(ours)
    theirs[60] *= 1 + 1.2e-5  # 1.2 times the tolerance of a loss of 4.2, at one step of 64
    _check_verdict(fn, ours, theirs, 1e-5)


@swap_verdict.case(hint="The tolerance is relative to OUR loss: rtol * |ours|, not rtol * |theirs|.")
def the_tolerance_is_relative_to_ours(fn):
    _check_verdict(fn, [4.0, 2.0, 8.0], [3.62, 2.0, 8.0], 0.1)  # 0.38 <= 0.4 = 0.1 * 4.0 (but > 0.362)


@swap_verdict.case(hint="A difference equal to rtol * |ours| is within tolerance ('<=', not '<').")
def a_difference_equal_to_the_tolerance_is_within(fn):
    _check_verdict(fn, [4.0, 2.0, 8.0], [5.0, 2.0, 8.0], 0.25)  # exactly 1.0 = 0.25 * 4.0, no rounding


@swap_verdict.case(hint="Only the relative tolerance counts: add no absolute slack (np.isclose and "
                        "np.allclose add atol=1e-8 unless told otherwise).")
def no_absolute_slack_is_added(fn):
    _check_verdict(fn, [4.0, 3.0], [4.0 + 1e-8, 3.0], 1e-9)  # 1e-8 off, where rtol allows 4e-9


@swap_verdict.case(points=2, hint="'bitwise' means equal with ==: a loss one float apart is not bitwise, "
                                  "however small the difference.")
def one_float_apart_is_not_bitwise(fn):
    theirs = list(_OURS)
    theirs[5] = math.nextafter(theirs[5], math.inf)  # the next float64 up
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


@step_time_ratio.case(points=2, hint="The median, not the mean: one stalled step, in either run, must not "
                                     "move it.")
def one_stalled_step_does_not_move_the_median(fn):
    _check_ratio(fn, [1.0, 0.010, 0.010, 0.500, 0.010], [1.0, 0.012, 0.012, 0.012, 0.012])
    _check_ratio(fn, [1.0, 0.010, 0.010, 0.010], [1.0, 0.012, 0.300, 0.012])


@step_time_ratio.case(hint="Drop the first step because it comes first, not because it is the slowest: here "
                           "a compilation cache made it quick.")
def the_first_step_is_dropped_even_when_quick(fn):
    _check_ratio(fn, [0.004, 0.010, 0.012, 0.011], [0.004, 0.020, 0.020, 0.020])


@step_time_ratio.case(hint="With an even number of steps the median is the mean of the middle two "
                           "(statistics.median).")
def an_even_number_of_steps_takes_the_middle_two(fn):
    _check_ratio(fn, [3.0, 0.010, 0.010, 0.010, 0.010], [2.0, 0.020, 0.024, 0.022, 0.026])


@step_time_ratio.case(hint="Take each run's median on its own, then their ratio: steps of the two runs do "
                           "not pair up.")
def the_medians_are_taken_run_by_run(fn):
    _check_ratio(fn, [1.0, 0.010, 0.012, 0.014], [1.0, 0.012, 0.016, 0.014])  # step by step: 1.2, 1.33, 1.0
