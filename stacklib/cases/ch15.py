"""Chapter 15 exercises: a batch-polymorphic export, a manifest's hash check, the batch
window's trade-off between rows per call and latency, and a language model's length buckets.

Expected answers come from `jax.export` itself, from `hashlib` on files the case writes,
or from closed forms, computed before the learner's code runs; dicts are handed over as
copies (`call_on_copies`).
"""

import hashlib
import pathlib
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from stacklib.grading import Exercise, call_on_copies, expect, expect_close, expect_equal
from stacklib.grading.expect import expect_mentions, seeded_permutation

# ---------------------------------------------------------------- 15.symbolic_export

symbolic_export = Exercise("15.symbolic_export", "Export a function with a symbolic batch dimension")


def _mlp(w, x):
    return jnp.tanh(x @ w["kernel"] + w["bias"])


_W = {"kernel": np.linspace(-1, 1, 4 * 3, dtype=np.float32).reshape(4, 3), "bias": np.ones(3, np.float32)}


def _exported(export_fn, platforms=("cpu",), example=None):
    example = np.zeros((2, 4), np.float32) if example is None else example
    exported = call_on_copies(export_fn, _mlp, _W, example, platforms, what="export_batch_polymorphic")
    expect(isinstance(exported, jax.export.Exported),
           f"expected a jax.export.Exported, got {type(exported).__name__}")
    return exported


@symbolic_export.case(points=2, hint="Only the leading dimension of x is symbolic; x's other dimensions come "
                                     "from `example` and the weights keep their concrete shapes (section "
                                     "'`jax.export`: StableHLO with a symbolic batch').")
def the_leading_dimension_is_symbolic_and_the_rest_concrete(export_fn):
    exported = _exported(export_fn)
    x_shape, out_shape = exported.in_avals[-1].shape, exported.out_avals[0].shape
    expect(not isinstance(x_shape[0], int) and x_shape[1:] == (4,),
           f"the input's shape should be (b, 4) with b symbolic, got {x_shape}")
    expect(not isinstance(out_shape[0], int), f"the output's batch should be symbolic too, got {out_shape}")
    expect(exported.in_avals[0].shape == (3,) and exported.in_avals[1].shape == (4, 3),
           f"the weights keep their concrete shapes, got {[a.shape for a in exported.in_avals[:2]]}")


@symbolic_export.case(hint="The exercise names the symbolic dimension `b`: the manifest and the callers read "
                           "that name.")
def the_symbolic_dimension_is_named_b(export_fn):
    exported = _exported(export_fn)
    dimension = exported.in_avals[-1].shape[0]
    expect(not isinstance(dimension, int),
           f"the batch dimension is the concrete {dimension}, not a symbolic dimension named 'b'")
    expect(str(dimension) == "b", f"the batch dimension is named {str(dimension)!r}; expected 'b'")


@symbolic_export.case(points=2, hint="One export must run at every batch size: exported.call(params, x).")
def one_export_runs_at_batch_sizes_1_3_and_7(export_fn):
    exported = _exported(export_fn)
    for batch in (1, 3, 7):
        x = np.random.default_rng(batch).random((batch, 4), dtype=np.float32)
        expected = jax.jit(_mlp)(_W, x)
        try:
            got = exported.call(_W, x)
        except Exception as error:  # noqa: BLE001 - a concrete export refuses other shapes
            expect(False, f"calling the export at batch {batch} failed: {type(error).__name__}: "
                          f"{str(error)[:200]}")
        expect_close(got, expected, rtol=1e-6, atol=1e-6, what=f"the export at batch {batch}")


@symbolic_export.case(hint="x's dtype comes from `example`, as its shape does: here float16, not float32.")
def the_input_keeps_the_dtype_of_the_example(export_fn):
    exported = _exported(export_fn, example=np.zeros((2, 4), np.float16))
    dtype = exported.in_avals[-1].dtype
    expect(dtype == np.float16, f"example is float16, but the exported program takes x as {dtype}")


@symbolic_export.case(points=2, hint="Lower for exactly the platforms passed in (the argument, not the "
                                     "chapter's example list).")
def it_is_lowered_for_the_platforms_asked(export_fn):
    for platforms in (["cpu", "cuda"], ("tpu",)):
        exported = _exported(export_fn, platforms)
        expect(exported.platforms == tuple(platforms),
               f"asked for platforms {tuple(platforms)}, got {exported.platforms}")


# ---------------------------------------------------------------- 15.bad_files

bad_files = Exercise("15.bad_files", "Check every file of an artifact against its manifest's SHA-256")


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _artifact(root: pathlib.Path, contents: dict[str, bytes]) -> dict[str, str]:
    """Write the files; return the manifest's {relative name: SHA-256}, as at export time."""
    for name, data in contents.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return {name: _sha256(data) for name, data in contents.items()}


_CONTENTS = {"program.bin": bytes(range(256)) * 8,
             "weights/00000.kernel.bin": np.arange(1024, dtype=np.float32).tobytes(),
             "weights/00001.bias.bin": np.ones(8, np.float32).tobytes(),
             "weights/manifest.json": b'{"leaves": []}'}
_BIG = np.random.default_rng(0).bytes((3 << 20) + 5)  # 3 MiB and 5 bytes: many read buffers, a ragged end


def _bad(bad_fn, root, files):
    got = call_on_copies(bad_fn, root, files, what="bad_files")
    expect(isinstance(got, list), f"expected a list of names, got {type(got).__name__}")
    return got


def _in_unsorted_order(files: dict[str, str]) -> dict[str, str]:
    """The manifest with its names in a seeded random order (not a reversal, which an answer that
    reverses would undo), so that an answer must sort them itself."""
    items = list(files.items())
    return dict(items[i] for i in seeded_permutation(len(items), seed=11))


def _expect_names(got, expected, what):
    """Name what is missing, extra or out of order, rather than print the expected list."""
    missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
    expect(not missing, f"{what}: a bad file was not reported ({len(missing)} missed), e.g. {missing[0]!r}"
           if missing else "")
    expect(not extra, f"{what}: {extra[0]!r} was reported but is intact" if extra else "")
    expect(got == sorted(got), f"{what}: the right names, but not in sorted order: {got}")
    expect(len(got) == len(expected), f"{what}: a name is reported more than once: {got}")


@bad_files.case(hint="Nothing was changed, yet some names were reported: compare each listed file's "
                     "SHA-256 hex digest with the manifest's, and leave files it does not list alone.")
def an_untouched_artifact_has_no_bad_files(bad_fn):
    with tempfile.TemporaryDirectory() as folder:
        root = pathlib.Path(folder)
        files = _artifact(root, _CONTENTS)
        (root / "manifest.json").write_text('{"files": "not listed in itself"}')
        got = _bad(bad_fn, root, files)
        expect(got == [], f"nothing was changed, but you reported {got}")


@bad_files.case(points=2, hint="An untouched file larger than one read buffer was reported: the whole file "
                                "must be hashed, every chunk fed to the same hash.")
def an_untouched_large_file_is_not_reported(bad_fn):
    with tempfile.TemporaryDirectory() as folder:
        root = pathlib.Path(folder)
        files = _artifact(root, {**_CONTENTS, "weights/00002.embedding.bin": _BIG})
        got = _bad(bad_fn, root, files)
        expect(got == [], f"nothing was changed (one file is 3 MiB), but you reported {got}")


@bad_files.case(points=2, hint="Return the manifest's names (relative, as listed), in sorted order whatever "
                                "the manifest's order: a flipped bit, a truncation and an extra byte all "
                                "change the hash.")
def a_flipped_bit_and_a_truncated_file_are_both_named(bad_fn):
    with tempfile.TemporaryDirectory() as folder:
        root = pathlib.Path(folder)
        files = _in_unsorted_order(_artifact(root, _CONTENTS))
        kernel = bytearray(_CONTENTS["weights/00000.kernel.bin"])
        kernel[10] ^= 0x04
        (root / "weights/00000.kernel.bin").write_bytes(bytes(kernel))
        (root / "program.bin").write_bytes(_CONTENTS["program.bin"][:-1])
        (root / "weights/00001.bias.bin").write_bytes(_CONTENTS["weights/00001.bias.bin"] + b"\0")
        got = _bad(bad_fn, root, files)
        _expect_names(got, ["program.bin", "weights/00000.kernel.bin", "weights/00001.bias.bin"],
                      "a flipped bit, a truncated file and a longer one")


@bad_files.case(points=2, hint="A missing file is bad too: report it instead of raising FileNotFoundError.")
def a_missing_file_is_named_not_raised(bad_fn):
    with tempfile.TemporaryDirectory() as folder:
        root = pathlib.Path(folder)
        files = _artifact(root, _CONTENTS)
        (root / "weights/00001.bias.bin").unlink()
        try:
            got = _bad(bad_fn, root, files)
        except FileNotFoundError as error:
            expect(False, f"a missing file raised FileNotFoundError ({error}); name it in the list instead")
        _expect_names(got, ["weights/00001.bias.bin"], "a missing file")


@bad_files.case(points=2, hint="Check every listed file, the large weights too: a change near the end of a "
                                "large file counts as much as one at the start.")
def a_change_at_the_end_of_a_large_file_is_found(bad_fn):
    with tempfile.TemporaryDirectory() as folder:
        root = pathlib.Path(folder)
        files = _artifact(root, {**_CONTENTS, "weights/00002.embedding.bin": _BIG})
        (root / "weights/00002.embedding.bin").write_bytes(_BIG[:-1] + bytes([_BIG[-1] ^ 1]))
        got = _bad(bad_fn, root, files)
        _expect_names(got, ["weights/00002.embedding.bin"], "a change at the end of a large file")


# ---------------------------------------------------------------- 15.batch_window

batch_window = Exercise("15.batch_window", "Choose the batch timeout from rows per call and a latency budget")


def _pick(pick_fn, *args):
    return call_on_copies(pick_fn, *args, what="pick_timeout")


@batch_window.case(hint="Among the timeouts within budget take the one whose calls carry the most rows "
                        "(a window stops collecting once the batch is full); on a tie the shortest timeout.")
def a_loose_budget_fills_the_batch_with_the_shortest_timeout(pick_fn):
    got = _pick(pick_fn, 1, [0, 2, 5, 7, 10, 20], 8, 3, 100)
    expect(got == 7, f"gap 1 ms, max 8 rows, call 3 ms, budget 100 ms: expected 7 ms (the batch is full at "
                     f"7 ms, longer windows add nothing), got {got}")


@batch_window.case(points=2, hint="The first request waits the whole window (or until the batch is full), "
                                  "then the call: its latency is that wait plus call_ms, and it may equal "
                                  "the budget.")
def a_tight_budget_caps_the_window(pick_fn):
    got = _pick(pick_fn, 1, [20, 7, 0, 5, 10, 2], 8, 3, 8)
    expect(got == 5, f"budget 8 ms: windows 0, 2, 5 give latencies 3, 5, 8 ms; expected 5, got {got}")
    got = _pick(pick_fn, 2, [9, 0, 6, 4], 16, 1, 7)
    expect(got == 6, f"gap 2 ms, call 1 ms, budget 7 ms: expected 6 (4 rows at 7 ms), got {got}")


@batch_window.case(points=2, hint="A full batch closes the window early: the first request waits until "
                                  "the batch is full, if that comes before the timeout (the exercise's "
                                  "formula for the wait).")
def a_full_batch_does_not_wait_out_the_window(pick_fn):
    got = _pick(pick_fn, 1, [10, 1], 4, 2, 5.5)
    expect(got == 10, f"gap 1 ms, max 4 rows, call 2 ms, budget 5.5 ms: a 10 ms window fills at 3 ms "
                      f"(latency 5 ms, within budget); expected 10, got {got}")


@batch_window.case(points=2, hint="The timeouts come in any order: on a tie in rows, return the shortest "
                                  "timeout, wherever it is in the list. Rows are whole: a window collects "
                                  "one row per full gap.")
def timeouts_in_any_order_tie_to_the_shortest(pick_fn):
    got = _pick(pick_fn, 1, [20, 10, 7, 2, 0, 5], 8, 3, 100)
    expect(got == 7, f"timeouts [20, 10, 7, 2, 0, 5], gap 1 ms, max 8 rows, budget 100 ms: 7, 10 and 20 all "
                     f"fill the batch; expected 7, got {got}")
    got = _pick(pick_fn, 2, [9, 7, 3, 6], 16, 1, 8.5)
    expect(got == 6, f"timeouts [9, 7, 3, 6], gap 2 ms, max 16 rows, call 1 ms, budget 8.5 ms: 6 and 7 both "
                     f"collect 4 rows (9 is over budget); expected 6, got {got}")


@batch_window.case(hint="When no timeout meets the budget, return None.")
def no_timeout_within_budget_gives_none(pick_fn):
    got = _pick(pick_fn, 1, [5, 0], 8, 10, 9)
    expect(got is None, f"a 10 ms call cannot meet a 9 ms budget: expected None, got {got}")


# ---------------------------------------------------------------- 15.length_buckets

length_buckets = Exercise("15.length_buckets", "Pad token rows into length buckets, one bucket per row")


def _buckets(bucket_fn, rows, buckets, pad_value):
    got = call_on_copies(bucket_fn, rows, buckets, pad_value, what="pad_to_buckets")
    expect(isinstance(got, dict), f"expected a dict {{bucket: array}}, got {type(got).__name__}")
    return got


def _as_lists(got):
    return {key: np.asarray(value).tolist() for key, value in got.items()}


def _shapes(got):
    return {key: tuple(np.shape(value)) for key, value in got.items()}


def _padded(rows, length, pad_value):
    out = np.full((len(rows), length), pad_value, np.int32)
    for i, row in enumerate(rows):
        out[i, :len(row)] = row
    return out


@length_buckets.case(points=2, hint="Each row goes, on its own, to the smallest bucket that holds it: a row "
                                    "of exactly 8 tokens fits the 8 bucket, and a row's bucket never "
                                    "depends on the rows it arrived with.")
def each_row_goes_to_the_smallest_bucket_that_holds_it(bucket_fn):
    rows = [[1, 2, 3], list(range(8)), list(range(9)), list(range(16)), list(range(17))]
    expected = {8: (2, 8), 16: (2, 16), 32: (1, 32)}
    shapes = _shapes(_buckets(bucket_fn, rows, [8, 16, 32], -1))
    expect(shapes == expected, f"rows of 3, 8, 9, 16 and 17 tokens into buckets [8, 16, 32]: expected "
                               f"bucket -> shape {expected}, got {shapes}")


@length_buckets.case(points=2, hint="`buckets` is not sorted here: choose the smallest bucket that holds "
                                    "each row, wherever it stands in the list, and compare a row's length "
                                    "with the largest bucket.")
def buckets_in_any_order(bucket_fn):
    for length, bucket in ((12, 16), (3, 8), (20, 32)):
        shapes = _shapes(_buckets(bucket_fn, [list(range(length))], [32, 8, 16], -1))
        filled = {key: shape for key, shape in shapes.items() if shape[:1] != (0,)}  # empties: next case
        expect(filled == {bucket: (1, bucket)}, f"one row of {length} tokens into buckets [32, 8, 16]: "
                                                f"expected {{{bucket}: (1, {bucket})}}, got {shapes}")


@length_buckets.case(hint="Only the buckets that received rows are keys of the dict.")
def buckets_without_rows_are_left_out(bucket_fn):
    keys = sorted(_buckets(bucket_fn, [[4, 5]], [8, 16, 32, 64], -1))
    expect(keys == [8], f"one row of 2 tokens into buckets [8, 16, 32, 64]: expected the keys [8], "
                        f"got {keys}")


@length_buckets.case(points=2, hint="Tokens first, then pad_value (the argument) up to the bucket's length: "
                                    "right padding, so that a causal model's answer after a row's last token "
                                    "never sees the padding.")
def tokens_first_then_the_pad_value(bucket_fn):
    for pad_value in (-1, 42):
        expected = _padded([[7, 0, 9]], 8, pad_value)
        got = _as_lists(_buckets(bucket_fn, [[7, 0, 9]], [8, 16], pad_value))
        expect(np.shape(got.get(8)) == (1, 8),
               f"[[7, 0, 9]] into buckets [8, 16]: expected {{8: shape (1, 8)}}, got shapes {_shapes(got)}")
        expect_equal(np.asarray(got[8], np.int32), expected,
                     what=f"[[7, 0, 9]] into bucket 8 with pad {pad_value}")


@length_buckets.case(points=2, hint="Within a bucket keep the rows in the order they were given: the "
                                    "server hands row j of a call back to whoever sent it.")
def rows_keep_their_order_within_a_bucket(bucket_fn):
    # Row i is made of token 10 + i only, so its place is read whatever the padding.
    lengths = [5, 1, 3, 2]
    rows = [[10 + i] * n for i, n in enumerate(lengths)]
    got = _buckets(bucket_fn, rows, [8], 99)
    expect(8 in got and np.shape(got[8]) == (4, 8),
           f"four short rows into bucket 8: expected {{8: shape (4, 8)}}, got shapes {_shapes(got)}")
    order = [next((int(t) - 10 for t in row if 10 <= t < 14), None) for row in np.asarray(got[8]).tolist()]
    expect(order == [0, 1, 2, 3], f"rows of {lengths} tokens: the bucket holds them in the order {order}, "
                                  f"expected [0, 1, 2, 3] (row i holds token 10 + i)")


@length_buckets.case(points=2, hint="The exercise asks for int32 arrays, the dtype the exported program "
                                    "takes (np.int64 is NumPy's default integer).")
def the_arrays_are_int32(bucket_fn):
    got = _buckets(bucket_fn, [[1, 2, 3], [4, 5]], [16, 8], -1)
    for bucket, value in got.items():
        dtype = getattr(value, "dtype", None)
        expect(dtype == np.int32, f"bucket {bucket}: expected an int32 array, got {type(value).__name__}"
                                  + ("" if dtype is None else f" of dtype {dtype}"))


def _expect_value_error(bucket_fn, rows, what, must_name):
    """The learner's ValueError, whose message must say what is wrong (`must_name`, for expect_mentions)."""
    try:
        call_on_copies(bucket_fn, rows, [16, 8], -1, what="pad_to_buckets")
    except ValueError as error:
        expect_mentions(str(error), must_name, what=f"the ValueError's message for {what}")
        return
    expect(False, f"{what} should raise ValueError, but it was accepted")


@length_buckets.case(hint="A row longer than the largest bucket fits nowhere: raise ValueError saying so, "
                          "with the row's length and the largest bucket in the message (do not cut it "
                          "short).")
def a_row_longer_than_every_bucket_is_refused(bucket_fn):
    _expect_value_error(bucket_fn, [[1, 2], list(range(17))], "a row of 17 tokens with buckets [16, 8]",
                        ["17", "16"])


@length_buckets.case(hint="An empty row has no token to answer after: raise ValueError saying so.")
def an_empty_row_is_refused(bucket_fn):
    _expect_value_error(bucket_fn, [[1, 2], []], "an empty row", [("empty", "0 tokens", "no token")])
