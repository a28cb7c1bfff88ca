"""Command line: `python -m stacklib.grading strip|grade ...` (see --help)."""

from __future__ import annotations

import argparse
import pathlib
import sys

from stacklib.grading.instructor import DEFAULT_NOTEBOOK_TIME_LIMIT_S, main_grade
from stacklib.grading.strip import stale_exercises, write_exercises


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stacklib.grading")
    commands = parser.add_subparsers(dest="command", required=True)

    strip = commands.add_parser("strip", help="regenerate exercise notebooks from solution notebooks")
    strip.add_argument("solutions", type=pathlib.Path)
    strip.add_argument("exercises", type=pathlib.Path)
    strip.add_argument("--check", action="store_true",
                       help="write nothing; exit 1 if the exercises are stale")

    grade = commands.add_parser("grade", help="execute and grade every notebook in a folder")
    grade.add_argument("folder", type=pathlib.Path)
    grade.add_argument("--out", default="scores",
                       help="write OUT.csv and OUT.md (default: scores)")
    grade.add_argument("--time-limit", type=float, default=DEFAULT_NOTEBOOK_TIME_LIMIT_S,
                       help="seconds each notebook may run (default: %(default)s)")

    args = parser.parse_args(argv)
    if args.command == "strip":
        if args.check:
            stale = stale_exercises(args.solutions, args.exercises)
            for name in stale:
                print(f"stale: {args.exercises / name}", file=sys.stderr)
            return 1 if stale else 0
        for path in write_exercises(args.solutions, args.exercises):
            print(f"wrote {path}")
        return 0
    return main_grade(args.folder, args.out, args.time_limit)


if __name__ == "__main__":
    sys.exit(main())
