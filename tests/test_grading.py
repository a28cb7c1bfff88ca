"""stacklib.grading: assertions, the case runner, check's report, stripping, instructor grading."""

import signal
import sys
import time
import warnings

import nbformat
import numpy as np
import pytest

from stacklib.grading import (
    CaseFailure,
    Exercise,
    UnknownExerciseError,
    check,
    expect,
    expect_close,
    expect_equal,
    expect_gradient,
    grade,
    numerical_gradient,
)
from stacklib.grading.expect import (
    as_in_another_process,
    call_on_copies,
    expect_instance,
    expect_mentions,
    expect_same_across_processes,
    expect_same_sequence,
    expect_sharding,
    first_difference,
    forbidding,
    seeded_permutation,
)
from stacklib.grading.instructor import grade_folder, write_score_tables
from stacklib.grading.report import GRADE_METADATA_KEY, format_html, format_text
from stacklib.grading.runner import ERROR, FAILED, NOT_IMPLEMENTED, PASSED, SKIPPED, TIMED_OUT
from stacklib.grading.strip import (
    SolutionMarkerError,
    stale_exercises,
    strip_source,
    write_exercises,
)

# A toy exercise for these tests; chapters 97 and 98 are reserved for the grader's own tests
# (the instructor's test below grades chapter 98 and expects this exercise alone there).
square = Exercise("98.square", "Square a number")


@square.case(points=2, hint="x * x")
def squares_three(fn):
    expect_close(fn(3.0), 9.0)


@square.case(time_limit_s=1.0)
def squares_an_array(fn):
    expect_close(fn(np.arange(3.0)), np.array([0.0, 1.0, 4.0]))


def statuses(result):
    return [case.status for case in result.cases]


# --- expect_close and friends --------------------------------------------------------------


def test_expect_close_accepts_equal_trees_within_tolerance():
    expect_close({"a": [np.ones(3), 2.0]}, {"a": [np.ones(3) + 1e-9, 2.0]})


def test_expect_close_names_the_path_of_a_structure_mismatch():
    with pytest.raises(CaseFailure, match=r"at \['a'\]\[1\]: expected an array or number, got list"):
        expect_close({"a": [1.0, [2.0]]}, {"a": [1.0, 2.0]})


def test_expect_close_names_missing_dict_keys():
    expected_message = r"expected dict with keys \['a', 'b'\], got dict with keys \['a'\]"
    with pytest.raises(CaseFailure, match=expected_message):
        expect_close({"a": 1.0}, {"a": 1.0, "b": 2.0})


def test_expect_close_reports_shapes():
    with pytest.raises(CaseFailure, match=r"expected shape \(3,\), got shape \(2, 3\)"):
        expect_close(np.ones((2, 3)), np.ones(3))


def test_expect_close_reports_the_worst_element_and_its_index():
    got = np.zeros((2, 3))
    got[1, 2] = 5.0
    with pytest.raises(CaseFailure, match=r"1 of 6 values differ .*worst at \[1, 2\]: expected 0, got 5"):
        expect_close(got, np.zeros((2, 3)))


def test_expect_close_treats_nan_as_a_mismatch_unless_expected():
    with pytest.raises(CaseFailure, match="got nan"):
        expect_close(np.array([1.0, np.nan]), np.array([1.0, 2.0]))
    expect_close(np.array([np.nan]), np.array([np.nan]))


def test_expect_equal_checks_dtypes():
    with pytest.raises(CaseFailure, match="expected dtype int32, got dtype int64"):
        expect_equal(np.array([1], np.int64), np.array([1], np.int32))


def test_a_dataclass_of_arrays_compares_field_by_field_and_its_copy_is_not_a_change():
    from stacklib.quant.qarray import QArray

    weights = QArray(np.ones((2, 3), np.int8), np.ones((2, 1), np.float32), None, np.int8)
    assert call_on_copies(lambda q: q.shape, weights) == (2, 3)  # an untouched copy is no change

    def doubles_the_scale_in_place(q):
        q.scale[...] *= 2  # the NumPy array inside the frozen dataclass

    with pytest.raises(CaseFailure, match="changed its input in place"):
        call_on_copies(doubles_the_scale_in_place, weights)
    with pytest.raises(CaseFailure, match=r"the result\.scale: 2 of 2 values differ"):
        expect_equal(QArray(weights.qvalue, 3 * weights.scale, None, np.int8), weights)


def test_in_another_process_only_salted_hashes_change():
    values = [("a", 1), "a", b"a", frozenset({"a"}), (1, 2), 7, 2.5, None]
    here = [hash(v) for v in values]
    with as_in_another_process():
        there = [hash(v) for v in values]
    assert [a != b for a, b in zip(here, there, strict=True)] == [True] * 4 + [False] * 4
    assert hash("a") == here[1]  # put back


def test_numerical_gradient_matches_an_analytic_gradient():
    x = np.array([0.3, -1.2, 2.0])
    np.testing.assert_allclose(numerical_gradient(lambda v: np.sum(np.sin(v) * v), x),
                               np.cos(x) * x + np.sin(x), rtol=1e-8)


def test_expect_gradient_catches_a_wrong_gradient():
    f = lambda v: np.sum(v**3)  # noqa: E731
    expect_gradient(lambda v: 3 * v**2, f, np.array([1.0, 2.0]))
    with pytest.raises(CaseFailure, match="the gradient"):
        expect_gradient(lambda v: 2 * v, f, np.array([1.0, 2.0]))


# --- running cases ---------------------------------------------------------------------------


def test_a_correct_answer_scores_full_marks():
    result = grade("98.square", lambda x: x * x)
    assert statuses(result) == [PASSED, PASSED] and (result.points, result.max_points) == (3, 3)


def test_a_wrong_answer_fails_with_the_difference_and_the_hint():
    result = grade("98.square", lambda x: x + x)
    assert statuses(result) == [FAILED, FAILED] and result.points == 0
    assert "expected 9, got 6" in result.cases[0].message
    assert "Hint: x * x" in result.cases[0].message


def test_a_stub_is_not_implemented_yet_rather_than_a_traceback():
    def stub(x):
        raise NotImplementedError

    for answer in (stub, None):
        result = grade("98.square", answer)
        assert statuses(result) == [NOT_IMPLEMENTED] * 2
        assert result.cases[0].message == "not implemented yet"


def test_an_exception_in_learner_code_is_reported_with_its_line():
    def broken(x):
        return x.nonexistent_attribute

    result = grade("98.square", broken)
    assert statuses(result) == [ERROR, ERROR]
    message = result.cases[0].message
    assert message.startswith("AttributeError:") and "in broken, line" in message
    assert "x.nonexistent_attribute" in message


def test_a_hanging_answer_is_stopped_at_the_time_limit():
    def hangs(x):
        if np.ndim(x) == 0:
            return x * x
        while True:
            try:
                sum(range(1000))
            except Exception:  # a learner's broad except must not swallow the stop
                pass

    result = grade("98.square", hangs)
    assert statuses(result) == [PASSED, TIMED_OUT]
    assert (result.points, result.cases[1].points) == (2, 0)
    assert "1 s time limit" in result.cases[1].message


def test_a_hanging_answer_is_stopped_outside_the_main_thread_too():
    import threading

    def hangs_on_arrays(x):
        if np.ndim(x) == 0:
            return x * x
        time.sleep(60)

    box = {}
    thread = threading.Thread(target=lambda: box.update(result=grade("98.square", hangs_on_arrays)))
    thread.start()
    thread.join(60)  # generous under load; the 1 s limit, not this join, is what stops the case
    assert not thread.is_alive()
    assert statuses(box["result"])[1] == TIMED_OUT


# --- what a learner's code can do that must not stop Run All -----------------------------------


def test_sys_exit_and_system_exit_are_graded_as_errors_not_raised():
    def calls_sys_exit(x):
        sys.exit()

    def raises_system_exit(x):
        raise SystemExit(3)

    for answer in (calls_sys_exit, raises_system_exit):
        result = grade("98.square", answer)  # would stop the cell (and Run All) if it escaped
        assert statuses(result) == [ERROR, ERROR]
        message = result.cases[0].message
        assert "your code called sys.exit()" in message and "return a value instead" in message
        assert f"in {answer.__name__}, line" in message


def test_a_keyboard_interrupt_raised_by_the_learner_is_graded():
    def raises_keyboard_interrupt(x):
        raise KeyboardInterrupt

    result = grade("98.square", raises_keyboard_interrupt)
    assert statuses(result) == [ERROR, ERROR]
    assert "your code raised KeyboardInterrupt" in result.cases[0].message


def test_a_real_interrupt_stops_the_check_even_if_the_learner_swallows_it():
    def presses_stop(x):
        signal.raise_signal(signal.SIGINT)  # what the notebook's stop button sends

    def presses_stop_and_swallows_it(x):
        try:
            signal.raise_signal(signal.SIGINT)
        except BaseException:
            pass
        return x * x

    # A kernel runs a cell under Python's default SIGINT handler. A test runner started in the
    # background by a shell (`make test &`, a CI job) inherits SIGINT ignored instead, and there the
    # stop button could never reach the check: set the kernel's handler, whoever started us.
    outside = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        for answer in (presses_stop, presses_stop_and_swallows_it):
            with pytest.raises(KeyboardInterrupt):
                grade("98.square", answer)
            assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, outside)


def _squares_two(fn):
    expect_close(fn(2.0), 4.0)


# A toy exercise of four cases, each with a short time limit.
slow = Exercise("97.slow", "Square quickly")
for _ in range(4):
    slow.case(time_limit_s=0.3)(_squares_two)


def test_after_a_timeout_the_exercise_skips_its_other_cases():
    calls = []

    def hangs(x):
        calls.append(x)
        while True:
            pass

    result = grade("97.slow", hangs)
    assert len(calls) == 1  # one time limit paid, not four: the other cases never call it
    assert statuses(result) == [TIMED_OUT, SKIPPED, SKIPPED, SKIPPED]
    assert result.points == 0 and result.max_points == 4
    assert "skipped: an earlier case timed out; fix the hang first" in result.cases[1].message
    assert format_text(result).count("fix the hang first") == 3


def test_a_timeout_swallowed_by_a_bare_except_still_counts():
    def swallows_the_stop(x):
        for _ in range(40):  # 0.8 s of CPU in all, past the 0.3 s limit
            try:
                start = time.process_time()
                while time.process_time() - start < 0.02:
                    pass
            except:  # noqa: E722 - the beginner's bare except this test is about
                pass
        return x * x

    result = grade("97.slow", swallows_the_stop)
    assert statuses(result)[0] == TIMED_OUT


def test_the_limit_counts_cpu_time_so_a_slow_machine_does_not_fail_a_right_answer():
    def waits_then_answers(x):  # 0.5 s of wall-clock time, little CPU: as on a loaded machine
        time.sleep(0.5)
        return x * x

    result = grade("97.slow", waits_then_answers)
    assert statuses(result) == [PASSED] * 4 and result.points == 4


def test_an_answer_that_waits_forever_is_stopped_by_the_wall_clock_backstop():
    def waits_forever(x):
        time.sleep(60)

    start = time.monotonic()
    result = grade("97.slow", waits_forever)
    assert statuses(result) == [TIMED_OUT, SKIPPED, SKIPPED, SKIPPED]
    assert time.monotonic() - start < 30  # the backstop, a few times the 0.3 s limit, not the 60 s sleep


# --- printed output -----------------------------------------------------------------------------


def test_printed_output_is_captured_and_shown_as_a_short_excerpt(capsys):
    def prints_a_lot(x):
        for i in range(10_000):
            print(f"step {i}")
        print("warning!", file=sys.stderr)
        return x + x

    result = grade("98.square", prints_a_lot)
    assert capsys.readouterr() == ("", "")  # nothing reached the cell
    output = result.cases[0].output
    assert output.splitlines()[:2] == ["step 0", "step 1"]
    assert output.splitlines()[-1] == "... 9,996 more lines"
    text = format_text(result)
    assert "step 0" in text and "9,996 more lines" in text and len(text.splitlines()) < 20
    assert "step 0" in format_html(result) and len(format_html(result)) < 3000


def test_the_output_of_a_passing_case_is_not_shown(capsys):
    def prints_and_passes(x):
        print("debugging")
        return x * x

    result = grade("98.square", prints_and_passes)
    assert capsys.readouterr() == ("", "")
    assert [case.output for case in result.cases] == ["", ""]
    assert "debugging" not in format_text(result)


def test_one_very_long_line_is_cut():
    result = grade("98.square", lambda x: print("x" * 100_000))
    assert len(result.cases[0].output) < 300


# --- the grader's code failing on what the learner returned --------------------------------------

# A toy exercise whose case uses the answer's result the way many chapters' cases do.
rows = Exercise("97.rows", "Split a matrix into its rows")
received = []


@rows.case(hint="Return a list with one array per row.")
def three_rows(fn):
    received.append(fn)
    got = fn(np.ones((3, 2)))
    expect(len(got) == 3, f"expected 3 rows, got {len(got)}")


def test_a_function_that_returns_none_is_told_to_return():
    def forgets_return(matrix):
        list(matrix)

    result = grade("97.rows", forgets_return)
    assert statuses(result) == [ERROR]
    assert result.cases[0].message.startswith("your function returned None: did you forget `return`?")
    assert "NoneType" not in result.cases[0].message


def test_a_failure_that_names_none_asks_about_return_too():
    def forgets_return(x):
        x * x

    message = grade("98.square", forgets_return).cases[0].message
    assert message.startswith("at the top: expected leaf, got None; your function "
                              "returned None: did you forget `return`? Hint: x * x")
    assert "forget `return`" not in grade("98.square", lambda x: x + x).cases[0].message


# An exercise where None is a right answer for some inputs ("no rule matches").
first_even = Exercise("97.first_even", "The first even number, or None", none_is_an_answer=True)


@first_even.case(hint="Return None only when no number is even.")
def finds_the_first_even_number(fn):
    expect_equal(fn([1, 4, 6]), 4)


def test_where_none_is_an_answer_a_none_is_not_called_a_forgotten_return():
    message = grade("97.first_even", lambda numbers: None).cases[0].message
    assert message.startswith("at the top: expected leaf, got None")
    assert "forget `return`" not in message and "Hint: Return None only when" in message


def test_a_result_the_grader_cannot_use_is_named_as_such():
    result = grade("97.rows", lambda matrix: 3)
    assert result.cases[0].message.startswith(
        "the grader could not use what your function returned (int): "
        "TypeError: object of type 'int' has no len()")


def test_the_learners_own_exception_still_names_the_learners_line():
    def indexes_past_the_end(matrix):
        rows = []
        for i in range(4):
            rows.append(matrix[i])
        return rows

    message = grade("97.rows", indexes_past_the_end).cases[0].message
    assert message.startswith("IndexError:") and "in indexes_past_the_end, line" in message
    assert "rows.append(matrix[i])" in message


def test_calling_with_the_wrong_arguments_is_the_learners_error():
    def takes_no_arguments():
        return []

    message = grade("97.rows", takes_no_arguments).cases[0].message
    assert message.startswith("TypeError:") and "takes 0 positional arguments" in message


def test_a_class_answer_is_handed_over_as_it_is():
    class Rows:
        def __init__(self, matrix):
            self.matrix = matrix

    received.clear()
    result = grade("97.rows", Rows)
    assert received == [Rows]
    assert result.cases[0].message.startswith(
        "the grader could not use your answer (Rows): TypeError:")


def test_a_function_answer_is_seen_through_a_transparent_wrapper():
    def two_rows(matrix):
        """Docstring."""
        return list(matrix)[:2]

    received.clear()
    grade("97.rows", two_rows)
    assert received[0].__wrapped__ is two_rows and received[0].__name__ == "two_rows"


def test_an_answer_that_is_not_callable_is_told_to_pass_the_function():
    result = grade("98.square", 9.0)
    assert statuses(result) == [ERROR, ERROR]
    assert "pass the function itself" in result.cases[0].message


def test_a_huge_error_message_is_shortened():
    def raises_a_long_message(x):
        raise ValueError("y" * 100_000)

    assert len(grade("98.square", raises_a_long_message).cases[0].message) < 1200


def test_an_unknown_exercise_id_lists_the_known_ones():
    with pytest.raises(UnknownExerciseError, match=r"no exercise '00.sofmax'.*00\.softmax.*98\.square"):
        grade("00.sofmax", lambda x: x)


def test_exercise_ids_must_look_like_chapter_dot_name():
    with pytest.raises(ValueError, match="'NN.name'"):
        Exercise("3.adam", "bad id")


def test_an_exercise_cannot_be_registered_twice():
    with pytest.raises(ValueError, match="registered twice"):
        Exercise("98.square", "again")


# --- the report ---------------------------------------------------------------------------------


def test_check_prints_a_line_per_case_outside_jupyter(capsys):
    check("98.square", lambda x: x + x)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "98.square · Square a number · 0/3 points"
    assert lines[1].lstrip().startswith("✗ squares three") and "0/2" in lines[1]


def test_check_tells_an_untouched_exercise_what_to_do(capsys):
    check("98.square", None)
    assert "Replace `raise NotImplementedError`" in capsys.readouterr().out


def test_the_html_report_escapes_messages():
    result = grade("98.square", lambda x: "<b>")
    assert "<b>'" not in format_html(result) and "&lt;b&gt;" in format_html(result)
    assert format_text(result).count("\n") == 2


# --- stripping solutions ---------------------------------------------------------------------


def test_strip_replaces_the_solution_with_an_indented_stub():
    source = "def f(x):\n    ### BEGIN SOLUTION\n    return x * 2\n    ### END SOLUTION\n\nprint(1)"
    assert strip_source(source) == (
        "def f(x):\n    # YOUR CODE HERE\n"
        '    raise NotImplementedError("Exercise: replace this line with your code.")\n\nprint(1)'
    )


@pytest.mark.parametrize("source, problem", [
    ("### BEGIN SOLUTION\nx = 1", "never closed"),
    ("x = 1\n### END SOLUTION", "without a ### BEGIN SOLUTION"),
    ("### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION", "cannot nest"),
])
def test_unbalanced_markers_are_errors_that_say_where(source, problem):
    with pytest.raises(SolutionMarkerError, match=problem):
        strip_source(source, where="solutions/x.ipynb, cell 3")


def _notebook(*sources: str, outputs: bool = False) -> nbformat.NotebookNode:
    notebook = nbformat.v4.new_notebook()
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    for source in sources:
        cell = nbformat.v4.new_code_cell(source)
        if outputs:
            cell.outputs = [nbformat.v4.new_output("stream", text="old output")]
            cell.execution_count = 1
        notebook.cells.append(cell)
    return notebook


def test_exercises_are_regenerated_without_solutions_or_outputs(tmp_path):
    solutions, exercises = tmp_path / "solutions", tmp_path / "exercises"
    solutions.mkdir()
    nbformat.write(_notebook("def f():\n    ### BEGIN SOLUTION\n    return 42\n    ### END SOLUTION",
                             outputs=True), solutions / "98_x.ipynb")
    assert stale_exercises(solutions, exercises) == ["98_x.ipynb"]
    write_exercises(solutions, exercises)
    assert stale_exercises(solutions, exercises) == []
    cell = nbformat.read(exercises / "98_x.ipynb", as_version=4).cells[0]
    assert "42" not in cell.source and cell.outputs == [] and cell.execution_count is None
    (exercises / "99_orphan.ipynb").write_text("{}")
    assert stale_exercises(solutions, exercises) == ["99_orphan.ipynb"]


# --- the instructor's command ---------------------------------------------------------------


@pytest.mark.slow
def test_grading_a_folder_grades_each_notebook_and_survives_bad_files(tmp_path):
    # Each kernel registers the toy exercise itself (chapter 98 has no case module).
    register = ("from stacklib.grading import Exercise, check, expect_close\n"
                "square_exercise = Exercise('98.square', 'Square a number')\n"
                "square_exercise.case(points=2)(lambda fn: expect_close(fn(3.0), 9.0))\n"
                "square_exercise.case(points=1)(lambda fn: expect_close(fn(2.0), 4.0))")
    check_cell = "check('98.square', square)"
    submissions = {
        "good.ipynb": _notebook(register, "def square(x):\n    return x * x", check_cell),
        "stub.ipynb": _notebook(register, "def square(x):\n    raise NotImplementedError", check_cell),
        "broken_cell.ipynb": _notebook(register, "def square(x) return x", check_cell,
                                       "print('the last cell still runs')"),
        "hangs.ipynb": _notebook(register, "import time\ntime.sleep(60)", check_cell),
    }
    for name, notebook in submissions.items():
        nbformat.write(notebook, tmp_path / name)
    (tmp_path / "corrupt.ipynb").write_text('{"cells": [')
    (tmp_path / "notes.txt").write_text("not a notebook")

    grades = {g.notebook: g for g in grade_folder(tmp_path, time_limit_s=8)}

    assert {name: g.total for name, g in grades.items()} == {
        "good.ipynb": 3, "stub.ipynb": 0, "broken_cell.ipynb": 0, "hangs.ipynb": 0,
        "corrupt.ipynb": 0, "notes.txt": 0,
    }
    assert grades["good.ipynb"].notes == [] and grades["good.ipynb"].possible == 3
    assert grades["stub.ipynb"].notes == []  # a stub ran to the end; it just scores zero
    assert "cell 1: SyntaxError" in grades["broken_cell.ipynb"].notes[0]
    assert "cell 2: NameError" in grades["broken_cell.ipynb"].notes[0]
    assert "8 s limit" in grades["hangs.ipynb"].notes[0]
    assert "no check ran for 98.square" in grades["hangs.ipynb"].notes[-1]
    assert "not a readable notebook" in grades["corrupt.ipynb"].notes[0]
    assert "not a notebook" in grades["notes.txt"].notes[0]

    csv_path, md_path = write_score_tables(list(grades.values()), tmp_path / "out" / "scores")
    header, *rows = csv_path.read_text().splitlines()
    assert header.startswith("notebook,98.square,total,possible,percent")
    assert len(rows) == 6
    assert "| good.ipynb | 3/3 | 3 | 3 | 100 |" in md_path.read_text()


def test_grades_are_read_from_the_check_output_metadata():
    from stacklib.grading.instructor import _reported_grades

    notebook = _notebook("check(...)")
    notebook.cells[0].outputs = [nbformat.v4.new_output(
        "display_data", data={"text/plain": "..."},
        metadata={GRADE_METADATA_KEY: {"exercise_id": "98.square", "points": 2, "max_points": 3}})]
    assert _reported_grades(notebook)["98.square"]["points"] == 2


def test_a_mismatch_with_infinities_is_reported_without_a_numpy_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a RuntimeWarning would show in the learner's output
        with pytest.raises(CaseFailure, match="1 of 2 values differ"):
            expect_close(np.array([-np.inf, 1.0]), np.array([-np.inf, 2.0]), what="the row")
        with pytest.raises(CaseFailure, match="expected -inf, got inf"):
            expect_close(np.array([np.inf, 1.0]), np.array([-np.inf, 1.0]), what="the row")


# --- feedback that teaches without handing over the answer -----------------------------------


def test_an_exact_mismatch_names_the_first_differing_element_not_the_whole_array():
    expected = np.zeros(1000, dtype=bool)
    got = expected.copy()
    got[[7, 900]] = True
    with pytest.raises(CaseFailure) as failure:
        expect_equal(got, expected, what="the mask")
    message = str(failure.value)
    assert "2 of 1000 values differ" in message and "first at [7]: expected False, got True" in message
    assert len(message) < 200


def test_a_mismatch_of_names_shows_one_element():
    with pytest.raises(CaseFailure, match=r"1 of 3 values differ .*first at \[1\]: expected 'b', got 'x'"):
        expect_close(np.array(["a", "x", "c"]), np.array(["a", "b", "c"]))


def test_a_sequence_mismatch_names_the_first_differing_position_only():
    expected = [(0, "F"), (1, "F"), (2, "B")]
    difference = r"the schedule: at position 1: expected \(1, 'F'\), got \(1, 'B'\)$"
    with pytest.raises(CaseFailure, match=difference):
        expect_same_sequence([(0, "F"), (1, "B"), (2, "B")], expected, what="the schedule")
    with pytest.raises(CaseFailure, match=r"2 items, expected 3: the next one should be \(2, 'B'\)"):
        expect_same_sequence(expected[:2], expected, what="the schedule")
    assert first_difference([1, 2, 3], [1, 2, 3]) == ""


def test_a_reason_must_name_what_the_statement_says_it_names():
    expect_mentions("the median of 5 runs was lowest", [("median", "typical")])
    with pytest.raises(CaseFailure, match="does not name 'median' or 'typical'"):
        expect_mentions("it was faster", [("median", "typical")])
    with pytest.raises(CaseFailure, match="a non-empty str"):
        expect_mentions("  ", ["median"])


def test_the_required_library_is_checked_with_the_statements_reason():
    expect_instance(np.ones(2), np.ndarray, why="the statement asks for NumPy")
    with pytest.raises(CaseFailure, match=r"is a builtins.list, expected a ndarray: the statement asks"):
        expect_instance([1.0], np.ndarray, why="the statement asks for NumPy")


def test_a_key_built_from_hash_of_a_string_is_caught_and_a_content_key_is_not():
    import hashlib

    with pytest.raises(CaseFailure, match="changes from one Python process to the next"):
        expect_same_across_processes(lambda name, shape: hash((name, shape)), "matmul", (2, 3))
    with pytest.raises(CaseFailure, match="changes from one Python process"):
        expect_same_across_processes(lambda name: f"{hash(name) % 1000}", "matmul")
    key = expect_same_across_processes(lambda name: hashlib.sha256(name.encode()).hexdigest(), "matmul")
    assert key == hashlib.sha256(b"matmul").hexdigest() and hash("x") == hash("x")  # hash is restored


def test_a_seeded_permutation_is_neither_a_reversal_nor_a_rotation():
    order = seeded_permutation(64, seed=3)
    assert sorted(order) == list(range(64)) and list(order) != list(range(63, -1, -1))
    assert list(order) == list(seeded_permutation(64, seed=3))


def test_a_tuple_of_per_device_values_is_named_as_such():
    import jax

    per_device = tuple(jax.device_put(np.ones(2), device) for device in jax.devices()[:4])
    named = r"tuple of length 4 of 4 arrays of shape \(2,\) on 4 devices: one value per device"
    with pytest.raises(CaseFailure, match=named):
        expect_close(per_device, np.ones(2), what="the loss")
    with pytest.raises(CaseFailure, match="one value per device"):
        expect_sharding(list(per_device), None, what="the loss")
    with pytest.raises(CaseFailure, match="where one array was expected: stack them"):
        expect_close([np.ones(2)] * 3, np.ones((3, 2)), what="the batch")


def test_a_forbidden_library_function_is_caught_however_it_was_imported():
    from numpy import median as imported_by_name

    with forbidding(np.median, why="compute the median yourself"):
        np.sort(np.ones(3))
    with pytest.raises(CaseFailure, match=r"your code calls numpy.median: compute the median yourself"):
        with forbidding(np.median, why="compute the median yourself"):
            imported_by_name(np.ones(3))
    assert sys.getprofile() is None


hinted = Exercise("97.hinted", "Square a number, with hints keyed to the failing condition")


@hinted.case(hint="the case's hint")
def squares_with_hints_per_condition(fn):
    got = fn(3.0)
    expect(got != 6.0, f"expected 9, got {got}", hint="You doubled x: square it (x * x).")
    expect(got != -9.0, f"expected 9, got {got}", hint="")
    expect_close(got, 9.0)


@hinted.case(hint="the second case's hint")
def uses_what_the_answer_returns(fn):
    result = fn(np.arange(3.0))
    if isinstance(result, tuple):
        raise ValueError("shard_map applied to the function 'f' was given out_specs which require "
                         "replication which can't be statically inferred given the mesh:\n\n"
                         "consider passing check_vma=False")
    len(result)


def test_a_hint_names_the_mistake_of_the_failing_condition_or_is_not_shown():
    doubled = grade("97.hinted", lambda x: x + x).cases[0].message
    assert doubled.endswith("Hint: You doubled x: square it (x * x).")
    assert "Hint" not in grade("97.hinted", lambda x: -x * x).cases[0].message
    assert grade("97.hinted", lambda x: x * x + 1).cases[0].message.endswith("Hint: the case's hint")


def test_an_error_from_jax_shows_the_learners_line_and_a_hint_not_jaxs_advice():
    import jax

    def uses_numpy_under_jit(x):
        return jax.jit(lambda v: np.asarray(v) * v)(x)

    message = grade("97.hinted", uses_numpy_under_jit).cases[0].message
    assert message.startswith("TracerArrayConversionError:") and "in <lambda>, line" in message
    assert "See https" not in message and "use the jax.numpy function" in message


def test_a_value_not_reduced_over_devices_is_named_not_jaxs_flag_advice():
    message = grade("97.hinted", lambda x: (x * x, x * x) if np.ndim(x) else x * x).cases[1].message
    assert "differs from device to device" in message and "jax.lax.psum" in message
    assert "check_vma" not in message
