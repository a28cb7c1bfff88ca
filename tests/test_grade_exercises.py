"""The grader on the untouched exercise notebooks: each scores zero and still runs to the end.

`make test` executes exercises/ only through the grader (not nbval as well): the grader runs
every cell in a fresh kernel and notes any error or any check that never reported. One test
per notebook, so a failure names it.
"""

import pytest
from conftest import notebooks

from stacklib.grading.instructor import grade_notebook

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("path", notebooks("exercises"), ids=lambda p: p.name)
def test_the_untouched_exercise_notebook_scores_zero_and_runs_to_the_end(path):
    grade = grade_notebook(path, time_limit_s=600)
    assert grade.possible > 0 and grade.total == 0, grade.points
    assert grade.notes == []  # no errors and no missing checks: every check cell ran and reported
