"""Chapter 05's exercise cases: right answers score full marks, planted wrong ones lose points."""

import os
import pathlib
import shutil
import tempfile
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stacklib.checkpoint import multitier, retention
from stacklib.grading import grade


def atomic_write(path, chunks):
    path = pathlib.Path(path)
    temporary = path.with_name(path.name + ".tmp")
    try:
        with open(temporary, "wb") as file:
            for chunk in chunks:
                file.write(chunk)
            file.flush()
            os.fsync(file.fileno())
        temporary.replace(path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


class AsyncSaver:
    def __init__(self, write_fn):
        self.write_fn, self.thread, self.error = write_fn, None, None

    def save(self, tree):
        self.wait_until_finished()
        snapshot = jax.tree.map(np.array, tree)
        self.thread = threading.Thread(target=self._write, args=(snapshot,))
        self.thread.start()

    def _write(self, snapshot):
        try:
            self.write_fn(snapshot)
        except Exception as error:
            self.error = error

    def wait_until_finished(self):
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            error, self.error = self.error, None
            raise error


def restore_into(target, saved):
    leaves_with_paths, treedef = jax.tree_util.tree_flatten_with_path(target)
    paths = [jax.tree_util.keystr(p) for p, _ in leaves_with_paths]
    problems = [p for p in paths if p not in saved] + [p for p in saved if p not in paths]
    problems += [f"{p} {np.shape(saved[p])} vs {np.shape(leaf)}"
                 for p, (_, leaf) in zip(paths, leaves_with_paths, strict=True)
                 if p in saved and np.shape(saved[p]) != np.shape(leaf)]
    if problems:
        raise ValueError("; ".join(problems))
    leaves = []
    for p, (_, leaf) in zip(paths, leaves_with_paths, strict=True):
        array = np.asarray(saved[p]).astype(leaf.dtype)
        is_jax = isinstance(leaf, jax.Array | jax.ShapeDtypeStruct)
        leaves.append(jax.device_put(array, leaf.sharding) if is_jax else array)
    return jax.tree_util.tree_unflatten(treedef, leaves)


def choose_restore(local_steps, persistent_steps, is_intact):
    copies = multitier.restore_order(local_steps, persistent_steps)
    return next(((step, tier) for step, tier in copies if is_intact(tier, step)), None)


RIGHT = {
    "05.atomic_write": atomic_write,
    "05.keep_n": retention.steps_to_keep,
    "05.async_save": AsyncSaver,
    "05.restore_into": restore_into,
    "05.choose_restore": choose_restore,
}


@pytest.mark.parametrize("exercise_id", sorted(RIGHT))
def test_a_right_answer_scores_full_marks(exercise_id):
    result = grade(exercise_id, RIGHT[exercise_id])
    assert result.points == result.max_points, [c.message for c in result.cases]


# Planted wrong answers.

def write_in_place(path, chunks):
    with open(path, "wb") as file:
        for chunk in chunks:
            file.write(chunk)


def without_fsync(path, chunks):
    path = pathlib.Path(path)
    temporary = path.with_name(path.name + ".tmp")
    try:
        temporary.write_bytes(b"".join(chunks))
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def leaves_the_temporary_file(path, chunks):
    path = pathlib.Path(path)
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "wb") as file:
        for chunk in chunks:
            file.write(chunk)
        os.fsync(file.fileno())
    os.replace(temporary, path)


def temporary_file_elsewhere(path, chunks):
    descriptor, temporary = tempfile.mkstemp()  # in the system's temporary folder, not beside path
    try:
        with os.fdopen(descriptor, "wb") as file:
            for chunk in chunks:
                file.write(chunk)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        pathlib.Path(temporary).unlink(missing_ok=True)
        raise


def swallows_the_error(path, chunks):
    try:
        atomic_write(path, chunks)
    except Exception:
        pass  # the caller never learns that the write failed


def always_max(steps, metrics, max_to_keep, best_fn=None, best_mode="max",
               keep_checkpoints_without_metrics=True):
    return retention.steps_to_keep(steps, metrics, max_to_keep=max_to_keep, best_fn=best_fn, best_mode="max",
                                   keep_checkpoints_without_metrics=keep_checkpoints_without_metrics)


def ties_to_the_earlier(steps, metrics, max_to_keep, best_fn=None, best_mode="max",
                        keep_checkpoints_without_metrics=True):
    if best_fn is None or max_to_keep is None or len(steps) <= max_to_keep:
        return retention.steps_to_keep(steps, metrics, max_to_keep=max_to_keep)
    scored = [(s, m) for s, m in zip(steps, metrics, strict=True) if m is not None]
    ranked = sorted(scored, key=lambda pair: best_fn(pair[1]), reverse=best_mode == "max")  # best first
    keep = {s for s, _ in ranked[:max_to_keep]}
    if keep_checkpoints_without_metrics:
        keep |= {s for s, m in zip(steps, metrics, strict=True) if m is None}
    return [s for s in steps if s in keep]


def drops_unscored(steps, metrics, max_to_keep, best_fn=None, best_mode="max",
                   keep_checkpoints_without_metrics=True):
    return retention.steps_to_keep(steps, metrics, max_to_keep=max_to_keep, best_fn=best_fn,
                                   best_mode=best_mode, keep_checkpoints_without_metrics=False)


def best_first(steps, metrics, max_to_keep, best_fn=None, best_mode="max",
               keep_checkpoints_without_metrics=True):
    kept = retention.steps_to_keep(steps, metrics, max_to_keep=max_to_keep, best_fn=best_fn,
                                   best_mode=best_mode,
                                   keep_checkpoints_without_metrics=keep_checkpoints_without_metrics)
    if best_fn is None:
        return kept
    score = {s: best_fn(m) for s, m in zip(steps, metrics, strict=True) if m is not None}
    return sorted(kept, key=lambda s: score.get(s, 0.0), reverse=best_mode == "max")  # not ascending


def keeps_all_at_zero(steps, metrics, max_to_keep, best_fn=None, best_mode="max",
                      keep_checkpoints_without_metrics=True):
    if max_to_keep == 0:
        return list(steps[-max_to_keep:])  # steps[-0:] is every step
    return retention.steps_to_keep(steps, metrics, max_to_keep=max_to_keep, best_fn=best_fn,
                                   best_mode=best_mode,
                                   keep_checkpoints_without_metrics=keep_checkpoints_without_metrics)


def drops_unscored_in_place(steps, metrics, max_to_keep, best_fn=None, best_mode="max",
                            keep_checkpoints_without_metrics=True):
    kept = retention.steps_to_keep(steps, metrics, max_to_keep=max_to_keep, best_fn=best_fn,
                                   best_mode=best_mode,
                                   keep_checkpoints_without_metrics=keep_checkpoints_without_metrics)
    steps[:] = [s for s in steps if s in kept]  # prunes the caller's list
    return kept


class Synchronous(AsyncSaver):
    def save(self, tree):
        self.write_fn(jax.tree.map(np.array, tree))


class NoSnapshot(AsyncSaver):
    def save(self, tree):
        self.wait_until_finished()
        self.thread = threading.Thread(target=self._write, args=(tree,))
        self.thread.start()


class JoinsInSave(AsyncSaver):
    def save(self, tree):
        super().save(tree)
        self.thread.join()  # a thread that save() waits for is a synchronous save


class SwallowsErrors(AsyncSaver):
    def _write(self, snapshot):
        try:
            self.write_fn(snapshot)
        except Exception:
            pass


class Overlapping(AsyncSaver):
    def save(self, tree):
        self.threads = getattr(self, "threads", [])
        thread = threading.Thread(target=self._write, args=(jax.tree.map(np.array, tree),))
        thread.start()
        self.threads.append(thread)

    def wait_until_finished(self):
        for thread in getattr(self, "threads", []):
            thread.join()
        self.threads = []
        super().wait_until_finished()


def unchecked_restore(target, saved):
    leaves_with_paths, treedef = jax.tree_util.tree_flatten_with_path(target)
    leaves = [saved[jax.tree_util.keystr(path)] for path, _ in leaves_with_paths]
    return jax.tree_util.tree_unflatten(treedef, leaves)


def first_problem_only(target, saved):
    for path, _ in jax.tree_util.tree_flatten_with_path(target)[0]:
        key = jax.tree_util.keystr(path)
        if key not in saved:
            raise ValueError(f"missing {key}")
    return restore_into(target, saved)


def numpy_for_shape_dtype_structs(target, saved):
    leaves_with_paths, treedef = jax.tree_util.tree_flatten_with_path(target)
    restored = restore_into(target, saved)
    leaves = [np.asarray(leaf) if isinstance(original, jax.ShapeDtypeStruct) else leaf
              for (_, original), leaf in zip(leaves_with_paths, jax.tree.leaves(restored), strict=True)]
    return jax.tree_util.tree_unflatten(treedef, leaves)


def places_on_the_shardings_device(target, saved):
    leaves_with_paths, treedef = jax.tree_util.tree_flatten_with_path(target)
    restore_into(target, saved)  # the checks
    leaves = []
    for path, leaf in leaves_with_paths:
        array = np.asarray(saved[jax.tree_util.keystr(path)]).astype(leaf.dtype)
        if isinstance(leaf, jax.Array | jax.ShapeDtypeStruct):  # fails for a sharding of None
            array = jax.device_put(array, next(iter(leaf.sharding.device_set)))
        leaves.append(array)
    return jax.tree_util.tree_unflatten(treedef, leaves)


def no_cast(target, saved):
    leaves_with_paths, treedef = jax.tree_util.tree_flatten_with_path(target)
    restore_into(target, saved)  # the checks
    leaves = [saved[jax.tree_util.keystr(path)] for path, _ in leaves_with_paths]
    return jax.tree_util.tree_unflatten(treedef, leaves)


def pops_what_it_restores(target, saved):
    restored = restore_into(target, saved)
    for path, _ in jax.tree_util.tree_flatten_with_path(target)[0]:
        saved.pop(jax.tree_util.keystr(path))  # empties the caller's dict
    return restored


def fsync_without_flush(path, chunks):
    path = pathlib.Path(path)
    temporary = path.with_name(path.name + ".tmp")
    try:
        with open(temporary, "wb") as file:
            for chunk in chunks:
                file.write(chunk)
            os.fsync(file.fileno())  # the bytes are still in Python's buffer
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def fsync_before_writing(path, chunks):
    path = pathlib.Path(path)
    temporary = path.with_name(path.name + ".tmp")
    try:
        with open(temporary, "wb") as file:
            os.fsync(file.fileno())  # of an empty file
            for chunk in chunks:
                file.write(chunk)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def removes_the_target_first(path, chunks):
    path = pathlib.Path(path)
    temporary = path.with_name(path.name + ".tmp")
    try:
        with open(temporary, "wb") as file:
            for chunk in chunks:
                file.write(chunk)
            file.flush()
            os.fsync(file.fileno())
        path.unlink(missing_ok=True)  # for a moment there is no file at all
        os.rename(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def cleans_up_only_after_an_exception(path, chunks):
    path = pathlib.Path(path)
    temporary = path.with_name(path.name + ".tmp")
    try:
        with open(temporary, "wb") as file:
            for chunk in chunks:
                file.write(chunk)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except Exception:  # a KeyboardInterrupt leaves the temporary file behind
        temporary.unlink(missing_ok=True)
        raise


def stops_at_an_empty_chunk(path, chunks):
    remaining = iter(chunks)
    atomic_write(path, iter(lambda: next(remaining, b""), b""))


def deletes_the_target_on_failure(path, chunks):
    path = pathlib.Path(path)
    temporary = path.with_name(path.name + ".tmp")
    try:
        with open(temporary, "wb") as file:
            for chunk in chunks:
                file.write(chunk)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        path.unlink(missing_ok=True)  # the wrong file
        raise


def returns_positions(steps, metrics, max_to_keep, best_fn=None, best_mode="max",
                      keep_checkpoints_without_metrics=True):
    kept = retention.steps_to_keep(list(range(len(steps))), metrics, max_to_keep=max_to_keep, best_fn=best_fn,
                                   best_mode=best_mode,
                                   keep_checkpoints_without_metrics=keep_checkpoints_without_metrics)
    return kept if best_fn is not None else [steps[i] for i in kept]


def returns_a_set(steps, metrics, max_to_keep, best_fn=None, best_mode="max",
                  keep_checkpoints_without_metrics=True):
    return set(retention.steps_to_keep(steps, metrics, max_to_keep=max_to_keep, best_fn=best_fn,
                                       best_mode=best_mode,
                                       keep_checkpoints_without_metrics=keep_checkpoints_without_metrics))


def keeps_all_at_zero_with_best_fn(steps, metrics, max_to_keep, best_fn=None, best_mode="max",
                                   keep_checkpoints_without_metrics=True):
    if max_to_keep == 0 and best_fn is not None:
        return [s for s, m in zip(steps, metrics, strict=True)
                if m is not None or keep_checkpoints_without_metrics]
    return retention.steps_to_keep(steps, metrics, max_to_keep=max_to_keep, best_fn=best_fn,
                                   best_mode=best_mode,
                                   keep_checkpoints_without_metrics=keep_checkpoints_without_metrics)


def zero_is_no_metric(steps, metrics, max_to_keep, best_fn=None, best_mode="max",
                      keep_checkpoints_without_metrics=True):
    metrics = [m if m else None for m in metrics]  # a metric of 0.0 is taken for a missing one
    return retention.steps_to_keep(steps, metrics, max_to_keep=max_to_keep, best_fn=best_fn,
                                   best_mode=best_mode,
                                   keep_checkpoints_without_metrics=keep_checkpoints_without_metrics)


def ranks_even_a_few_steps(steps, metrics, max_to_keep, best_fn=None, best_mode="max",
                           keep_checkpoints_without_metrics=True):
    if best_fn is not None and max_to_keep and not keep_checkpoints_without_metrics:
        scored = [s for s, m in zip(steps, metrics, strict=True) if m is not None]  # skips the first rule
        kept = retention.steps_to_keep(scored, [m for m in metrics if m is not None], max_to_keep=max_to_keep,
                                       best_fn=best_fn, best_mode=best_mode)
        return kept
    return retention.steps_to_keep(steps, metrics, max_to_keep=max_to_keep, best_fn=best_fn,
                                   best_mode=best_mode,
                                   keep_checkpoints_without_metrics=keep_checkpoints_without_metrics)


def unscored_count_towards_n(steps, metrics, max_to_keep, best_fn=None, best_mode="max",
                             keep_checkpoints_without_metrics=True):
    if best_fn is None or max_to_keep is None or max_to_keep == 0 or len(steps) <= max_to_keep:
        return retention.steps_to_keep(steps, metrics, max_to_keep=max_to_keep, best_fn=best_fn,
                                       best_mode=best_mode)
    unscored = [s for s, m in zip(steps, metrics, strict=True) if m is None]
    unscored = unscored if keep_checkpoints_without_metrics else []
    scored = [(s, m) for s, m in zip(steps, metrics, strict=True) if m is not None]
    ranked = sorted(scored, key=lambda pair: best_fn(pair[1]), reverse=best_mode == "min")
    room = max(max_to_keep - len(unscored), 0)  # the unscored steps take places among the N
    keep = set(unscored) | {s for s, _ in ranked[len(ranked) - room:]}
    return [s for s in steps if s in keep]


class SnapshotInTheThread(AsyncSaver):
    def save(self, tree):
        self.wait_until_finished()
        self.thread = threading.Thread(target=lambda: self._write(jax.tree.map(np.array, tree)))
        self.thread.start()  # the copy happens later, in the thread


class AsarraySnapshot(AsyncSaver):
    def save(self, tree):
        self.wait_until_finished()
        snapshot = jax.tree.map(np.asarray, tree)  # np.asarray does not copy a NumPy array
        self.thread = threading.Thread(target=self._write, args=(snapshot,))
        self.thread.start()


class WaitsOnlyInsideSave(AsyncSaver):
    def save(self, tree):
        if self.thread is not None:
            self.thread.join()
        self.thread = threading.Thread(target=self._write, args=(jax.tree.map(np.array, tree),))
        self.thread.start()

    def wait_until_finished(self):
        self.thread.join()  # fails before the first save
        if self.error is not None:
            error, self.error = self.error, None
            raise error


class RaisesEveryTime(AsyncSaver):
    def wait_until_finished(self):
        if self.thread is not None:
            self.thread.join()
        if self.error is not None:
            raise self.error  # never cleared


class LooksForTheErrorBeforeJoining(AsyncSaver):
    def wait_until_finished(self):
        if self.error is not None:
            error, self.error = self.error, None
            raise error
        if self.thread is not None:
            self.thread.join()  # an error raised meanwhile waits for the next call
            self.thread = None


def ignores_the_targets_sharding(target, saved):
    leaves_with_paths, treedef = jax.tree_util.tree_flatten_with_path(target)
    restore_into(target, saved)  # the checks
    leaves = []
    for path, leaf in leaves_with_paths:
        array = np.asarray(saved[jax.tree_util.keystr(path)]).astype(leaf.dtype)
        leaves.append(jax.device_put(array) if isinstance(leaf, jax.Array | jax.ShapeDtypeStruct) else array)
    return jax.tree_util.tree_unflatten(treedef, leaves)


def casts_only_jax_leaves(target, saved):
    leaves_with_paths, treedef = jax.tree_util.tree_flatten_with_path(target)
    restore_into(target, saved)  # the checks
    leaves = []
    for path, leaf in leaves_with_paths:
        array = np.asarray(saved[jax.tree_util.keystr(path)])
        is_jax = isinstance(leaf, jax.Array | jax.ShapeDtypeStruct)
        leaves.append(jax.device_put(array.astype(leaf.dtype), leaf.sharding) if is_jax else array)
    return jax.tree_util.tree_unflatten(treedef, leaves)


def checks_shapes_only_when_no_path_is_missing(target, saved):
    paths = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(target)[0]]
    missing = [p for p in paths if p not in saved] + [p for p in saved if p not in paths]
    if missing:
        raise ValueError(f"missing or extra paths: {missing}")
    return restore_into(target, saved)


def ignores_damage(local_steps, persistent_steps, is_intact):
    copies = multitier.restore_order(local_steps, persistent_steps)
    return copies[0] if copies else None  # never asks is_intact


def persistent_copy_first(local_steps, persistent_steps, is_intact):
    copies = sorted([(s, "local") for s in local_steps] + [(s, "persistent") for s in persistent_steps],
                    key=lambda copy: (-copy[0], copy[1] != "persistent"))
    return next(((s, t) for s, t in copies if is_intact(t, s)), None)


def local_tier_first(local_steps, persistent_steps, is_intact):
    for tier, steps in (("local", local_steps), ("persistent", persistent_steps)):
        for step in sorted(steps, reverse=True):  # every local step before any persistent one
            if is_intact(tier, step):
                return step, tier
    return None


def checks_every_copy_first(local_steps, persistent_steps, is_intact):
    copies = multitier.restore_order(local_steps, persistent_steps)
    intact = [(s, t) for s, t in copies if is_intact(t, s)]  # reads every checkpoint
    return intact[0] if intact else None


def assumes_sorted_lists(local_steps, persistent_steps, is_intact):
    local, persistent = list(local_steps), list(persistent_steps)
    while local or persistent:  # merges from the ends, as if both lists were ascending
        if local and (not persistent or local[-1] >= persistent[-1]):
            step, tier = local.pop(), "local"
        else:
            step, tier = persistent.pop(), "persistent"
        if is_intact(tier, step):
            return step, tier
    return None


def raises_when_nothing_is_intact(local_steps, persistent_steps, is_intact):
    copies = multitier.restore_order(local_steps, persistent_steps)
    return next((s, t) for s, t in copies if is_intact(t, s))  # StopIteration instead of None


def sorts_the_callers_lists(local_steps, persistent_steps, is_intact):
    local_steps.sort(reverse=True)
    persistent_steps.sort(reverse=True)
    return choose_restore(local_steps, persistent_steps, is_intact)


# (exercise, planted wrong answer, points it should still get, why)
# Fresh wrong answers a learner writes (issue 38).


def ranks_with_the_default_argsort(steps, metrics, max_to_keep, best_fn=None, best_mode="max",
                                   keep_checkpoints_without_metrics=True):
    if max_to_keep is None or len(steps) <= max_to_keep:
        return list(steps)
    if best_fn is None:
        return list(steps)[len(steps) - max_to_keep:] if max_to_keep else []
    if max_to_keep == 0:
        return []
    scored = [(s, m) for s, m in zip(steps, metrics, strict=True) if m is not None]
    values = np.array([best_fn(m) for _, m in scored])
    order = np.argsort(values if best_mode == "max" else -values)  # quicksort: ties in no set order
    keep = {scored[i][0] for i in order[-max_to_keep:]}
    if keep_checkpoints_without_metrics:
        keep |= {s for s, m in zip(steps, metrics, strict=True) if m is None}
    return [s for s in steps if s in keep]


def compares_max_to_keep_before_none(steps, metrics, max_to_keep, best_fn=None, best_mode="max",
                                     keep_checkpoints_without_metrics=True):
    if len(steps) <= max_to_keep:  # TypeError for max_to_keep=None
        return list(steps)
    return retention.steps_to_keep(steps, metrics, max_to_keep=max_to_keep, best_fn=best_fn,
                                   best_mode=best_mode,
                                   keep_checkpoints_without_metrics=keep_checkpoints_without_metrics)


def takes_the_first_listed_step_as_newest(local_steps, persistent_steps, is_intact):
    copies = [(steps[0], tier) for steps, tier in ((local_steps, "local"), (persistent_steps, "persistent"))
              if steps]  # as if the listings came newest first
    copies.sort(key=lambda copy: (-copy[0], copy[1] != "local"))
    return next(((step, tier) for step, tier in copies if is_intact(tier, step)), None)


def local_tier_unless_empty(local_steps, persistent_steps, is_intact):
    steps, tier = (local_steps, "local") if local_steps else (persistent_steps, "persistent")
    return next(((step, tier) for step in sorted(steps, reverse=True) if is_intact(tier, step)), None)


def restores_every_leaf_as_a_jax_array(target, saved):
    restored = restore_into(target, saved)
    return jax.tree.map(jnp.asarray, restored)  # NumPy targets must stay NumPy



def fsyncs_the_folder_not_the_file(path, chunks):
    path = pathlib.Path(path)
    temporary = path.with_name(path.name + ".tmp")
    try:
        with open(temporary, "wb") as file:
            for chunk in chunks:
                file.write(chunk)
        folder = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(folder)  # the folder's entry, not the file's bytes
        finally:
            os.close(folder)
        temporary.replace(path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


class ShallowSnapshot(AsyncSaver):
    def save(self, tree):
        self.wait_until_finished()
        snapshot = dict(tree) if isinstance(tree, dict) else list(tree)  # new container, the same arrays
        self.thread = threading.Thread(target=self._write, args=(snapshot,))
        self.thread.start()


def atomic_write_copying_onto_the_target(path, chunks):
    path = pathlib.Path(path)
    temporary = path.with_name(path.name + ".tmp")
    try:
        with open(temporary, "wb") as file:
            for chunk in chunks:
                file.write(chunk)
            file.flush()
            os.fsync(file.fileno())
        shutil.copyfile(temporary, path)  # rewrites the target byte by byte: a reader can see half of it
    finally:
        temporary.unlink(missing_ok=True)


def keeps_the_best_by_a_dict_of_scores(steps, metrics, max_to_keep, best_fn=None, best_mode="max",
                                       keep_checkpoints_without_metrics=True):
    if max_to_keep is None or len(steps) <= max_to_keep:
        return list(steps)
    if best_fn is None:
        return list(steps)[len(steps) - max_to_keep:] if max_to_keep else []
    # One step per score: of two steps with the same score, the dict keeps only the later one.
    step_of = {best_fn(m): step for step, m in zip(steps, metrics, strict=True) if m is not None}
    ranked = sorted(step_of, reverse=best_mode == "min")
    kept = {step_of[score] for score in ranked[len(ranked) - max_to_keep:]} if max_to_keep else set()
    unscored = {step for step, m in zip(steps, metrics, strict=True) if m is None}
    return sorted(kept | (unscored if keep_checkpoints_without_metrics else set()))


class SnapshotInJaxArrays(AsyncSaver):
    def save(self, tree):
        self.wait_until_finished()
        snapshot = jax.tree.map(jnp.array, tree)  # copies, but into float32 jax arrays, not NumPy
        self.thread = threading.Thread(target=self._write, args=(snapshot,))
        self.thread.start()


def restores_the_leaves_in_the_saved_order(target, saved):
    leaves, treedef = jax.tree_util.tree_flatten(target)
    if len(leaves) != len(saved):
        raise ValueError(f"{len(saved)} saved arrays for {len(leaves)} leaves")
    restored = []
    for leaf, array in zip(leaves, saved.values(), strict=True):  # by position, not by path
        array = np.asarray(array).astype(leaf.dtype)
        is_jax = isinstance(leaf, jax.Array | jax.ShapeDtypeStruct)
        restored.append(jax.device_put(array, leaf.sharding) if is_jax else array)
    return jax.tree_util.tree_unflatten(treedef, restored)


def chooses_among_the_newest_steps_copies_only(local_steps, persistent_steps, is_intact):
    steps = set(local_steps) | set(persistent_steps)
    if not steps:
        return None
    newest = max(steps)
    for tier, held in (("local", local_steps), ("persistent", persistent_steps)):
        if newest in held and is_intact(tier, newest):
            return newest, tier
    return None  # both copies of the newest step damaged: gives up instead of trying older steps


FRESH = [
    ("05.keep_n", ranks_with_the_default_argsort, 7, "np.argsort's default (unstable) kind"),
    ("05.keep_n", compares_max_to_keep_before_none, 7, "len(steps) <= None"),
    ("05.keep_n", keeps_the_best_by_a_dict_of_scores, 5, "a dict keyed by score: tied steps collide"),
    ("05.choose_restore", takes_the_first_listed_step_as_newest, 2, "the first listed step as the newest"),
    ("05.choose_restore", local_tier_unless_empty, 3, "the local tier unless it is empty"),
    ("05.choose_restore", chooses_among_the_newest_steps_copies_only, 6, "gives up after the newest step"),
    ("05.restore_into", restores_every_leaf_as_a_jax_array, 4, "jax arrays where the target has NumPy"),
    ("05.restore_into", restores_the_leaves_in_the_saved_order, 2, "pairs leaves by position, not by path"),
    ("05.atomic_write", fsyncs_the_folder_not_the_file, 7, "fsyncs the folder, not the file"),
    ("05.atomic_write", atomic_write_copying_onto_the_target, 6, "copies onto the target: no os.replace"),
    ("05.async_save", ShallowSnapshot, 7, "a shallow copy: the same arrays"),
    ("05.async_save", SnapshotInJaxArrays, 6, "a snapshot of jax arrays, not NumPy ones"),
]


WRONG = [
    ("05.atomic_write", write_in_place, 1, "writes in place"),
    ("05.atomic_write", without_fsync, 7, "no fsync"),
    ("05.atomic_write", fsync_without_flush, 7, "fsyncs before flushing Python's buffer"),
    ("05.atomic_write", fsync_before_writing, 7, "fsyncs the empty file"),
    ("05.atomic_write", leaves_the_temporary_file, 5, "leaves the temporary file"),
    ("05.atomic_write", temporary_file_elsewhere, 7, "writes the temporary file in another folder"),
    ("05.atomic_write", swallows_the_error, 6, "swallows the exception"),
    ("05.atomic_write", removes_the_target_first, 7, "removes the old file before the rename"),
    ("05.atomic_write", cleans_up_only_after_an_exception, 7, "an interrupt leaves the temporary file"),
    ("05.atomic_write", stops_at_an_empty_chunk, 7, "takes an empty chunk for the end"),
    ("05.atomic_write", deletes_the_target_on_failure, 4, "deletes the target, not the temporary file"),
    ("05.keep_n", always_max, 3, "ignores best_mode"),
    ("05.keep_n", best_first, 4, "returns the kept steps best first"),
    ("05.keep_n", keeps_all_at_zero, 7, "steps[-0:] keeps everything"),
    ("05.keep_n", keeps_all_at_zero_with_best_fn, 7, "max_to_keep=0 keeps everything with a best_fn"),
    ("05.keep_n", drops_unscored_in_place, 1, "prunes the caller's list"),
    ("05.keep_n", ties_to_the_earlier, 6, "ties go to the earlier step"),
    ("05.keep_n", drops_unscored, 6, "drops steps without metrics"),
    ("05.keep_n", returns_positions, 2, "returns positions in the list, not steps"),
    ("05.keep_n", returns_a_set, 0, "returns a set"),
    ("05.keep_n", zero_is_no_metric, 7, "takes a metric of 0 for a missing one"),
    ("05.keep_n", ranks_even_a_few_steps, 7, "drops an unscored step when all steps fit"),
    ("05.keep_n", unscored_count_towards_n, 6, "steps without metrics take places among the N"),
    ("05.async_save", Synchronous, 5, "writes synchronously"),
    ("05.async_save", NoSnapshot, 7, "no snapshot"),
    ("05.async_save", SnapshotInTheThread, 7, "takes the snapshot in the thread"),
    ("05.async_save", AsarraySnapshot, 7, "np.asarray, which does not copy"),
    ("05.async_save", JoinsInSave, 7, "joins the thread inside save"),
    ("05.async_save", SwallowsErrors, 7, "swallows errors"),
    ("05.async_save", RaisesEveryTime, 7, "raises the error on every call"),
    ("05.async_save", LooksForTheErrorBeforeJoining, 7, "looks for the error before the thread has ended"),
    ("05.async_save", WaitsOnlyInsideSave, 8, "wait_until_finished fails before the first save"),
    ("05.async_save", Overlapping, 7, "does not wait for the previous save"),
    ("05.restore_into", unchecked_restore, 1, "no casting, placing or checking"),
    ("05.restore_into", first_problem_only, 3, "names only the first problem"),
    ("05.restore_into", checks_shapes_only_when_no_path_is_missing, 3, "names the shapes only when no path "
                                                                       "is missing"),
    ("05.restore_into", numpy_for_shape_dtype_structs, 4, "a ShapeDtypeStruct target becomes a NumPy array"),
    ("05.restore_into", places_on_the_shardings_device, 4, "cannot place a target whose sharding is None"),
    ("05.restore_into", ignores_the_targets_sharding, 4, "places every array on the default device"),
    ("05.restore_into", no_cast, 3, "does not cast, nor place a ShapeDtypeStruct"),
    ("05.restore_into", casts_only_jax_leaves, 4, "does not cast NumPy leaves"),
    ("05.restore_into", pops_what_it_restores, 3, "empties the caller's dict"),
    ("05.choose_restore", ignores_damage, 3, "restores the newest copy, damaged or not"),
    ("05.choose_restore", persistent_copy_first, 7, "reads the persistent copy of a step first"),
    ("05.choose_restore", local_tier_first, 4, "tries every local step before any persistent one"),
    ("05.choose_restore", checks_every_copy_first, 8, "checks every copy, not only until the first intact"),
    ("05.choose_restore", assumes_sorted_lists, 9, "takes the last step of each list for the newest"),
    ("05.choose_restore", raises_when_nothing_is_intact, 9, "raises StopIteration when nothing is intact"),
    ("05.choose_restore", sorts_the_callers_lists, 1, "sorts the caller's lists in place"),
    *FRESH,
]


@pytest.mark.parametrize("exercise_id, answer, points, why", WRONG, ids=[w[3] for w in WRONG])
def test_a_planted_wrong_answer_loses_points(exercise_id, answer, points, why):
    result = grade(exercise_id, answer)
    assert result.points == points, [(c.name, c.status, c.message) for c in result.cases]
    assert result.points < result.max_points


# (exercise, planted wrong answer, words its first failing case's message must hold)
DIAGNOSED = [
    ("05.keep_n", returns_positions, "positions in the list, not the steps"),
    ("05.keep_n", always_max, "what the other best_mode keeps"),
    ("05.async_save", LooksForTheErrorBeforeJoining, "before the thread had ended"),
    ("05.atomic_write", fsync_without_flush, "still in Python's buffer"),
    ("05.atomic_write", removes_the_target_first, "the old file was already gone"),
    ("05.choose_restore", ignores_damage, "that copy is damaged"),
    ("05.choose_restore", persistent_copy_first, "the right step, from the other tier"),
]


@pytest.mark.parametrize("exercise_id, answer, words", DIAGNOSED, ids=[d[2] for d in DIAGNOSED])
def test_a_planted_wrong_answer_is_told_its_own_mistake(exercise_id, answer, words):
    failed = [c for c in grade(exercise_id, answer).cases if c.points < c.max_points]
    assert words in failed[0].message, failed[0].message
