"""How far each chapter assert is from failing, across seeds and device setups.

    python -m benchmarks.demo_margins 13 --seeds 0 1 2

A chapter that trains a model for a few seconds and then asserts what the training
showed ("the loophole pays 20 points more than the honest reward") must hold on every
machine, not just the one that wrote it. XLA's CPU code rounds differently with the
number of simulated devices and of cores, and another seed is another run, so this runs
the chapter's code as a script under each combination of

* seed: every `seed=0` in the chapter's code becomes `seed=S` (except the split of a task
  into training and held-out problems, which the chapter's prose describes), and so do the
  seeds `SEED_SITES` points at; a chapter with neither (16) varies only the setup;
* setup: "as written" (the notebook's own device count, on two cores, as in CI) or
  "8 devices, 1 core" (8 simulated CPU devices set before the chapter's first line); a
  chapter that simulates devices itself keeps its own count and differs only in the cores,

with every comparison assert (`a >= b + 0.2`, `x < y`) turned into a measurement of its
slack, in the assert's own units: positive holds, negative fails. It prints, per assert,
the smallest slack over the runs. Asserts that are not a comparison (`==`, a flag) are
reported as held or failed. Not part of `make test` (minutes per chapter); the closing note of
each change to a demo quotes its table.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import pathlib
import re
import subprocess
import sys

import jupytext
from IPython.core.inputtransformer2 import TransformerManager

ROOT = pathlib.Path(__file__).resolve().parents[1]
COMPARISONS = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">="}
# name -> (simulated CPU devices, None for the chapter's own count; cores)
SETUPS = {"as written": (None, 2), "8 devices, 1 core": (8, 1)}


# Chapters whose seeds are not spelled `seed=0`: where to put the seed instead.
SEED_SITES = {
    "11": [("nnx.Rngs(0)", "nnx.Rngs({seed})")],
    "12": [('"eval_every=50"', '"eval_every=50", "seed={seed}", "data_seed={seed}"')],
}


def chapter_source(number: str, seed: int) -> str:
    """The chapter's code cells as one script, magics made Python, `seed=0` made `seed=<seed>`."""
    (path,) = ROOT.glob(f"chapters/{number}_*.md")
    cells = [cell.source for cell in jupytext.read(path).cells if cell.cell_type == "code"]
    source = "\n\n".join(TransformerManager().transform_cell(cell) for cell in cells)
    for site, seeded in SEED_SITES.get(number, []):
        source = source.replace(site, seeded.format(seed=seed))
    return re.sub(r"(?<!make_problems\()\bseed=0\b", f"seed={seed}", source)


class _Measure(ast.NodeTransformer):
    """`assert a OP b` -> `_slack(line, a, OP, b)`; other asserts -> `_held(line, test)`."""

    def visit_Assert(self, node: ast.Assert) -> ast.AST:
        tests = node.test.values if isinstance(node.test, ast.BoolOp) and isinstance(node.test.op, ast.And) \
            else [node.test]
        calls = []
        for test in tests:
            if isinstance(test, ast.Compare) and len(test.ops) == 1 and type(test.ops[0]) in COMPARISONS:
                op = COMPARISONS[type(test.ops[0])]
                call = ast.Call(ast.Name("_slack", ast.Load()), [
                    ast.Constant(node.lineno), ast.Constant(ast.unparse(test)), test.left, ast.Constant(op),
                    test.comparators[0]], [])
            else:
                call = ast.Call(ast.Name("_held", ast.Load()), [
                    ast.Constant(node.lineno), ast.Constant(ast.unparse(test)), test], [])
            calls.append(ast.Expr(call))
        return calls


PRELUDE = """
import json as _json, numpy as _np
_RESULTS = []
def _slack(line, text, left, op, right):  # arrays compare elementwise: the smallest slack counts
    left, right = _np.asarray(left, dtype=float), _np.asarray(right, dtype=float)
    gap = float(_np.min(right - left if op in ("<", "<=") else left - right))
    _RESULTS.append(dict(line=line, text=text, slack=gap, held=gap > 0 or (gap == 0 and "=" in op)))
def _held(line, text, value):
    _RESULTS.append(dict(line=line, text=text, slack=None, held=bool(value)))
"""
EPILOGUE = "\nprint('MARGINS ' + _json.dumps(_RESULTS))\n"


def instrument(source: str) -> str:
    """`source` with its asserts measured, printing one `MARGINS <json>` line at the end."""
    tree = _Measure().visit(ast.parse(source))
    return PRELUDE + ast.unparse(ast.fix_missing_locations(tree)) + EPILOGUE


def run(number: str, seed: int, setup: str) -> list[dict]:
    """Run chapter `number` once under `seed` and `setup`; return each assert's measurement."""
    devices, cores = SETUPS[setup]
    script = instrument(chapter_source(number, seed))
    if devices and "simulate_cpu_devices(" not in script:
        script = f"import jax\njax.config.update('jax_num_cpu_devices', {devices})\n" + script
    chapter_dir = ROOT / "chapters"
    env = dict(os.environ, MPLBACKEND="Agg", JAX_PLATFORMS="cpu")

    def one_process_per_cores():
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:cores])

    done = subprocess.run([sys.executable, "-c", script], cwd=chapter_dir, env=env, capture_output=True,
                          text=True, preexec_fn=one_process_per_cores)
    lines = [line for line in done.stdout.splitlines() if line.startswith("MARGINS ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"chapter {number}, seed {seed}, {setup}: the script failed\n"
                           f"{done.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("MARGINS "))


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.demo_margins",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("chapter", help="two digits, e.g. 13")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--setups", nargs="+", default=list(SETUPS), choices=list(SETUPS))
    args = parser.parse_args()
    runs = {(seed, setup): run(args.chapter, seed, setup) for seed in args.seeds for setup in args.setups}
    columns = [f"s{seed} {setup}" for seed, setup in runs]
    print(f"| line | assert | {' | '.join(columns)} | smallest slack |")
    print(f"|---|---|{'---|' * len(columns)}---|")
    first = next(iter(runs.values()))
    for index, entry in enumerate(first):
        cells = []
        for results in runs.values():
            result = results[index]
            cells.append(("ok" if result["held"] else "FAILS") if result["slack"] is None
                         else f"{result['slack']:+.3g}")
        slacks = [results[index]["slack"] for results in runs.values() if results[index]["slack"] is not None]
        held = all(results[index]["held"] for results in runs.values())
        smallest = f"{min(slacks):+.3g}" if slacks else ("ok" if held else "FAILS")
        print(f"| {entry['line']} | `{entry['text']}` | {' | '.join(cells)} | {smallest} |")


if __name__ == "__main__":
    main()
