"""The grader on the book's solution notebooks: each scores full marks and runs without an error.

`make test` executes solutions/ only through the grader (not nbval as well): the grader runs
every cell in a fresh kernel and notes any error, so a failing cell fails here, with the
scores as well. One test per notebook, so a failure names it.
"""

import pytest
from conftest import notebooks

from stacklib.grading.instructor import grade_notebook

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("path", notebooks("solutions"), ids=lambda p: p.name)
def test_the_solution_notebook_scores_full_marks_without_an_error(path):
    grade = grade_notebook(path, time_limit_s=600)
    assert grade.possible > 0 and grade.total == grade.possible, grade.points
    assert grade.notes == []
