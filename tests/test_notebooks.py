"""The notebooks' structure: pairs in sync, no outputs, the shared setup cell, badges, the toc."""

import re

import jupytext
import nbformat
import pytest
import yaml
from conftest import NOTEBOOK_DIRS, ROOT, notebooks

from stacklib import hw
from stacklib.grading import exercises_of_chapter
from stacklib.grading.strip import stale_exercises

ALL_NOTEBOOKS = [path for folder in NOTEBOOK_DIRS for path in notebooks(folder)]
IDS = [str(path.relative_to(ROOT)) for path in ALL_NOTEBOOKS]
CHECK_CALL = r"""check\(\s*["'](\d\d\.\w+)["']"""  # check("NN.name", answer)


def read(path):
    return nbformat.read(path, as_version=4)


def test_every_folder_has_notebooks():
    for folder in NOTEBOOK_DIRS:
        assert notebooks(folder), f"{folder}/ has no notebooks"


@pytest.mark.parametrize("path", notebooks("chapters"), ids=lambda p: p.name)
def test_each_chapter_is_paired_with_an_identical_markdown_twin(path):
    twin = path.with_suffix(".md")
    assert twin.exists(), f"{twin.name} is missing: run `make notebooks`"
    from_markdown = jupytext.read(twin)
    from_notebook = read(path)
    assert [(c.cell_type, c.source) for c in from_markdown.cells] == [
        (c.cell_type, c.source) for c in from_notebook.cells
    ], f"{path.name} and {twin.name} differ: edit one, then run `make notebooks`"
    assert from_notebook.metadata["jupytext"]["formats"] == "ipynb,md:myst"


@pytest.mark.parametrize("path", ALL_NOTEBOOKS, ids=IDS)
def test_no_outputs_or_execution_counts_are_committed(path):
    for index, cell in enumerate(read(path).cells):
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, f"{path.name} cell {index}"


@pytest.mark.parametrize("path", ALL_NOTEBOOKS, ids=IDS)
def test_the_first_code_cell_is_the_shared_setup_cell(path):
    first_code = next(c for c in read(path).cells if c.cell_type == "code")
    assert first_code.source == hw.setup_cell_source(), (
        f"{path.name}: the first code cell must be stacklib.hw.setup_cell_source()"
    )


@pytest.mark.parametrize("path", ALL_NOTEBOOKS, ids=IDS)
def test_the_title_is_followed_by_a_colab_badge_for_the_notebook_learners_open(path):
    title = read(path).cells[0]
    assert title.cell_type == "markdown" and title.source.startswith("# ")
    target = path.relative_to(ROOT).as_posix().replace("solutions/", "exercises/")
    assert hw.colab_badge(target) in title.source


def test_the_book_config_uses_the_same_repository_as_the_setup_cell():
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    assert config["repository"]["url"] == hw.REPOSITORY_URL
    assert config["repository"]["branch"] == hw.BRANCH


def test_exercises_are_in_sync_with_solutions():
    stale = stale_exercises(ROOT / "solutions", ROOT / "exercises")
    assert not stale, f"stale exercise notebooks {stale}: run `make exercises`"


def test_each_solution_belongs_to_a_chapter():
    chapters = {path.name for path in notebooks("chapters")}
    for path in notebooks("solutions"):
        assert path.name in chapters, f"solutions/{path.name} has no chapter of the same name"


@pytest.mark.parametrize("path", notebooks("solutions"), ids=lambda p: p.name)
def test_solutions_check_every_exercise_of_their_chapter_exactly_once(path):
    sources = "\n".join(c.source for c in read(path).cells if c.cell_type == "code")
    checked = re.findall(CHECK_CALL, sources)
    registered = [ex.exercise_id for ex in exercises_of_chapter(path.name[:2])]
    assert sorted(checked) == registered
    assert len(registered) >= 3, "each chapter has at least three graded exercises"


@pytest.mark.parametrize("path", notebooks("solutions"), ids=lambda p: p.name)
def test_each_exercise_heading_states_the_points_its_cases_give(path):
    """An "## Exercise ... (N points)" heading is paired with the next check("NN.name", ...) cell."""
    stated, points = {}, None
    for cell in read(path).cells:
        heading = re.search(r"^## Exercise .*\((\d+) points?\)", cell.source, re.MULTILINE)
        if cell.cell_type == "markdown" and heading:
            points = int(heading.group(1))
        elif cell.cell_type == "code" and (call := re.search(CHECK_CALL, cell.source)):
            stated[call.group(1)] = points
    assert stated == {ex.exercise_id: ex.max_points for ex in exercises_of_chapter(path.name[:2])}


def _toc_files():
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    return [entry["file"] for part in toc["parts"] for entry in part["chapters"]]


# Besides the notebooks, the book has two pages: the instructor's and the maintainer's guide.
GUIDES = ["instructors", "CONTRIBUTING"]


def test_every_chapter_and_exercise_notebook_and_the_guides_are_in_the_toc_and_nothing_else():
    expected = [f"chapters/{p.stem}" for p in notebooks("chapters")]
    expected += [f"exercises/{p.stem}" for p in notebooks("exercises")]
    expected += GUIDES
    assert sorted(_toc_files()) == sorted(expected)


def test_the_readme_chapter_table_lists_every_chapter():
    readme = (ROOT / "README.md").read_text()
    for path in notebooks("chapters"):
        assert f"chapters/{path.name}" in readme, f"README's chapter table lacks {path.name}"


def test_the_readme_chapter_table_counts_each_chapters_exercises():
    rows = re.findall(r"^\| (\d\d) \| .* \| (\d+) \|$", (ROOT / "README.md").read_text(), re.M)
    assert len(rows) == len(notebooks("chapters"))
    for chapter, count in rows:
        assert int(count) == len(exercises_of_chapter(chapter)), (
            f"README's row {chapter} says {count} exercises; stacklib/cases/ch{chapter}.py registers "
            f"{len(exercises_of_chapter(chapter))}")
