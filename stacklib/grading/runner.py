"""Exercises, their cases, and running a learner's answer through them.

An exercise is an id such as "03.adam", a title, and a list of cases. A case is a
small function that receives the learner's answer (a function or class), calls it,
and raises `CaseFailure` if the result is wrong; each case is worth some points.
Chapters register their exercises in `stacklib.cases.chNN`; `grade("03.adam", adam)`
imports that module on first use, runs every case, and returns the scores.

Running a case never lets a learner's bug escape as a traceback, nor stop the
notebook's Run All (so the later exercises are graded too). The outcome is one of
  passed           — full points;
  failed           — the case's message says what differs, plus a hint: the failed
                     check's own (`expect(..., hint=...)`) or else the case's;
  not implemented  — the answer raised NotImplementedError (the exercise stub does);
  error            — the answer raised (or called sys.exit()); we report the exception
                     (its first paragraph: no wall of JAX internals), the learner's line,
                     and a hint for that kind of error;
  timed out        — the answer ran past the case's time limit and was stopped;
  skipped          — an earlier case of the same exercise timed out.

Decisions, and why:
- Hangs. A function that hangs usually hangs in every case, so after the first
  timeout the exercise's remaining cases are skipped (0 points, "fix the hang
  first"): the learner waits one time limit, not cases x limit. Each case keeps its
  own limit (rather than sharing one budget) so that one slow but finishing case
  cannot use up the time of the next.
- Exits and interrupts. `sys.exit()`, `raise SystemExit` and `raise KeyboardInterrupt`
  in the learner's code are graded as errors. A real interrupt (the notebook's stop
  button or Ctrl-C, both a SIGINT) still stops the check: while a case runs, a SIGINT
  handler records that a signal arrived, and the runner raises KeyboardInterrupt when
  the case ends, even if the learner's code swallowed it with a bare `except:`.
- Printed output. What a case prints (stdout and stderr) is captured into a bounded
  buffer, and the report shows its first lines for the cases that did not pass: a
  function that prints 10,000 lines cannot flood the cell, and a debugging print
  appears beside the case it explains.
- Whose error. An exception that passed through the learner's code is the learner's:
  the report gives its message and the learner's line. One raised while the
  learner's code was not running is the case's own code failing on what the answer
  returned (`len(None)`); the report says so instead of showing the grader's
  TypeError as if it were the learner's bug, and names the usual cause, a function
  that returned None because it has no `return`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import io
import pathlib
import pkgutil
import re
import signal
import sysconfig
import threading
import traceback
from collections.abc import Callable
from typing import Any

from stacklib.grading.expect import CaseFailure, _per_device_note

CASES_PACKAGE = "stacklib.cases"
DEFAULT_TIME_LIMIT_S = 30.0

PASSED, FAILED, NOT_IMPLEMENTED, ERROR, TIMED_OUT, SKIPPED = (
    "passed", "failed", "not implemented", "error", "timed out", "skipped"
)
SKIPPED_AFTER_TIMEOUT = "skipped: an earlier case timed out; fix the hang first"
MAX_MESSAGE_CHARS = 1000  # a learner's exception may carry a whole array in its message


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
    # Where None is a right answer for some inputs ("no rule matches"), a failure must not
    # suggest that returning None means a forgotten `return`.
    none_is_an_answer: bool = False

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
    output: str = ""  # the start of what the case printed; kept only if it did not pass


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


# --- time limits ------------------------------------------------------------------------------


class CaseTimeout(BaseException):
    """Raised inside a case that ran past its time limit.

    A BaseException, like KeyboardInterrupt, so that a learner's `except Exception`
    inside a loop cannot swallow it.
    """


_ALARM_REPEAT_S = 0.1

# A case's limit is on the CPU time the grading process spends (all its threads), so that a
# grade does not depend on what else the machine is running: a right answer that needs 5 s of
# CPU passes a 30 s limit at any load. Code that waits without computing (a blocked queue, a
# sleep) uses no CPU, so a wall-clock backstop stops it too, at a multiple of the limit that
# leaves room for a loaded machine.
_WALL_BACKSTOP_FACTOR = 4


def _call_with_time_limit(function: Callable[[], None], seconds: float) -> None:
    """Call `function()`, stopping it with CaseTimeout after `seconds` of CPU time.

    In the main thread of a POSIX process (a Jupyter kernel, pytest) timer signals raise
    CaseTimeout inside the running Python code, which stops even `while True: pass`:
    SIGPROF after `seconds` of the process's CPU time, SIGALRM after
    `_WALL_BACKSTOP_FACTOR * seconds` of wall-clock time, whichever comes first.
    Elsewhere, the call runs in a daemon thread that we stop waiting for after `seconds`
    of wall-clock time; the thread cannot be killed, but the grader moves on. Code stuck
    inside one long C call (a huge XLA computation) is stopped when that call returns.
    """
    if hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread():
        _call_with_alarm(function, seconds)
    else:
        _call_in_thread(function, seconds)


def _call_with_alarm(function: Callable[[], None], seconds: float) -> None:
    """The timer-signal version of `_call_with_time_limit`.

    A bare `except:` catches CaseTimeout too. So a call that a timer interrupted
    counts as timed out even if it then returned (a fallback value earns no points),
    and the timers repeat until the call ends, so code that carries on after
    swallowing one stop meets the next. (A loop that swallows every stop inside its
    `try` cannot be stopped from within Python; restarting the kernel can.)
    """
    alarm = _AlarmState()

    def on_alarm(signum, frame):
        if alarm.armed:
            alarm.rang = True
            raise CaseTimeout

    timers = {signal.SIGPROF: (signal.ITIMER_PROF, seconds),
              signal.SIGALRM: (signal.ITIMER_REAL, seconds * _WALL_BACKSTOP_FACTOR)}
    previous = {signum: signal.signal(signum, on_alarm) for signum in timers}
    for timer, after in timers.values():
        signal.setitimer(timer, after, _ALARM_REPEAT_S)
    try:
        function()
    except BaseException:
        if not alarm.rang:
            raise
    finally:
        alarm.armed = False  # first, so that a signal already on its way is ignored
        for signum, (timer, _) in timers.items():
            signal.setitimer(timer, 0)
            _restore_handler(signum, previous[signum])
    if alarm.rang:
        raise CaseTimeout


@dataclasses.dataclass
class _AlarmState:
    armed: bool = True
    rang: bool = False


def _call_in_thread(function: Callable[[], None], seconds: float) -> None:
    """The thread version of `_call_with_time_limit`, for where SIGALRM cannot be used."""
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


def _restore_handler(signum: int, previous: Any) -> None:
    # None means the handler was set outside Python; the default is the closest we can do.
    default = signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL
    signal.signal(signum, default if previous is None else previous)


# --- interrupts -------------------------------------------------------------------------------


@contextlib.contextmanager
def _real_interrupts_stop_the_check():
    """Within the block, record a real SIGINT; at its end, raise KeyboardInterrupt if one came.

    The learner's code can raise KeyboardInterrupt itself (graded as an error), or
    swallow the real one with a bare `except:`. Only the signal handler knows which is
    which. Signals reach only the main thread, so elsewhere (and where SIGINT is
    ignored anyway) every KeyboardInterrupt comes from code, and nothing is installed.
    """
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.getsignal(signal.SIGINT)
    if previous in (None, signal.SIG_IGN):
        yield
        return
    arrived = False

    def on_interrupt(signum, frame):
        nonlocal arrived
        arrived = True
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_interrupt)
    try:
        yield
    finally:
        _restore_handler(signal.SIGINT, previous)
    if arrived:
        raise KeyboardInterrupt


# --- printed output ---------------------------------------------------------------------------


class _OutputExcerpt(io.TextIOBase):
    """A text stream that keeps the first lines written to it and counts the rest.

    It stands in for sys.stdout and sys.stderr while a case runs. A learner's function
    may print thousands of lines; the report needs the first few (usually where the
    surprise is) and how many more there were, and memory stays bounded.
    """

    MAX_LINES = 5
    MAX_LINE_CHARS = 160
    encoding = "utf-8"

    def __init__(self):
        super().__init__()
        self._head = ""  # the start of the output: enough for MAX_LINES full lines
        self._newlines = 0
        self._ends_with_newline = True

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        room = self.MAX_LINES * (self.MAX_LINE_CHARS + 1) - len(self._head)
        if room > 0:
            self._head += text[:room]
        self._newlines += text.count("\n")
        if text:
            self._ends_with_newline = text.endswith("\n")
        return len(text)

    def excerpt(self) -> str:
        """The first lines (long ones cut), then '... N more lines'; '' if nothing was printed."""
        total = self._newlines + (0 if self._ends_with_newline else 1)
        shown = self._head.split("\n")[: min(total, self.MAX_LINES)]
        lines = [line if len(line) <= self.MAX_LINE_CHARS else line[: self.MAX_LINE_CHARS] + "…"
                 for line in shown]
        hidden = total - len(shown)
        if hidden:
            lines.append(f"... {hidden:,} more line{'s' if hidden > 1 else ''}")
        return "\n".join(lines)


# --- whose error ------------------------------------------------------------------------------


@dataclasses.dataclass
class _Calls:
    """What the learner's function did during one case, as `_watched` saw it."""

    none_is_an_answer: bool = False  # the exercise's: then returning None is not the mistake
    returned_none: bool = False
    last_result_type: str = ""
    per_device_note: str = ""  # set when the last result looks like one value per device
    escaped: list[BaseException] = dataclasses.field(default_factory=list)  # raised through it


def _watched(answer: Any, calls: _Calls) -> Any:
    """`answer`, wrapped if it is a plain function so that the runner sees its results.

    The wrapper is transparent: functools.wraps keeps the name, docstring and signature,
    and it is a function, so a case can still jit it or make it a method. Classes are
    handed over as they are, since a case may subclass them or check isinstance.
    """
    if not inspect.isfunction(answer):
        return answer

    @functools.wraps(answer)
    def watched(*args, **kwargs):
        try:
            result = answer(*args, **kwargs)
        except BaseException as error:
            calls.escaped.append(error)
            raise
        calls.returned_none |= result is None and not calls.none_is_an_answer
        calls.last_result_type = type(result).__name__
        calls.per_device_note = _per_device_note(result, devices_only=True)
        return result

    return watched


_NOT_LEARNER_CODE = (
    sysconfig.get_paths()["stdlib"],
    str(pathlib.Path(__file__).resolve().parents[1]),  # the stacklib package
)


def _is_learner_frame(filename: str) -> bool:
    """False for frames in stacklib, the standard library and installed packages."""
    if filename.startswith(("<frozen ", "<string>")):  # importlib; code generated by dataclasses
        return False
    installed = {"site-packages", "dist-packages"} & set(pathlib.Path(filename).parts)
    return not installed and not str(pathlib.Path(filename).resolve()).startswith(_NOT_LEARNER_CODE)


def _learner_frames(error: BaseException, case: Case) -> list[traceback.FrameSummary]:
    """The frames of `error`'s traceback in the learner's code, outermost first.

    The case's own function is the grader's wherever it is defined (a test file, or a
    notebook cell that registers cases).
    """
    case_code = getattr(case.run, "__code__", None)
    tb = error.__traceback__
    frames = zip(traceback.walk_tb(tb), traceback.extract_tb(tb), strict=True)
    return [summary for (frame, _), summary in frames
            if frame.f_code is not case_code and _is_learner_frame(summary.filename)]


def _where_in_learner_code(error: BaseException, case: Case) -> str:
    """' (in fn_name, line N: `source`)' for the innermost frame of the learner's code."""
    frames = _learner_frames(error, case)
    if not frames:
        return ""
    frame = frames[-1]
    source = f": `{frame.line.strip()}`" if frame.line else ""
    return f" (in {frame.name}, line {frame.lineno}{source})"


def _raised_in_learner_code(error: BaseException, case: Case, calls: _Calls) -> bool:
    """Whether `error`, or one it was raised from, came out of the learner's code.

    Either a frame of the learner's code is in its traceback, or it came out of a call
    of the learner's function (a wrong number of arguments has no frame of its own).
    """
    while error is not None:
        if any(error is escaped for escaped in calls.escaped) or _learner_frames(error, case):
            return True
        error = error.__cause__
    return False


def _is_not_implemented(error: BaseException) -> bool:
    while error is not None:
        if isinstance(error, NotImplementedError):
            return True
        error = error.__cause__ or error.__context__
    return False


# --- running cases ----------------------------------------------------------------------------


def _with_hint(message: str, case: Case, hint: str | None = None) -> str:
    """`message`, then a hint: `hint` when given ("" for none), else the case's."""
    hint = case.hint if hint is None else hint
    hint = f" Hint: {hint}" if hint else ""
    if not message:
        return hint.strip()
    return f"{message}{'' if message.endswith(('.', '?', '!')) else '.'}{hint}"


_RETURNED_NONE = "your function returned None: did you forget `return`?"

# Errors whose cause is known from their type or message: (type name, message pattern, what it
# means for the learner, the hint that names the mistake). JAX's own text for these is long and
# advises flags (check_vma=False, JAX_TRACEBACK_FILTERING) that a learner cannot pass.
_ERROR_HINTS: list[tuple[str, str, str, str]] = [
    ("", r"out_specs which require replication", (
        "your function returns a value that differs from device to device where the output is "
        "declared the same on every device (out_specs=P())"),
     "Combine the per-device values first: jax.lax.psum (a sum) or jax.lax.pmean (a mean) over the "
     "mesh axis, inside the shard_map."),
    ("TracerArrayConversionError", "", "", (
        "A NumPy function (np.*, or np.asarray) was given a traced array inside jax.jit, grad or "
        "vmap: use the jax.numpy function of the same name.")),
    ("TracerBoolConversionError", "", "", (
        "Python `if`, `while`, `and`/`or` or bool() on a traced value: under jit the value is not known "
        "yet. Use jnp.where, jax.lax.cond or jax.lax.while_loop, or compute on shapes, which are known.")),
    ("ConcretizationTypeError", "", "", (
        "A concrete number (a size, an index, a Python int) was taken from a traced value: derive it from "
        "the shapes (x.shape) or static arguments instead.")),
    ("TracerIntegerConversionError", "", "", (
        "int() or an index of a traced value: under jit it has no value yet. Use jnp indexing "
        "(x[i] with a traced i works) or jax.lax.dynamic_slice.")),
    ("TypeError", r"dot_general requires contracting dimensions|incompatible shapes|"
                  r"add got incompatible shapes|cannot broadcast", "", (
        "Two arrays' shapes do not fit: check each operand's shape against the statement "
        "(print x.shape) and the order of a matmul's operands.")),
    ("ValueError", r"operands could not be broadcast|matmul: Input operand|shapes .* not aligned", "", (
        "Two arrays' shapes do not fit: check each operand's shape against the statement "
        "(print x.shape) and the order of a matmul's operands.")),
    ("TypeError", r"positional argument|unexpected keyword argument|required keyword", "", (
        "The function's signature differs from the one in the statement: keep its arguments' names "
        "and order.")),
    ("AttributeError", r"'NoneType' object has no attribute", "", (
        "Something in your code is None where a value was expected: a helper without `return`, "
        "or a method such as list.sort() that returns None.")),
]


def _known_error(error: BaseException) -> tuple[str, str] | None:
    """(what it means, hint) for an error of a known kind, or None."""
    chain = [error]
    while chain[-1].__cause__ is not None and len(chain) < 5:
        chain.append(chain[-1].__cause__)
    for raised in chain:
        for type_name, pattern, meaning, hint in _ERROR_HINTS:
            names = {cls.__name__ for cls in type(raised).__mro__}
            if (not type_name or type_name in names) and (not pattern or re.search(pattern, str(raised))):
                return meaning, hint
    return None


def _error_text(error: BaseException) -> str:
    """`Type: message`, cut to its first paragraph without JAX's links and flag advice."""
    paragraphs = [p for p in str(error).strip().split("\n\n") if p.strip()]
    first = paragraphs[0] if paragraphs else ""
    lines = [line for line in first.splitlines() if not re.match(
        r"\s*(See https?://|The error occurred while tracing|For simplicity, JAX has removed|"
        r"-+$|.*JAX_TRACEBACK_FILTERING)", line)]
    text = " ".join(line.strip() for line in lines) or first.strip()
    return f"{type(error).__name__}: {text}"


def _grader_could_not_use(error: BaseException, answer: Any, calls: _Calls, case: Case) -> str:
    """The message for the case's own code failing on what the answer gave it."""
    if calls.returned_none:
        return _with_hint(_RETURNED_NONE, case)
    known = _known_error(error)
    if known is not None and known[0]:
        return _with_hint(known[0], case, known[1])
    described = _error_text(error)
    if calls.per_device_note:
        return _with_hint(f"the grader could not use what your function returned, a "
                          f"{calls.last_result_type}{calls.per_device_note}", case, "")
    if calls.last_result_type:
        return _with_hint(
            f"the grader could not use what your function returned ({calls.last_result_type}): "
            f"{described}", case)
    name = getattr(answer, "__name__", type(answer).__name__)
    if "NoneType" in str(error):
        described += " (None often comes from a method with no `return`)"
    return _with_hint(f"the grader could not use your answer ({name}): {described}", case)


def _diagnose(error: BaseException, case: Case, answer: Any, calls: _Calls) -> tuple[str, str]:
    """The status and message of a case that raised `error`."""
    if isinstance(error, CaseFailure):
        message = str(error)
        if calls.returned_none and "None" in message:
            message += f"; {_RETURNED_NONE}"
        return FAILED, _with_hint(message, case, getattr(error, "hint", None))
    if isinstance(error, CaseTimeout):
        return TIMED_OUT, (
            f"stopped at the {case.time_limit_s:g} s time limit (CPU time): look for a loop that never "
            "ends, or for a slow Python loop that array operations could replace."
        )
    where = _where_in_learner_code(error, case)
    if isinstance(error, SystemExit):
        return ERROR, ("your code called sys.exit() (or raised SystemExit), which would stop the "
                       f"notebook: return a value instead{where}")
    if isinstance(error, KeyboardInterrupt):
        return ERROR, ("your code raised KeyboardInterrupt, which would stop the notebook: raise "
                       f"an ordinary exception (e.g. ValueError) or return a value instead{where}")
    if _is_not_implemented(error):
        return NOT_IMPLEMENTED, "not implemented yet"
    if _raised_in_learner_code(error, case, calls):
        known = _known_error(error)
        meaning = f"{known[0]}: " if known and known[0] else ""
        return ERROR, _with_hint(f"{meaning}{_error_text(error)}{where}", case, known[1] if known else None)
    return ERROR, _grader_could_not_use(error, answer, calls, case)


def _shortened(message: str) -> str:
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    return f"{message[:MAX_MESSAGE_CHARS]}… ({len(message) - MAX_MESSAGE_CHARS:,} more characters)"


def _result(case: Case, status: str, message: str = "", output: str = "") -> CaseResult:
    points = case.points if status == PASSED else 0
    return CaseResult(case.name, status, points, case.points, _shortened(message), output)


def run_case(case: Case, answer: Any, *, none_is_an_answer: bool = False) -> CaseResult:
    """Run one case against the learner's answer and score it.

    Every exception, SystemExit and KeyboardInterrupt included, becomes an outcome; only
    a real interrupt (see the module docstring) stops the check.
    """
    if answer is None:
        return _result(case, NOT_IMPLEMENTED, "not implemented yet")
    if not callable(answer):
        return _result(case, ERROR, (
            f"expected your function or class, got {type(answer).__name__} {answer!r:.60}: "
            "pass the function itself, by its name and without calling it, "
            "as in check('00.softmax', softmax)"))
    calls = _Calls(none_is_an_answer=none_is_an_answer)
    output = _OutputExcerpt()
    with (_real_interrupts_stop_the_check(),
          contextlib.redirect_stdout(output), contextlib.redirect_stderr(output)):
        try:
            _call_with_time_limit(lambda: case.run(_watched(answer, calls)), case.time_limit_s)
            status, message = PASSED, ""
        except BaseException as error:  # graded below; a real interrupt is raised on exit
            status, message = _diagnose(error, case, answer, calls)
    return _result(case, status, message, "" if status == PASSED else output.excerpt())


def grade(exercise_id: str, answer: Any) -> ExerciseResult:
    """Run every case of `exercise_id` against `answer` and return the scores (no printing).

    After a case times out, the others are skipped (see the module docstring).
    """
    exercise = get_exercise(exercise_id)
    results: list[CaseResult] = []
    for case in exercise.cases:
        if any(result.status == TIMED_OUT for result in results):
            results.append(_result(case, SKIPPED, SKIPPED_AFTER_TIMEOUT))
        else:
            results.append(run_case(case, answer, none_is_an_answer=exercise.none_is_an_answer))
    return ExerciseResult(exercise.exercise_id, exercise.title, tuple(results))
