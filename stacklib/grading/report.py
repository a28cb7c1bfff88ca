"""`check`: grade an answer and show the result in the notebook.

In Jupyter the report is one display output with three representations: plain text
(terminals, nbval), an HTML table (the notebook and the rendered book), and, in the
output's metadata under `GRADE_METADATA_KEY`, the scores as JSON. The instructor's
command reads that metadata back from executed notebooks, so the grades in a table are
the ones the learner saw.

What a case printed is shown under it, cut to a few lines by the runner, for the
cases that did not pass: that is where a learner's debugging print helps.
"""

from __future__ import annotations

import html
from typing import Any

from stacklib.grading.runner import (
    ERROR,
    FAILED,
    NOT_IMPLEMENTED,
    PASSED,
    SKIPPED,
    TIMED_OUT,
    ExerciseResult,
    grade,
)

GRADE_METADATA_KEY = "stacklib_grade"

_MARKS = {PASSED: "✓", FAILED: "✗", NOT_IMPLEMENTED: "·", ERROR: "!", TIMED_OUT: "⏱", SKIPPED: "-"}
_COLOURS = {PASSED: "#1a7f37", FAILED: "#cf222e", NOT_IMPLEMENTED: "#6e7781",
            ERROR: "#cf222e", TIMED_OUT: "#9a6700", SKIPPED: "#6e7781"}


def format_text(result: ExerciseResult) -> str:
    """The report as plain text: a header line, then one line per case (and what it printed)."""
    lines = [f"{result.exercise_id} · {result.title} · {result.points}/{result.max_points} points"]
    width = max((len(case.name) for case in result.cases), default=0)
    for case in result.cases:
        score = f"{case.points}/{case.max_points}"
        message = f"  {case.message}" if case.message else ""
        lines.append(f"  {_MARKS[case.status]} {case.name:<{width}}  {score:>5}{message}")
        if case.output:
            label = "      printed: "
            printed = case.output.splitlines()
            lines.append(label + printed[0])
            lines += [" " * len(label) + line for line in printed[1:]]
    if result.cases and all(case.status == NOT_IMPLEMENTED for case in result.cases):
        lines.append("  Replace `raise NotImplementedError` with your code, then run this cell again.")
    return "\n".join(lines)


def format_html(result: ExerciseResult) -> str:
    """The report as a small HTML table, coloured by outcome."""
    rows = "".join(
        f"<tr><td style='color:{_COLOURS[case.status]}'>{_MARKS[case.status]}</td>"
        f"<td>{html.escape(case.name)}</td><td>{case.points}/{case.max_points}</td>"
        f"<td>{html.escape(case.message)}{_printed_html(case.output)}</td></tr>"
        for case in result.cases
    )
    header = (
        f"<b>{html.escape(result.exercise_id)}</b> · {html.escape(result.title)} · "
        f"<b>{result.points}/{result.max_points} points</b>"
    )
    return f"<div>{header}<table>{rows}</table></div>"


def _printed_html(output: str) -> str:
    if not output:
        return ""
    return ("<pre style='margin:0.3em 0 0;font-size:85%'>printed:\n"
            f"{html.escape(output)}</pre>")


def _in_ipython_kernel() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and hasattr(shell, "kernel")


def check(exercise_id: str, answer: Any) -> None:
    """Grade `answer` on every case of `exercise_id` and show pass/fail, points and hints.

    Args:
      exercise_id: such as "00.softmax"; an unknown id raises an error listing the known ones.
      answer: the learner's function or class (None counts as not implemented).
    """
    result = grade(exercise_id, answer)
    text = format_text(result)
    if _in_ipython_kernel():
        from IPython.display import display

        display(
            {"text/plain": text, "text/html": format_html(result)},
            raw=True,
            metadata={GRADE_METADATA_KEY: result.to_dict()},
        )
    else:
        print(text)
