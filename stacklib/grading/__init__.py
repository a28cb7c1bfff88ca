"""Graded exercises: cases, `check` in notebooks, exercise generation, instructor grading.

The learner calls `check("00.softmax", softmax)` in an exercise notebook. The author of a
chapter registers cases in `stacklib/cases/chNN.py` with `Exercise` and the `expect_*`
helpers. Instructors run `python -m stacklib.grading grade FOLDER`.
"""

from stacklib.grading.expect import (
    CaseFailure,
    call_on_copies,
    expect,
    expect_close,
    expect_equal,
    expect_gradient,
    expect_instance,
    expect_mentions,
    expect_same_across_processes,
    expect_same_sequence,
    expect_sharding,
    first_difference,
    forbidding,
    numerical_gradient,
    seeded_permutation,
)
from stacklib.grading.report import check
from stacklib.grading.runner import (
    Exercise,
    ExerciseResult,
    UnknownExerciseError,
    exercises_of_chapter,
    get_exercise,
    grade,
)

__all__ = [
    "CaseFailure",
    "Exercise",
    "ExerciseResult",
    "UnknownExerciseError",
    "call_on_copies",
    "check",
    "exercises_of_chapter",
    "expect",
    "expect_close",
    "expect_equal",
    "expect_gradient",
    "expect_instance",
    "expect_mentions",
    "expect_same_across_processes",
    "expect_same_sequence",
    "expect_sharding",
    "first_difference",
    "forbidding",
    "get_exercise",
    "grade",
    "numerical_gradient",
    "seeded_permutation",
]
