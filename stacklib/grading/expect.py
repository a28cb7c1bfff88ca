"""Assertions for exercise cases that explain what is wrong.

A learner who sees "AssertionError" learns nothing. These helpers compare a learner's
answer with the expected one and, when they differ, raise `CaseFailure` with the first
thing that differs: the tree structure (with the path), the shape, the dtype, or the
values (with the worst element, its index and both numbers).

NumPy only: answers may be JAX arrays, which `np.asarray` converts. Pytrees are
walked by hand (dicts, lists, tuples, named tuples, None) so this module does not
depend on JAX.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np


class CaseFailure(AssertionError):
    """The learner's answer is wrong; the message says how."""


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(x, "_fields")


def _children(tree: Any) -> list[tuple[str, Any]] | None:
    """(path step, child) pairs of a container node, or None for a leaf."""
    if isinstance(tree, dict):
        return [(f"[{key!r}]", tree[key]) for key in sorted(tree, key=repr)]
    if _is_namedtuple(tree):
        return [(f".{name}", getattr(tree, name)) for name in tree._fields]
    if isinstance(tree, list | tuple):
        return [(f"[{i}]", child) for i, child in enumerate(tree)]
    return None


def _node_kind(tree: Any) -> str:
    if tree is None:
        return "None"
    if isinstance(tree, dict):
        return f"dict with keys {sorted(tree, key=repr)}"
    if isinstance(tree, list | tuple):
        return f"{type(tree).__name__} of length {len(tree)}"
    return "leaf"


def _walk(got: Any, expected: Any, path: str) -> Iterator[tuple[str, Any, Any]]:
    """Yield matching (path, got leaf, expected leaf); raise on a structure mismatch."""
    got_children, expected_children = _children(got), _children(expected)
    if expected is None or got is None:
        if got is not expected:
            raise CaseFailure(
                f"at {path or 'the top'}: expected {_node_kind(expected)}, got {_node_kind(got)}"
            )
        return
    if expected_children is None:
        if got_children is not None:
            raise CaseFailure(
                f"at {path or 'the top'}: expected an array or number, got {_node_kind(got)}"
            )
        yield path, got, expected
        return
    same_kind = got_children is not None and (
        isinstance(got, dict) == isinstance(expected, dict)
        and [step for step, _ in got_children] == [step for step, _ in expected_children]
    )
    if not same_kind:
        raise CaseFailure(
            f"at {path or 'the top'}: expected {_node_kind(expected)}, got {_node_kind(got)}"
        )
    if type(got) is not type(expected) and not isinstance(expected, dict):
        raise CaseFailure(
            f"at {path or 'the top'}: expected a {type(expected).__name__}, "
            f"got a {type(got).__name__}"
        )
    for (step, got_child), (_, expected_child) in zip(got_children, expected_children, strict=True):
        yield from _walk(got_child, expected_child, path + step)


def _describe_array(x: np.ndarray) -> str:
    return f"shape {x.shape}, dtype {x.dtype}"


def expect_close(
    got: Any,
    expected: Any,
    *,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    check_dtype: bool = False,
    what: str = "the result",
) -> None:
    """Require `got` to match `expected`: same tree structure, shapes, and values within tolerance.

    Args:
      got: the learner's answer; an array, number or pytree of them.
      expected: the reference answer, of the same structure.
      rtol, atol: the tolerance of `np.allclose`; NaNs match only NaNs.
      check_dtype: also require identical dtypes.
      what: how the message names the value (e.g. "the gradient").

    Raises:
      CaseFailure: naming the path, then what differs.
    """
    for path, got_leaf, expected_leaf in _walk(got, expected, ""):
        where = f"{what}{path}"
        try:
            got_array = np.asarray(got_leaf)
        except Exception as error:  # e.g. a learner returned an object that is not an array
            raise CaseFailure(
                f"{where}: expected an array, got {type(got_leaf).__name__} ({error})"
            ) from None
        expected_array = np.asarray(expected_leaf)
        if got_array.shape != expected_array.shape:
            raise CaseFailure(
                f"{where}: expected shape {expected_array.shape}, got shape {got_array.shape}"
            )
        if check_dtype and got_array.dtype != expected_array.dtype:
            raise CaseFailure(
                f"{where}: expected dtype {expected_array.dtype}, got dtype {got_array.dtype}"
            )
        numeric = "biufc"
        if expected_array.dtype.kind in numeric and got_array.dtype.kind not in numeric:
            raise CaseFailure(
                f"{where}: expected numbers, got {type(got_leaf).__name__} {got_leaf!r:.80}"
            )
        if expected_array.dtype.kind not in numeric:
            if not np.array_equal(got_array, expected_array):
                raise CaseFailure(f"{where}: expected {expected_array!r}, got {got_array!r}")
            continue
        got_values = got_array.astype(np.float64)
        expected_values = expected_array.astype(np.float64)
        close = np.isclose(got_values, expected_values, rtol=rtol, atol=atol, equal_nan=True)
        if not close.all():
            raise CaseFailure(_mismatch_message(where, got_values, expected_values, close))


def _mismatch_message(
    where: str, got: np.ndarray, expected: np.ndarray, close: np.ndarray
) -> str:
    if got.ndim == 0:
        return f"{where}: expected {expected.item():.6g}, got {got.item():.6g}"
    with np.errstate(invalid="ignore"):  # inf - inf is NaN here, not a warning in the learner's output
        error = np.where(close, 0.0, np.abs(got - expected))
    error = np.where(np.isnan(error), np.inf, error)  # a NaN is the worst mismatch
    worst = np.unravel_index(np.argmax(error), error.shape)
    index = ", ".join(str(int(i)) for i in worst)
    return (
        f"{where}: {int((~close).sum())} of {close.size} values differ "
        f"({_describe_array(got)}); worst at [{index}]: "
        f"expected {expected[worst]:.6g}, got {got[worst]:.6g}"
    )


def expect_equal(got: Any, expected: Any, *, what: str = "the result") -> None:
    """Require exact equality: same structure, shapes, dtypes and values."""
    expect_close(got, expected, rtol=0.0, atol=0.0, check_dtype=True, what=what)


def expect(condition: bool, message: str) -> None:
    """Require `condition`; otherwise fail with `message` (say what was expected and got)."""
    if not condition:
        raise CaseFailure(message)


def numerical_gradient(f: Callable[[np.ndarray], float], x: np.ndarray, eps: float = 1e-6):
    """Central-difference gradient of a scalar function of one float64 array.

    Each coordinate costs two calls of `f`: (f(x + eps e_i) - f(x - eps e_i)) / 2 eps.
    The error is O(eps^2) from truncation plus O(1e-16 / eps) from rounding, so
    eps = 1e-6 in float64 gives about 1e-9 relative accuracy on smooth functions.
    """
    x = np.asarray(x, dtype=np.float64)
    gradient = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        step = np.zeros_like(x)
        step[i] = eps
        gradient[i] = (float(f(x + step)) - float(f(x - step))) / (2 * eps)
    return gradient


def expect_gradient(
    gradient_fn: Callable, f: Callable, x: np.ndarray, *, rtol: float = 1e-4, atol: float = 1e-6
) -> None:
    """Require `gradient_fn(x)` to match the central-difference gradient of `f` at `x`."""
    expect_close(
        gradient_fn(x), numerical_gradient(f, x), rtol=rtol, atol=atol, what="the gradient"
    )


def _same_value(a: Any, b: Any) -> bool:
    """Deep equality for the inputs cases hand to learners (arrays compared by value)."""
    try:
        expect_equal(a, b)
    except CaseFailure:
        return False
    except Exception:  # not an array tree (an object, a generator): compare as Python values
        try:
            return bool(a == b)
        except Exception:
            return False
    return True


def _copy_for_learner(value: Any) -> Any:
    """A deep copy of `value`, except for parts that cannot be copied, which are shared.

    Some inputs hold objects that refuse `deepcopy` (a JAX `Device` inside a sharding, a
    lock); those are immutable or not the learner's to change, so sharing them is safe.
    """
    try:
        return copy.deepcopy(value)
    except Exception:
        if isinstance(value, dict):
            return type(value)((key, _copy_for_learner(child)) for key, child in value.items())
        if _is_namedtuple(value):
            return type(value)(*(_copy_for_learner(child) for child in value))
        if isinstance(value, list | tuple):
            return type(value)(_copy_for_learner(child) for child in value)
        return value


def call_on_copies(function: Callable, *args: Any, what: str = "your function", **kwargs: Any) -> Any:
    """Call the learner's `function` on deep copies of its arguments, and return its result.

    Cases compute their expected answer from the original arguments, before or after this
    call: the learner never sees them, so an answer that changes its inputs in place
    cannot change the expectation. Changing an input is itself a mistake worth naming
    (the caller's data would change under it), so it fails with its own message.

    Raises:
      CaseFailure: the function changed one of its arguments in place.
    """
    given_args, given_kwargs = _copy_for_learner(args), _copy_for_learner(kwargs)
    result = function(*given_args, **given_kwargs)
    changed = [f"argument {i + 1}" for i, (original, given) in enumerate(zip(args, given_args, strict=True))
               if not _same_value(given, original)]
    changed += [f"argument {name}=" for name in kwargs if not _same_value(given_kwargs[name], kwargs[name])]
    if changed:
        raise CaseFailure(
            f"{what} changed its input in place ({', '.join(changed)}): the caller's data must stay as "
            "it was. Work on a copy (e.g. np.array(x), list(x)) or build new arrays instead"
        )
    return result
