"""Run the benchmarks: `python -m benchmarks [name ...] [--scale S]`.

Each `benchmarks/bench_<name>.py` defines `main(scale: float = 1.0)`, which times our
version and the real library on the same work in the same process and prints their
ratio. Timings from one process on a shared 2-core machine are noisy, so they are
printed, not asserted; `tests/test_benchmarks.py` only runs each one at a tiny scale to
keep it working.

Each benchmark runs in a fresh Python process: some set JAX options that must come
before JAX starts (simulated devices, 64-bit mode), and none should inherit another's.
"""

import argparse
import pathlib
import subprocess
import sys

HERE = pathlib.Path(__file__).parent


def available() -> list[str]:
    return sorted(path.stem.removeprefix("bench_") for path in HERE.glob("bench_*.py"))


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks")
    parser.add_argument("names", nargs="*", help=f"which to run (default: all of {available()})")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply problem sizes by this")
    args = parser.parse_args()
    for name in args.names or available():
        if name not in available():
            parser.error(f"no benchmark {name!r}; choose from {available()}")
        print(f"== {name}", flush=True)
        code = f"from benchmarks.bench_{name} import main; main(scale={args.scale!r})"
        subprocess.run([sys.executable, "-c", code], check=True, cwd=HERE.parent)


if __name__ == "__main__":
    main()
