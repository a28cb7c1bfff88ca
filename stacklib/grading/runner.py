"""Exercises, their cases, and running a learner's answer through them.

An exercise is an id such as "03.adam", a title, and a list of cases. A case is a
small function that receives the learner's answer (a function or class), calls it,
and raises `CaseFailure` if the result is wrong; each case is worth some points.
Chapters register their exercises in `stacklib.cases.chNN`; `grade("03.adam", adam)`
imports that module on first use, runs every case, and returns the scores.

Running a case never lets a learner's bug escape as a traceback. The outcome is one of
  passed           — full points;
  failed           — the case's message says what differs, plus the case's hint;
  not implemented  — the answer raised NotImplementedError (the exercise stub does);
  error            — the answer raised; we report the exception and the learner's line;
  timed out        — the answer ran past the case's time limit and was stopped.
"""

from __future__ import annotations

import dataclasses
import importlib
import pathlib
import pkgutil
import signal
import sysconfig
import threading
import traceback
from collections.abc import Callable
from typing import Any

from stacklib.grading.expect import CaseFailure

CASES_PACKAGE = "stacklib.cases"
DEFAULT_TIME_LIMIT_S = 30.0

PASSED, FAILED, NOT_IMPLEMENTED, ERROR, TIMED_OUT = (
    "passed", "failed", "not implemented", "error", "timed out"
)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    run: Callable[[Any], None]  # raises CaseFailure when the answer is wrong
    points: int
    hint: str
    time_limit_s: float


@dataclasses.dataclass
class Exercise:
    """An exercise id, what it asks, and the cases that grade it.

    Register cases with the `case` decorator:

        softmax = Exercise("00.softmax", "A numerically stable softmax")

        @softmax.case(points=2, hint="Subtract the maximum before exp.")
        def large_logits_do_not_overflow(softmax_fn):
            expect_close(softmax_fn(np.array([1000.0, 1000.0])), [0.5, 0.5])
    """

    exercise_id: str
    title: str
    cases: list[Case] = dataclasses.field(default_factory=list)

    def __post_init__(self):
        chapter, _, name = self.exercise_id.partition(".")
        if not (len(chapter) == 2 and chapter.isdigit() and name.isidentifier()):
            raise ValueError(
                f"Exercise id {self.exercise_id!r} must look like 'NN.name' "
                "(two-digit chapter, a dot, a Python identifier), e.g. '03.adam'."
            )
        if self.exercise_id in _REGISTRY:
            raise ValueError(f"Exercise {self.exercise_id!r} is registered twice.")
        _REGISTRY[self.exercise_id] = self

    @property
    def chapter(self) -> str:
        return self.exercise_id.split(".")[0]

    @property
    def max_points(self) -> int:
        return sum(case.points for case in self.cases)

    def case(self, *, points: int = 1, hint: str = "", time_limit_s: float = DEFAULT_TIME_LIMIT_S):
        """Decorator that adds a case; the function's name, with spaces, is the case name."""

        def register(run: Callable[[Any], None]) -> Callable[[Any], None]:
            name = run.__name__.replace("_", " ")
            self.cases.append(Case(name, run, points, hint, time_limit_s))
            return run

        return register


_REGISTRY: dict[str, Exercise] = {}


class UnknownExerciseError(LookupError):
    """`check` or `grade` was given an exercise id that no chapter registers."""


def _import_chapter_cases(chapter: str) -> None:
    try:
        importlib.import_module(f"{CASES_PACKAGE}.ch{chapter}")
    except ModuleNotFoundError as error:
        if error.name != f"{CASES_PACKAGE}.ch{chapter}":
            raise  # a case module exists but one of its imports is missing


def _import_all_cases() -> None:
    package = importlib.import_module(CASES_PACKAGE)
    for module in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{CASES_PACKAGE}.{module.name}")


def exercises_of_chapter(chapter: str) -> list[Exercise]:
    """The exercises that chapter `chapter` ("00".."99") registers, in id order."""
    _import_chapter_cases(chapter)
    return sorted(
        (ex for ex in _REGISTRY.values() if ex.chapter == chapter), key=lambda ex: ex.exercise_id
    )


def get_exercise(exercise_id: str) -> Exercise:
    """Look up an exercise by id, importing its chapter's cases on first use.

    Raises:
      UnknownExerciseError: no such id; the message lists every known id.
    """
    if not isinstance(exercise_id, str):
        raise TypeError(f"The exercise id must be a string like '00.softmax', got {exercise_id!r}.")
    chapter = exercise_id.partition(".")[0]
    if len(chapter) == 2 and chapter.isdigit():
        _import_chapter_cases(chapter)
    if exercise_id not in _REGISTRY:
        _import_all_cases()
        known = ", ".join(sorted(_REGISTRY)) or "(none)"
        raise UnknownExerciseError(
            f"There is no exercise {exercise_id!r}. Known exercises: {known}."
        )
    return _REGISTRY[exercise_id]


@dataclasses.dataclass(frozen=True)
class CaseResult:
    name: str
    status: str
    points: int
    max_points: int
    message: str = ""


@dataclasses.dataclass(frozen=True)
class ExerciseResult:
    exercise_id: str
    title: str
    cases: tuple[CaseResult, ...]

    @property
    def points(self) -> int:
        return sum(case.points for case in self.cases)

    @property
    def max_points(self) -> int:
        return sum(case.max_points for case in self.cases)

    def to_dict(self) -> dict:
        return {
            "exercise_id": self.exercise_id,
            "points": self.points,
            "max_points": self.max_points,
            "cases": [dataclasses.asdict(case) for case in self.cases],
        }


class CaseTimeout(BaseException):
    """Raised inside a case that ran past its time limit.

    A BaseException, like KeyboardInterrupt, so that a learner's `except Exception`
    inside a loop cannot swallow it.
    """


def _call_with_time_limit(function: Callable[[], None], seconds: float) -> None:
    """Call `function()`, stopping it with CaseTimeout after `seconds`.

    In the main thread of a POSIX process (a Jupyter kernel, pytest) a SIGALRM timer
    raises CaseTimeout inside the running Python code, which stops even `while True:
    pass`. Elsewhere, the call runs in a daemon thread that we stop waiting for; the
    thread cannot be killed, but the grader moves on. Code stuck inside one long C call
    (a huge XLA computation) is stopped when that call returns.
    """
    use_alarm = hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
    if use_alarm:

        def on_alarm(signum, frame):
            raise CaseTimeout

        previous = signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, seconds)
        try:
            function()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        return

    outcome: list[BaseException | None] = []

    def target():
        try:
            function()
            outcome.append(None)
        except BaseException as error:  # handed to the caller's thread below
            outcome.append(error)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    if not outcome:
        raise CaseTimeout
    if outcome[0] is not None:
        raise outcome[0]


_NOT_LEARNER_CODE = (
    sysconfig.get_paths()["stdlib"],
    str(pathlib.Path(__file__).resolve().parents[1]),  # the stacklib package
)


def _is_learner_frame(filename: str) -> bool:
    """False for frames in stacklib, the standard library and installed packages."""
    installed = {"site-packages", "dist-packages"} & set(pathlib.Path(filename).parts)
    return not installed and not str(pathlib.Path(filename).resolve()).startswith(_NOT_LEARNER_CODE)


def _where_in_learner_code(error: BaseException) -> str:
    """' (in fn_name, line N: `source`)' for the innermost frame of the learner's code."""
    frames = [
        frame for frame in traceback.extract_tb(error.__traceback__)
        if _is_learner_frame(frame.filename)
    ]
    if not frames:
        return ""
    frame = frames[-1]
    source = f": `{frame.line.strip()}`" if frame.line else ""
    return f" (in {frame.name}, line {frame.lineno}{source})"


def _is_not_implemented(error: BaseException) -> bool:
    while error is not None:
        if isinstance(error, NotImplementedError):
            return True
        error = error.__cause__ or error.__context__
    return False


def run_case(case: Case, answer: Any) -> CaseResult:
    """Run one case against the learner's answer and score it."""

    def result(status: str, message: str = "") -> CaseResult:
        points = case.points if status == PASSED else 0
        return CaseResult(case.name, status, points, case.points, message)

    if answer is None:
        return result(NOT_IMPLEMENTED, "not implemented yet")
    try:
        _call_with_time_limit(lambda: case.run(answer), case.time_limit_s)
    except CaseFailure as failure:
        hint = f" Hint: {case.hint}" if case.hint else ""
        return result(FAILED, f"{failure}.{hint}" if str(failure) else hint.strip())
    except CaseTimeout:
        return result(
            TIMED_OUT,
            f"stopped at the {case.time_limit_s:g} s time limit: look for a loop that never "
            "ends, or for a slow Python loop that array operations could replace.",
        )
    except Exception as error:
        if _is_not_implemented(error):
            return result(NOT_IMPLEMENTED, "not implemented yet")
        message = f"{type(error).__name__}: {error}{_where_in_learner_code(error)}"
        return result(ERROR, message)
    return result(PASSED)


def grade(exercise_id: str, answer: Any) -> ExerciseResult:
    """Run every case of `exercise_id` against `answer` and return the scores (no printing)."""
    exercise = get_exercise(exercise_id)
    results = tuple(run_case(case, answer) for case in exercise.cases)
    return ExerciseResult(exercise.exercise_id, exercise.title, results)
