"""A structural build of the book: every page renders, warnings are errors, nothing executes.

`make book` executes the notebooks; here they are already executed by nbval, so the
build only checks what Sphinx checks: the toc, cross-references, MyST syntax, config.
"""

import pathlib
import subprocess
import sys

import pytest
import yaml
from conftest import ROOT

pytestmark = pytest.mark.slow


def test_the_book_builds_without_warnings(tmp_path):
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    config["execute"]["execute_notebooks"] = "off"
    # Unexecuted notebooks hold no glued values, so every {glue} role would warn here. `make book`
    # executes and keeps the warning an error; tests/test_prose.py checks each role's key is glued.
    config["sphinx"]["config"]["suppress_warnings"].append("mystnb.glue")
    config_path = tmp_path / "_config.yml"
    config_path.write_text(yaml.safe_dump(config))
    jupyter_book = pathlib.Path(sys.executable).parent / "jupyter-book"
    result = subprocess.run(
        [jupyter_book, "build", str(ROOT), "--config", str(config_path),
         "--path-output", str(tmp_path), "--warningiserror", "--nitpick", "--keep-going"],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-5000:]
    html = tmp_path / "_build" / "html"
    for page in ["intro.html", "chapters/00_how_to_use.html", "exercises/00_how_to_use.html"]:
        assert (html / page).exists(), page
    chapter = (html / "chapters" / "00_how_to_use.html").read_text()
    assert "colab.research.google.com/github/" in chapter  # the launch button and badge
