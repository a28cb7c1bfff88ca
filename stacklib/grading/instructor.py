"""Grade a folder of submitted exercise notebooks and write a score table.

Each notebook runs from a clean state in its own kernel (the Python running this
command, so the pinned stack), under a time limit for the whole notebook. Errors in
cells do not stop it: every check cell that can run, runs. The scores are the ones the
`check` calls displayed (read from their output metadata); an exercise of the chapter
that no check cell reported counts as zero, with a note.

A file that is not a readable notebook, a kernel that dies, or a notebook that runs out
of time becomes a row that says so; the other notebooks are graded as usual.
"""

from __future__ import annotations

import csv
import dataclasses
import pathlib
import re
import subprocess
import sys
import time

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellTimeoutError, DeadKernelError

from stacklib.grading.report import GRADE_METADATA_KEY
from stacklib.grading.runner import exercises_of_chapter

DEFAULT_NOTEBOOK_TIME_LIMIT_S = 600.0


@dataclasses.dataclass
class NotebookGrade:
    notebook: str
    points: dict[str, int]  # exercise id -> points scored
    max_points: dict[str, int]  # exercise id -> points available
    seconds: float = 0.0
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.points.values())

    @property
    def possible(self) -> int:
        return sum(self.max_points.values())


_CHECK_CALL = re.compile(r"""check\(\s*["'](\d\d)\.""")


def _chapters_of(path: pathlib.Path, notebook: nbformat.NotebookNode) -> set[str]:
    """Chapters whose exercises this notebook answers: from its check calls, else its name.

    Submissions are often renamed (alice.ipynb), so the check cells are the better guide.
    """
    chapters = {
        match for cell in notebook.cells if cell.cell_type == "code"
        for match in _CHECK_CALL.findall(cell.source)
    }
    if not chapters and re.match(r"\d\d_", path.name):
        chapters = {path.name[:2]}
    return chapters


def _reported_grades(notebook: nbformat.NotebookNode) -> dict[str, dict]:
    """The last grade each exercise's check cell displayed, by exercise id."""
    grades = {}
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            grade = output.get("metadata", {}).get(GRADE_METADATA_KEY)
            if grade:
                grades[grade["exercise_id"]] = grade
    return grades


def _execute(notebook: nbformat.NotebookNode, workdir: pathlib.Path, time_limit_s: float) -> list[str]:
    """Run every cell in place, within `time_limit_s` in all; return notes on what went wrong."""
    client = NotebookClient(
        notebook,
        timeout=time_limit_s,
        allow_errors=True,
        kernel_name="python3",
        resources={"metadata": {"path": str(workdir)}},
    )
    # 'python3' resolves to this interpreter (jupyter_client maps a kernelspec's bare
    # `python` to sys.executable), so the kernel sees the same packages as this command.
    deadline = time.monotonic() + time_limit_s
    notes = []
    # The kernel's own stderr (start-up warnings) would only clutter the command's output.
    with client.setup_kernel(stderr=subprocess.DEVNULL):
        for index, cell in enumerate(notebook.cells):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                notes.append(f"stopped: the notebook ran past its {time_limit_s:g} s limit "
                             f"before cell {index}")
                break
            client.timeout = max(1, int(remaining))
            try:
                client.execute_cell(cell, index)
            except CellTimeoutError:
                notes.append(f"stopped: cell {index} ran past the notebook's {time_limit_s:g} s limit")
                break
            except DeadKernelError:
                notes.append(f"the kernel died in cell {index} (out of memory, or a crash)")
                break
    errors = [
        f"cell {index}: {output.ename}" for index, cell in enumerate(notebook.cells)
        for output in cell.get("outputs", []) if output.get("output_type") == "error"
    ]
    if errors:
        notes.append("errors in " + ", ".join(errors))
    return notes


def grade_notebook(path: pathlib.Path, time_limit_s: float = DEFAULT_NOTEBOOK_TIME_LIMIT_S) -> NotebookGrade:
    """Execute one submitted notebook and collect its grades."""
    path = pathlib.Path(path)
    grade = NotebookGrade(path.name, {}, {})
    start = time.monotonic()
    if path.suffix != ".ipynb":
        grade.notes.append(f"not a notebook: expected a .ipynb file, got {path.suffix or 'no extension'}")
        return grade
    try:
        notebook = nbformat.read(path, as_version=4)
        nbformat.validate(notebook)
    except Exception as error:
        grade.notes.append(f"not a readable notebook: {type(error).__name__}: {str(error)[:200]}")
        return grade
    for chapter in sorted(_chapters_of(path, notebook)):
        for exercise in exercises_of_chapter(chapter):
            grade.points[exercise.exercise_id] = 0
            grade.max_points[exercise.exercise_id] = exercise.max_points
    try:
        grade.notes.extend(_execute(notebook, path.parent, time_limit_s))
    except Exception as error:  # e.g. the kernel could not start
        grade.notes.append(f"could not execute: {type(error).__name__}: {str(error)[:200]}")
    reported = _reported_grades(notebook)
    for exercise_id, result in reported.items():
        grade.points[exercise_id] = result["points"]
        grade.max_points.setdefault(exercise_id, result["max_points"])
    missing = [exercise for exercise in grade.max_points if exercise not in reported]
    if missing:
        grade.notes.append("no check ran for " + ", ".join(missing))
    grade.seconds = time.monotonic() - start
    return grade


def grade_folder(
    folder: pathlib.Path, time_limit_s: float = DEFAULT_NOTEBOOK_TIME_LIMIT_S, progress=None
) -> list[NotebookGrade]:
    """Grade every file in `folder` (not hidden ones), in name order, each notebook in a fresh kernel."""
    folder = pathlib.Path(folder)
    if not folder.is_dir():
        raise NotADirectoryError(f"{folder} is not a folder of notebooks.")
    grades = []
    for path in sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith(".")):
        if progress:
            progress(f"grading {path.name} ...")
        grades.append(grade_notebook(path, time_limit_s))
    return grades


def _table(grades: list[NotebookGrade]) -> tuple[list[str], list[list[str]]]:
    exercise_ids = sorted({exercise for grade in grades for exercise in grade.max_points})
    header = ["notebook", *exercise_ids, "total", "possible", "percent", "seconds", "notes"]
    rows = []
    for grade in grades:
        cells = [grade.notebook]
        for exercise in exercise_ids:
            cells.append(
                f"{grade.points[exercise]}/{grade.max_points[exercise]}"
                if exercise in grade.max_points else ""
            )
        percent = f"{100 * grade.total / grade.possible:.0f}" if grade.possible else ""
        cells += [str(grade.total), str(grade.possible), percent, f"{grade.seconds:.1f}",
                  "; ".join(grade.notes)]
        rows.append(cells)
    return header, rows


def _markdown_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def write_score_tables(
    grades: list[NotebookGrade], prefix: pathlib.Path
) -> tuple[pathlib.Path, pathlib.Path]:
    """Write `<prefix>.csv` and `<prefix>.md`; return their paths."""
    prefix = pathlib.Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    header, rows = _table(grades)
    csv_path = prefix.with_suffix(".csv")
    with csv_path.open("w", newline="") as file:
        csv.writer(file).writerows([header, *rows])
    markdown = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    markdown += ["| " + " | ".join(_markdown_cell(cell) for cell in row) + " |" for row in rows]
    md_path = prefix.with_suffix(".md")
    md_path.write_text("\n".join(markdown) + "\n")
    return csv_path, md_path


def main_grade(folder: str, out: str, time_limit_s: float) -> int:
    grades = grade_folder(pathlib.Path(folder), time_limit_s, progress=lambda m: print(m, file=sys.stderr))
    csv_path, md_path = write_score_tables(grades, pathlib.Path(out))
    print(md_path.read_text())
    print(f"Wrote {csv_path} and {md_path}.", file=sys.stderr)
    return 0
