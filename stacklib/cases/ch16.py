"""Chapter 16 exercises: three capstone decisions made with the stack, on small given inputs.

1. Resume and verify: restore the latest checkpoint a `stacklib.checkpoint.CheckpointManager`
   wrote, run the remaining steps, and find the first loss that is not bit-for-bit the
   uninterrupted run's.
2. A swap's verdict: does a component swapped for the real library agree as promised, how fast
   is it (the median step time, the statistic chapter 08 teaches), and a reason that names the
   library and the failing step.
3. A quantization decision: count the bytes of quantized weights as chapter 11 does (`QArray`
   values at their bit width, plus scales), take each candidate's median accuracy, and choose
   the smallest one within the accuracy budget.

Nothing is trained here: the "training step" is a small NumPy function, the weights a few
arrays quantized once. Expected answers are computed here, in closed form, before the learner's
code runs; inputs are handed over as copies (`call_on_copies`).
"""

import copy
import functools
import math
import pathlib
import re
import statistics
import tempfile

import numpy as np

from stacklib import checkpoint as ocp
from stacklib.grading import Exercise, call_on_copies, expect, expect_close

# ---------------------------------------------------------------- 16.resume_and_verify

resume_and_verify = Exercise("16.resume_and_verify", "Resume from the latest checkpoint, verify bit for bit")


def _train_step(state, step):
    """One deterministic "training step": the learning rate decays with `step` (1-based)."""
    w = np.asarray(state["w"], np.float32)
    lr = np.float32(0.1 + 0.2 / step)
    grad = (w - np.float32(1.0)) * np.float32(2.0)  # the gradient of ‖w − 1‖²
    loss = float(np.sum((w - np.float32(1.0)) ** 2, dtype=np.float32))
    return {"w": (w - lr * grad).astype(np.float32), "count": state["count"] + 1}, loss


def _initial_state():
    return {"w": np.linspace(-1.0, 3.0, 6, dtype=np.float32), "count": np.array(0, np.int32)}


def _run(steps):
    """The uninterrupted run: the states after 0..steps steps and the loss of each step."""
    states, losses = [_initial_state()], []
    for step in range(1, steps + 1):
        state, loss = _train_step(states[-1], step)
        states.append(state)
        losses.append(loss)
    return states, losses


def _write_checkpoints(directory, states, saved_steps, perturb_step=None):
    """Save the state after each of `saved_steps` steps, as the training loop would."""
    with ocp.CheckpointManager(directory) as manager:
        for step in saved_steps:
            state = {k: np.array(v) for k, v in states[step].items()}
            if step == perturb_step:  # one float apart: a checkpoint that restored not quite its bytes
                state["w"][2] = np.nextafter(state["w"][2], np.float32(np.inf))
            manager.save(step, args=ocp.args.StandardSave(state))


_FOLDERS: list[tempfile.TemporaryDirectory] = []


@functools.cache
def _checkpoint_folder(total_steps, saved_steps, perturb_step):
    """A folder of checkpoints, written once per process and shared by the answers graded in it.

    Writing checkpoints (with their fsyncs) is the slow part of a case; an answer only reads them
    (one that saved into it would be wrong anyway). The folder is removed when the process exits.
    """
    folder = tempfile.TemporaryDirectory(prefix="stacklib-ch16-")
    _FOLDERS.append(folder)  # kept alive (and cleaned up) with the process
    _write_checkpoints(folder.name, _run(total_steps)[0], saved_steps, perturb_step)
    return folder.name


def _listing(directory):
    """Every file under `directory` with its size: what a reader must leave as it found it."""
    files = [path for path in pathlib.Path(directory).rglob("*") if path.is_file()]
    return sorted((str(path), path.stat().st_size) for path in files)


def _check_resume(fn, total_steps, saved_steps, expected, *, perturb_step=None, reference_change=None):
    """Run the learner's resume on a checkpoint folder; `expected` is (resumed_from, first_differing_step)."""
    _, losses = _run(total_steps)
    if reference_change is not None:  # the reference run's loss at one step differs
        step, factor = reference_change
        losses[step - 1] = float(np.float32(losses[step - 1]) * np.float32(factor))
    template = {k: np.zeros_like(v) for k, v in _initial_state().items()}
    directory = _checkpoint_folder(total_steps, tuple(saved_steps), perturb_step)
    before = _listing(directory)
    try:
        got = call_on_copies(fn, directory, _train_step, template, losses, what="resume_and_verify")
    finally:
        changed = _listing(directory) != before
        if changed:
            _checkpoint_folder.cache_clear()  # the next case writes a fresh folder
    expect(not changed, "your function changed the checkpoint folder (it saved, deleted or rewrote a "
                        "checkpoint): resuming to verify only reads the checkpoints")
    expect(isinstance(got, tuple) and len(got) == 2,
           f"return (resumed_from, first_differing_step), got {type(got).__name__} {got!r:.60}")
    expect(got[0] == expected[0] and isinstance(got[0], int | np.integer),
           f"checkpoints at steps {saved_steps}: expected to resume from step {expected[0]}, got {got[0]!r}")
    expect(got[1] == expected[1] and (got[1] is None) == (expected[1] is None),
           f"checkpoints at steps {saved_steps}, {total_steps} steps in all: expected the first differing "
           f"step to be {expected[1]!r}, got {got[1]!r}")


@resume_and_verify.case(points=2, hint="Open the folder with ocp.CheckpointManager and restore its latest "
                                       "step (manager.latest_step()), not the first one saved.")
def a_clean_resume_from_the_latest_checkpoint(fn):
    _check_resume(fn, 9, [2, 4, 6], (6, None))
    _check_resume(fn, 14, [4, 8, 12], (12, None))  # the latest by number: 12, not "8" (the last as text)


@resume_and_verify.case(points=2, hint="The checkpoint at step s holds the state after s steps: the next "
                                       "step to run is s + 1, and train_step takes that 1-based step number.")
def the_steps_after_the_checkpoint_are_numbered_from_it(fn):
    _check_resume(fn, 12, [3, 5], (5, None))


@resume_and_verify.case(points=3, hint="Compare with ==, bit for bit: a state one float away from the saved "
                                       "one gives losses that np.isclose calls equal.")
def a_state_one_float_off_is_caught_at_the_first_resumed_step(fn):
    _check_resume(fn, 9, [2, 4, 6], (6, 7), perturb_step=6)


@resume_and_verify.case(points=2, hint="Report the first step whose loss differs, counting steps from 1 as "
                                       "the losses list does (reference_losses[s - 1] is step s's loss).")
def a_later_difference_is_reported_at_its_own_step(fn):
    _check_resume(fn, 10, [4], (4, 8), reference_change=(8, 1.0 + 2 ** -20))
    _check_resume(fn, 10, [4], (4, 10), reference_change=(10, 1.0 + 2 ** -20))  # the last step counts too


@resume_and_verify.case(points=1, hint="Only the steps after the checkpoint are run again: a difference "
                                       "before it is not the resumed run's.")
def differences_before_the_checkpoint_are_not_looked_at(fn):
    _check_resume(fn, 10, [6], (6, None), reference_change=(3, 1.5))


@resume_and_verify.case(points=1, hint="A checkpoint at the last step leaves nothing to run: nothing can "
                                       "differ.")
def a_checkpoint_at_the_last_step_leaves_nothing_to_run(fn):
    _check_resume(fn, 6, [3, 6], (6, None))


# ---------------------------------------------------------------- 16.swap_report

swap_report = Exercise("16.swap_report", "A swapped component's verdict, its speed, and the reason")

# stacklib.capstone.swap.REAL, written out: importing the swap program would cost the grader seconds.
# tests/test_cases_ch16.py checks that the two agree.
REAL = {"data": "grain", "modules": "flax", "optimizer": "optax", "checkpoint": "orbax",
        "quantization": "qwix"}


def _first_disagreement(ours, theirs, rtol):
    """The 1-based step of the first loss out of tolerance, or None."""
    for step, (o, t) in enumerate(zip(ours, theirs, strict=True), start=1):
        if abs(t - o) > rtol * abs(o):
            return step
    return None


def _expected_report(component, ours, theirs, rtol):
    if list(ours["losses"]) == list(theirs["losses"]):
        verdict = "bitwise"
    elif _first_disagreement(ours["losses"], theirs["losses"], rtol) is None:
        verdict = "within tolerance"
    else:
        verdict = "disagrees"
    ratio = statistics.median(theirs["step_seconds"][1:]) / statistics.median(ours["step_seconds"][1:])
    return verdict, ratio, _first_disagreement(ours["losses"], theirs["losses"], rtol)


def _report(fn, component, ours, theirs, rtol):
    got = call_on_copies(fn, component, ours, theirs, rtol, what="swap_report")
    expect(isinstance(got, tuple) and len(got) == 3,
           f"return (verdict, ratio, reason), got {type(got).__name__}")
    return got, _expected_report(component, ours, theirs, rtol)


def _check_verdict(fn, component, ours, theirs, rtol):
    (verdict, _, _), (expected, _, _) = _report(fn, component, ours, theirs, rtol)
    expect(verdict == expected, f"the verdict: expected {expected!r}, got {verdict!r} (rtol={rtol})")


def _check_ratio(fn, ours_seconds, theirs_seconds):
    ours = {"losses": [1.0], "step_seconds": ours_seconds}
    theirs = {"losses": [1.0], "step_seconds": theirs_seconds}
    (_, ratio, _), (_, expected, _) = _report(fn, "optimizer", ours, theirs, 1e-5)
    expect(isinstance(ratio, float), f"the ratio: return a float, got {type(ratio).__name__}")
    expect_close(ratio, expected, rtol=1e-9, atol=0, what="the step-time ratio theirs / ours")


def _step_mentions(reason):
    return [int(n) for n in re.findall(r"\bsteps? (\d+)\b", reason.lower())]


def _check_reason(fn, component, ours, theirs, rtol):
    (_, _, reason), (verdict, _, first) = _report(fn, component, ours, theirs, rtol)
    expect(isinstance(reason, str) and reason.strip(), f"the reason: expected a sentence, got {reason!r:.60}")
    library = REAL[component]
    expect(re.search(rf"\b{library}\b", reason.lower()) is not None,
           f"the reason {reason!r:.120} does not name {library!r}, the library swapped in for {component!r}")
    if verdict == "disagrees":
        steps = _step_mentions(reason)
        expect(steps == [first], f"the reason {reason!r:.120} should name the first step out of tolerance, "
                                 f"as 'step N', and no other step; it names {steps or 'none'}")


_OURS = [6.3615980, 6.6454873, 5.8482022, 5.3107419, 5.0511250, 4.8412743, 4.7301006, 4.6549153]
_SECONDS = [2.1, 0.0110, 0.0112, 0.0109, 0.0111, 0.0110, 0.0112, 0.0110]


def _run_pair(ours_losses, theirs_losses, ours_seconds=_SECONDS, theirs_seconds=_SECONDS):
    return ({"losses": list(ours_losses), "step_seconds": list(ours_seconds)},
            {"losses": list(theirs_losses), "step_seconds": list(theirs_seconds)})


@swap_report.case(points=1, hint="Equal with == at every step is 'bitwise', and only then.")
def identical_losses_are_bitwise_and_one_float_apart_is_not(fn):
    _check_verdict(fn, "data", *_run_pair(_OURS, _OURS), 1e-5)
    theirs = list(_OURS)
    theirs[5] = math.nextafter(theirs[5], math.inf)
    _check_verdict(fn, "data", *_run_pair(_OURS, theirs), 1e-5)


@swap_report.case(points=2, hint="The tolerance is relative to our loss at that step (rtol · |ours|), with "
                                 "no absolute slack, and a difference equal to it is within.")
def the_tolerance_is_relative_to_ours_and_inclusive(fn):
    _check_verdict(fn, "optimizer", *_run_pair([4.0, 2.0, 8.0], [3.62, 2.0, 8.0]), 0.1)  # 0.38 <= 0.4
    _check_verdict(fn, "optimizer", *_run_pair([4.0, 2.0, 8.0], [5.0, 2.0, 8.0]), 0.25)  # exactly 1.0
    _check_verdict(fn, "optimizer", *_run_pair([4.0, 3.0], [4.0 + 1e-8, 3.0]), 1e-9)    # 1e-8 > 4e-9


@swap_report.case(points=2, hint="One step out of tolerance, wherever it is, makes the swap disagree: not "
                                 "the last step, the mean or a majority.")
def one_step_out_of_tolerance_among_many_disagrees(fn):
    ours = [6.0 - 0.03 * step for step in range(64)]
    theirs = list(ours)
    theirs[40] *= 1 + 1.2e-5
    _check_verdict(fn, "modules", *_run_pair(ours, theirs), 1e-5)


@swap_report.case(points=2, hint="The typical step time of a run is the median of its steps after the first "
                                 "(which compiles); the ratio is theirs over ours.")
def the_ratio_is_of_medians_without_the_first_step(fn):
    _check_ratio(fn, [2.5, 0.010, 0.011, 0.012], [0.9, 0.020, 0.021, 0.022])
    _check_ratio(fn, [0.004, 0.010, 0.012, 0.011], [0.004, 0.020, 0.020, 0.020])  # a quick first step


@swap_report.case(points=2, hint="Not the fastest step: a run's fastest step is luck, its median is what "
                                 "it typically takes. One stalled step must not move it either.")
def the_median_not_the_fastest_nor_the_mean(fn):
    _check_ratio(fn, [1.0, 0.010, 0.014, 0.014, 0.500, 0.014], [1.0, 0.012, 0.012, 0.013, 0.013, 0.013])


@swap_report.case(points=1, hint="With an even number of steps the median is the mean of the middle two "
                                 "(statistics.median); each run's median on its own, then their ratio.")
def even_counts_and_unpaired_steps(fn):
    _check_ratio(fn, [3.0, 0.010, 0.010, 0.010, 0.010], [2.0, 0.020, 0.024, 0.022, 0.026])
    _check_ratio(fn, [1.0, 0.010, 0.012, 0.014], [1.0, 0.012, 0.016, 0.014])


@swap_report.case(points=2, hint="The reason names the library that was swapped in (REAL[component]), so a "
                                 "reader of the table knows which swap it is about.")
def the_reason_names_the_library(fn):
    for component in ("checkpoint", "quantization"):
        _check_reason(fn, component, *_run_pair(_OURS, _OURS), 1e-5)


@swap_report.case(points=2, hint="When the swap disagrees, the reason names the first step out of tolerance "
                                 "as 'step N', counting steps from 1.")
def the_reason_names_the_first_failing_step(fn):
    theirs = list(_OURS)
    theirs[3] += 0.01   # step 4
    theirs[6] += 0.02   # step 7, later
    _check_reason(fn, "optimizer", *_run_pair(_OURS, theirs), 1e-5)
    ours = [6.0 - 0.03 * step for step in range(64)]
    theirs = list(ours)
    theirs[0] += 0.5    # step 1: the first step is a step too
    _check_reason(fn, "modules", *_run_pair(ours, theirs), 1e-5)


# ---------------------------------------------------------------- 16.quantization_choice

quantization_choice = Exercise("16.quantization_choice", "A quantization chosen by accuracy and bytes")


@functools.lru_cache(maxsize=1)
def _weights():
    """One float32 layer and its quantized versions (chapter 11's QArray), built once per process."""
    import jax.numpy as jnp

    from stacklib.quant import qarray

    rng = np.random.default_rng(0)
    kernel = rng.standard_normal((48, 32)).astype(np.float32)
    bias = rng.standard_normal(32).astype(np.float32)
    return {
        "float32": {"kernel": kernel, "bias": bias},
        "bfloat16": {"kernel": np.asarray(jnp.asarray(kernel, jnp.bfloat16)), "bias": bias},
        "int8": {"kernel": qarray.quantize(kernel, jnp.int8, channelwise_axes=(1,)), "bias": bias},
        "int8-minmax": {"kernel": qarray.quantize(kernel, jnp.int8, channelwise_axes=(1,),
                                                  calibration_method="minmax"), "bias": bias},
        "int4": {"kernel": qarray.quantize(kernel, jnp.int4, channelwise_axes=(1,)), "bias": bias},
        "int4-tiled": {"kernel": qarray.quantize(kernel, jnp.int4, channelwise_axes=(1,), tiled_axes={0: 16}),
                       "bias": bias},
    }


def _bytes(params) -> int:
    """What chapter 11 counts: a QArray's `nbytes` (int4 packs two values per byte, scales and zero
    points included), a float array's size × itemsize."""
    from stacklib.quant.qarray import QArray

    total = 0
    for leaf in params.values():
        total += leaf.nbytes if isinstance(leaf, QArray) else leaf.size * leaf.dtype.itemsize
    return total


def _choice(candidates, baseline, max_drop):
    typical = {name: statistics.median(c["accuracy"]) for name, c in candidates.items()}
    size = {name: _bytes(c["params"]) for name, c in candidates.items()}
    acceptable = [name for name in candidates if typical[baseline] - typical[name] <= max_drop]
    return min(acceptable, key=lambda name: (size[name], -typical[name], name)), size


def _candidates(accuracies):
    weights = _weights()
    return {name: {"params": weights[name], "accuracy": list(runs)} for name, runs in accuracies.items()}


def _check_choice(fn, accuracies, max_drop, *, check_reason=False):
    candidates = _candidates(accuracies)
    expected, size = _choice(candidates, "float32", max_drop)
    # A copy by hand, not call_on_copies: its comparison does not know QArray. The accuracy lists are
    # what an answer might sort in place, so those are compared.
    given = copy.deepcopy(candidates)
    got = fn(given, "float32", max_drop)
    changed = [name for name in candidates if given[name]["accuracy"] != candidates[name]["accuracy"]]
    expect(not changed, f"quantization_choice changed the accuracy list of {changed[0]!r} in place (sorted "
                        "it?): the caller's data must stay as it was; use sorted() or statistics.median"
           if changed else "")
    expect(isinstance(got, tuple) and len(got) == 2, f"return (name, reason), got {type(got).__name__}")
    name, reason = got
    expect(name == expected, f"with a budget of {max_drop} points: expected {expected!r}, got {name!r}")
    if check_reason:
        expect(isinstance(reason, str) and reason.strip(),
               f"the reason: expected a sentence, got {reason!r:.60}")
        plain = reason.replace(",", "").replace("_", "")  # "1,344 bytes" and "1344 bytes" both count
        expect(expected in reason and re.search(rf"\b{size[expected]}\b", plain) is not None,
               f"the reason {reason!r:.120} should name the chosen candidate {expected!r} and its size in "
               "bytes (an integer)")


_ALL_GOOD = {"float32": [91.0, 91.2, 90.8], "bfloat16": [91.0, 91.1, 90.9], "int8": [90.9, 91.0, 90.7],
             "int8-minmax": [90.9, 91.1, 90.8], "int4": [90.5, 90.8, 90.6], "int4-tiled": [90.7, 90.6, 90.9]}


@quantization_choice.case(points=2, hint="Count a QArray's bytes with its nbytes: an int4 value takes half a "
                                         "byte (two pack into one), and the scales count too.")
def int4_is_half_the_bytes_of_int8(fn):
    _check_choice(fn, _ALL_GOOD, 2.0)
    _check_choice(fn, dict(_ALL_GOOD, int4=[85.0, 85.0, 85.0]), 2.0)  # int4 per channel out of budget


@quantization_choice.case(points=2, hint="Per-channel scales cost less than one scale per tile of 16: count "
                                         "every scale (and a zero point, where minmax calibration has one).")
def scales_and_zero_points_count(fn):
    accuracies = dict(_ALL_GOOD, **{"int4": [85.0] * 3, "int4-tiled": [88.0] * 3,  # int4 out of budget
                                     "int8-minmax": [91.1, 91.0, 91.0]})  # more accurate, 32 bytes bigger
    _check_choice(fn, accuracies, 2.0)


@quantization_choice.case(points=2, hint="Judge each candidate by the median of its runs, the baseline too: "
                                         "not its best run, its first or its mean.")
def the_median_run_decides(fn):
    accuracies = dict(_ALL_GOOD, **{"int4": [91.0, 86.0, 86.5], "int4-tiled": [84.0, 89.5, 89.9],
                                     "int8": [89.4, 89.6, 99.0]})
    _check_choice(fn, accuracies, 1.5)


@quantization_choice.case(points=2, hint="A drop equal to the budget is within it ('at most max_drop "
                                         "points').")
def a_drop_equal_to_the_budget_is_accepted(fn):
    accuracies = {"float32": [90.0, 90.0, 90.0], "bfloat16": [90.0, 90.0, 90.0], "int8": [89.0, 89.0, 89.0],
                  "int8-minmax": [88.0, 88.0, 88.0], "int4": [88.75, 88.75, 88.75], "int4-tiled": [80.0] * 3}
    _check_choice(fn, accuracies, 1.25)


@quantization_choice.case(points=1, hint="When every smaller candidate is out of budget, the baseline itself "
                                         "is the answer.")
def nothing_within_budget_keeps_the_baseline(fn):
    accuracies = {"float32": [91.0, 91.0, 91.0], "bfloat16": [80.0, 80.0, 80.0], "int8": [70.0, 70.0, 70.0]}
    _check_choice(fn, accuracies, 0.5)


@quantization_choice.case(points=2, hint="The reason names the candidate chosen and its size in bytes.")
def the_reason_names_the_choice_and_its_bytes(fn):
    _check_choice(fn, _ALL_GOOD, 2.0, check_reason=True)
    _check_choice(fn, dict(_ALL_GOOD, int4=[85.0, 85.0, 85.0]), 2.0, check_reason=True)
