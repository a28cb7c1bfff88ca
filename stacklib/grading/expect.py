"""Assertions for exercise cases that explain what is wrong, without handing over the answer.

A learner who sees "AssertionError" learns nothing; one who sees the whole expected array
can copy it back case by case and learn nothing either. These helpers compare a learner's
answer with the expected one and, when they differ, raise `CaseFailure` with the smallest
difference that teaches: the tree structure (with the path), the shape, the dtype, or the
one element that differs (the worst one for floats, the first one for exact values), with
its index and both values. Never the whole expected value.

NumPy only: answers may be JAX arrays, which `np.asarray` converts. Pytrees are
walked by hand (dicts, lists, tuples, named tuples, None) so this module does not
depend on JAX (`expect_sharding` imports it when called).

The helpers, one usage line each (all take `what=` to name the value, and `hint=`: a hint
shown only when THIS condition fails, in place of the case's own hint; `hint=""` shows none):

    expect(ok, "what was expected, what was got", hint="the mistake that gives this")
    expect_close(got, expected, rtol=1e-5, what="the gradient", hint=...)   # pytrees of arrays
    expect_equal(got, expected, what="the mask")             # exact, dtype too; first differing index
    expect_same_sequence(rows, expected_rows, what="the schedule", describe=str)  # first differing item
    expect_instance(got, np.ndarray, what="the result", why="the statement asks for NumPy")  # library
    expect_mentions(reason, ["median"], what="the reason")   # free text must name what it must name
    expect_same_across_processes(key_fn, *args, what="the cache key")  # no hash()/id() in a persistent key
    with as_in_another_process(): again = fn(...)            # hash() of str salted anew, id() moved
    expect_sharding(out, NamedSharding(mesh, P()), what="the loss")     # a reduced, not per-device, value
    with forbidding(parallel.gpipe_schedule, why="the exercise is to build the table"): table = fn(4, 6)
    first_difference(got_items, expected_items)              # '' or "at position 3: expected 7, got 5"
    seeded_permutation(n, seed)                              # a shuffle no fixed permutation reproduces
    raise CaseFailure("message", hint="...")                 # the same, by hand

A case's `hint=` (in `Exercise.case`) is shown when a check without its own `hint=` fails,
so write it for the condition that case checks (name the mistake), not as a generic
sentence about the exercise. When the learner's code raises, the runner shows their line
and a hint for the kind of error (a NumPy call on a traced array, Python `if` on a traced
value, a shape mismatch, a value not reduced over devices); the case's hint otherwise.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np


class CaseFailure(AssertionError):
    """The learner's answer is wrong; the message says how.

    Args:
      message: what was expected and what was got (not the whole expected value).
      hint: shown instead of the case's hint when given; names the mistake that gives this
        failure. "" shows no hint at all; None (the default) shows the case's hint.
    """

    def __init__(self, message: str = "", hint: str | None = None):
        super().__init__(message)
        self.hint = hint


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
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        # Compared field by field (a QArray's qvalue and scale), not with the dataclass's `==`,
        # which cannot compare array fields and would call equal values different.
        return [(f".{field.name}", getattr(tree, field.name)) for field in dataclasses.fields(tree)]
    return None


def _node_kind(tree: Any) -> str:
    if tree is None:
        return "None"
    if isinstance(tree, dict):
        return f"dict with keys {sorted(tree, key=repr)}"
    if isinstance(tree, list | tuple):
        return f"{type(tree).__name__} of length {len(tree)}"
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        return f"a {type(tree).__name__}"
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
                f"{_per_device_note(got)}"
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


def _per_device_note(got: Any, *, devices_only: bool = False) -> str:
    """A note for a list or tuple of same-shaped arrays where one array was expected.

    Arrays that live on different devices are one value per device (read from a sharded
    array's shards, or returned per device): say how to combine them. Otherwise say to stack
    (or, with `devices_only`, say nothing: a pair such as (padded, mask) is no mistake).
    """
    if not isinstance(got, list | tuple) or len(got) < 2 or _is_namedtuple(got):
        return ""
    shapes = {getattr(leaf, "shape", None) for leaf in got}
    if len(shapes) != 1 or None in shapes:
        return ""
    shape = shapes.pop()
    devices = set()
    for leaf in got:
        try:
            devices |= set(leaf.devices())  # a jax.Array's devices; NumPy arrays have none
        except Exception:
            devices.add(None)
    if None not in devices and len(devices) > 1:
        return (f" of {len(got)} arrays of shape {shape} on {len(devices)} devices: one value per device, "
                "not yet combined. Reduce them into the one value asked for (jax.lax.psum or pmean "
                "inside shard_map, then out_specs=P())")
    if devices_only:
        return ""
    return f" of {len(got)} arrays of shape {shape}, where one array was expected: stack them (np.stack)"


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
    hint: str | None = None,
) -> None:
    """Require `got` to match `expected`: same tree structure, shapes, and values within tolerance.

    Args:
      got: the learner's answer; an array, number or pytree of them.
      expected: the reference answer, of the same structure.
      rtol, atol: the tolerance of `np.allclose`; NaNs match only NaNs.
      check_dtype: also require identical dtypes.
      what: how the message names the value (e.g. "the gradient").
      hint: shown for this failure instead of the case's hint (see `CaseFailure`).

    Raises:
      CaseFailure: naming the path, then what differs: one element, never the whole value.
    """
    try:
        _expect_close(got, expected, rtol=rtol, atol=atol, check_dtype=check_dtype, what=what)
    except CaseFailure as failure:
        if hint is None:
            raise
        raise CaseFailure(str(failure), hint=hint) from None


def _expect_close(got: Any, expected: Any, *, rtol: float, atol: float, check_dtype: bool, what: str) -> None:
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
            try:
                same = np.asarray(got_array == expected_array, dtype=bool)
            except Exception:  # values that do not compare (a str against a number)
                same = np.zeros(got_array.shape, bool)
            if same.shape != got_array.shape:
                same = np.broadcast_to(same, got_array.shape)
            if not same.all():
                raise CaseFailure(_first_mismatch_message(where, got_array, expected_array, same))
            continue
        # Exact values (ints, masks, or a comparison without tolerance): the first difference
        # teaches more than the largest one.
        integers = expected_array.dtype.kind in "biu" and got_array.dtype.kind in "biu"
        exact = (rtol == 0 and atol == 0) or integers
        if exact:
            with np.errstate(invalid="ignore"):
                same = (got_array == expected_array) | (np.isnan(got_array.astype(np.complex128))
                                                        & np.isnan(expected_array.astype(np.complex128)))
            if not same.all():
                raise CaseFailure(_first_mismatch_message(where, got_array, expected_array, same))
            continue
        got_values = got_array.astype(np.float64)
        expected_values = expected_array.astype(np.float64)
        close = np.isclose(got_values, expected_values, rtol=rtol, atol=atol, equal_nan=True)
        if not close.all():
            raise CaseFailure(_mismatch_message(where, got_values, expected_values, close))


def _show(value: Any) -> str:
    """One element, short: 6 significant digits for floats, repr (cut) for the rest."""
    if isinstance(value, float | np.floating):
        return f"{value:.6g}"
    if isinstance(value, np.generic):
        value = value.item()
    text = repr(value)
    return text if len(text) <= 60 else text[:60] + "…"


def _first_mismatch_message(where: str, got: np.ndarray, expected: np.ndarray, same: np.ndarray) -> str:
    """The count of differing elements and the first of them: for exact values (ints, masks, names)."""
    if got.ndim == 0:
        return f"{where}: expected {_show(expected[()])}, got {_show(got[()])}"
    first = tuple(int(i) for i in np.argwhere(~same)[0])
    index = ", ".join(str(i) for i in first)
    return (f"{where}: {int((~same).sum())} of {same.size} values differ ({_describe_array(got)}); "
            f"first at [{index}]: expected {_show(expected[first])}, got {_show(got[first])}")


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


def expect_equal(got: Any, expected: Any, *, what: str = "the result", hint: str | None = None) -> None:
    """Require exact equality: same structure, shapes, dtypes and values (the first difference is shown)."""
    expect_close(got, expected, rtol=0.0, atol=0.0, check_dtype=True, what=what, hint=hint)


def expect(condition: bool, message: str, *, hint: str | None = None) -> None:
    """Require `condition`; otherwise fail with `message` (say what was expected and got).

    `hint`, when given, names the mistake that makes this condition fail; it replaces the
    case's hint for this failure ("" shows none).
    """
    if not condition:
        raise CaseFailure(message, hint=hint)


def first_difference(got: Sequence, expected: Sequence, *, describe: Callable[[Any], str] = repr) -> str:
    """Where two sequences first differ, as a sentence; "" when they are equal.

    Shows the position and the two items there, or which one is longer, never the whole
    sequences: "at position 3: expected 7, got 5", "6 items, expected 8: it stops after ...".
    """
    got, expected = list(got), list(expected)
    for position, (got_item, expected_item) in enumerate(zip(got, expected, strict=False)):
        if not _same_value(got_item, expected_item):
            return (f"at position {position}: expected {describe(expected_item)}, "
                    f"got {describe(got_item)}")
    if len(got) < len(expected):
        return (f"{len(got)} items, expected {len(expected)}: the next one should be "
                f"{describe(expected[len(got)])}")
    if len(got) > len(expected):
        return (f"{len(got)} items, expected {len(expected)}: the first extra one is "
                f"{describe(got[len(expected)])}")
    return ""


def expect_same_sequence(got: Any, expected: Sequence, *, what: str = "the result",
                         describe: Callable[[Any], str] = repr, hint: str | None = None) -> None:
    """Require `got` to be a sequence with the items of `expected`, in order.

    The failure names the first differing position and the item expected there (a row of
    a schedule, a batch of indices), not the whole expected sequence.
    """
    if isinstance(got, str | bytes | dict) or not hasattr(got, "__iter__"):
        raise CaseFailure(f"{what}: expected a sequence of {len(expected)} items, got "
                          f"{type(got).__name__} {_show(got)}", hint=hint)
    difference = first_difference(got, expected, describe=describe)
    if difference:
        raise CaseFailure(f"{what}: {difference}", hint=hint)


def expect_instance(got: Any, types: type | tuple[type, ...], *, what: str = "the result", why: str,
                    hint: str | None = None) -> None:
    """Require `got` to be an instance of `types`: the library or structure the statement requires.

    Args:
      why: the statement's reason, said in the failure (e.g. "the statement asks for NumPy: this
        code runs on the host, where a jax.Array would copy to the device and back").
    """
    if not isinstance(got, types):
        wanted = " or ".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))
        kind = type(got)
        raise CaseFailure(f"{what} is a {kind.__module__.split('.')[0]}.{kind.__name__}, expected a "
                          f"{wanted}: {why}", hint=hint)


def expect_mentions(text: Any, required: Sequence[str | Sequence[str]], *, what: str = "the reason",
                    hint: str | None = None) -> None:
    """Require free text to name each thing in `required` (case-insensitive).

    Each entry is a word, or a list of alternatives of which one must appear:
    `expect_mentions(reason, [("median", "typical"), "block_size"])`. A reason that is any
    non-empty text does not pass.
    """
    expect(isinstance(text, str) and text.strip() != "",
           f"{what}: expected a sentence (a non-empty str), got {type(text).__name__} {_show(text)}",
           hint=hint)
    lowered = text.lower()
    for entry in required:
        options = (entry,) if isinstance(entry, str) else tuple(entry)
        if not any(option.lower() in lowered for option in options):
            said = " or ".join(repr(option) for option in options)
            raise CaseFailure(f"{what} {_show(text)} does not name {said}, which it must name", hint=hint)


def _resalted(value: Any) -> Any:
    """What `hash` sees of `value` in another process: str and bytes salted anew, at any depth of a tuple."""
    if isinstance(value, str | bytes):
        return ("another process", value)
    if isinstance(value, tuple):
        return tuple(_resalted(item) for item in value)
    if isinstance(value, frozenset):
        return frozenset(_resalted(item) for item in value)
    return value  # ints, floats, None: hashed alike in every process


@contextlib.contextmanager
def as_in_another_process() -> Iterator[None]:
    """Within the block, `hash()` and `id()` give what a new Python process could give.

    `hash()` of a str or bytes (also inside a tuple or frozenset) changes, as PYTHONHASHSEED
    would change it; `hash()` of ints and of tuples of ints does not, as in real processes;
    `id()` (an address) moves. Code that must give the same answer wherever it runs (a cache
    key, a data order) is run once outside and once inside, then compared.
    """
    import builtins

    real_hash, real_id = builtins.hash, builtins.id
    builtins.hash = lambda value: real_hash(_resalted(value))
    builtins.id = lambda value: real_id(value) + 16
    try:
        yield
    finally:
        builtins.hash, builtins.id = real_hash, real_id


def expect_same_across_processes(function: Callable, *args: Any, what: str = "the key",
                                 hint: str | None = None, **kwargs: Any) -> Any:
    """Require `function(*args)` not to depend on per-process values: `hash()` of a str or bytes, `id()`.

    Python salts `hash()` of str and bytes per process (PYTHONHASHSEED) and `id()` is an
    address, so a key built from them never matches in the next process: an on-disk cache
    never hits. Starting a second process is slow; instead the function is called twice,
    the second time `as_in_another_process()`. Returns the first result.
    """
    first = function(*args, **kwargs)
    with as_in_another_process():
        second = function(*args, **kwargs)
    expect(_same_value(first, second),
           f"{what} changes from one Python process to the next ({_show(first)} here, {_show(second)} in "
           "another): it uses hash() of a string or id(), which differ per process",
           hint=hint if hint is not None else "Build it from the values themselves (a string such as "
           "repr of a tuple, or hashlib.sha256 of one), not from hash() or id().")
    return first


def expect_sharding(got: Any, sharding: Any, *, what: str = "the result", hint: str | None = None) -> None:
    """Require a jax.Array laid out as `sharding` (e.g. replicated: NamedSharding(mesh, P())).

    A tuple or list of per-device arrays, or an array still split over the devices where one
    combined value was asked for, is named as such.
    """
    import jax

    expect(not isinstance(got, list | tuple), f"{what}: expected one array, got {_node_kind(got)}"
           f"{_per_device_note(got)}", hint=hint)
    expect(isinstance(got, jax.Array), f"{what}: expected a jax.Array, got {type(got).__name__}", hint=hint)
    if not got.sharding.is_equivalent_to(sharding, got.ndim):
        spec = getattr(got.sharding, "spec", got.sharding)
        wanted = getattr(sharding, "spec", sharding)
        raise CaseFailure(f"{what} is laid out as {spec} over the devices, expected {wanted}: each device "
                          "holds a different piece (or a value not yet reduced over the devices)", hint=hint)


@contextlib.contextmanager
def forbidding(*functions: Callable, why: str, hint: str | None = "") -> Iterator[None]:
    """Within the block, fail if any of `functions` runs: the library the exercise asks you to write.

    Calls are seen by their code object (with `sys.setprofile`, in this thread), so they are
    caught however the learner imported the function (`from stacklib.parallel import
    gpipe_schedule`, an alias, a module attribute). Compute expected values before the block.

    Raises:
      CaseFailure: naming the first forbidden function called, and `why`.
    """
    codes = {}
    for function in functions:
        code = getattr(inspect.unwrap(function), "__code__", None)
        if code is not None:
            codes[code] = f"{function.__module__}.{function.__qualname__}"
    called: list[str] = []
    previous = sys.getprofile()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code in codes and not called:
            called.append(codes[frame.f_code])
        if previous is not None:
            previous(frame, event, arg)

    sys.setprofile(profile)
    try:
        yield
    finally:
        sys.setprofile(previous)
    if called:
        raise CaseFailure(f"your code calls {called[0]}: {why}", hint=hint)


def seeded_permutation(n: int, seed: int) -> np.ndarray:
    """A random permutation of range(n) from `seed`: test "any order" with this, never a reversal.

    A fixed permutation (a reversal, a rotation) lets an answer that applies that same
    permutation pass; a seeded random one of a realistic size does not.
    """
    return np.random.default_rng(seed).permutation(n)


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
