"""stacklib.llm with a local checkpoint tier: the config keys, resuming from either tier, SIGTERM.

The trainer's two-tier path is chapter 05's `ocp.multitier` manager put behind two config
keys; these tests check what the trainer adds to it: the loop stops on a preemption notice,
a restart resumes from the newest copy in either tier, and the resumed weights are the
uninterrupted run's bit for bit. (Which copy wins, damaged copies and the save on a notice
are tests/test_checkpoint_multitier.py's.) Runs are tiny (tests/test_llm.py's `TINY`), 7
steps: 7 is on neither tier's interval, so the forced save of the last step is exercised too.
"""

import pathlib
import shutil
import signal
import tempfile

import jax
import numpy as np
import pytest
from test_llm import tiny

import stacklib.checkpoint as ocp
from stacklib.llm import train
from stacklib.llm.config import ConfigError, load_config

STEPS = 7


@pytest.fixture(scope="module")
def whole():
    """The uninterrupted run every resumed run must equal (no checkpoints: saving changes no bits)."""
    return train.train(tiny(steps=STEPS))


@pytest.fixture
def ram_disk(tmp_path):
    """A folder for local tiers on a RAM disk where the machine has one, as a real local tier would be.

    A commit there skips the disk's fsync: 8 ms a save of the tiny model, against 220 ms in /tmp
    here, and these runs save every step.
    """
    if not pathlib.Path("/dev/shm").is_dir():
        yield tmp_path / "ram"
        return
    directory = pathlib.Path(tempfile.mkdtemp(dir="/dev/shm"))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def tiered(tmp_path, local_root=None):
    """A local tier every step and a persistent one every 4."""
    return tiny(steps=STEPS, checkpoint_dir=str(tmp_path / "persistent"), checkpoint_every=4,
                local_checkpoint_dir=str((local_root or tmp_path) / "local"), local_checkpoint_every=1)


def assert_bitwise(result, whole, start):
    assert result.start_step == start
    assert [r["step"] for r in result.history] == list(range(start + 1, STEPS + 1))
    assert result.losses == whole.losses[start:]  # == on Python floats: bitwise
    for a, b in zip(jax.tree.leaves(result.params), jax.tree.leaves(whole.params), strict=True):
        np.testing.assert_array_equal(a, b)


# -- config -----------------------------------------------------------------------------------

@pytest.mark.parametrize("changes, message", [
    (dict(local_checkpoint_every=0), r"local_checkpoint_every=0 must be at least 1"),
    (dict(checkpoint_dir=""), r"local_checkpoint_dir='/tmp/l' needs checkpoint_dir.*Set checkpoint_dir too"),
    (dict(checkpoint_every=10, local_checkpoint_every=4),
     r"checkpoint_every=10 is not a multiple of local_checkpoint_every=4.*Use checkpoint_every=8 or "
     r"checkpoint_every=12, or a local_checkpoint_every that divides 10"),
    (dict(checkpoint_dir="/tmp/l"), r"must be separate folders, neither inside the other"),
    (dict(checkpoint_dir="/tmp/l/persistent"), r"must be separate folders"),
])
def test_a_local_tier_that_cannot_work_is_refused_naming_the_keys_and_the_fix(changes, message):
    settings = dict(checkpoint_dir="/tmp/p", checkpoint_every=4, local_checkpoint_dir="/tmp/l",
                    local_checkpoint_every=2)
    with pytest.raises(ConfigError, match=message):
        load_config(None, **{**settings, **changes})


def test_the_local_interval_is_free_while_there_is_no_local_tier():
    assert load_config(None, checkpoint_every=10, local_checkpoint_every=4).local_checkpoint_every == 4


def test_a_local_tier_is_refused_in_a_job_of_several_processes(tmp_path, monkeypatch):
    config = tiered(tmp_path)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    expected = r"works in a single process only, and this job has 2.*Set local_checkpoint_dir= \(empty\)"
    with pytest.raises(ConfigError, match=expected):
        train.make_checkpoint_manager(config)
    assert not (tmp_path / "local").exists()  # refused before anything is created


# -- stopping and resuming ------------------------------------------------------------------------

def test_a_preempted_run_resumes_from_the_local_tier_or_without_it_the_persistent_one_bitwise(
        tmp_path, ram_disk, whole, capsys):
    config = tiered(tmp_path, ram_disk)
    assert isinstance(train.make_checkpoint_manager(config), ocp.multitier.CheckpointManager)
    handler = signal.getsignal(signal.SIGTERM)

    def log(record):
        if record["step"] == 5:
            signal.raise_signal(signal.SIGTERM)  # the preemption notice, between steps 5 and 6

    stopped = train.train(config.replace(eval_batches=1), log=log)
    assert stopped.preempted_at == 6 and [r["step"] for r in stopped.history] == list(range(1, 7))
    assert stopped.eval_loss is None  # no final evaluation in the grace period
    assert "preemption notice (SIGTERM): step 6 is saved" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) == handler  # the caller's handler is back
    local = ocp.CheckpointManager(ram_disk / "local")
    persistent = ocp.CheckpointManager(tmp_path / "persistent")
    assert (local.all_steps(), persistent.all_steps()) == ([5, 6], [1, 4])  # keep-2 in each tier
    # The same items in both tiers: state, the data iterator's position, the config.
    assert set(local.restore(6).keys()) == set(persistent.restore(4).keys()) == {"state", "data", "config"}

    # The machine is lost with its local tier: a copy of the persistent tier alone.
    shutil.copytree(tmp_path / "persistent", tmp_path / "survivor")
    alone = config.replace(checkpoint_dir=str(tmp_path / "survivor"),
                           local_checkpoint_dir=str(ram_disk / "new"))

    assert_bitwise(train.train(config), whole, start=6)  # 0 steps of work lost, not 2
    # The finished run's last step is saved in both tiers, though 7 is on neither interval.
    local.reload()
    persistent.reload()
    assert (local.all_steps(), persistent.all_steps()) == ([6, 7], [4, 7])

    assert_bitwise(train.train(alone), whole, start=4)
