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


def platforms_of_the_texts_example(fn, params, example, platforms):  # the argument ignored
    (x_spec,) = jax.export.symbolic_args_specs((example,), "b, ...")
    return jax.export.export(jax.jit(fn), platforms=("cpu", "tpu", "cuda"))(params, x_spec)


def first_platform_only(fn, params, example, platforms):
    (x_spec,) = jax.export.symbolic_args_specs((example,), "b, ...")
    return jax.export.export(jax.jit(fn), platforms=(platforms[0],))(params, x_spec)


def dimension_named_batch(fn, params, example, platforms):  # not the name the exercise gives
    (x_spec,) = jax.export.symbolic_args_specs((example,), "batch, ...")
    return jax.export.export(jax.jit(fn), platforms=tuple(platforms))(params, x_spec)


def float32_assumed(fn, params, example, platforms):  # example's shape kept, its dtype not
    (b,) = jax.export.symbolic_shape("b")
    x_spec = jax.ShapeDtypeStruct((b, *example.shape[1:]), np.float32)
    return jax.export.export(jax.jit(fn), platforms=tuple(platforms))(params, x_spec)


def every_dimension_symbolic(fn, params, example, platforms):
    (x_spec,) = jax.export.symbolic_args_specs((example,), "b, f")
    return jax.export.export(jax.jit(fn), platforms=tuple(platforms))(params, x_spec)


def weights_symbolic_too(fn, params, example, platforms):
    specs = jax.export.symbolic_args_specs((params, example), "b, ...")
    return jax.export.export(jax.jit(fn), platforms=tuple(platforms))(*specs)


def serialized_bytes(fn, params, example, platforms):  # bytes, not the Exported
    return export_batch_polymorphic(fn, params, example, platforms).serialize()


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


def first_64_kib(directory, files):  # one read, one buffer: a large file never matches its hash
    bad = []
    for name, digest in files.items():
        path = pathlib.Path(directory) / name
        if not path.is_file():
            bad.append(name)
            continue
        with open(path, "rb") as f:
            if hashlib.sha256(f.read(1 << 16)).hexdigest() != digest:
                bad.append(name)
    return sorted(bad)


def hash_of_the_last_chunk(directory, files):  # a new hash per chunk instead of update()
    bad = []
    for name, digest in files.items():
        path = pathlib.Path(directory) / name
        if not path.is_file():
            bad.append(name)
            continue
        with open(path, "rb") as f:
            while chunk := f.read(1 << 16):
                sha = hashlib.sha256(chunk)
        if sha.hexdigest() != digest:
            bad.append(name)
    return sorted(bad)


def in_manifest_order(directory, files):  # not sorted
    found = bad_files(directory, files)
    return [name for name in files if name in found]


def walks_the_folder(directory, files):  # a file the manifest does not list is reported
    root = pathlib.Path(directory)
    bad = [name for name in files if not (root / name).is_file()]
    for path in root.rglob("*"):
        if path.is_file():
            name = path.relative_to(root).as_posix()
            if files.get(name) != hashlib.sha256(path.read_bytes()).hexdigest():
                bad.append(name)
    return sorted(bad)


def base_names_only(directory, files):  # looks for weights/x.bin at the top of the folder
    return bad_files(directory, {pathlib.Path(name).name: digest for name, digest in files.items()})


def returns_a_set(directory, files):
    return set(bad_files(directory, files))


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


def first_listed_on_ties(gap_ms, timeouts_ms, max_batch_size, call_ms, budget_ms):
    best = None
    for timeout in timeouts_ms:  # the caller's order, taken to be ascending
        rows = min(max_batch_size, 1 + timeout // gap_ms)
        wait = min(timeout, (max_batch_size - 1) * gap_ms)
        if wait + call_ms <= budget_ms and (best is None or rows > best[0]):
            best = (rows, timeout)
    return None if best is None else best[1]


def sorts_in_place(gap_ms, timeouts_ms, max_batch_size, call_ms, budget_ms):  # the caller's list changes
    timeouts_ms.sort()
    return pick_timeout(gap_ms, timeouts_ms, max_batch_size, call_ms, budget_ms)


def fractional_rows(gap_ms, timeouts_ms, max_batch_size, call_ms, budget_ms):  # / where the text has //
    best = None
    for timeout in sorted(timeouts_ms):
        rows = min(max_batch_size, 1 + timeout / gap_ms)
        wait = min(timeout, (max_batch_size - 1) * gap_ms)
        if wait + call_ms <= budget_ms and (best is None or rows > best[0]):
            best = (rows, timeout)
    return None if best is None else best[1]


def forgets_the_first_row(gap_ms, timeouts_ms, max_batch_size, call_ms, budget_ms):  # timeout // gap rows
    best = None
    for timeout in sorted(timeouts_ms):
        rows = min(max_batch_size, timeout // gap_ms)
        wait = min(timeout, (max_batch_size - 1) * gap_ms)
        if wait + call_ms <= budget_ms and (best is None or rows > best[0]):
            best = (rows, timeout)
    return None if best is None else best[1]


def zero_when_none_fits(gap_ms, timeouts_ms, max_batch_size, call_ms, budget_ms):
    got = pick_timeout(gap_ms, timeouts_ms, max_batch_size, call_ms, budget_ms)
    return 0 if got is None else got


def longest_within_budget(gap_ms, timeouts_ms, max_batch_size, call_ms, budget_ms):  # rows never compared
    within = [t for t in timeouts_ms if min(t, (max_batch_size - 1) * gap_ms) + call_ms <= budget_ms]
    return max(within) if within else None


def full_one_gap_late(gap_ms, timeouts_ms, max_batch_size, call_ms, budget_ms):  # max_batch_size * gap
    best = None
    for timeout in sorted(timeouts_ms):
        rows = min(max_batch_size, 1 + timeout // gap_ms)
        wait = min(timeout, max_batch_size * gap_ms)
        if wait + call_ms <= budget_ms and (best is None or rows > best[0]):
            best = (rows, timeout)
    return None if best is None else best[1]


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


def pads_with_the_texts_minus_one(rows, buckets, pad_value):  # the example's pad, not the argument
    return pad_to_buckets(rows, buckets, -1)


def first_bucket_that_fits(rows, buckets, pad_value):  # takes the buckets to be sorted
    grouped = {}
    for row in rows:
        if not row or len(row) > buckets[-1]:
            raise ValueError(f"a row of {len(row)} tokens fits no bucket of {buckets}")
        grouped.setdefault(next(b for b in buckets if b >= len(row)), []).append(row)
    return {bucket: pad_to_buckets(members, [bucket], pad_value)[bucket]
            for bucket, members in grouped.items()}


def sorts_the_buckets_in_place(rows, buckets, pad_value):
    buckets.sort()
    return pad_to_buckets(rows, buckets, pad_value)


def int64_arrays(rows, buckets, pad_value):  # NumPy's default integer, not the int32 asked for
    return {bucket: padded.astype(np.int64)
            for bucket, padded in pad_to_buckets(rows, buckets, pad_value).items()}


def nested_lists(rows, buckets, pad_value):
    return {bucket: padded.tolist() for bucket, padded in pad_to_buckets(rows, buckets, pad_value).items()}


def every_bucket_a_key(rows, buckets, pad_value):  # empty buckets included
    filled = pad_to_buckets(rows, buckets, pad_value)
    return {bucket: filled.get(bucket, np.full((0, bucket), pad_value, np.int32)) for bucket in buckets}


def cuts_long_rows_short(rows, buckets, pad_value):  # a row too long is truncated, not refused
    return pad_to_buckets([row[:max(buckets)] for row in rows], buckets, pad_value)


def empty_row_accepted(rows, buckets, pad_value):  # an empty row becomes a row of padding
    return pad_to_buckets([row or [pad_value] for row in rows], buckets, pad_value)


def pads_the_callers_rows(rows, buckets, pad_value):  # the caller's lists grow
    out = pad_to_buckets(rows, buckets, pad_value)
    for row in rows:
        row.extend([pad_value] * (min(b for b in buckets if b >= len(row)) - len(row)))
    return out



def undoes_a_reversal(root, files):  # reverses the manifest's order instead of sorting
    return [name for name in reversed(list(files)) if name in set(bad_files(root, files))]


def says_only_bad_row(rows, buckets, pad_value):  # right buckets, a message that names nothing
    try:
        return pad_to_buckets(rows, buckets, pad_value)
    except ValueError:
        raise ValueError("bad row") from None


# (exercise, planted wrong answer, points it should still get, why)
WRONG = [
    ("15.symbolic_export", concrete_export, 3, "a concrete batch: runs at batch 2 only"),
    ("15.symbolic_export", ignores_platforms, 6, "ignores the platforms asked for"),
    ("15.symbolic_export", numpy_function_not_exported, 0, "returns a jitted function, not an Exported"),
    ("15.symbolic_export", platforms_of_the_texts_example, 6, "the text's platforms, not the argument"),
    ("15.symbolic_export", first_platform_only, 6, "the first platform only"),
    ("15.symbolic_export", dimension_named_batch, 7, "the dimension named batch, not b"),
    ("15.symbolic_export", float32_assumed, 7, "float32 assumed, not example's dtype"),
    ("15.symbolic_export", every_dimension_symbolic, 0, "every dimension of x symbolic"),
    ("15.symbolic_export", weights_symbolic_too, 0, "the weights' dimensions symbolic too"),
    ("15.symbolic_export", serialized_bytes, 0, "the serialized bytes, not the Exported"),
    ("15.bad_files", raises_on_missing, 7, "raises FileNotFoundError on a missing file"),
    ("15.bad_files", skips_large_files, 7, "checks only files up to 1 MiB"),
    ("15.bad_files", full_paths, 3, "absolute paths instead of the manifest's names"),
    ("15.bad_files", first_64_kib, 7, "hashes only the first 64 KiB"),
    ("15.bad_files", hash_of_the_last_chunk, 7, "hashes only the last chunk read"),
    ("15.bad_files", in_manifest_order, 7, "in the manifest's order, not sorted"),
    ("15.bad_files", walks_the_folder, 8, "reports a file the manifest does not list"),
    ("15.bad_files", base_names_only, 0, "drops the folder from each name"),
    ("15.bad_files", returns_a_set, 0, "a set, not a list"),
    ("15.bad_files", undoes_a_reversal, 7, "the manifest's order reversed, not sorted"),
    ("15.batch_window", always_waits_the_timeout, 6, "a full batch still waits out the window"),
    ("15.batch_window", longest_window_on_ties, 5, "the longest window on a tie"),
    ("15.batch_window", budget_exclusive, 6, "latency strictly below the budget"),
    ("15.batch_window", first_listed_on_ties, 6, "the first listed on a tie, not the shortest"),
    ("15.batch_window", sorts_in_place, 1, "sorts the caller's list"),
    ("15.batch_window", fractional_rows, 6, "rows from / instead of //"),
    ("15.batch_window", forgets_the_first_row, 5, "the request that opens the window not counted"),
    ("15.batch_window", zero_when_none_fits, 7, "0 instead of None"),
    ("15.batch_window", longest_within_budget, 5, "the longest timeout within budget"),
    ("15.batch_window", full_one_gap_late, 6, "the batch full one gap late"),
    ("15.length_buckets", bucket_of_the_longest_row, 9, "the bucket of the request's longest row"),
    ("15.length_buckets", pads_with_zero, 11, "pads with token 0"),
    ("15.length_buckets", pads_with_the_texts_minus_one, 11, "pads with the text's -1, not pad_value"),
    ("15.length_buckets", strictly_longer_bucket, 11, "a full row goes to the next bucket"),
    ("15.length_buckets", sorted_by_length, 11, "rows sorted by length in a bucket"),
    ("15.length_buckets", left_padded, 11, "padding before the tokens"),
    ("15.length_buckets", first_bucket_that_fits, 11, "the first bucket that fits, in the list's order"),
    ("15.length_buckets", sorts_the_buckets_in_place, 9, "sorts the caller's buckets"),
    ("15.length_buckets", int64_arrays, 11, "int64 arrays"),
    ("15.length_buckets", nested_lists, 11, "lists, not arrays"),
    ("15.length_buckets", every_bucket_a_key, 12, "buckets without rows included"),
    ("15.length_buckets", cuts_long_rows_short, 12, "a row too long is cut short"),
    ("15.length_buckets", empty_row_accepted, 12, "an empty row accepted"),
    ("15.length_buckets", pads_the_callers_rows, 2, "pads the caller's rows in place"),
    ("15.length_buckets", says_only_bad_row, 11, "a ValueError that says only 'bad row'"),
]


@pytest.mark.parametrize("exercise_id, answer, points, why", WRONG, ids=[w[3] for w in WRONG])
def test_a_planted_wrong_answer_loses_points(exercise_id, answer, points, why):
    result = grade(exercise_id, answer)
    assert result.points == points, [(c.name, c.status, c.message) for c in result.cases]
    assert result.points < result.max_points

