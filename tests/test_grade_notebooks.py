"""The grader on the book's own notebooks: solutions score full marks, exercises score zero."""

import pytest
from conftest import ROOT, notebooks

from stacklib.grading.instructor import grade_folder

pytestmark = pytest.mark.slow


def test_every_solution_notebook_scores_full_marks():
    grades = grade_folder(ROOT / "solutions", time_limit_s=600)
    assert len(grades) == len(notebooks("solutions"))
    for grade in grades:
        assert grade.possible > 0 and grade.total == grade.possible, (grade.notebook, grade.points)
        assert grade.notes == [], (grade.notebook, grade.notes)


def test_untouched_exercise_notebooks_score_zero_and_run_to_the_end():
    grades = grade_folder(ROOT / "exercises", time_limit_s=600)
    assert len(grades) == len(notebooks("exercises"))
    for grade in grades:
        assert grade.possible > 0 and grade.total == 0, (grade.notebook, grade.points)
        # No errors and no missing checks: every check cell ran and reported.
        assert grade.notes == [], (grade.notebook, grade.notes)
