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

from stacklib.grading import Exercise, call_on_copies, expect, expect_close

# ---------------------------------------------------------------- 15.symbolic_export

symbolic_export = Exercise("15.symbolic_export", "Export a function with a symbolic batch dimension")


def _mlp(w, x):
    return jnp.tanh(x @ w["kernel"] + w["bias"])


_W = {"kernel": np.linspace(-1, 1, 4 * 3, dtype=np.float32).reshape(4, 3), "bias": np.ones(3, np.float32)}


def _exported(export_fn, platforms=("cpu",)):
    example = np.zeros((2, 4), np.float32)
    exported = call_on_copies(export_fn, _mlp, _W, example, platforms, what="export_batch_polymorphic")
    expect(isinstance(exported, jax.export.Exported),
           f"expected a jax.export.Exported, got {type(exported).__name__}")
    return exported


@symbolic_export.case(points=2, hint="jax.export.symbolic_args_specs((example,), 'b, ...') makes the leading "
                                     "dimension symbolic and keeps the others; pass params as they are.")
def the_leading_dimension_is_symbolic_and_the_rest_concrete(export_fn):
    exported = _exported(export_fn)
    x_shape, out_shape = exported.in_avals[-1].shape, exported.out_avals[0].shape
    expect(not isinstance(x_shape[0], int) and x_shape[1:] == (4,),
           f"the input's shape should be (b, 4) with b symbolic, got {x_shape}")
    expect(not isinstance(out_shape[0], int), f"the output's batch should be symbolic too, got {out_shape}")
    expect(exported.in_avals[0].shape == (3,) and exported.in_avals[1].shape == (4, 3),
           f"the weights keep their concrete shapes, got {[a.shape for a in exported.in_avals[:2]]}")


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


@symbolic_export.case(hint="jax.export.export(jax.jit(fn), platforms=tuple(platforms)).")
def it_is_lowered_for_the_platforms_asked(export_fn):
    exported = _exported(export_fn, ("cpu", "tpu", "cuda"))
    expect(exported.platforms == ("cpu", "tpu", "cuda"),
           f"expected platforms ('cpu', 'tpu', 'cuda'), got {exported.platforms}")


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


def _bad(bad_fn, root, files):
    got = call_on_copies(bad_fn, root, files, what="bad_files")
    expect(isinstance(got, list), f"expected a list of names, got {type(got).__name__}")
    return got


@bad_files.case(hint="Hash each listed file's bytes with hashlib.sha256(...).hexdigest() and compare.")
def an_untouched_artifact_has_no_bad_files(bad_fn):
    with tempfile.TemporaryDirectory() as folder:
        files = _artifact(pathlib.Path(folder), _CONTENTS)
        got = _bad(bad_fn, pathlib.Path(folder), files)
        expect(got == [], f"nothing was changed, but you reported {got}")


@bad_files.case(points=2, hint="Return the manifest's names (relative, as listed), sorted: a flipped bit and "
                                "a truncation both change the hash.")
def a_flipped_bit_and_a_truncated_file_are_both_named(bad_fn):
    with tempfile.TemporaryDirectory() as folder:
        root = pathlib.Path(folder)
        files = _artifact(root, _CONTENTS)
        kernel = bytearray(_CONTENTS["weights/00000.kernel.bin"])
        kernel[10] ^= 0x04
        (root / "weights/00000.kernel.bin").write_bytes(bytes(kernel))
        (root / "program.bin").write_bytes(_CONTENTS["program.bin"][:-1])
        got = _bad(bad_fn, root, files)
        expect(got == ["program.bin", "weights/00000.kernel.bin"],
               f"expected ['program.bin', 'weights/00000.kernel.bin'], got {got}")


@bad_files.case(hint="A missing file is bad too: report it instead of raising FileNotFoundError.")
def a_missing_file_is_named_not_raised(bad_fn):
    with tempfile.TemporaryDirectory() as folder:
        root = pathlib.Path(folder)
        files = _artifact(root, _CONTENTS)
        (root / "weights/00001.bias.bin").unlink()
        try:
            got = _bad(bad_fn, root, files)
        except FileNotFoundError as error:
            expect(False, f"a missing file raised FileNotFoundError ({error}); name it in the list instead")
        expect(got == ["weights/00001.bias.bin"], f"expected ['weights/00001.bias.bin'], got {got}")


@bad_files.case(hint="Check every listed file, the large weights too: a change near the end of a large "
                     "file counts as much as one at the start.")
def a_change_at_the_end_of_a_large_file_is_found(bad_fn):
    with tempfile.TemporaryDirectory() as folder:
        root = pathlib.Path(folder)
        big = np.random.default_rng(0).bytes(3 << 20)
        files = _artifact(root, {**_CONTENTS, "weights/00002.embedding.bin": big})
        (root / "weights/00002.embedding.bin").write_bytes(big[:-1] + bytes([big[-1] ^ 1]))
        got = _bad(bad_fn, root, files)
        expect(got == ["weights/00002.embedding.bin"], f"expected ['weights/00002.embedding.bin'], got {got}")


# ---------------------------------------------------------------- 15.batch_window

batch_window = Exercise("15.batch_window", "Choose the batch timeout from rows per call and a latency budget")


def _pick(pick_fn, *args):
    return call_on_copies(pick_fn, *args, what="pick_timeout")


@batch_window.case(hint="Rows per call: min(max_batch_size, 1 + timeout_ms // gap_ms). Among the timeouts "
                        "within budget take the most rows; on a tie the shortest timeout.")
def a_loose_budget_fills_the_batch_with_the_shortest_timeout(pick_fn):
    got = _pick(pick_fn, 1, [0, 2, 5, 7, 10, 20], 8, 3, 100)
    expect(got == 7, f"gap 1 ms, max 8 rows, call 3 ms, budget 100 ms: expected 7 ms (the batch is full at "
                     f"7 ms, longer windows add nothing), got {got}")


@batch_window.case(points=2, hint="The first request waits the whole window (or until the batch is full), "
                                  "then the call: latency = wait + call_ms, and it must be <= the budget.")
def a_tight_budget_caps_the_window(pick_fn):
    got = _pick(pick_fn, 1, [0, 2, 5, 7, 10, 20], 8, 3, 8)
    expect(got == 5, f"budget 8 ms: windows 0, 2, 5 give latencies 3, 5, 8 ms; expected 5, got {got}")
    got = _pick(pick_fn, 2, [0, 4, 6, 9], 16, 1, 7)
    expect(got == 6, f"gap 2 ms, call 1 ms, budget 7 ms: expected 6 (4 rows at 7 ms), got {got}")


@batch_window.case(hint="A full batch closes the window early: the wait is min(timeout, (max_batch_size - 1) "
                        "* gap), not always the timeout.")
def a_full_batch_does_not_wait_out_the_window(pick_fn):
    got = _pick(pick_fn, 1, [1, 10], 4, 2, 5)
    expect(got == 10, f"gap 1 ms, max 4 rows: a 10 ms window fills at 3 ms (latency 5 ms, within budget); "
                      f"expected 10, got {got}")


@batch_window.case(hint="When no timeout meets the budget, return None.")
def no_timeout_within_budget_gives_none(pick_fn):
    got = _pick(pick_fn, 1, [0, 5], 8, 10, 9)
    expect(got is None, f"a 10 ms call cannot meet a 9 ms budget: expected None, got {got}")


# ---------------------------------------------------------------- 15.length_buckets

length_buckets = Exercise("15.length_buckets", "Pad token rows into length buckets, one bucket per row")


def _buckets(bucket_fn, rows, buckets, pad_value):
    got = call_on_copies(bucket_fn, rows, buckets, pad_value, what="pad_to_buckets")
    expect(isinstance(got, dict), f"expected a dict {{bucket: array}}, got {type(got).__name__}")
    return {key: np.asarray(value) for key, value in got.items()}


def _padded(rows, length, pad_value):
    out = np.full((len(rows), length), pad_value, np.int32)
    for i, row in enumerate(rows):
        out[i, :len(row)] = row
    return out


@length_buckets.case(points=2, hint="For each row on its own, the bucket is the smallest b in buckets with "
                                    "b >= len(row): a row of exactly 8 tokens fits the 8 bucket. Never "
                                    "bucket a row by the longest row it arrived with.")
def each_row_goes_to_the_smallest_bucket_that_holds_it(bucket_fn):
    rows = [[1, 2, 3], list(range(8)), list(range(9)), list(range(16)), list(range(17))]
    expected = {8: (2, 8), 16: (2, 16), 32: (1, 32)}
    got = _buckets(bucket_fn, rows, [8, 16, 32], -1)
    shapes = {key: tuple(value.shape) for key, value in got.items()}
    expect(shapes == expected, f"rows of 3, 8, 9, 16 and 17 tokens into buckets [8, 16, 32]: expected "
                               f"bucket -> shape {expected}, got {shapes}")


@length_buckets.case(hint="Tokens first, then pad_value up to the bucket's length (right padding): a "
                          "causal model's answer after a row's last token must not see the padding.")
def tokens_first_then_the_pad_value(bucket_fn):
    expected = _padded([[7, 0, 9]], 8, -1)
    got = _buckets(bucket_fn, [[7, 0, 9]], [8, 16], -1)
    expect(set(got) == {8} and got[8].tolist() == expected.tolist(),
           f"[[7, 0, 9]] into buckets [8, 16] with pad -1: expected {{8: {expected.tolist()}}}, got "
           f"{ {k: v.tolist() for k, v in got.items()} }")


@length_buckets.case(hint="Within a bucket keep the rows in the order they were given: the server hands "
                          "row j of a call back to whoever sent it.")
def rows_keep_their_order_within_a_bucket(bucket_fn):
    rows = [[5, 5, 5, 5, 5], [1], [2, 2, 2], [3, 3]]
    expected = _padded(rows, 8, 99)
    got = _buckets(bucket_fn, rows, [8], 99)
    expect(set(got) == {8} and got[8].tolist() == expected.tolist(),
           f"four rows into bucket 8 with pad 99: expected {expected.tolist()}, got "
           f"{ {k: v.tolist() for k, v in got.items()} }")


@length_buckets.case(hint="A row longer than the largest bucket, or an empty row, cannot be served: raise "
                          "ValueError saying so.")
def a_row_too_long_or_empty_is_refused(bucket_fn):
    for rows, what in (([list(range(17))], "a row of 17 tokens with buckets [8, 16]"),
                       ([[]], "an empty row")):
        try:
            call_on_copies(bucket_fn, rows, [8, 16], -1, what="pad_to_buckets")
        except ValueError:
            continue
        expect(False, f"{what} should raise ValueError, but it was accepted")
