"""Each benchmark still runs (at a tiny scale); the timings themselves are not asserted."""

import importlib
import json
import subprocess
import sys

import pytest
from conftest import ROOT

from benchmarks import demo_margins
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


def test_demo_margins_measures_each_comparison_assert_instead_of_raising():
    source = ("a, b = 0.5, 0.2\nassert a >= b + 0.2\nassert a < b and a == 0.5\nx = [1]\nassert x\n"
              "import numpy as np\nassert np.array([1.0, 2.0]) > 0.5\n")
    script = demo_margins.instrument(source)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    results = json.loads(out.splitlines()[-1].removeprefix("MARGINS "))
    assert [(r["line"], r["text"], r["held"]) for r in results] == [
        (2, "a >= b + 0.2", True), (3, "a < b", False), (3, "a == 0.5", True), (5, "x", True),
        (7, "np.array([1.0, 2.0]) > 0.5", True)]
    slacks = [None if r["slack"] is None else round(r["slack"], 9) for r in results]
    assert slacks == [0.1, -0.3, None, None, 0.5]  # positive holds, negative fails, in the assert's units


def test_demo_margins_varies_the_seeds_but_not_the_problem_split():
    source = demo_margins.chapter_source("13", seed=2)
    assert "make_problems(seed=0)" in source  # the split the prose describes
    assert "sft_start(seed=2)" in source and "sft_start(seed=0)" not in source
