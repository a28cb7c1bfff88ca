"""Command line: `python -m stacklib.grading strip|grade ...` (see --help).

A user mistake (a missing folder, a broken solution marker, a bad time limit) exits with
status 2 and one message, as argparse's own errors do.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

from stacklib.grading.instructor import DEFAULT_NOTEBOOK_TIME_LIMIT_S, main_grade
from stacklib.grading.strip import SolutionMarkerError, stale_exercises, write_exercises


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m stacklib.grading",
                                     description="The book's graded exercises, for authors and instructors.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{strip,grade}")

    strip = commands.add_parser("strip", help="regenerate exercise notebooks from solution notebooks",
                                description="Write EXERCISES/NAME.ipynb for every SOLUTIONS/NAME.ipynb, "
                                            "with the code between the solution markers removed.")
    strip.add_argument("solutions", type=pathlib.Path, help="the folder of solution notebooks")
    strip.add_argument("exercises", type=pathlib.Path, help="the folder to write exercise notebooks into")
    strip.add_argument("--check", action="store_true",
                       help="write nothing; exit 1 if the exercises are stale")

    grade = commands.add_parser("grade", help="execute and grade every notebook in a folder",
                                description="Run each notebook in FOLDER in a fresh kernel and write a "
                                            "score table as OUT.csv and OUT.md.")
    grade.add_argument("folder", type=pathlib.Path, help="a folder of submitted notebooks")
    grade.add_argument("--out", default="scores",
                       help="write OUT.csv and OUT.md (default: %(default)s)")
    grade.add_argument("--time-limit", type=float, default=DEFAULT_NOTEBOOK_TIME_LIMIT_S,
                       help="seconds each notebook may run (default: %(default)s)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "strip":
        if not any(args.solutions.glob("*.ipynb")):
            parser.error(f"{str(args.solutions)!r} holds no solution notebooks (*.ipynb).")
        try:
            if args.check:
                stale = stale_exercises(args.solutions, args.exercises)
                for name in stale:
                    print(f"stale: {args.exercises / name}", file=sys.stderr)
                return 1 if stale else 0
            for path in write_exercises(args.solutions, args.exercises):
                print(f"wrote {path}")
        except SolutionMarkerError as error:
            parser.error(str(error))
        return 0
    if not args.folder.is_dir():
        parser.error(f"{str(args.folder)!r} is not a folder; give the folder of submitted notebooks.")
    if not args.time_limit > 0:
        parser.error(f"--time-limit {args.time_limit} must be a positive number of seconds.")
    return main_grade(args.folder, args.out, args.time_limit)


if __name__ == "__main__":
    sys.exit(main())
