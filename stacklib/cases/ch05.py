"""Chapter 05 exercises: an atomic write, keep-N, an asynchronous saver, restoring into a target."""

import os
import pathlib
import tempfile
import threading
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

from stacklib.checkpoint import retention
from stacklib.grading import Exercise, call_on_copies, expect, expect_equal

# 05.atomic_write ------------------------------------------------------------------------

atomic_write = Exercise("05.atomic_write", "Write a file so that a crash never leaves it half-written")


class _Killed(Exception):
    """Raised by the chunks generator: the process 'dies' in the middle of writing."""


def _crashing_chunks():
    yield b"new content, first half; "
    raise _Killed("the process was killed here")


@atomic_write.case(hint="Write every chunk, in order.")
def writes_the_content(write):
    with tempfile.TemporaryDirectory() as folder:
        path = pathlib.Path(folder) / "state.bin"
        write(path, [b"abc", b"", b"def" * 1000])
        expect(path.read_bytes() == b"abc" + b"def" * 1000, "the file does not hold the chunks in order")
        expect(sorted(os.listdir(folder)) == ["state.bin"], f"the folder holds {sorted(os.listdir(folder))}")


@atomic_write.case(points=2, hint="Write into a temporary file in the same folder and os.replace it over the "
                                  "target only after the last chunk.")
def a_crash_keeps_the_old_file(write):
    with tempfile.TemporaryDirectory() as folder:
        path = pathlib.Path(folder) / "state.bin"
        path.write_bytes(b"old content")
        try:
            write(path, _crashing_chunks())
        except _Killed:
            pass
        else:
            expect(False, "the exception from the chunks did not propagate out of atomic_write")
        content = path.read_bytes()
        expect(content == b"old content", f"after the crash the file holds {content[:40]!r}")


@atomic_write.case(hint="Remove the temporary file if writing fails (try/except, then re-raise).")
def a_failed_write_leaves_no_temporary_file(write):
    with tempfile.TemporaryDirectory() as folder:
        path = pathlib.Path(folder) / "state.bin"
        try:
            write(path, _crashing_chunks())
        except _Killed:
            pass
        left = sorted(os.listdir(folder))
        expect(left == [], f"after a failed write of a new file the folder holds {left}")


@atomic_write.case(hint="The target must not exist while the chunks are being written.")
def the_target_appears_only_when_complete(write):
    with tempfile.TemporaryDirectory() as folder:
        path = pathlib.Path(folder) / "state.bin"
        seen = []

        def chunks():
            for chunk in (b"a", b"b", b"c"):
                seen.append(path.exists())
                yield chunk

        write(path, chunks())
        expect(not any(seen), "the target existed (partly written) while chunks were still coming")


@atomic_write.case(hint="Call os.fsync(file.fileno()) after the last write, before os.replace.")
def fsyncs_before_renaming(write):
    events = []
    real_fsync, real_replace, real_rename = os.fsync, os.replace, os.rename

    def fsync(descriptor):
        events.append("fsync")
        return real_fsync(descriptor)

    def replace(source, destination):
        events.append(("rename", pathlib.Path(source).parent, pathlib.Path(destination)))
        return real_replace(source, destination)

    def rename(source, destination):
        events.append(("rename", pathlib.Path(source).parent, pathlib.Path(destination)))
        return real_rename(source, destination)

    with tempfile.TemporaryDirectory() as folder, mock.patch("os.fsync", fsync), \
            mock.patch("os.replace", replace), mock.patch("os.rename", rename):
        path = pathlib.Path(folder) / "state.bin"
        write(path, [b"data"])
    renames = [i for i, event in enumerate(events) if event != "fsync"]
    expect(renames, "no os.replace or os.rename: how does the complete file get its name?")
    expect("fsync" in events[:renames[0]], "the data is not fsynced before the rename")
    _, source_folder, destination = events[renames[0]]
    expect(destination == path and source_folder == path.parent,
           "rename a file from the target's own folder onto the target (a rename is atomic only "
           "within one file system)")


# 05.keep_n ------------------------------------------------------------------------------

keep_n = Exercise("05.keep_n", "Which checkpoints to keep: the latest N or the best N")


def _loss(metrics):
    return metrics["loss"]


def _expect_kept(keep, steps, metrics, **options):
    expected = retention.steps_to_keep(steps, metrics, **options)
    got = call_on_copies(keep, list(steps), list(metrics), what="steps_to_keep", **options)
    shown = {k: getattr(v, "__name__", v) for k, v in options.items()}
    expect(list(got) == expected,
           f"steps {list(steps)}, {shown}: expected to keep {expected}, got {list(got)}")


@keep_n.case(hint="Without best_fn keep the last max_to_keep steps; None keeps all.")
def keeps_the_latest_n(keep):
    steps = [0, 5, 10, 15, 20]
    for n in (None, 1, 3, 5, 9):
        _expect_kept(keep, steps, [None] * 5, max_to_keep=n)


@keep_n.case(points=2, hint="Rank the steps that have metrics by best_fn(metrics): the highest for 'max', "
                            "the lowest for 'min'.")
def keeps_the_best_n_in_both_modes(keep):
    steps = list(range(6))
    metrics = [{"loss": v} for v in (0.9, 0.2, 0.5, 0.7, 0.1, 0.95)]
    for mode in ("min", "max"):
        _expect_kept(keep, steps, metrics, max_to_keep=2, best_fn=_loss, best_mode=mode)


@keep_n.case(hint="On ties, keep the later step (sort stably, then take the last max_to_keep).")
def ties_go_to_the_later_step(keep):
    for mode, losses in (("min", (0.3, 0.5, 0.3, 0.5, 0.3)), ("max", (0.5, 0.3, 0.5, 0.3, 0.5))):
        metrics = [{"loss": v} for v in losses]  # three steps tie for best; two are kept
        _expect_kept(keep, list(range(5)), metrics, max_to_keep=2, best_fn=_loss, best_mode=mode)


@keep_n.case(hint="Steps saved without metrics (None) are kept unless "
                  "keep_checkpoints_without_metrics=False.")
def steps_without_metrics_are_kept_unless_told(keep):
    metrics = [{"loss": 0.4}, None, {"loss": 0.2}, {"loss": 0.3}, None]
    for flag in (True, False):
        _expect_kept(keep, list(range(5)), metrics, max_to_keep=1, best_fn=_loss, best_mode="min",
                     keep_checkpoints_without_metrics=flag)


@keep_n.case(hint="max_to_keep=0 keeps nothing.")
def keeping_zero_keeps_nothing(keep):
    _expect_kept(keep, [1, 2, 3], [None] * 3, max_to_keep=0)


# 05.async_save --------------------------------------------------------------------------

async_save = Exercise("05.async_save", "An asynchronous saver: snapshot on the caller, write in a thread")

# No case here reads a clock: each one holds the write in the saver's thread on an Event
# until it has looked at what save() did, so a right answer passes and a wrong one fails
# on every run. The waits below only bound how long a wrong answer (one that blocks in
# save) holds the case up; a right one never waits for them to run out.
_BLOCKED_WRITE_S = 3.0  # how long a held write waits for the case to release it
_OVERLAP_WAIT_S = 2.0  # how long the first write waits for an overlapping second one


def _tree():
    return {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": [np.zeros(2), np.ones(1)]}


def _held_write(release, written):
    """A write_fn that, off the caller's thread, waits for `release` before it writes."""
    caller = threading.current_thread()

    def write(tree):
        if threading.current_thread() is not caller:
            release.wait(_BLOCKED_WRITE_S)
        written.append((threading.current_thread() is caller, tree))

    return write


@async_save.case(hint="save(tree) starts a thread that calls write_fn(snapshot); "
                      "wait_until_finished joins it.")
def writes_what_was_saved(AsyncSaver):
    written = []
    saver = AsyncSaver(written.append)
    saver.save(_tree())
    saver.wait_until_finished()
    expect(len(written) == 1, f"write_fn was called {len(written)} times for one save")
    expect_equal(written[0], _tree(), what="the written tree")


@async_save.case(points=2, time_limit_s=20, hint="Do the writing in a threading.Thread; save() returns right "
                                                 "after starting it.")
def save_returns_before_the_write_finishes(AsyncSaver):
    release, written = threading.Event(), []
    saver = AsyncSaver(_held_write(release, written))
    saver.save(_tree())
    done_when_save_returned = list(written)
    release.set()
    saver.wait_until_finished()
    expect(not any(on_caller for on_caller, _ in written),
           "save() called write_fn itself, on the caller's thread: start a threading.Thread that calls it")
    expect(not done_when_save_returned, "the write had already finished when save() returned: save() "
                                        "waited for it (a join right after start?)")
    expect(len(written) == 1, "after wait_until_finished the write has not happened")


@async_save.case(points=2, time_limit_s=20, hint="Copy every leaf on the caller "
                                                 "(jax.tree.map(np.array, tree)) before starting the thread.")
def the_snapshot_is_taken_when_save_returns(AsyncSaver):
    release, written = threading.Event(), []
    tree = _tree()
    saver = AsyncSaver(_held_write(release, written))
    saver.save(tree)
    tree["w"] += 100.0  # the next training step changes the weights in place
    release.set()
    saver.wait_until_finished()
    expect(len(written) == 1, f"write_fn was called {len(written)} times for one save")
    expect_equal(written[0][1], _tree(), what="the written tree (it must not see changes made after save)")


@async_save.case(time_limit_s=20, hint="Before starting a new write, wait for the previous one.")
def saves_never_overlap(AsyncSaver):
    lock, second_started = threading.Lock(), threading.Event()
    running, overlapped, order = [], [], []

    def write(tree):
        with lock:
            overlapped.append(bool(running))
            running.append(1)
            order.append(float(tree["w"][0, 0]))
            first = len(order) == 1
        if first:  # a saver that does not wait starts the second write while this one runs
            second_started.wait(_OVERLAP_WAIT_S)
        else:
            second_started.set()
        with lock:
            running.pop()

    saver = AsyncSaver(write)
    for value in (1.0, 2.0, 3.0):
        tree = _tree()
        tree["w"][0, 0] = value
        saver.save(tree)
    saver.wait_until_finished()
    expect(not any(overlapped), "a write started while the previous one was still running")
    expect(order == [1.0, 2.0, 3.0], f"the writes happened in the order {order}, not 1, 2, 3")


@async_save.case(hint="Catch the exception in the thread, keep it, and raise it (once) in "
                      "wait_until_finished.")
def a_failed_write_is_raised_by_wait_until_finished(AsyncSaver):
    def failing_write(tree):
        raise OSError(28, "No space left on device")

    saver = AsyncSaver(failing_write)
    saver.save(_tree())
    try:
        saver.wait_until_finished()
    except OSError:
        pass
    else:
        expect(False, "the write failed, but wait_until_finished did not raise its OSError")
    saver.wait_until_finished()  # reported once; must not raise again


# 05.restore_into ------------------------------------------------------------------------

restore_into = Exercise("05.restore_into", "Restore saved arrays into a target structure")


def _saved(tree):
    return {jax.tree_util.keystr(path): np.asarray(leaf)
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


@restore_into.case(hint="Flatten the target with jax.tree_util.tree_flatten_with_path, look each leaf up by "
                        "keystr(path), and unflatten with the target's treedef.")
def rebuilds_the_targets_structure(restore):
    tree = {"layers": [{"w": jnp.ones((2, 2))}, {"w": jnp.full((2, 1), 3.0)}], "step": (jnp.int32(4),)}
    got = call_on_copies(restore, tree, _saved(tree), what="restore_into")
    expect(jax.tree.structure(got) == jax.tree.structure(tree),
           f"expected structure {jax.tree.structure(tree)}, got {jax.tree.structure(got)}")
    expect_equal([np.asarray(x) for x in jax.tree.leaves(got)],
                 [np.asarray(x) for x in jax.tree.leaves(tree)])


@restore_into.case(hint="Cast each array to the target leaf's dtype; NumPy target leaves stay NumPy arrays.")
def casts_to_the_target_dtype_and_keeps_numpy_leaves(restore):
    saved = _saved({"w": np.linspace(0, 1, 5, dtype=np.float32), "host": np.arange(3, dtype=np.int64)})
    target = {"w": jnp.zeros(5, jnp.bfloat16), "host": np.zeros(3, np.int32)}
    got = call_on_copies(restore, target, saved, what="restore_into")
    expect(isinstance(got["w"], jax.Array) and got["w"].dtype == jnp.bfloat16,
           f"['w']: expected a bfloat16 jax array, got {type(got['w']).__name__} "
           f"of {np.asarray(got['w']).dtype}")
    expect(isinstance(got["host"], np.ndarray) and got["host"].dtype == np.int32,
           f"['host']: expected an int32 NumPy array, got {type(got['host']).__name__}")


@restore_into.case(hint="For a jax.ShapeDtypeStruct (or jax array) target, "
                        "jax.device_put(array, target.sharding); a sharding of None means the default "
                        "device, which jax.device_put(array, None) gives.")
def shape_dtype_struct_targets_become_arrays_with_the_targets_sharding(restore):
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = {"w": jax.ShapeDtypeStruct((2, 3), jnp.float32, sharding=sharding),
              "step": jax.ShapeDtypeStruct((), jnp.int32)}  # no sharding: the default device
    # Called directly: a sharding holds devices, which cannot be deep-copied; nothing expected
    # here is computed from the inputs.
    got = restore(target, {"['w']": np.arange(6, dtype=np.float32).reshape(2, 3), "['step']": np.int64(7)})
    for key in ("w", "step"):
        expect(isinstance(got[key], jax.Array),
               f"['{key}']: expected a jax.Array, got {type(got[key]).__name__}")
    expect(got["w"].sharding == sharding, f"['w']: expected sharding {sharding}, got {got['w'].sharding}")
    expect(got["step"].devices() == {jax.devices()[0]} and got["step"].dtype == jnp.int32,
           f"['step'] (sharding None): expected an int32 array on {jax.devices()[0]}, got "
           f"{got['step'].dtype} on {got['step'].devices()}")


@restore_into.case(points=2, hint="Collect every problem first (missing paths, extra paths, shapes with both "
                                  "shapes), then raise one ValueError that lists them all.")
def mismatches_are_all_named_in_one_error(restore):
    saved = _saved({"w": np.zeros((2, 3)), "b": np.zeros(3), "old": np.zeros(1)})
    target = {"w": jnp.zeros((3, 2)), "b": jnp.zeros(3), "new": jnp.zeros(1)}
    try:
        call_on_copies(restore, target, saved, what="restore_into")
    except ValueError as error:
        message = str(error)
    else:
        message = None
    expect(message is not None, "restoring into a mismatched target did not raise ValueError")
    for needed, what in (("['new']", "the path missing from the checkpoint"),
                         ("['old']", "the path missing from the target"),
                         ("['w']", "the path whose shape differs"), ("(2, 3)", "the saved shape"),
                         ("(3, 2)", "the target's shape")):
        expect(needed in message, f"the error does not name {what} ({needed}): {message!r}")
