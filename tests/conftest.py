"""Shared paths and helpers for the test suite."""

import pathlib
import subprocess
import sys

import jax
import pytest

# The sharding tests (chapter 07) need 8 devices. JAX fixes the CPU device count when
# its backend starts, and one pytest process runs every test file, so this must happen
# here, before any test module runs a JAX operation. Single-device code is unaffected:
# it runs on device 0 as before.
jax.config.update("jax_num_cpu_devices", 8)

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
