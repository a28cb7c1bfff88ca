"""Shared paths and helpers for the test suite."""

import json
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


def cache_fingerprint(directory: pathlib.Path) -> dict[str, bytes]:
    """Every file of a cached model, by relative path, minus what records when or how long.

    Two builds of one request must agree on all of it: the step metadata's timestamp and
    the `timing` item (the training's wall-clock seconds) are the only parts left out.
    """
    files = {}
    for path in sorted(directory.rglob("*")):
        relative = path.relative_to(directory)
        if path.is_dir() or "timing" in relative.parts:
            continue
        data = path.read_bytes()
        if path.name == "_CHECKPOINT_METADATA":
            data = json.dumps({k: v for k, v in json.loads(data).items() if k != "timestamp"}).encode()
        files[str(relative)] = data
    return files
