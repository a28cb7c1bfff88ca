"""stacklib.checkpoint: round trips, atomicity, retention, async saves, integrity, bad input, crashes."""

import json
import multiprocessing
import os
import pathlib
import random
import re
import shutil
import signal
import textwrap
import threading
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import run_python

import stacklib.checkpoint as ocp
from stacklib.checkpoint import atomic, retention, tree_files, zoo
from stacklib.checkpoint.args import Composite, JsonRestore, JsonSave, StandardRestore, StandardSave


def sample_tree():
    return {
        "params": {"w": jnp.arange(12.0).reshape(3, 4), "b": jnp.ones(4, jnp.bfloat16)},
        "layers": [jnp.int32(3), {"scale": np.float32(0.5)}],
        "count": 7,
        "rate": 0.25,
        "host": np.arange(5, dtype=np.int16),
    }


def assert_same_tree(got, expected):
    assert jax.tree.structure(got) == jax.tree.structure(expected)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        both_jax = isinstance(a, jax.Array) and isinstance(b, jax.Array)
        assert type(a) is type(b) or both_jax, (type(a), type(b))
        assert np.asarray(a).dtype == np.asarray(b).dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def manager(path, **options):
    return ocp.CheckpointManager(path, options=ocp.CheckpointManagerOptions(**options))


# Round trips.

def test_a_pytree_round_trips_exactly_into_a_target(tmp_path):
    tree = sample_tree()
    with manager(tmp_path) as m:
        assert m.save(1, args=StandardSave(tree))
        m.wait_until_finished()
        assert_same_tree(m.restore(1, args=StandardRestore(tree)), tree)


def test_without_a_target_the_saved_structure_comes_back_as_dicts_and_lists(tmp_path):
    with manager(tmp_path) as m:
        m.save(1, args=StandardSave(sample_tree()))
        restored = m.restore(1)
    assert isinstance(restored["params"]["w"], jax.Array) and restored["params"]["b"].dtype == jnp.bfloat16
    assert isinstance(restored["host"], np.ndarray) and restored["count"] == 7 and restored["rate"] == 0.25
    assert isinstance(restored["layers"], list) and isinstance(restored["layers"][1]["scale"], np.float32)


def test_restoring_casts_to_the_target_dtype_and_accepts_shape_dtype_structs(tmp_path):
    with manager(tmp_path) as m:
        m.save(1, args=StandardSave({"w": jnp.arange(6.0).reshape(2, 3)}))
        target = {"w": jax.ShapeDtypeStruct((2, 3), jnp.bfloat16)}
        restored = m.restore(1, args=StandardRestore(target))
    assert restored["w"].dtype == jnp.bfloat16 and restored["w"][1, 2] == 5


def test_composite_checkpoints_hold_arrays_and_json_items(tmp_path):
    state = {"w": jnp.ones(3)}
    with manager(tmp_path) as m:
        m.save(5, args=Composite(state=StandardSave(state), data=JsonSave({"next_index": 17}),
                                 config=JsonSave({"lr": 1e-3, "layers": [2, 3]})))
        everything = m.restore(5)
        only_data = m.restore(5, args=Composite(data=JsonRestore()))
    assert everything.data == {"next_index": 17} and everything["config"]["layers"] == [2, 3]
    assert_same_tree(everything.state, state)
    assert list(only_data) == ["data"]


def test_restoring_into_a_target_sharding_places_each_leaf_there():
    result = run_python(textwrap.dedent("""
        from stacklib import hw
        hw.simulate_cpu_devices(2)
        import tempfile, jax, jax.numpy as jnp, numpy as np
        from jax.sharding import NamedSharding, PartitionSpec as P
        import stacklib.checkpoint as ocp
        mesh = jax.make_mesh((2,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
        rows, cols = NamedSharding(mesh, P("x", None)), NamedSharding(mesh, P(None, "x"))
        w = jax.device_put(jnp.arange(16.0).reshape(4, 4), rows)
        m = ocp.CheckpointManager(tempfile.mkdtemp())
        m.save(0, args=ocp.args.StandardSave({"w": w}))
        m.wait_until_finished()
        target = {"w": jax.ShapeDtypeStruct((4, 4), jnp.float32, sharding=cols)}
        restored = m.restore(0, args=ocp.args.StandardRestore(target))["w"]
        assert restored.sharding == cols, restored.sharding
        np.testing.assert_array_equal(restored, np.arange(16.0).reshape(4, 4))
        print("ok")
    """))
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-2000:]


# Bad input.

def test_a_mismatched_target_is_named_path_by_path(tmp_path):
    with manager(tmp_path) as m:
        m.save(1, args=StandardSave({"w": jnp.zeros((2, 3)), "b": jnp.zeros(3), "gone": 1}))
        target = {"w": jnp.zeros((3, 2)), "b": jnp.zeros(3), "new": jnp.zeros(1)}
        with pytest.raises(ocp.StructureMismatchError) as raised:
            m.restore(1, args=StandardRestore(target))
    message = str(raised.value)
    assert "in the target but not in the checkpoint: ['new']" in message
    assert "in the checkpoint but not in the target: ['gone']" in message
    assert "['w'] (2, 3) vs (3, 2)" in message


def test_a_damaged_file_is_named_and_an_earlier_step_still_restores(tmp_path):
    with manager(tmp_path) as m:
        for step in (1, 2):
            m.save(step, args=StandardSave({"w": jnp.full(100, float(step))}))
        m.wait_until_finished()
        (leaf_file,) = (tmp_path / "2" / "default").glob("*.w.bin")
        data = bytearray(leaf_file.read_bytes())
        data[17] ^= 0x40
        leaf_file.write_bytes(bytes(data))
        with pytest.raises(ocp.CheckpointCorruptedError, match=f"{leaf_file}.*fails its checksum"):
            m.restore(2)
        leaf_file.write_bytes(bytes(data[:-4]))
        with pytest.raises(ocp.CheckpointCorruptedError, match="truncated"):
            m.restore(2)
        assert float(m.restore(1)["w"][0]) == 1.0


def test_a_damaged_json_item_is_named(tmp_path):
    with manager(tmp_path) as m:
        m.save(1, args=Composite(data=JsonSave({"next_index": 3})))
        m.wait_until_finished()
        (tmp_path / "1" / "data" / "item.json").write_text('{"next_index": 4}')
        with pytest.raises(ocp.CheckpointCorruptedError, match="item.json fails its checksum"):
            m.restore(1)


def test_directories_that_are_not_checkpoints_get_clear_errors(tmp_path):
    with manager(tmp_path / "root") as m:
        m.save(3, args=StandardSave({"w": jnp.zeros(2)}))
    with pytest.raises(ocp.NotACheckpointError, match="Pass its parent"):
        ocp.CheckpointManager(tmp_path / "root" / "3")
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(NotADirectoryError):
        ocp.CheckpointManager(tmp_path / "a_file")
    with pytest.raises(FileNotFoundError, match="create=True"):
        manager(tmp_path / "missing", create=False)
    empty = manager(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="no checkpoint yet"):
        empty.restore()
    with pytest.raises(FileNotFoundError, match=r"saved steps: \[3\]"):
        ocp.CheckpointManager(tmp_path / "root").restore(4)
    (tmp_path / "root" / "9").mkdir()  # a step-like directory that no manager wrote
    assert ocp.CheckpointManager(tmp_path / "root").all_steps() == [3]
    (tmp_path / "root" / "3" / "_CHECKPOINT_METADATA").write_text('{"format": "something else"}')
    with pytest.raises(ocp.NotACheckpointError, match="not a stacklib checkpoint"):
        ocp.CheckpointManager(tmp_path / "root").restore(3)


@pytest.mark.parametrize("save, error, match", [
    (lambda m: m.save(1, args={"w": 1}), TypeError, "StandardSave"),
    (lambda m: m.save(1, args=StandardSave({"w": object()})), TypeError, r"\['w'\].*JsonSave"),
    (lambda m: m.save(1, args=JsonSave({"w": np.zeros(2)})), TypeError, "JSON-serialisable"),
    (lambda m: m.save(1, args=StandardRestore()), TypeError, "cannot save with StandardRestore"),
    (lambda m: m.save(1), ValueError, "needs args"),
])
def test_unsaveable_input_fails_on_the_callers_thread(tmp_path, save, error, match):
    with pytest.raises(error, match=match):
        save(manager(tmp_path))
    assert not list(tmp_path.iterdir())


def test_restoring_an_item_with_the_wrong_args_says_which_to_use(tmp_path):
    with manager(tmp_path) as m:
        m.save(1, args=Composite(state=StandardSave({"w": jnp.zeros(1)})))
        with pytest.raises(TypeError, match="restore it with StandardRestore"):
            m.restore(1, args=Composite(state=JsonRestore()))
        with pytest.raises(KeyError, match="has no item 'stat'"):
            m.restore(1, args=Composite(stat=StandardRestore()))


# Which steps are saved and kept.

def test_steps_are_saved_on_the_interval_first_save_always_and_never_twice(tmp_path):
    with manager(tmp_path, save_interval_steps=5) as m:
        saved = [step for step in range(3, 17) if m.save(step, args=StandardSave({"s": step}))]
        assert saved == [3, 5, 10, 15]
        assert not m.save(15, args=StandardSave({"s": 0}))
        with pytest.raises(ocp.StepAlreadyExistsError, match="step 15 already exists"):
            m.save(15, args=StandardSave({"s": 0}), force=True)
        assert m.save(16, args=StandardSave({"s": 16}), force=True)
        m.wait_until_finished()
        assert m.all_steps() == [3, 5, 10, 15, 16]


def test_max_to_keep_keeps_the_latest_steps(tmp_path):
    with manager(tmp_path, max_to_keep=2) as m:
        for step in range(6):
            m.save(step, args=StandardSave({"s": step}))
        m.wait_until_finished()
        assert m.all_steps() == [4, 5]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["4", "5"]


@pytest.mark.parametrize("mode, kept, best", [("min", [1, 4], 4), ("max", [0, 5], 5)])
def test_keep_best_keeps_the_best_steps_by_metric_even_over_the_latest(tmp_path, mode, kept, best):
    losses = [0.9, 0.2, 0.5, 0.7, 0.1, 0.95]
    options = dict(max_to_keep=2, best_fn=lambda metrics: metrics["loss"], best_mode=mode)
    with manager(tmp_path, **options) as m:
        for step, loss in enumerate(losses):
            m.save(step, args=StandardSave({"s": step}), metrics={"loss": loss})
        m.wait_until_finished()
        assert m.all_steps() == kept and m.best_step() == best
        assert m.metrics(best) == {"loss": losses[best]}


def test_steps_without_metrics_are_kept_unless_told_otherwise():
    steps, metrics = [1, 2, 3, 4], [{"a": 1}, None, {"a": 3}, {"a": 2}]
    best = lambda m: m["a"]  # noqa: E731
    assert retention.steps_to_keep(steps, metrics, max_to_keep=1, best_fn=best) == [2, 3]
    assert retention.steps_to_keep(steps, metrics, max_to_keep=1, best_fn=best,
                                   keep_checkpoints_without_metrics=False) == [3]


def test_a_restarted_manager_sees_the_saved_steps_and_their_metrics(tmp_path):
    with manager(tmp_path, max_to_keep=2, best_fn=lambda m: m, best_mode="min") as m:
        for step, loss in enumerate([3.0, 1.0, 2.0]):
            m.save(step, args=StandardSave({"s": step}), metrics=loss)
    again = manager(tmp_path, max_to_keep=2, best_fn=lambda m: m, best_mode="min")
    assert again.all_steps() == [1, 2] and again.best_step() == 1


def _rewrite(path, old, new):
    path.write_text(path.read_text().replace(old, new))


def write_with_orbax(root, step):
    import orbax.checkpoint as orbax

    with orbax.CheckpointManager(root.parent / "orbax") as theirs:
        theirs.save(step, args=orbax.args.StandardSave({"w": np.ones(3)}))
    (root.parent / "orbax" / str(step)).rename(root / str(step))  # Orbax refuses a directory with our steps


def write_a_newer_format(root, step):
    with manager(root.parent / "newer") as newer:
        newer.save(step, args=StandardSave({"w": np.ones(3)}))
    metadata = root.parent / "newer" / str(step) / "_CHECKPOINT_METADATA"
    _rewrite(metadata, "stacklib.checkpoint.step/1", "stacklib.checkpoint.step/2")
    metadata.parent.rename(root / str(step))


def write_unreadable_metadata(root, step):
    (root / str(step)).mkdir()
    (root / str(step) / "_CHECKPOINT_METADATA").write_bytes(b"\x00\xff not JSON")


NOT_OURS = {"written by orbax": write_with_orbax, "a newer format": write_a_newer_format,
            "unreadable metadata": write_unreadable_metadata}


@pytest.mark.parametrize("write", NOT_OURS.values(), ids=NOT_OURS)
def test_retention_and_delete_never_touch_a_folder_this_library_did_not_write(tmp_path, write):
    (tmp_path / "root").mkdir()
    write(tmp_path / "root", 1)
    theirs = sorted((p.relative_to(tmp_path), p.read_bytes()) for p in (tmp_path / "root" / "1").rglob("*")
                    if p.is_file())
    with manager(tmp_path / "root", max_to_keep=2) as m:
        for step in range(2, 7):
            m.save(step, args=StandardSave({"s": step}))
        m.wait_until_finished()
        assert m.all_steps() == [1, 5, 6]  # listed, so that restoring it says what it is; kept, not counted
        with pytest.raises(ocp.NotACheckpointError, match=r"root/1 was not written by .*Remove it yourself"):
            m.delete(1)
    assert sorted(p.name for p in (tmp_path / "root").iterdir()) == ["1", "5", "6"]
    assert sorted((p.relative_to(tmp_path), p.read_bytes()) for p in (tmp_path / "root" / "1").rglob("*")
                  if p.is_file()) == theirs


def test_a_folder_this_library_did_not_write_blocks_no_later_save_and_is_never_overwritten(tmp_path):
    (tmp_path / "root").mkdir()
    write_a_newer_format(tmp_path / "root", 100)
    with manager(tmp_path / "root", save_interval_steps=50) as m:
        saved = [step for step in range(0, 160, 10) if m.save(step, args=StandardSave({"s": step}))]
        assert saved == [0, 50, 150]  # 100 is taken: not due, and the steps after it still are
        with pytest.raises(ocp.StepAlreadyExistsError, match=r"/100 already exists and was not written by"):
            m.save(100, args=StandardSave({"s": 100}), force=True)


@pytest.mark.parametrize("step, error, fix", [
    (-1, ValueError, "steps count from 0"),
    (5.0, TypeError, r"int\(step\)"),
    (np.float32(5), TypeError, r"int\(step\)"),
    (True, TypeError, "a bool is not a step number"),
    ("5", TypeError, r"int\(step\)"),
])
def test_a_step_that_would_be_written_and_never_listed_is_refused_with_the_fix(tmp_path, step, error, fix):
    with pytest.raises(error, match=rf"step must be a non-negative int.*got {re.escape(repr(step))}.*{fix}"):
        manager(tmp_path).save(step, args=StandardSave({"w": np.ones(2)}))
    assert not list(tmp_path.iterdir())


def test_a_numpy_integer_step_is_saved_and_listed_as_that_int(tmp_path):
    with manager(tmp_path) as m:
        assert m.save(np.int64(5), args=StandardSave({"w": np.ones(2)}))
        m.wait_until_finished()
        assert m.all_steps() == [5] and type(m.all_steps()[0]) is int and m.latest_step() == 5
    assert manager(tmp_path).all_steps() == [5]
    assert json.loads((tmp_path / "5" / "_CHECKPOINT_METADATA").read_text())["step"] == 5


# Asynchronous saves and atomic commits.

class _Gate:
    """Makes the writer thread wait inside its first file write until the test opens the gate."""

    def __init__(self, monkeypatch):
        self.reached, self.opened = threading.Event(), threading.Event()
        original = tree_files.write_file

        def gated_write(path, data):
            self.reached.set()
            assert self.opened.wait(timeout=30), "the test never opened the gate"
            return original(path, data)

        monkeypatch.setattr(tree_files, "write_file", gated_write)


def test_an_async_save_returns_before_writing_and_the_step_appears_only_when_complete(tmp_path, monkeypatch):
    gate = _Gate(monkeypatch)
    m = manager(tmp_path)
    assert m.save(1, args=StandardSave({"w": jnp.ones(3)}))  # returns although the writer is blocked
    assert gate.reached.wait(timeout=30) and m.is_saving_in_progress()
    assert m.all_steps() == [] and not (tmp_path / "1").exists()
    assert [p.name.startswith("1.partial-") for p in tmp_path.iterdir()] == [True]
    gate.opened.set()
    m.wait_until_finished()
    assert m.all_steps() == [1] and [p.name for p in tmp_path.iterdir()] == ["1"]


def test_the_snapshot_is_taken_when_save_returns(tmp_path, monkeypatch):
    gate = _Gate(monkeypatch)
    weights = np.zeros(4, np.float32)
    m = manager(tmp_path)
    m.save(1, args=StandardSave({"w": weights}))
    weights += 1  # the training loop moves on while the save is being written
    gate.opened.set()
    m.wait_until_finished()
    np.testing.assert_array_equal(m.restore(1)["w"], np.zeros(4))


def test_a_failed_background_save_is_raised_once_and_leaves_no_step(tmp_path, monkeypatch):
    def full_disk(path, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tree_files, "write_file", full_disk)
    m = manager(tmp_path)
    m.save(1, args=StandardSave({"w": jnp.ones(2)}))
    with pytest.raises(OSError, match="No space left"):
        m.wait_until_finished()
    m.wait_until_finished()  # reported once, not forever
    assert m.all_steps() == [] and not list(tmp_path.iterdir())


def test_leftovers_of_interrupted_saves_are_invisible_and_cleaned_up_on_request(tmp_path):
    with manager(tmp_path) as m:
        m.save(1, args=StandardSave({"w": jnp.ones(2)}))
    (tmp_path / "2.partial-0badcafe").mkdir()
    (tmp_path / "1.deleting-0badcafe").mkdir()
    assert manager(tmp_path).all_steps() == [1]
    manager(tmp_path, cleanup_tmp_directories=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1"]


def test_a_synchronous_save_is_complete_when_save_returns(tmp_path):
    m = manager(tmp_path, enable_async_checkpointing=False)
    m.save(1, args=StandardSave({"w": jnp.ones(2)}))
    assert not m.is_saving_in_progress() and m.all_steps() == [1]


def test_commit_refuses_to_overwrite_a_step(tmp_path):
    (tmp_path / "7").mkdir()
    partial = atomic.temporary_directory(tmp_path / "7")
    partial.mkdir()
    with pytest.raises(FileExistsError, match="never overwritten"):
        atomic.commit(partial, tmp_path / "7")


def test_iterator_states_are_saved_as_json_and_resume_a_pipeline(tmp_path):
    import stacklib.data as grain

    dataset = grain.MapDataset.range(20).shuffle(seed=0).batch(3)
    pipeline = dataset.to_iter_dataset(grain.ReadOptions(num_threads=0))
    iterator = iter(pipeline)
    for _ in range(4):
        next(iterator)
    with manager(tmp_path) as m:
        m.save(4, args=Composite(data=JsonSave(iterator.get_state())))
        resumed = iter(pipeline)
        resumed.set_state(m.restore(4).data)
    assert [b.tolist() for b in resumed] == [b.tolist() for b in iterator]


# Crashes.

def _save_forever(directory: str, ready, saves_begun) -> None:
    """Child process: resume from the latest step, then save asynchronously as fast as possible.

    `saves_begun` counts the saves this process has started, so the parent can kill it
    while it is working rather than while it is still starting up.
    """
    m = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(
        max_to_keep=2, cleanup_tmp_directories=True))
    step = (m.latest_step() or 0) + 1
    ready.set()
    while True:
        tree = {"w": np.full((512, 1024), step, np.float32), "b": np.arange(3000) + step}
        m.save(step, args=Composite(state=StandardSave(tree), meta=JsonSave({"step": step})))
        saves_begun.value += 1
        step += 1


def _check_step(m, step):
    restored = m.restore(step)
    assert restored.meta == {"step": step}
    assert np.all(restored.state["w"] == step) and np.array_equal(restored.state["b"], np.arange(3000) + step)


@pytest.mark.slow
def test_twenty_sigkills_during_async_saves_always_leave_a_latest_step_that_restores(tmp_path):
    # A forkserver that has imported stacklib.checkpoint starts each child in ~50 ms; the
    # children never start JAX's runtime (NumPy leaves), so forking them is safe.
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["stacklib.checkpoint", "numpy"])
    directory = str(tmp_path)
    rng = random.Random(0)
    latest, interrupted_writes, kills = 0, 0, 0
    # Kill at least 20 times, and on until the run has tested something: past step 20, with
    # at least one kill inside a write. A loaded machine makes the children slower, so it
    # takes more kills, never a failure; the invariant is checked after every kill.
    while kills < 20 or latest <= 20 or not interrupted_writes:
        assert kills < 200, f"{kills} kills: latest step {latest}, {interrupted_writes} interrupted writes"
        ready, saves_begun = context.Event(), context.Value("i", 0)
        child = context.Process(target=_save_forever, args=(directory, ready, saves_begun), daemon=True)
        child.start()
        assert ready.wait(timeout=120), "the child never started"
        deadline = time.monotonic() + 120
        while saves_begun.value == 0:  # kill it at work, not while it starts up
            assert time.monotonic() < deadline, "the child never started a save"
            time.sleep(0.001)
        time.sleep(rng.uniform(0.0, 0.3))
        os.kill(child.pid, signal.SIGKILL)
        child.join(timeout=60)
        assert child.exitcode == -signal.SIGKILL
        kills += 1
        interrupted_writes += any(atomic.is_temporary(p) for p in tmp_path.iterdir())
        m = ocp.CheckpointManager(directory)
        # Before the first save commits there is no latest step; after it, there always is one.
        now = m.latest_step()
        assert (now is None and latest == 0) or (now is not None and now >= latest), f"kill {kills}"
        latest = now or 0
        for step in m.all_steps():
            _check_step(m, step)


@pytest.mark.slow
def test_a_run_interrupted_mid_epoch_and_resumed_ends_bitwise_identical(tmp_path):
    from stacklib.examples.resumable_training import RunConfig, digest, train

    config = RunConfig(steps=24, records=128, batch_size=16, width=16, save_every=3)  # 8 steps per epoch
    uninterrupted = train(str(tmp_path / "a"), config)
    train(str(tmp_path / "b"), config, stop_after=13)  # last checkpoint at step 12, mid-epoch 2
    resumed_from = []
    resumed = train(str(tmp_path / "b"), config, log=lambda step, loss: resumed_from.append(step))
    assert resumed_from[0] == 13 and 12 % 8 != 0
    assert digest(resumed) == digest(uninterrupted)
    for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(uninterrupted), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_metadata_records_items_metrics_and_format(tmp_path):
    with manager(tmp_path) as m:
        m.save(2, args=Composite(state=StandardSave({"w": jnp.ones(1)}), data=JsonSave([1])),
               metrics={"loss": 0.5}, custom_metadata={"run": "a"})
    metadata = json.loads((tmp_path / "2" / "_CHECKPOINT_METADATA").read_text())
    assert metadata["items"] == {"state": "standard", "data": "json"}
    assert metadata["metrics"] == {"loss": 0.5} and metadata["custom_metadata"] == {"run": "a"}


# The zoo's cache (zoo.py): rebuilt when broken, never when the loader has a bug.

def build_into(directory):
    zoo.write_atomically(directory, 1, {"w": StandardSave({"x": np.arange(4.0)})})


def load_cached(directory):
    cache, step = zoo.open_latest(directory)
    return cache.restore(step, args=Composite(w=StandardRestore({"x": np.zeros(4)}))).w["x"]


@pytest.fixture
def builds(monkeypatch):
    """Stand in for the fixed build process: write the cached model here, and count the builds."""
    done = []

    def run(function, request):
        build_into(pathlib.Path(request["directory"]))
        done.append(function)

    monkeypatch.setattr(zoo, "run", run)
    return done


def _leaf(directory):
    (leaf_file,) = directory.glob("1/w/*.x.bin")
    return leaf_file


BROKEN = {  # how a cache breaks -> the error that says so
    "nothing committed": (lambda d: shutil.rmtree(d / "1"), "FileNotFoundError"),
    "a file missing": (lambda d: _leaf(d).unlink(), "CheckpointCorruptedError"),
    "a file truncated": (lambda d: _leaf(d).write_bytes(_leaf(d).read_bytes()[:-3]),
                         "CheckpointCorruptedError"),
    "a flipped bit": (lambda d: _leaf(d).write_bytes(b"\x01" + _leaf(d).read_bytes()[1:]),
                      "CheckpointCorruptedError"),
    "another format": (lambda d: _rewrite(d / "1" / "_CHECKPOINT_METADATA", "step/1", "step/2"),
                       "NotACheckpointError"),
    "other shapes": (lambda d: (shutil.rmtree(d), zoo.write_atomically(d, 1, {"w": StandardSave(
        {"x": np.zeros((2, 2))})})), "StructureMismatchError"),  # written by an earlier version of the code
}


@pytest.mark.parametrize("damage, error", BROKEN.values(), ids=BROKEN)
def test_a_broken_zoo_cache_is_rebuilt_with_a_warning_that_says_why(tmp_path, builds, damage, error):
    build_into(tmp_path / "model")
    damage(tmp_path / "model")
    said = rf"(?s)model' in .*model cannot be loaded \({error}: .*training it again"
    with pytest.warns(UserWarning, match=said):
        loaded = zoo.load_or_build(tmp_path / "model", load_cached, "builder:build", {})
    np.testing.assert_array_equal(loaded, np.arange(4.0))
    assert builds == ["builder:build"]


def test_a_zoo_loader_that_finds_the_cache_stale_has_it_rebuilt(tmp_path, builds):
    build_into(tmp_path / "model")
    calls = []

    def load(directory):
        calls.append(directory)
        if len(calls) == 1:
            raise zoo.StaleCacheError("the cached model was trained with another config")
        return load_cached(directory)

    with pytest.warns(UserWarning, match=r"\(StaleCacheError: the cached model was trained with another"):
        zoo.load_or_build(tmp_path / "model", load, "builder:build", {})
    assert builds == ["builder:build"]


@pytest.mark.parametrize("bug", [TypeError("unsupported operand"), KeyError("params"),
                                 ValueError("too many values to unpack"), AttributeError("no attribute 'w'")])
def test_a_bug_in_a_zoo_loader_surfaces_and_the_cache_is_kept(tmp_path, builds, bug):
    build_into(tmp_path / "model")
    cached = sorted((p.relative_to(tmp_path), p.read_bytes()) for p in tmp_path.rglob("*") if p.is_file())

    def buggy_load(directory):
        load_cached(directory)
        raise bug

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(type(bug)):
            zoo.load_or_build(tmp_path / "model", buggy_load, "builder:build", {})
    assert builds == []
    assert sorted((p.relative_to(tmp_path), p.read_bytes()) for p in tmp_path.rglob("*")
                  if p.is_file() and p.suffix != ".lock") == cached


def test_write_atomically_makes_the_rename_durable_by_fsyncing_the_parent(tmp_path, monkeypatch):
    events = []

    def recorded(name, function):
        def call(*paths):
            events.append((name, pathlib.Path(paths[-1])))
            return function(*paths)
        return call

    monkeypatch.setattr(os, "replace", recorded("rename", os.replace))
    monkeypatch.setattr(atomic, "fsync_directory", recorded("fsync", atomic.fsync_directory))
    build_into(tmp_path / "model")
    assert events[-2:] == [("rename", tmp_path / "model"), ("fsync", tmp_path)]
