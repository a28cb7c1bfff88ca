"""Chapter 15's exercise cases: right answers score full marks, planted wrong ones lose points."""

import hashlib
import pathlib

import jax
import numpy as np
import pytest

from stacklib.grading import grade


def export_batch_polymorphic(fn, params, example, platforms):
    (x_spec,) = jax.export.symbolic_args_specs((example,), "b, ...")
    return jax.export.export(jax.jit(fn), platforms=tuple(platforms))(params, x_spec)


def bad_files(directory, files):
    bad = []
    for name, digest in files.items():
        path = pathlib.Path(directory) / name
        if not path.is_file() or hashlib.sha256(path.read_bytes()).hexdigest() != digest:
            bad.append(name)
    return sorted(bad)


def pick_timeout(gap_ms, timeouts_ms, max_batch_size, call_ms, budget_ms):
    best = None
    for timeout in sorted(timeouts_ms):
        rows = min(max_batch_size, 1 + timeout // gap_ms)
        wait = min(timeout, (max_batch_size - 1) * gap_ms)
        if wait + call_ms <= budget_ms and (best is None or rows > best[0]):
            best = (rows, timeout)
    return None if best is None else best[1]


def pad_to_buckets(rows, buckets, pad_value):
    grouped = {}
    for row in rows:
        if not row or len(row) > max(buckets):
            raise ValueError(f"a row of {len(row)} tokens fits no bucket of {buckets}")
        grouped.setdefault(min(b for b in buckets if b >= len(row)), []).append(row)
    out = {}
    for bucket, members in grouped.items():
        out[bucket] = np.full((len(members), bucket), pad_value, np.int32)
        for i, row in enumerate(members):
            out[bucket][i, :len(row)] = row
    return out


RIGHT = {
    "15.symbolic_export": export_batch_polymorphic,
    "15.bad_files": bad_files,
    "15.batch_window": pick_timeout,
    "15.length_buckets": pad_to_buckets,
}


@pytest.mark.parametrize("exercise_id", sorted(RIGHT))
def test_a_right_answer_scores_full_marks(exercise_id):
    result = grade(exercise_id, RIGHT[exercise_id])
    assert result.points == result.max_points, [c.message for c in result.cases]


# Planted wrong answers.

def concrete_export(fn, params, example, platforms):  # no symbolic dimension: batch 2 only
    return jax.export.export(jax.jit(fn), platforms=tuple(platforms))(params, example)


def ignores_platforms(fn, params, example, platforms):  # lowered for this machine only
    (x_spec,) = jax.export.symbolic_args_specs((example,), "b, ...")
    return jax.export.export(jax.jit(fn))(params, x_spec)


def numpy_function_not_exported(fn, params, example, platforms):  # returns a callable, not an Exported
    return jax.jit(fn)


def raises_on_missing(directory, files):
    return sorted(name for name, digest in files.items()
                  if hashlib.sha256((pathlib.Path(directory) / name).read_bytes()).hexdigest() != digest)


def skips_large_files(directory, files):  # "hashing big weights is slow": checks files <= 1 MiB only
    bad = []
    for name, digest in files.items():
        path = pathlib.Path(directory) / name
        if not path.is_file():
            bad.append(name)
        elif path.stat().st_size <= 1 << 20 and hashlib.sha256(path.read_bytes()).hexdigest() != digest:
            bad.append(name)
    return sorted(bad)


def full_paths(directory, files):
    return [str(pathlib.Path(directory) / name) for name in bad_files(directory, files)]


def always_waits_the_timeout(gap_ms, timeouts_ms, max_batch_size, call_ms, budget_ms):
    best = None
    for timeout in sorted(timeouts_ms):
        rows = min(max_batch_size, 1 + timeout // gap_ms)
        if timeout + call_ms <= budget_ms and (best is None or rows > best[0]):
            best = (rows, timeout)
    return None if best is None else best[1]


def longest_window_on_ties(gap_ms, timeouts_ms, max_batch_size, call_ms, budget_ms):
    best = None
    for timeout in sorted(timeouts_ms):
        rows = min(max_batch_size, 1 + timeout // gap_ms)
        wait = min(timeout, (max_batch_size - 1) * gap_ms)
        if wait + call_ms <= budget_ms and (best is None or rows >= best[0]):
            best = (rows, timeout)
    return None if best is None else best[1]


def budget_exclusive(gap_ms, timeouts_ms, max_batch_size, call_ms, budget_ms):  # < instead of <=
    return pick_timeout(gap_ms, timeouts_ms, max_batch_size, call_ms, budget_ms - 1e-9)


def bucket_of_the_longest_row(rows, buckets, pad_value):  # the whole request in one bucket
    longest = max(len(row) for row in rows)
    if not all(rows) or longest > max(buckets):
        raise ValueError("no bucket")
    bucket = min(b for b in buckets if b >= longest)
    out = np.full((len(rows), bucket), pad_value, np.int32)
    for i, row in enumerate(rows):
        out[i, :len(row)] = row
    return {bucket: out}


def pads_with_zero(rows, buckets, pad_value):  # 0 is a token (a NUL byte), not padding
    return pad_to_buckets(rows, buckets, 0)


def strictly_longer_bucket(rows, buckets, pad_value):  # b > len(row): a full row moves up a bucket
    longer = {len(row): len(row) + 1 for row in rows if len(row) in buckets and len(row) < max(buckets)}
    grown = [list(row) + [pad_value] * (longer.get(len(row), len(row)) - len(row)) for row in rows]
    return pad_to_buckets(grown, buckets, pad_value)


def sorted_by_length(rows, buckets, pad_value):  # rows reordered: answers go back to the wrong clients
    return pad_to_buckets(sorted(rows, key=len), buckets, pad_value)


def left_padded(rows, buckets, pad_value):  # padding before the tokens: rolled right by the pad count
    return {bucket: np.stack([np.roll(row, int((row == pad_value).sum())) for row in padded])
            for bucket, padded in pad_to_buckets(rows, buckets, pad_value).items()}


# (exercise, planted wrong answer, points it should still get, why)
WRONG = [
    ("15.symbolic_export", concrete_export, 1, "a concrete batch: runs at batch 2 only"),
    ("15.symbolic_export", ignores_platforms, 4, "ignores the platforms asked for"),
    ("15.symbolic_export", numpy_function_not_exported, 0, "returns a jitted function, not an Exported"),
    ("15.bad_files", raises_on_missing, 4, "raises FileNotFoundError on a missing file"),
    ("15.bad_files", skips_large_files, 4, "checks only files up to 1 MiB"),
    ("15.bad_files", full_paths, 1, "absolute paths instead of the manifest's names"),
    ("15.batch_window", always_waits_the_timeout, 4, "a full batch still waits out the window"),
    ("15.batch_window", longest_window_on_ties, 4, "the longest window on a tie"),
    ("15.batch_window", budget_exclusive, 2, "latency strictly below the budget"),
    ("15.length_buckets", bucket_of_the_longest_row, 3, "the bucket of the request's longest row"),
    ("15.length_buckets", pads_with_zero, 3, "pads with token 0"),
    ("15.length_buckets", strictly_longer_bucket, 3, "a full row goes to the next bucket"),
    ("15.length_buckets", sorted_by_length, 4, "rows sorted by length in a bucket"),
    ("15.length_buckets", left_padded, 3, "padding before the tokens"),
]


@pytest.mark.parametrize("exercise_id, answer, points, why", WRONG, ids=[w[3] for w in WRONG])
def test_a_planted_wrong_answer_loses_points(exercise_id, answer, points, why):
    result = grade(exercise_id, answer)
    assert result.points == points, [(c.name, c.status, c.message) for c in result.cases]
    assert result.points < result.max_points

