"""Chapter 05 exercises: an atomic write, keep-N, an async saver, restoring into a target, two tiers."""

import contextlib
import os
import pathlib
import tempfile
import threading
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from stacklib.checkpoint import multitier, retention
from stacklib.grading import (
    Exercise,
    call_on_copies,
    expect,
    expect_equal,
    expect_same_sequence,
    seeded_permutation,
)

# 05.atomic_write ------------------------------------------------------------------------

atomic_write = Exercise("05.atomic_write", "Write a file so that a crash never leaves it half-written")
_ATOMIC = "the chapter's section 'Atomic commits: write aside, fsync, rename'"


class _Killed(Exception):
    """Raised by the chunks generator: the process 'dies' in the middle of writing."""


def _crashing_chunks():
    yield b"new content, first half; "
    raise _Killed("the process was killed here")


def _interrupted_chunks():
    yield b"new content, first half; "
    raise KeyboardInterrupt  # the user pressed Ctrl-C: not an Exception, but the write failed all the same


@contextlib.contextmanager
def _watched_file_calls(path, events):
    """Record each fsync (with the bytes its file held) and each rename (with what `path` held then)."""
    real_fsync, real_replace, real_rename = os.fsync, os.replace, os.rename

    def fsync(descriptor):
        events.append(("fsync", os.fstat(descriptor).st_size))
        return real_fsync(descriptor)

    def renamed_by(real):
        def rename(source, destination):
            held = path.read_bytes() if path.exists() else None
            events.append(("rename", pathlib.Path(source).parent, pathlib.Path(destination), held))
            return real(source, destination)
        return rename

    with mock.patch("os.fsync", fsync), mock.patch("os.replace", renamed_by(real_replace)), \
            mock.patch("os.rename", renamed_by(real_rename)):
        yield


@atomic_write.case(hint="Write every chunk, in order, and leave only the target in the folder.")
def writes_the_content(write):
    with tempfile.TemporaryDirectory() as folder:
        path = pathlib.Path(folder) / "state.bin"
        write(path, [b"abc", b"", b"def" * 1000])
        content, expected = path.read_bytes(), b"abc" + b"def" * 1000
        expect(content == expected, f"the file holds {len(content)} bytes starting {content[:9]!r}; expected "
                                    f"the {len(expected)} bytes of the chunks b'abc', b'' and b'def' * 1000")
        expect(sorted(os.listdir(folder)) == ["state.bin"], f"the folder holds {sorted(os.listdir(folder))}")


@atomic_write.case(points=2, hint=f"The old file must stay whole until the new one is complete: see "
                                   f"{_ATOMIC}.")
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
        expect(path.exists(), "after the crash the old file is gone")
        content = path.read_bytes()
        expect(content == b"old content", f"after the crash the file holds {content[:40]!r}")


@atomic_write.case(hint="A failed write must clean up after itself (step 4 of the exercise).")
def a_failed_write_leaves_no_temporary_file(write):
    with tempfile.TemporaryDirectory() as folder:
        path = pathlib.Path(folder) / "state.bin"
        try:
            write(path, _crashing_chunks())
        except _Killed:
            pass
        left = sorted(os.listdir(folder))
        expect(left == [], f"after a failed write of a new file the folder holds {left}")


@atomic_write.case(hint="The cleanup of step 4 must run too when KeyboardInterrupt stops the write, and "
                        "KeyboardInterrupt is not an Exception.")
def an_interrupted_write_leaves_no_temporary_file(write):
    with tempfile.TemporaryDirectory() as folder:
        path = pathlib.Path(folder) / "state.bin"
        try:
            write(path, _interrupted_chunks())
        except KeyboardInterrupt:
            pass
        else:
            expect(False, "the KeyboardInterrupt from the chunks did not propagate out of atomic_write")
        left = sorted(os.listdir(folder))
        expect(left == [], f"after a write stopped by KeyboardInterrupt the folder holds {left}")


@atomic_write.case(hint=f"Readers look only at the target's name: see {_ATOMIC}.")
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


@atomic_write.case(hint=f"A reader must find the old file until the new one takes its name: see {_ATOMIC}.")
def the_old_file_stays_until_the_rename_replaces_it(write):
    events = []
    with tempfile.TemporaryDirectory() as folder:
        path = pathlib.Path(folder) / "state.bin"
        path.write_bytes(b"old content")
        with _watched_file_calls(path, events):
            write(path, [b"new content"])
    renames = [event for event in events if event[0] == "rename"]
    expect(renames, "no os.replace or os.rename: how does the complete file get its name?")
    expect(renames[0][3] == b"old content",
           "when the new file was renamed onto the target, the old file was already gone: in between, a "
           "reader (or a crash) finds no file at all. os.replace replaces the old file in one step")


@atomic_write.case(hint=f"The bytes must be on the disk before the file gets its name: see {_ATOMIC} "
                        "(and Python's own write buffer).")
def fsyncs_the_whole_file_before_renaming(write):
    content = b"forty bytes of checkpoint data, in full."
    events = []
    with tempfile.TemporaryDirectory() as folder:
        path = pathlib.Path(folder) / "state.bin"
        with _watched_file_calls(path, events):
            write(path, [content])
    renames = [i for i, event in enumerate(events) if event[0] == "rename"]
    expect(renames, "no os.replace or os.rename: how does the complete file get its name?")
    synced = [size for kind, size, *_ in events[:renames[0]] if kind == "fsync"]
    expect(synced, "the data is not fsynced before the rename")
    expect(len(content) in synced,
           f"the file was fsynced while it held {max(synced)} of its {len(content)} bytes: the rest was "
           "still in Python's buffer (or not written yet), so fsync could not make it durable")
    _, source_folder, destination, _ = events[renames[0]]
    expect(destination == path and source_folder == path.parent,
           "rename a file from the target's own folder onto the target (a rename is atomic only "
           "within one file system)")


# 05.keep_n ------------------------------------------------------------------------------

keep_n = Exercise("05.keep_n", "Which checkpoints to keep: the latest N or the best N")
_KEEP = "the chapter's section 'Which steps to save and keep'"


def _loss(metrics):
    return metrics["loss"]


def accuracy(metric):  # for metrics that are plain numbers
    return metric


def _expect_kept(keep, steps, metrics, **options):
    expected = retention.steps_to_keep(steps, metrics, **options)
    got = call_on_copies(keep, list(steps), list(metrics), what="steps_to_keep", **options)
    shown = {k: getattr(v, "__name__", v) for k, v in options.items()}
    expect(isinstance(got, list | tuple), f"expected a list of steps, got {type(got).__name__} {got!r:.60}")
    got = list(got)
    if got == expected:
        return
    diagnosis = ""
    if got == [list(steps).index(step) for step in expected]:
        diagnosis = ": those are the kept steps' positions in the list, not the steps"
    elif options.get("best_fn") and got == retention.steps_to_keep(
            steps, metrics, **{**options, "best_mode": {"min": "max", "max": "min"}[options["best_mode"]]}):
        diagnosis = ": that is what the other best_mode keeps"
    situation = (f"steps {list(steps)}, metrics {list(metrics)}, {shown}" if len(steps) <= 8 else
                 f"{len(steps)} steps ({steps[0]} to {steps[-1]}), {shown}")
    expect(False, f"{situation}: {_first_wrong_step(got, expected)}{diagnosis}")


def _first_wrong_step(got: list, expected: list) -> str:
    """One step kept that should not be, or one missing: the smallest difference, not the answer."""
    extra = [step for step in got if step not in expected]
    missing = [step for step in expected if step not in got]
    if extra:
        return f"{len(got)} steps kept; step {extra[0]!r} should not be among them"
    if missing:
        return f"{len(got)} steps kept, expected {len(expected)}; step {missing[0]!r} is missing"
    return f"the right steps, but not once each in ascending order: got {got}"


@keep_n.case(hint=f"Without best_fn the newest steps are kept; None keeps all. See {_KEEP}.")
def keeps_the_latest_n(keep):
    steps = [0, 5, 10, 15, 20]
    for n in (None, 1, 3, 5, 9):
        _expect_kept(keep, steps, [None] * 5, max_to_keep=n)


@keep_n.case(points=2, hint=f"With best_fn, rank the steps that have metrics by best_fn(metrics), in "
                             f"the direction best_mode says. See {_KEEP}.")
def keeps_the_best_n_in_both_modes(keep):
    steps = [100, 200, 300, 400, 500, 600]
    metrics = [{"loss": v} for v in (0.9, 0.2, 0.5, 0.7, 0.1, 0.95)]
    for mode in ("min", "max"):
        _expect_kept(keep, steps, metrics, max_to_keep=2, best_fn=_loss, best_mode=mode)


# Ties at a realistic size (in ties_go_to_the_later_step): 48 steps whose metrics take 3 values.
# NumPy's default argsort is not stable at this size (nor, with its SIMD sorts, always at 5), so
# the step a tie keeps shows whether the sort was stable; a case of 5 steps can pass by chance.
_MANY_STEPS = list(range(0, 480, 10))
_MANY_LOSSES = [{"loss": float(v) / 10} for v in np.random.default_rng(5).integers(1, 4, size=48)]


@keep_n.case(hint="On ties the later step wins, at any size: the exercise says how to get that from a "
                  "stable sort (sorted, or np.argsort(..., kind='stable'); np.argsort's default kind is not "
                  "stable).")
def ties_go_to_the_later_step(keep):
    for mode, losses in (("min", (0.3, 0.5, 0.3, 0.5, 0.3)), ("max", (0.5, 0.3, 0.5, 0.3, 0.5))):
        metrics = [{"loss": v} for v in losses]  # three steps tie for best; two are kept
        _expect_kept(keep, [10, 20, 30, 40, 50], metrics, max_to_keep=2, best_fn=_loss, best_mode=mode)
    for mode in ("min", "max"):
        _expect_kept(keep, _MANY_STEPS, _MANY_LOSSES, max_to_keep=5, best_fn=_loss, best_mode=mode)


@keep_n.case(hint="Steps saved without metrics (None) do not count towards max_to_keep, and are kept "
                  "unless keep_checkpoints_without_metrics=False.")
def steps_without_metrics_are_kept_unless_told(keep):
    metrics = [{"loss": 0.4}, None, {"loss": 0.2}, {"loss": 0.3}, None]
    for flag in (True, False):
        _expect_kept(keep, [2, 4, 6, 8, 10], metrics, max_to_keep=1, best_fn=_loss, best_mode="min",
                     keep_checkpoints_without_metrics=flag)


@keep_n.case(hint="A metric that is 0 is still a metric: only None means 'saved without metrics'.")
def a_metric_of_zero_is_still_a_metric(keep):
    metrics = [0.0, 0.5, 0.0, 0.25, None]
    for mode in ("max", "min"):
        _expect_kept(keep, [1, 2, 3, 4, 5], metrics, max_to_keep=2, best_fn=accuracy, best_mode=mode)


@keep_n.case(hint="The first rule comes first: with at most max_to_keep steps, every step is kept, "
                  "with or without metrics.")
def at_most_max_to_keep_steps_are_all_kept(keep):
    metrics = [{"loss": 0.4}, None, {"loss": 0.2}]
    _expect_kept(keep, [3, 6, 9], metrics, max_to_keep=3, best_fn=_loss, best_mode="min",
                 keep_checkpoints_without_metrics=False)


@keep_n.case(hint="max_to_keep=0 keeps nothing, with or without best_fn.")
def keeping_zero_keeps_nothing(keep):
    _expect_kept(keep, [1, 2, 3], [None] * 3, max_to_keep=0)
    _expect_kept(keep, [1, 2, 3], [{"loss": 0.5}, None, {"loss": 0.1}], max_to_keep=0, best_fn=_loss,
                 best_mode="min")


# 05.async_save --------------------------------------------------------------------------

async_save = Exercise("05.async_save", "An asynchronous saver: snapshot on the caller, write in a thread")
_ASYNC = "the chapter's section 'Asynchronous saves'"

# No case here reads a clock: each one holds the write in the saver's thread on an Event
# until it has looked at what save() did, so a right answer passes and a wrong one fails
# on every run. The waits below only bound how long a wrong answer (one that blocks in
# save) holds the case up; a right one that waits for its threads with join() never waits
# for them to run out.
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


@contextlib.contextmanager
def _threads_held_until(gate):
    """Threads started inside the block run only once `gate` is set, or once someone joins them.

    The thread's whole run waits, not only write_fn, so a snapshot taken inside the thread is
    taken after the case has changed the tree: the case sees that on every run. A save() that
    joins its own thread opens the gate; one that waits for it some other way is slow (the
    wait is bounded), not stuck.
    """
    real_start, real_join = threading.Thread.start, threading.Thread.join

    def start(thread):
        run = thread.run

        def held_run():
            gate.wait(_BLOCKED_WRITE_S)
            run()

        thread.run = held_run
        real_start(thread)

    def join(thread, timeout=None):
        gate.set()
        return real_join(thread, timeout)

    with mock.patch.object(threading.Thread, "start", start), \
            mock.patch.object(threading.Thread, "join", join):
        yield


@async_save.case(hint="save() hands the snapshot to a thread that calls write_fn once; "
                      "wait_until_finished() waits for that thread, and has nothing to wait for before "
                      "the first save.")
def writes_what_was_saved(AsyncSaver):
    written = []
    saver = AsyncSaver(written.append)
    saver.wait_until_finished()  # nothing saved yet: returns at once
    saver.save(_tree())
    saver.wait_until_finished()
    expect(len(written) == 1, f"write_fn was called {len(written)} times for one save")
    expect_equal(written[0], _tree(), what="the written tree")


@async_save.case(points=2, time_limit_s=20, hint=f"save() must return while the write is still running: "
                                                 f"see {_ASYNC}.")
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


@async_save.case(points=2, time_limit_s=20, hint=f"The caller may change its arrays as soon as save() "
                                                 f"returns: by then the snapshot must be a complete copy, "
                                                 f"made on the caller's thread. See {_ASYNC}.")
def the_snapshot_is_taken_when_save_returns(AsyncSaver):
    gate, written = threading.Event(), []
    tree = _tree()
    saver = AsyncSaver(written.append)
    with _threads_held_until(gate):
        saver.save(tree)
    tree["w"] += 100.0  # the next training step changes the weights in place
    tree["b"][1][:] = 7.0
    gate.set()
    saver.wait_until_finished()
    expect(len(written) == 1, f"write_fn was called {len(written)} times for one save")
    expect_equal(written[0], _tree(), what="the written tree (it must not see changes made after save)")


@async_save.case(points=2, time_limit_s=20, hint=f"A save must not start while the previous one is still "
                                                 f"writing: see {_ASYNC}.")
def saves_never_overlap(AsyncSaver):
    lock, released = threading.Lock(), threading.Event()  # released: the first write may end
    running, overlapped, order = [], [], []
    started = []  # the threads started during the case, in order
    real_start, real_join = threading.Thread.start, threading.Thread.join

    def start(thread):
        started.append(thread)
        real_start(thread)

    def join(thread, timeout=None):
        # Waiting, without a timeout, for the first write's thread before starting another: no
        # write can overlap it now, so it need not wait any longer for one that would.
        if timeout is None and started == [thread]:
            released.set()
        return real_join(thread, timeout)

    def write(tree):
        with lock:
            overlapped.append(bool(running))
            running.append(1)
            order.append(float(tree["w"][0, 0]))
            first = len(order) == 1
        if first:  # a saver that does not wait starts the second write while this one runs
            released.wait(_OVERLAP_WAIT_S)
        else:
            released.set()
        with lock:
            running.pop()

    saver = AsyncSaver(write)
    with mock.patch.object(threading.Thread, "start", start), \
            mock.patch.object(threading.Thread, "join", join):
        for value in (1.0, 2.0, 3.0):
            tree = _tree()
            tree["w"][0, 0] = value
            saver.save(tree)
        saver.wait_until_finished()
    expect(not any(overlapped), "a write started while the previous one was still running")
    expect(order == [1.0, 2.0, 3.0], f"the writes happened in the order {order}, not 1, 2, 3")


@async_save.case(points=2, time_limit_s=20, hint="An exception in a thread is lost unless the thread keeps "
                                                 "it; wait_until_finished() raises it once the thread has "
                                                 "ended, and only once.")
def a_failed_write_is_raised_by_wait_until_finished(AsyncSaver):
    joined = threading.Event()
    caller = threading.current_thread()

    def failing_write(tree):
        if threading.current_thread() is not caller:
            joined.wait(_BLOCKED_WRITE_S)  # fails only once someone waits for the thread
        raise OSError(28, "No space left on device")

    real_join = threading.Thread.join

    def join(thread, timeout=None):
        joined.set()
        return real_join(thread, timeout)

    with mock.patch.object(threading.Thread, "join", join):
        saver = AsyncSaver(failing_write)
        saver.save(_tree())
        try:
            saver.wait_until_finished()
        except OSError:
            pass
        else:
            expect(False, "the write failed, but wait_until_finished did not raise its OSError (did it look "
                          "for the error before the thread had ended?)")
    saver.wait_until_finished()  # reported once; must not raise again


# 05.restore_into ------------------------------------------------------------------------

restore_into = Exercise("05.restore_into", "Restore saved arrays into a target structure")
_RESTORE = "the chapter's section 'Restoring into a target: shapes, dtypes, shardings'"


def _saved(tree):
    return {jax.tree_util.keystr(path): np.asarray(leaf)
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


@restore_into.case(hint="The result has the target's structure (dicts, lists, tuples), its leaves found "
                        "in `saved` by their keystr path.")
def rebuilds_the_targets_structure(restore):
    tree = {"layers": [{"w": jnp.ones((2, 2))}, {"w": jnp.full((2, 1), 3.0)}], "step": (jnp.int32(4),)}
    got = call_on_copies(restore, tree, _saved(tree), what="restore_into")
    expect(jax.tree.structure(got) == jax.tree.structure(tree),
           f"expected structure {jax.tree.structure(tree)}, got {jax.tree.structure(got)}")
    expect_equal([np.asarray(x) for x in jax.tree.leaves(got)],
                 [np.asarray(x) for x in jax.tree.leaves(tree)])


@restore_into.case(hint=f"Each leaf takes the target's dtype; a NumPy target leaf stays a NumPy array. See "
                        f"{_RESTORE}.")
def casts_to_the_target_dtype_and_keeps_numpy_leaves(restore):
    saved = _saved({"w": np.linspace(0, 1, 5, dtype=np.float32), "host": np.arange(3, dtype=np.int64)})
    target = {"w": jnp.zeros(5, jnp.bfloat16), "host": np.zeros(3, np.int32)}
    got = call_on_copies(restore, target, saved, what="restore_into")
    expect(isinstance(got["w"], jax.Array) and got["w"].dtype == jnp.bfloat16,
           f"['w']: expected a bfloat16 jax array, got {type(got['w']).__name__} "
           f"of {np.asarray(got['w']).dtype}")
    expect(isinstance(got["host"], np.ndarray) and got["host"].dtype == np.int32,
           f"['host']: expected an int32 NumPy array, got {type(got['host']).__name__} "
           f"of {np.asarray(got['host']).dtype}")


@restore_into.case(hint="The target says where each jax leaf lives: place it with the target leaf's own "
                        "sharding, not the default one (a sharding of None means the default device).")
def shape_dtype_struct_targets_become_arrays_with_the_targets_sharding(restore):
    device = jax.devices()[0]
    sharding = NamedSharding(Mesh(np.array([device]), ("x",)), P("x", None))
    target = {"w": jax.ShapeDtypeStruct((2, 3), jnp.float32, sharding=sharding),
              "step": jax.ShapeDtypeStruct((), jnp.int32)}  # no sharding: the default device
    # Called directly: a sharding holds devices, which cannot be deep-copied; nothing expected
    # here is computed from the inputs.
    got = restore(target, {"['w']": np.arange(6, dtype=np.float32).reshape(2, 3), "['step']": np.int64(7)})
    for key in ("w", "step"):
        expect(isinstance(got[key], jax.Array),
               f"['{key}']: expected a jax.Array, got {type(got[key]).__name__}")
    expect(got["w"].sharding == sharding, f"['w']: expected sharding {sharding}, got {got['w'].sharding}")
    expect(got["step"].devices() == {device} and got["step"].dtype == jnp.int32,
           f"['step'] (sharding None): expected an int32 array on {device}, got "
           f"{got['step'].dtype} on {got['step'].devices()}")


@restore_into.case(points=2, hint="One ValueError names every problem at once: paths missing from either "
                                  "side, and shapes that differ, with both shapes. Collect them before "
                                  "raising.")
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


# 05.choose_restore ----------------------------------------------------------------------

choose_restore = Exercise("05.choose_restore", "Which copy to restore from two tiers of checkpoints",
                          none_is_an_answer=True)  # None: nothing to restore
_TIERS = "the chapter's section 'Two tiers: surviving preemption'"


class _Copies:
    """The `is_intact(tier, step)` a case hands the learner: some copies damaged, every call recorded."""

    def __init__(self, damaged=()):
        self.damaged, self.calls = set(damaged), []

    def __call__(self, tier, step):
        self.calls.append((tier, step))
        return (tier, step) not in self.damaged

    def __deepcopy__(self, memo):  # call_on_copies hands the learner this very object, to record its calls
        return self


def _expected_choice(local_steps, persistent_steps, damaged):
    copies = multitier.restore_order(local_steps, persistent_steps)
    return next(((step, tier) for step, tier in copies if (tier, step) not in damaged), None)


def _expect_choice(choose, local_steps, persistent_steps, damaged=()):
    """Run the learner's answer on one situation; return the `is_intact` it was given."""
    is_intact = _Copies(damaged)
    expected = _expected_choice(local_steps, persistent_steps, set(damaged))
    got = call_on_copies(choose, list(local_steps), list(persistent_steps), is_intact, what="choose_restore")
    if isinstance(got, list | tuple) and len(got) == 2:
        got = tuple(got)
    situation = f"local tier {list(local_steps)}, persistent tier {list(persistent_steps)}"
    if damaged:
        situation += f", damaged copies {sorted(damaged, key=lambda copy: (copy[1], copy[0]))}"
    if got != expected:
        wrong = _what_is_wrong(got, expected, local_steps, persistent_steps, damaged)
        shown = "nothing to restore" if got is None else repr(got)
        expect(False, f"{situation}: got {shown}: {wrong}")
    return is_intact


def _what_is_wrong(got, expected, local_steps, persistent_steps, damaged) -> str:
    """Why `got` is not the copy to restore, without naming the copy that is."""
    held = {"local": set(local_steps), "persistent": set(persistent_steps)}
    if expected is None:
        return "no copy is intact (or there is none): expected None"
    if got is None:
        return "an intact copy exists, and restoring nothing would lose all the work saved"
    if not (isinstance(got, tuple) and len(got) == 2 and got[1] in held):
        return "expected a tuple (step, tier), tier 'local' or 'persistent', or None"
    step, tier = got
    if step not in held[tier]:
        return f"the {tier} tier holds no step {step!r}"
    if (tier, step) in set(damaged):
        return "that copy is damaged (is_intact said False)"
    if step == expected[0]:
        return "the right step, from the other tier"
    if step < expected[0]:
        return "a newer step has an intact copy"
    return "the newest intact copy is of an older step"


@choose_restore.case(points=2, hint=f"Compare the steps of both tiers: the newest step loses the least "
                                     f"work, and the persistent tier can be ahead of a new machine's local "
                                     f"tier. See {_TIERS}.")
def the_newest_step_wins_whichever_tier_holds_it(choose):
    _expect_choice(choose, [10, 12, 14], [6, 12])
    _expect_choice(choose, [4], [6, 12])
    _expect_choice(choose, [], [5])


@choose_restore.case(hint="When both tiers hold the newest step, one of the two copies is faster to read.")
def the_local_copy_comes_first_for_the_same_step(choose):
    _expect_choice(choose, [6, 12], [12])


@choose_restore.case(points=2, hint="A damaged copy of a step does not make that step's other copy useless: "
                                    "it still loses less work than any older step.")
def a_damaged_copy_falls_back_to_the_other_tiers_copy_of_the_same_step(choose):
    _expect_choice(choose, [10, 12], [6, 12], damaged={("local", 12)})


@choose_restore.case(hint="Skip every damaged copy, in either tier, and take the newest of the rest.")
def damaged_newest_steps_fall_back_to_an_older_step(choose):
    _expect_choice(choose, [16, 18, 20], [10], damaged={("local", 20), ("local", 18)})
    _expect_choice(choose, [20], [10, 15], damaged={("local", 20), ("persistent", 15)})


@choose_restore.case(hint="With no intact copy (or no copy at all) there is nothing to restore: return None.")
def nothing_intact_gives_none(choose):
    _expect_choice(choose, [], [])
    _expect_choice(choose, [3], [3], damaged={("local", 3), ("persistent", 3)})


@choose_restore.case(points=2, hint="Each is_intact call reads a whole checkpoint: ask about the copies in "
                                    "the order you would restore them, and stop at the first intact one.")
def checks_the_newest_copy_first_and_stops_at_the_first_intact_one(choose):
    damaged = {("local", 14), ("local", 12)}
    is_intact = _expect_choice(choose, [10, 12, 14], [6, 12], damaged=damaged)
    expected = [("local", 14), ("local", 12), ("persistent", 12)]
    expect_same_sequence(is_intact.calls, expected, what="the copies is_intact was asked about, in order")


@choose_restore.case(hint="The step lists come from listing directories: they may be in any order.")
def step_lists_in_any_order_are_handled(choose):
    _expect_choice(choose, [14, 10, 12], [12, 6])
    _expect_choice(choose, [8, 20, 14], [], damaged={("local", 20)})
    # Seeded shuffles of longer lists: no fixed order (a reversal, a rotation) passes by chance.
    local, persistent = [10 * i for i in range(3, 15)], [10 * i for i in range(0, 16, 3)]
    for seed in (1, 2):
        local = [local[i] for i in seeded_permutation(len(local), seed)]
        persistent = [persistent[i] for i in seeded_permutation(len(persistent), seed + 10)]
        _expect_choice(choose, local, persistent, damaged={("persistent", 150), ("local", 140)})
