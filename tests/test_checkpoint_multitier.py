"""stacklib.checkpoint.multitier: two tiers, restore fallbacks, kills during saves, SIGTERM, bad input."""

import os
import pathlib
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings

import numpy as np
import pytest
from conftest import ROOT

import stacklib.checkpoint as ocp
from stacklib.checkpoint import multitier
from stacklib.checkpoint.args import StandardSave

K_LOCAL, K_PERSISTENT = 2, 6


def options(**overrides):
    return multitier.CheckpointManagerOptions(
        local=multitier.LocalCheckpointOptions(save_interval_steps=K_LOCAL, max_to_keep=2),
        persistent=multitier.PersistentCheckpointOptions(save_interval_steps=K_PERSISTENT, max_to_keep=2),
        **overrides)


def open_manager(tmp_path, **overrides):
    return multitier.CheckpointManager(tmp_path / "local", tmp_path / "persistent",
                                       options=options(**overrides))


def weights(step: int) -> np.ndarray:
    """The state after `step`: a recurrence, so that a resumed run must restore the exact bytes."""
    w = np.zeros(256)
    for s in range(step + 1):
        w = w * 0.5 + s
    return w


def train(manager, steps):
    for step in steps:
        manager.save(step, args=StandardSave({"w": weights(step)}))
    manager.wait_until_finished()


def flip_a_byte(tier_directory: pathlib.Path, step: int) -> pathlib.Path:
    (leaf_file,) = (tier_directory / str(step) / "default").glob("*.w.bin")
    data = bytearray(leaf_file.read_bytes())
    data[len(data) // 2] ^= 0x01
    leaf_file.write_bytes(bytes(data))
    return leaf_file


# Saving and restoring.

def test_each_tier_saves_on_its_own_interval_and_keeps_its_own_n(tmp_path):
    with open_manager(tmp_path) as manager:
        train(manager, range(16))
        assert manager.local.all_steps() == [12, 14] and manager.persistent.all_steps() == [6, 12]
        assert manager.all_steps() == [6, 12, 14] and manager.latest_step() == 14


def test_restore_picks_the_newest_intact_step_across_tiers(tmp_path):
    with open_manager(tmp_path) as manager:
        train(manager, range(16))
        np.testing.assert_array_equal(manager.restore()["w"], weights(14))
        assert manager.last_restore == (14, "local", ())


def test_the_restore_order_is_newest_step_first_and_local_before_persistent():
    assert multitier.restore_order([12, 14], [6, 12, 18]) == [
        (18, "persistent"), (14, "local"), (12, "local"), (12, "persistent"), (6, "persistent")]
    assert multitier.restore_order([], []) == []


def test_a_lost_local_tier_restores_from_the_persistent_tier(tmp_path):
    with open_manager(tmp_path) as manager:
        train(manager, range(16))
    shutil.rmtree(tmp_path / "local")  # the machine is gone; the job restarts on another one
    restarted = open_manager(tmp_path)
    np.testing.assert_array_equal(restarted.restore()["w"], weights(12))
    assert restarted.last_restore == (12, "persistent", ())


def test_a_damaged_newest_local_step_falls_back_with_a_warning_that_names_the_file(tmp_path):
    with open_manager(tmp_path) as manager:
        train(manager, range(16))
        damaged = flip_a_byte(tmp_path / "local", 14)
        named = f"step 14 in the local tier.*{damaged.name}.*fails its checksum"
        with pytest.warns(multitier.CheckpointFallbackWarning, match=named):
            np.testing.assert_array_equal(manager.restore()["w"], weights(12))
        assert manager.last_restore.step == 12 and manager.last_restore.tier == "local"
        assert "fails its checksum" in manager.last_restore.skipped[0]


def test_a_damaged_local_copy_falls_back_to_the_persistent_copy_of_the_same_step(tmp_path):
    with open_manager(tmp_path) as manager:
        train(manager, range(13))  # local [10, 12], persistent [6, 12]
        flip_a_byte(tmp_path / "local", 12)
        with pytest.warns(multitier.CheckpointFallbackWarning, match="step 12 in the local tier"):
            np.testing.assert_array_equal(manager.restore(12)["w"], weights(12))
        assert manager.last_restore[:2] == (12, "persistent")


def test_a_damaged_step_is_replaced_when_the_run_saves_it_again(tmp_path):
    with open_manager(tmp_path) as manager:
        train(manager, range(16))
        flip_a_byte(tmp_path / "local", 14)
        with pytest.warns(multitier.CheckpointFallbackWarning):
            manager.restore()
        train(manager, range(13, 16))  # the resumed run reaches step 14 again
        assert manager.local.all_steps() == [12, 14]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            np.testing.assert_array_equal(manager.restore()["w"], weights(14))


def test_when_no_copy_is_intact_the_error_lists_every_problem(tmp_path):
    with open_manager(tmp_path) as manager:
        train(manager, range(7))  # local [4, 6], persistent [0, 6]
        for tier, step in (("local", 4), ("local", 6), ("persistent", 0), ("persistent", 6)):
            flip_a_byte(tmp_path / tier, step)
        with warnings.catch_warnings(), pytest.raises(ocp.CheckpointCorruptedError) as raised:
            warnings.simplefilter("ignore", multitier.CheckpointFallbackWarning)
            manager.restore()
    assert str(raised.value).count("fails its checksum") == 4


def test_a_mismatched_target_is_the_callers_mistake_and_is_not_skipped(tmp_path):
    with open_manager(tmp_path) as manager:
        train(manager, range(3))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(ocp.StructureMismatchError):
                manager.restore(args=ocp.args.StandardRestore({"w": np.zeros(3)}))


# What restore moves aside, and what it leaves alone. A copy it cannot read is never deleted:
# a damaged one is renamed out of the way, anything else stays where it is.

def files_of(folder: pathlib.Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def truncate_a_leaf(tier_directory, step):
    (leaf_file,) = (tier_directory / str(step) / "default").glob("*.w.bin")
    leaf_file.write_bytes(leaf_file.read_bytes()[:-8])


def delete_the_manifest(tier_directory, step):
    (tier_directory / str(step) / "default" / "manifest.json").unlink()


def garble_the_step_metadata(tier_directory, step):
    (tier_directory / str(step) / ocp.manager.METADATA).write_text('{"format": "stacklib.checkpo')


DAMAGE = {"a flipped bit": flip_a_byte, "a truncated leaf": truncate_a_leaf,
          "a missing manifest": delete_the_manifest, "garbled step metadata": garble_the_step_metadata}


@pytest.mark.parametrize("damage", DAMAGE.values(), ids=DAMAGE)
def test_a_damaged_copy_is_moved_aside_under_a_quarantine_name_and_never_deleted(tmp_path, damage):
    with open_manager(tmp_path) as manager:
        train(manager, range(15))  # local [12, 14], persistent [6, 12]
        damage(tmp_path / "local", 14)
        damaged = files_of(tmp_path / "local" / "14")
        with pytest.warns(multitier.CheckpointFallbackWarning,
                          match=r"step 14 in the local tier.*Moved .*local/14 aside to 14\.damaged-"):
            np.testing.assert_array_equal(manager.restore()["w"], weights(12))
        (aside,) = (tmp_path / "local").glob("14.damaged-*")
        assert manager.local.all_steps() == [12]  # never listed as a step
        train(manager, range(13, 30))  # saves step 14 again, and on until 14 expires
        assert sorted(p.name for p in (tmp_path / "local").iterdir()) == sorted(["26", "28", aside.name])
        assert files_of(aside) == damaged


def write_with_orbax(tier_directory, step):
    import orbax.checkpoint as orbax

    elsewhere = tier_directory.parent / "orbax"
    with orbax.CheckpointManager(elsewhere) as manager:
        manager.save(step, args=orbax.args.StandardSave({"w": weights(step)}))
    (elsewhere / str(step)).rename(tier_directory / str(step))  # Orbax refuses a directory with our steps


def write_a_newer_format(tier_directory, step):
    with ocp.CheckpointManager(tier_directory.parent / "newer") as manager:
        manager.save(step, args=StandardSave({"w": weights(step)}))
    metadata = tier_directory.parent / "newer" / str(step) / ocp.manager.METADATA
    metadata.write_text(metadata.read_text().replace("checkpoint.step/1", "checkpoint.step/2"))
    metadata.parent.rename(tier_directory / str(step))


FOREIGN = {"written by orbax": write_with_orbax, "a newer format": write_a_newer_format}


@pytest.mark.parametrize("write", FOREIGN.values(), ids=FOREIGN)
def test_a_folder_another_program_or_a_newer_version_wrote_is_left_alone(tmp_path, write):
    with open_manager(tmp_path) as manager:
        train(manager, range(13))  # local [10, 12], persistent [6, 12]
    write(tmp_path / "local", 14)
    theirs = files_of(tmp_path / "local" / "14")
    restarted = open_manager(tmp_path)
    left = r"step 14 in the local tier.*Left .*local/14 as it is: .*did not write it.*not this manager.s"
    with pytest.warns(multitier.CheckpointFallbackWarning, match=left):
        np.testing.assert_array_equal(restarted.restore()["w"], weights(12))
    train(restarted, range(13, 30))
    assert sorted(p.name for p in (tmp_path / "local").iterdir()) == ["14", "26", "28"]
    assert sorted(p.name for p in (tmp_path / "persistent").iterdir()) == ["18", "24"]
    assert files_of(tmp_path / "local" / "14") == theirs


def test_a_copy_that_fails_for_a_reason_other_than_damage_is_neither_moved_nor_deleted(tmp_path, monkeypatch):
    with open_manager(tmp_path) as manager:
        for step in range(15):
            manager.save(step, args=ocp.args.Composite(state=StandardSave({"w": weights(step)}),
                                                       data=ocp.args.JsonSave({"step": step})))
        manager.wait_until_finished()
        before = {tier: files_of(tmp_path / tier) for tier in ("local", "persistent")}
        with pytest.raises(ocp.StructureMismatchError):  # the caller's target, not the copy, is wrong
            manager.restore(args=ocp.args.Composite(state=ocp.args.StandardRestore({"w": np.zeros(3)})))
        read_bytes = pathlib.Path.read_bytes

        def permission_denied(path):
            if path.name == "item.json":
                raise PermissionError(13, "Permission denied", str(path))
            return read_bytes(path)

        with monkeypatch.context() as patch:
            patch.setattr(pathlib.Path, "read_bytes", permission_denied)
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # not skipped as damage: raised
                with pytest.raises(PermissionError):
                    manager.restore()
        assert {tier: files_of(tmp_path / tier) for tier in ("local", "persistent")} == before
        manager.save(16, args=ocp.args.Composite(state=StandardSave({"w": weights(16)}),
                                                 data=ocp.args.JsonSave({"step": 16})))
        manager.wait_until_finished()
        assert manager.local.all_steps() == [14, 16] and manager.persistent.all_steps() == [6, 12]


# Preemption, in one process.

def test_a_preemption_notice_saves_the_next_step_locally_and_then_reports_it(tmp_path):
    with open_manager(tmp_path) as manager:
        train(manager, range(8))
        manager.notify_preemption()
        assert not manager.reached_preemption(7)  # step 7 was saved before the notice: not saved again
        assert manager.should_save(9)  # not on either interval, but a notice is pending
        assert manager.save(9, args=StandardSave({"w": weights(9)}))
        assert manager.reached_preemption(9) and 9 in manager.local.all_steps()
        assert 9 not in manager.persistent.all_steps()  # the slow tier keeps its schedule
    restarted = open_manager(tmp_path)
    np.testing.assert_array_equal(restarted.restore()["w"], weights(9))


def test_the_handler_only_records_the_notice(tmp_path):
    manager = open_manager(tmp_path)
    previous = multitier.install_preemption_handler(manager, signal.SIGUSR1)
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert manager.should_save(1) and not manager.reached_preemption(1)
        assert manager.all_steps() == []  # nothing was written by the handler itself
    finally:
        signal.signal(signal.SIGUSR1, previous)


# Bad input.

@pytest.mark.parametrize("make, match", [
    (lambda: multitier.LocalCheckpointOptions(save_interval_steps=0), "interval_steps must be a positive"),
    (lambda: multitier.LocalCheckpointOptions(save_interval_steps=2.5), "positive int"),
    (lambda: multitier.LocalCheckpointOptions(max_to_keep=0), "keeps no step has nothing to restore"),
    (lambda: multitier.PersistentCheckpointOptions(save_interval_steps=-100), "positive int"),
    (lambda: multitier.PersistentCheckpointOptions(max_to_keep=0), "or None to keep every step"),
    (lambda: multitier.CheckpointManagerOptions(
        local=multitier.LocalCheckpointOptions(save_interval_steps=10),
        persistent=multitier.PersistentCheckpointOptions(save_interval_steps=25)),
     r"\(25\) must be a multiple of local.save_interval_steps \(10\).*Use 20 or 30"),
    (lambda: multitier.CheckpointManagerOptions(
        local=multitier.LocalCheckpointOptions(save_interval_steps=10),
        persistent=multitier.PersistentCheckpointOptions(save_interval_steps=5)), r"multiple.*Use 10,"),
])
def test_bad_options_say_what_is_wrong_and_how_to_fix_it(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize("step", [-2, 4.0, True])
def test_steps_that_would_never_be_listed_are_refused_by_both_tiers(tmp_path, step):
    with open_manager(tmp_path) as manager:
        with pytest.raises((TypeError, ValueError), match="step must be a non-negative int"):
            manager.save(step, args=StandardSave({"w": weights(0)}))
    assert not list((tmp_path / "local").iterdir()) and not list((tmp_path / "persistent").iterdir())


def test_numpy_integer_steps_are_saved_and_listed_as_ints_in_both_tiers(tmp_path):
    with open_manager(tmp_path) as manager:
        for step in np.arange(7):
            manager.save(step, args=StandardSave({"w": weights(int(step))}))
        manager.wait_until_finished()
        assert manager.local.all_steps() == [4, 6] and manager.persistent.all_steps() == [0, 6]
        assert all(type(step) is int for step in manager.all_steps())


@pytest.mark.parametrize("persistent", [".", "./", "sub/persistent", ".."])
def test_the_tiers_need_separate_directories(tmp_path, persistent):
    local = tmp_path / "run" / "local"
    with pytest.raises(ValueError, match="must be separate directories.*survive losing the local one"):
        multitier.CheckpointManager(local, local / persistent)


def test_the_handler_must_be_installed_from_the_main_thread(tmp_path):
    manager, raised = open_manager(tmp_path), []

    def install():
        try:
            multitier.install_preemption_handler(manager)
        except RuntimeError as error:
            raised.append(str(error))

    thread = threading.Thread(target=install)
    thread.start()
    thread.join()
    assert raised and "main thread" in raised[0]


def test_restoring_from_empty_tiers_names_both_directories(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"neither tier holds any step: local \[\] in .*local"):
        open_manager(tmp_path).restore()
    with pytest.raises(FileNotFoundError, match="neither tier holds step 3"):
        open_manager(tmp_path).restore(3)


# Crashes and preemption in a child process. The child trains a few KB of state and saves
# every step the intervals ask for; it writes its last finished step to `progress`. A write
# can be made to hang forever (a stuck disk) in one tier at one step, so that the kill is
# sure to land inside that save; nothing below depends on how fast the child runs.

CHILD = """
import pathlib, sys, time
import numpy as np
from stacklib.checkpoint import args, multitier, tree_files

root, hang_tier, hang_step = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3]
if hang_tier != "none":
    write = tree_files.write_file

    def stuck_disk(path, data):
        if str(path).startswith(str(root / hang_tier / f"{hang_step}.partial-")):
            time.sleep(600)  # the parent kills the process while it waits here
        return write(path, data)

    tree_files.write_file = stuck_disk
options = multitier.CheckpointManagerOptions(
    local=multitier.LocalCheckpointOptions(save_interval_steps=2, max_to_keep=2),
    persistent=multitier.PersistentCheckpointOptions(save_interval_steps=6, max_to_keep=2))
manager = multitier.CheckpointManager(root / "local", root / "persistent", options=options)
multitier.install_preemption_handler(manager)
w, deadline = np.zeros(256), time.monotonic() + 60
for step in range(2000):
    assert time.monotonic() < deadline, "never stopped by the parent"
    w = w * 0.5 + step
    manager.save(step, args=args.StandardSave({"w": w}))
    if manager.reached_preemption(step):
        print("preempted", step, flush=True)
        sys.exit(0)
    (root / "progress.tmp").write_text(str(step))
    (root / "progress.tmp").replace(root / "progress")
    time.sleep(0.005)
sys.exit(3)
"""


def start_child(root: pathlib.Path, hang_tier: str = "none", hang_step: int = -1) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CHILD, str(root), hang_tier, str(hang_step)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)


def wait_for(condition, child, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        exited = child.poll() is not None
        assert not exited, f"the child exited ({child.returncode}) before {what}: {child.stderr.read()}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def progress(root: pathlib.Path) -> int:
    path = root / "progress"
    return int(path.read_text()) if path.exists() else -1


def kill(child) -> int:
    if child.poll() is None:
        child.kill()
    child.wait(timeout=60)
    return child.returncode


def assert_every_listed_step_is_intact(manager):
    for tier in (manager.local, manager.persistent):
        for step in tier.all_steps():
            np.testing.assert_array_equal(tier.restore(step)["w"], weights(step))


def test_a_kill_during_a_local_save_loses_only_the_steps_after_the_previous_local_step(tmp_path):
    child = start_child(tmp_path, hang_tier="local", hang_step=8)
    try:
        wait_for(lambda: list((tmp_path / "local").glob("8.partial-*")), child, "the local save of step 8")
    finally:
        assert kill(child) == -signal.SIGKILL
    assert not (tmp_path / "local" / "8").exists()
    restarted = open_manager(tmp_path)
    assert not list((tmp_path / "local").glob("*.partial-*"))  # the local tier's leftovers are removed
    assert_every_listed_step_is_intact(restarted)
    np.testing.assert_array_equal(restarted.restore()["w"], weights(8 - K_LOCAL))
    assert restarted.last_restore == (8 - K_LOCAL, "local", ())


def test_a_stuck_persistent_save_neither_holds_up_local_saves_nor_loses_them_when_killed(tmp_path):
    child = start_child(tmp_path, hang_tier="persistent", hang_step=12)
    try:
        # Step 17 finished means save(16) returned, and it waited for the local save of 14.
        wait_for(lambda: progress(tmp_path) >= 17, child, "step 17, past the stuck persistent save of 12")
        assert list((tmp_path / "persistent").glob("12.partial-*"))
    finally:
        assert kill(child) == -signal.SIGKILL
    restarted = open_manager(tmp_path)
    assert restarted.persistent.all_steps() == [0, 6]
    assert_every_listed_step_is_intact(restarted)
    restarted.restore()
    assert restarted.last_restore.tier == "local" and restarted.last_restore.step >= 14


def test_sigterm_saves_the_step_in_progress_and_a_restart_resumes_from_it(tmp_path):
    child = start_child(tmp_path)
    try:
        wait_for(lambda: progress(tmp_path) >= 5, child, "step 5")
        child.send_signal(signal.SIGTERM)
        stdout, stderr = child.communicate(timeout=60)
    finally:
        kill(child)
    assert child.returncode == 0, stderr
    preempted = int(stdout.split()[-1])
    # Every finished step is kept: the one the notice interrupted is finished and saved.
    assert preempted == progress(tmp_path) + 1
    restarted = open_manager(tmp_path)
    state = restarted.restore()
    assert restarted.last_restore == (preempted, "local", ())
    w = state["w"]
    for step in range(preempted + 1, preempted + 4):  # the restarted run goes on where it stopped
        w = w * 0.5 + step
    np.testing.assert_array_equal(w, weights(preempted + 3))
