"""The capstone's claims, checked in a way that `python -O` cannot switch off.

An `assert` statement is removed under `python -O` (or `PYTHONOPTIMIZE=1`): a report whose
every claim failed would pass, and `python -m stacklib.capstone` would exit 0. `claim`
raises `ClaimFailed` instead, whatever the interpreter's flags, with what was expected
and what was measured:

    claim(report.quant.int8_bytes < limit, "int8 weights are about 4x smaller",
          expected=f"< {limit} bytes", measured=f"{report.quant.int8_bytes} bytes")
"""

from __future__ import annotations

from collections.abc import Sequence


class ClaimFailed(AssertionError):
    """A claim the capstone makes did not hold.

    A subclass of AssertionError, so that callers that caught the failed `assert`s
    still catch it; unlike an `assert`, it is raised under `python -O` too.
    """


def claim(holds: bool, what: str, *, expected: object, measured: object) -> None:
    """Raise `ClaimFailed` unless `holds`.

    Args:
      holds: whether the claim held.
      what: the claim, as a sentence ("the resumed run's weights equal ...").
      expected: what the claim needs, in words or numbers.
      measured: what the run measured.

    Raises:
      ClaimFailed: "<what>: expected <expected>, measured <measured>".
    """
    if not holds:
        raise ClaimFailed(f"{what}: expected {expected}, measured {measured}")


def first_difference(measured: Sequence, expected: Sequence) -> str:
    """Where two sequences first differ, in words (for `claim`'s `measured`); "" when equal."""
    for index, (got, want) in enumerate(zip(measured, expected, strict=False)):  # lengths: below
        if got != want:
            return f"{got!r} at index {index} (expected {want!r} there)"
    if len(measured) != len(expected):
        return f"{len(measured)} items where {len(expected)} were expected"
    return ""
