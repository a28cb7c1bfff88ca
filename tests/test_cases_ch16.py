"""Chapter 16's exercise cases: right answers score full marks, planted wrong ones lose points."""

import statistics

import jax
import numpy as np
import pytest

from stacklib import checkpoint as ocp
from stacklib.cases import ch16
from stacklib.grading import grade
from stacklib.quant.qarray import QArray

# ---------------------------------------------------------------- right answers


def resume_and_verify(directory, train_step, state_template, reference_losses):
    manager = ocp.CheckpointManager(directory)
    resumed_from = manager.latest_step()
    state = manager.restore(resumed_from, args=ocp.args.StandardRestore(state_template))
    for step in range(resumed_from + 1, len(reference_losses) + 1):
        state, loss = train_step(state, step)
        if loss != reference_losses[step - 1]:
            return resumed_from, step
    return resumed_from, None


REAL = {"data": "grain", "modules": "flax", "optimizer": "optax", "checkpoint": "orbax",
        "quantization": "qwix"}


def _first_out(ours, theirs, rtol):
    return next((step for step, (o, t) in enumerate(zip(ours, theirs, strict=True), start=1)
                 if abs(t - o) > rtol * abs(o)), None)


def swap_report(component, ours, theirs, rtol):
    first = _first_out(ours["losses"], theirs["losses"], rtol)
    if list(ours["losses"]) == list(theirs["losses"]):
        verdict = "bitwise"
    else:
        verdict = "within tolerance" if first is None else "disagrees"
    ratio = statistics.median(theirs["step_seconds"][1:]) / statistics.median(ours["step_seconds"][1:])
    library = REAL[component]
    if verdict == "disagrees":
        reason = f"{library} disagrees with ours from step {first} on (rtol {rtol})"
    else:
        reason = f"{library} agrees with ours: {verdict}"
    return verdict, float(ratio), reason


def weight_bytes(params):
    leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, QArray))
    return sum(leaf.nbytes if isinstance(leaf, QArray) else leaf.size * leaf.dtype.itemsize
               for leaf in leaves)


def quantization_choice(candidates, baseline, max_drop):
    typical = {name: statistics.median(c["accuracy"]) for name, c in candidates.items()}
    size = {name: weight_bytes(c["params"]) for name, c in candidates.items()}
    acceptable = [name for name in candidates if typical[baseline] - typical[name] <= max_drop]
    best = min(acceptable, key=lambda name: size[name])
    return best, f"{best}: {size[best]} bytes, median accuracy {typical[best]:.1f}%"


RIGHT = {"16.resume_and_verify": resume_and_verify, "16.swap_report": swap_report,
         "16.quantization_choice": quantization_choice}


@pytest.mark.parametrize("exercise_id", sorted(RIGHT))
def test_a_right_answer_scores_full_marks(exercise_id):
    result = grade(exercise_id, RIGHT[exercise_id])
    assert result.points == result.max_points, [c.message for c in result.cases]


def test_the_cases_know_the_swap_programs_libraries():
    from stacklib.capstone import swap

    assert ch16.REAL == swap.REAL


# ---------------------------------------------------------------- planted wrong answers: 16.resume_and_verify


def _restore(directory, step, template):
    return ocp.CheckpointManager(directory).restore(step, args=ocp.args.StandardRestore(template))


def _verify_from(step0, state, train_step, reference_losses, equal=lambda a, b: a == b, number=lambda s: s):
    for step in range(step0 + 1, len(reference_losses) + 1):
        state, loss = train_step(state, number(step))
        if not equal(loss, reference_losses[step - 1]):
            return step0, step
    return step0, None


def resumes_from_the_first_checkpoint(directory, train_step, state_template, reference_losses):
    first = ocp.CheckpointManager(directory).all_steps()[0]
    return _verify_from(first, _restore(directory, first, state_template), train_step, reference_losses)


def compares_with_isclose(directory, train_step, state_template, reference_losses):  # not bit for bit
    latest = ocp.CheckpointManager(directory).latest_step()
    return _verify_from(latest, _restore(directory, latest, state_template), train_step, reference_losses,
                        equal=lambda a, b: np.isclose(a, b))


def zero_based_steps(directory, train_step, state_template, reference_losses):  # train_step(state, s − 1)
    latest = ocp.CheckpointManager(directory).latest_step()
    return _verify_from(latest, _restore(directory, latest, state_template), train_step, reference_losses,
                        number=lambda s: max(s - 1, 1))


def reruns_the_checkpoint_step(directory, train_step, state_template, reference_losses):  # from s, not s + 1
    latest = ocp.CheckpointManager(directory).latest_step()
    return _verify_from(latest - 1, _restore(directory, latest, state_template), train_step,
                        reference_losses)[0] + 1, None


def compares_the_last_loss_only(directory, train_step, state_template, reference_losses):
    latest = ocp.CheckpointManager(directory).latest_step()
    state, loss = _restore(directory, latest, state_template), None
    for step in range(latest + 1, len(reference_losses) + 1):
        state, loss = train_step(state, step)
    return latest, (None if loss is None or loss == reference_losses[-1] else len(reference_losses))


def reports_the_zero_based_index(directory, train_step, state_template, reference_losses):
    resumed, first = resume_and_verify(directory, train_step, state_template, reference_losses)
    return resumed, None if first is None else first - 1


def reports_the_resume_step_on_any_difference(directory, train_step, state_template, reference_losses):
    resumed, first = resume_and_verify(directory, train_step, state_template, reference_losses)
    return resumed, None if first is None else resumed + 1


def misaligned_comparison(directory, train_step, state_template, reference_losses):  # resumed[i] vs ref[i]
    latest = ocp.CheckpointManager(directory).latest_step()
    state, resumed = _restore(directory, latest, state_template), []
    for step in range(latest + 1, len(reference_losses) + 1):
        state, loss = train_step(state, step)
        resumed.append(loss)
    first = next((i for i, (a, b) in enumerate(zip(resumed, reference_losses, strict=False)) if a != b), None)
    return latest, None if first is None else latest + 1 + first


def returns_a_bool(directory, train_step, state_template, reference_losses):  # "verified or not"
    resumed, first = resume_and_verify(directory, train_step, state_template, reference_losses)
    return resumed, first is None


def latest_by_text(directory, train_step, state_template, reference_losses):
    steps = sorted(ocp.CheckpointManager(directory).all_steps(), key=str)  # as strings: "10" < "2"
    latest = steps[-1]
    return _verify_from(latest, _restore(directory, latest, state_template), train_step, reference_losses)


def one_step_short(directory, train_step, state_template, reference_losses):  # range(s + 1, N): no last step
    latest = ocp.CheckpointManager(directory).latest_step()
    state = _restore(directory, latest, state_template)
    return _verify_from(latest, state, train_step, reference_losses[:-1])


def saves_what_it_resumed(directory, train_step, state_template, reference_losses):  # writes while verifying
    result = resume_and_verify(directory, train_step, state_template, reference_losses)
    with ocp.CheckpointManager(directory) as manager:
        state = manager.restore(manager.latest_step(), args=ocp.args.StandardRestore(state_template))
        manager.save(len(reference_losses) + 1, args=ocp.args.StandardSave(state))
    return result


# ---------------------------------------------------------------- planted wrong answers: 16.swap_report


def _verdict_and_ratio(ours, theirs, rtol):
    verdict, ratio, _ = swap_report("data", ours, theirs, rtol)
    return verdict, ratio


def fastest_step_ratio(component, ours, theirs, rtol):  # min, not the median
    verdict, _, reason = swap_report(component, ours, theirs, rtol)
    return verdict, float(min(theirs["step_seconds"][1:]) / min(ours["step_seconds"][1:])), reason


def mean_step_ratio(component, ours, theirs, rtol):
    verdict, _, reason = swap_report(component, ours, theirs, rtol)
    ratio = statistics.mean(theirs["step_seconds"][1:]) / statistics.mean(ours["step_seconds"][1:])
    return verdict, float(ratio), reason


def keeps_the_compiling_step(component, ours, theirs, rtol):
    verdict, _, reason = swap_report(component, ours, theirs, rtol)
    ratio = statistics.median(theirs["step_seconds"]) / statistics.median(ours["step_seconds"])
    return verdict, float(ratio), reason


def any_reason_will_do(component, ours, theirs, rtol):  # free text that names nothing
    verdict, ratio, _ = swap_report(component, ours, theirs, rtol)
    return verdict, ratio, "the swap was checked"


def names_the_component_not_the_library(component, ours, theirs, rtol):
    verdict, ratio, reason = swap_report(component, ours, theirs, rtol)
    return verdict, ratio, reason.replace(REAL[component], component)


def zero_based_step_in_the_reason(component, ours, theirs, rtol):
    verdict, ratio, reason = swap_report(component, ours, theirs, rtol)
    first = _first_out(ours["losses"], theirs["losses"], rtol)
    return verdict, ratio, reason if first is None else reason.replace(f"step {first}", f"step {first - 1}")


def lists_every_failing_step(component, ours, theirs, rtol):  # names the answer among others
    verdict, ratio, _ = swap_report(component, ours, theirs, rtol)
    failing = [s for s in range(1, len(ours["losses"]) + 1)
               if abs(theirs["losses"][s - 1] - ours["losses"][s - 1]) > rtol * abs(ours["losses"][s - 1])]
    return verdict, ratio, f"{REAL[component]}: " + ", ".join(f"step {s}" for s in failing)


def allclose_verdict(component, ours, theirs, rtol):  # np.allclose adds atol=1e-8
    _, ratio, reason = swap_report(component, ours, theirs, rtol)
    if list(ours["losses"]) == list(theirs["losses"]):
        return "bitwise", ratio, reason
    ok = np.allclose(theirs["losses"], ours["losses"], rtol=rtol)
    return ("within tolerance" if ok else "disagrees"), ratio, reason


def mean_difference_verdict(component, ours, theirs, rtol):
    _, ratio, reason = swap_report(component, ours, theirs, rtol)
    if list(ours["losses"]) == list(theirs["losses"]):
        return "bitwise", ratio, reason
    mean = statistics.mean(abs(t - o) / abs(o) for o, t in zip(ours["losses"], theirs["losses"], strict=True))
    return ("within tolerance" if mean <= rtol else "disagrees"), ratio, reason


def bitwise_when_close(component, ours, theirs, rtol):  # "equal" as within 1e-12
    verdict, ratio, reason = swap_report(component, ours, theirs, rtol)
    close = all(abs(t - o) < 1e-12 for o, t in zip(ours["losses"], theirs["losses"], strict=True))
    return ("bitwise" if close else verdict), ratio, reason


def ratio_inverted(component, ours, theirs, rtol):
    verdict, ratio, reason = swap_report(component, ours, theirs, rtol)
    return verdict, 1.0 / ratio, reason


def relative_to_theirs(component, ours, theirs, rtol):
    _, ratio, reason = swap_report(component, ours, theirs, rtol)
    if list(ours["losses"]) == list(theirs["losses"]):
        return "bitwise", ratio, reason
    ok = all(abs(t - o) <= rtol * abs(t) for o, t in zip(ours["losses"], theirs["losses"], strict=True))
    return ("within tolerance" if ok else "disagrees"), ratio, reason


# ------------------------------------------------------- planted wrong answers: 16.quantization_choice


def _choose(candidates, baseline, max_drop, *, size, typical=statistics.median, within=lambda d, m: d <= m):
    acc = {name: typical(c["accuracy"]) for name, c in candidates.items()}
    sizes = {name: size(c["params"]) for name, c in candidates.items()}
    acceptable = [name for name in candidates if within(acc[baseline] - acc[name], max_drop)]
    best = min(acceptable, key=lambda name: (sizes[name], -acc[name]))
    return best, f"{best}: {sizes[best]} bytes"


def every_leafs_nbytes(candidates, baseline, max_drop):  # jax.tree.leaves opens a QArray: int4 at a byte
    return _choose(candidates, baseline, max_drop,
                   size=lambda p: sum(leaf.nbytes for leaf in jax.tree.leaves(p)))


def values_only(candidates, baseline, max_drop):  # a QArray's qvalue, without its scales
    return _choose(candidates, baseline, max_drop, size=lambda p: sum(
        (leaf.qvalue.size * (4 if "int4" in str(leaf.qvalue.dtype) else 8) // 8) if isinstance(leaf, QArray)
        else leaf.nbytes for leaf in jax.tree.leaves(p, is_leaf=lambda x: isinstance(x, QArray))))


def best_run(candidates, baseline, max_drop):
    return _choose(candidates, baseline, max_drop, size=weight_bytes, typical=max)


def mean_run(candidates, baseline, max_drop):
    return _choose(candidates, baseline, max_drop, size=weight_bytes, typical=statistics.mean)


def first_run(candidates, baseline, max_drop):
    return _choose(candidates, baseline, max_drop, size=weight_bytes, typical=lambda runs: runs[0])


def strictly_within(candidates, baseline, max_drop):  # < where the statement says at most
    return _choose(candidates, baseline, max_drop, size=weight_bytes, within=lambda d, m: d < m)


def most_accurate(candidates, baseline, max_drop):  # ignores bytes
    acc = {name: statistics.median(c["accuracy"]) for name, c in candidates.items()}
    best = max(acc, key=acc.get)
    return best, f"{best}: {weight_bytes(candidates[best]['params'])} bytes"


def sorts_in_place(candidates, baseline, max_drop):  # the median by sorting the caller's list
    for c in candidates.values():
        c["accuracy"].sort()
    return quantization_choice(candidates, baseline, max_drop)


def reason_without_bytes(candidates, baseline, max_drop):  # free text that names the choice only
    best, _ = quantization_choice(candidates, baseline, max_drop)
    return best, f"{best} is the smallest within budget"


def reason_in_kilobytes(candidates, baseline, max_drop):
    best, _ = quantization_choice(candidates, baseline, max_drop)
    return best, f"{best}: {weight_bytes(candidates[best]['params']) / 1024:.1f} KiB"


def itemsize_of_the_scale(candidates, baseline, max_drop):  # a QArray's size × its dtype (the scale's)
    return _choose(candidates, baseline, max_drop, size=lambda p: sum(
        leaf.qvalue.size * leaf.dtype.itemsize if isinstance(leaf, QArray) else leaf.nbytes
        for leaf in jax.tree.leaves(p, is_leaf=lambda x: isinstance(x, QArray))))


# (exercise, planted wrong answer, points it keeps, why)
WRONG = [
    ("16.resume_and_verify", resumes_from_the_first_checkpoint, 3, "resumes from the first checkpoint"),
    ("16.resume_and_verify", compares_with_isclose, 6, "np.isclose, not =="),
    ("16.resume_and_verify", zero_based_steps, 4, "train_step given 0-based steps"),
    ("16.resume_and_verify", reruns_the_checkpoint_step, 6, "never verifies"),
    ("16.resume_and_verify", compares_the_last_loss_only, 6, "the last loss only"),
    ("16.resume_and_verify", reports_the_zero_based_index, 6, "the first differing index, 0-based"),
    ("16.resume_and_verify", reports_the_resume_step_on_any_difference, 9, "s + 1 whenever anything differs"),
    ("16.resume_and_verify", misaligned_comparison, 4, "resumed losses compared from the list's start"),
    ("16.resume_and_verify", returns_a_bool, 0, "a bool, not the step"),
    ("16.resume_and_verify", latest_by_text, 9, "the latest step by string order"),
    ("16.resume_and_verify", one_step_short, 9, "the last step left out"),
    ("16.resume_and_verify", saves_what_it_resumed, 0, "saves into the folder it verifies"),
    ("16.swap_report", fastest_step_ratio, 9, "the fastest step, not the median"),
    ("16.swap_report", mean_step_ratio, 12, "the mean step time"),
    ("16.swap_report", keeps_the_compiling_step, 11, "the compiling first step kept"),
    ("16.swap_report", any_reason_will_do, 10, "a reason that names nothing"),
    ("16.swap_report", names_the_component_not_the_library, 10, "names the component, not the library"),
    ("16.swap_report", zero_based_step_in_the_reason, 12, "the first failing step 0-based"),
    ("16.swap_report", lists_every_failing_step, 12, "lists every failing step"),
    ("16.swap_report", allclose_verdict, 12, "np.allclose's atol"),
    ("16.swap_report", mean_difference_verdict, 12, "the mean relative difference"),
    ("16.swap_report", bitwise_when_close, 13, "bitwise when within 1e-12"),
    ("16.swap_report", ratio_inverted, 9, "ours over theirs"),
    ("16.swap_report", relative_to_theirs, 12, "relative to theirs"),
    ("16.quantization_choice", every_leafs_nbytes, 3, "int4 counted a byte per value"),
    ("16.quantization_choice", values_only, 5, "scales not counted"),
    ("16.quantization_choice", best_run, 9, "each candidate's best run"),
    ("16.quantization_choice", mean_run, 9, "the mean run"),
    ("16.quantization_choice", first_run, 9, "the first run"),
    ("16.quantization_choice", strictly_within, 7, "< where the statement says at most"),
    ("16.quantization_choice", most_accurate, 1, "the most accurate, whatever its bytes"),
    ("16.quantization_choice", sorts_in_place, 3, "sorts the caller's accuracy lists"),
    ("16.quantization_choice", reason_without_bytes, 9, "a reason without the bytes"),
    ("16.quantization_choice", reason_in_kilobytes, 9, "the size in KiB"),
    ("16.quantization_choice", itemsize_of_the_scale, 1, "a QArray counted at its scale's itemsize"),
]


@pytest.mark.parametrize("exercise_id, answer, points, why", WRONG, ids=[w[3] for w in WRONG])
def test_a_planted_wrong_answer_loses_points(exercise_id, answer, points, why):
    result = grade(exercise_id, answer)
    assert result.points == points, [(c.name, c.status, c.message) for c in result.cases]
    assert result.points < result.max_points
