"""Shared paths and helpers for the test suite."""

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK_DIRS = ("chapters", "solutions", "exercises")


def notebooks(folder: str) -> list[pathlib.Path]:
    return sorted((ROOT / folder).glob("*.ipynb"))


def run_python(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter (for things that must happen before JAX starts)."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


@pytest.fixture
def root() -> pathlib.Path:
    return ROOT
