"""Each benchmark still runs (at a tiny scale); the timings themselves are not asserted."""

import importlib
import subprocess
import sys

import pytest
from conftest import ROOT

from benchmarks.__main__ import available


def test_the_runner_lists_the_benchmarks():
    files = (ROOT / "benchmarks").glob("bench_*.py")
    assert available() == sorted(path.stem.removeprefix("bench_") for path in files)


@pytest.mark.slow
@pytest.mark.parametrize("name", available())
def test_a_benchmark_runs_at_a_tiny_scale(name):
    result = subprocess.run([sys.executable, "-m", "benchmarks", name, "--scale", "0.01"],
                            capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "speed" in result.stdout
    importlib.import_module(f"benchmarks.bench_{name}")
