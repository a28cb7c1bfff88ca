"""Make exercise notebooks from solution notebooks by removing the solution code.

`solutions/NN_slug.ipynb` is the single source of a chapter's exercises. Inside its code
cells, the lines between the markers

        ### BEGIN SOLUTION
        ...
        ### END SOLUTION

are the answer. `strip_notebook` replaces each such block (markers included) with a
stub at the markers' indentation, so the exercise notebook still runs top to bottom:

        # YOUR CODE HERE
        raise NotImplementedError("Exercise: replace this line with your code.")

Solutions therefore sit inside function or method bodies; the check cells call them
and report "not implemented yet" instead of crashing.
"""

from __future__ import annotations

import pathlib

import nbformat

BEGIN_MARKER = "### BEGIN SOLUTION"
END_MARKER = "### END SOLUTION"
STUB = ("# YOUR CODE HERE", 'raise NotImplementedError("Exercise: replace this line with your code.")')


class SolutionMarkerError(ValueError):
    """A solution cell's markers are unbalanced or nested."""


def strip_source(source: str, *, where: str = "cell") -> str:
    """Replace every marked solution block in one cell's source with the stub."""
    output: list[str] = []
    inside = False
    for number, line in enumerate(source.splitlines(), start=1):
        marker = line.strip()
        if marker == BEGIN_MARKER:
            if inside:
                raise SolutionMarkerError(f"{where}, line {number}: a second {BEGIN_MARKER} "
                                          f"before {END_MARKER}; blocks cannot nest.")
            inside = True
            indent = line[: len(line) - len(line.lstrip())]
            output.extend(indent + stub_line for stub_line in STUB)
        elif marker == END_MARKER:
            if not inside:
                raise SolutionMarkerError(f"{where}, line {number}: {END_MARKER} without "
                                          f"a {BEGIN_MARKER} above it.")
            inside = False
        elif not inside:
            output.append(line)
    if inside:
        raise SolutionMarkerError(f"{where}: {BEGIN_MARKER} is never closed by {END_MARKER}.")
    return "\n".join(output)


def strip_notebook(solution: nbformat.NotebookNode, *, name: str = "notebook"):
    """Return the exercise version of a solution notebook: no solutions, no outputs."""
    exercise = nbformat.from_dict(solution)
    for index, cell in enumerate(exercise.cells):
        if cell.cell_type != "code":
            continue
        cell.source = strip_source(cell.source, where=f"{name}, cell {index}")
        cell.outputs = []
        cell.execution_count = None
    return exercise


def render_exercises(solutions_dir: pathlib.Path) -> dict[str, str]:
    """Map each solution notebook's file name to the text of its exercise notebook."""
    rendered = {}
    for path in sorted(pathlib.Path(solutions_dir).glob("*.ipynb")):
        solution = nbformat.read(path, as_version=4)
        rendered[path.name] = nbformat.writes(strip_notebook(solution, name=str(path))) + "\n"
    return rendered


def write_exercises(solutions_dir: pathlib.Path, exercises_dir: pathlib.Path) -> list[pathlib.Path]:
    """Regenerate `exercises_dir` from `solutions_dir`; return the files written."""
    exercises_dir = pathlib.Path(exercises_dir)
    exercises_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in render_exercises(solutions_dir).items():
        target = exercises_dir / name
        target.write_text(text)
        written.append(target)
    return written


def stale_exercises(solutions_dir: pathlib.Path, exercises_dir: pathlib.Path) -> list[str]:
    """Names of exercise notebooks that are missing or differ from their solutions."""
    rendered = render_exercises(solutions_dir)
    stale = [
        name for name, text in rendered.items()
        if not (pathlib.Path(exercises_dir) / name).exists()
        or (pathlib.Path(exercises_dir) / name).read_text() != text
    ]
    orphans = [
        path.name for path in pathlib.Path(exercises_dir).glob("*.ipynb") if path.name not in rendered
    ]
    return stale + orphans
