"""Two tiers of checkpoints: frequent saves to fast local storage, rare ones to persistent storage.

Mirrors `orbax.checkpoint.experimental.emergency.checkpoint_manager.CheckpointManager` and its
options (orbax-checkpoint 0.12.8), Orbax's "emergency" or multi-tier checkpointing:

    from stacklib.checkpoint import args, multitier

    options = multitier.CheckpointManagerOptions(
        local=multitier.LocalCheckpointOptions(save_interval_steps=10, max_to_keep=2),
        persistent=multitier.PersistentCheckpointOptions(save_interval_steps=1000, max_to_keep=3))
    manager = multitier.CheckpointManager("/dev/shm/run", "/mnt/shared/run", options=options)
    multitier.install_preemption_handler(manager)        # SIGTERM: save the next step locally
    for step in ...:
        state = train_step(state)
        manager.save(step, args=args.StandardSave(state))
        if manager.reached_preemption(step):             # that save is committed: leave now
            sys.exit(0)

Why two tiers. A job that checkpoints every k steps loses up to k - 1 steps of work when
it dies. Persistent storage (a bucket, a network file system) survives the machine but is
slow to write, so k is large there. Storage on the machine (a RAM disk, a local SSD) is
fast enough to write every few steps, but is lost with the machine. A job whose process
dies on a machine that lives on restarts from the local tier and loses few steps; when the
machine is gone, the persistent tier bounds the loss.

Each tier is an ordinary `CheckpointManager` (manager.py) with its own directory, interval
and keep-N, so each commits atomically and checks its checksums; this class only decides
which tier saves a step and which copy a restore reads:

* `save(step)` saves to each tier whose interval is due; the tiers write in their own
  threads, so a slow persistent write does not hold up the local saves after it.
* `restore()` tries every saved copy, newest step first and, for one step, the local copy
  before the persistent one (`restore_order`). A copy it cannot read is skipped with a
  `CheckpointFallbackWarning` that names the folder, the problem and what was done, and
  nothing is ever deleted. A damaged copy (a file missing, truncated or failing its
  checksum) is moved aside to `<step>.damaged-<random>` (atomic.quarantine), so that the run
  can save that step number again and a person can look at what went wrong. A folder
  another program (Orbax) or a newer version of this library wrote is left as it is. A copy
  that fails for any other reason (a target of the wrong structure, a permission denied)
  is not skipped: the error is raised, and nothing is moved.
* Preemption. A preempted VM gets a notice (SIGTERM) and a grace period before it is
  killed. The handler only records the notice: it runs between two bytecodes of the main
  thread, possibly halfway through a training step (its state half updated) or inside
  this manager's own lock (a deadlock). The next `save(step)` writes that step to the
  local tier, whatever the interval, and waits until it is committed; then
  `reached_preemption(step)` is True and the loop exits. A kill before the commit leaves
  the previous steps untouched (atomic.py).

What a crash costs: a restart resumes from the newest copy committed in either tier. With
saves every k steps that is `p % k` steps of work for a crash after step `p` (k the local
interval while the machine lives, the persistent one when it is lost), plus whatever an
interrupted or stuck save had not yet committed; a save on the preemption notice costs none.

Differences from orbax:
- One process writes both tiers. Orbax's manager spans the slices of a multi-slice job:
  one slice writes the persistent tier, the others write per-process local checkpoints
  (the directory is per host, e.g. a RAM disk), and a restore broadcasts the state from
  a slice whose local copy is complete. Given a single slice it writes no local
  checkpoints at all. Nothing is replicated here: a lost machine loses its local tier.
- `restore()` verifies checksums and falls back to another copy or an older step, moving
  damaged copies aside; orbax restores the latest step it finds, local if a slice holds it,
  and does not fall back.
- `restore()` takes `args` as our `CheckpointManager` does; orbax takes `global_mesh` and
  `abstract_state` when it is built and restores that one pytree.
- The persistent interval must be a multiple of the local one (orbax accepts any); the
  directories are created if missing (orbax wants them to exist).
- Preemption comes from our SIGTERM handler; orbax asks JAX's preemption sync point
  (`multihost_utils.reached_preemption_sync_point`, fed by `jax.distributed`'s notifier),
  which makes every host agree on the step to save.
- No `delete`, `metrics`, `best_step`, per-tier `read_only` or `should_save_fn`.
"""

from __future__ import annotations

import dataclasses
import pathlib
import signal
import threading
import warnings
from collections.abc import Iterable
from typing import Any, NamedTuple

from stacklib.checkpoint import args as args_lib
from stacklib.checkpoint import atomic
from stacklib.checkpoint import manager as manager_lib
from stacklib.checkpoint.tree_files import CheckpointCorruptedError

LOCAL, PERSISTENT = "local", "persistent"


class CheckpointFallbackWarning(UserWarning):
    """A saved copy could not be restored, and `restore` went on to the next one."""


def _check_positive(name: str, value: Any, meaning: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int ({meaning}), got {value!r}.")


@dataclasses.dataclass(frozen=True)
class LocalCheckpointOptions:
    """The local tier: saved often to fast storage on the machine. Orbax's defaults."""

    save_interval_steps: int = 10
    max_to_keep: int = 1

    def __post_init__(self):
        _check_positive("LocalCheckpointOptions.save_interval_steps", self.save_interval_steps,
                        "save every N steps")
        _check_positive("LocalCheckpointOptions.max_to_keep", self.max_to_keep,
                        "a local tier that keeps no step has nothing to restore")


@dataclasses.dataclass(frozen=True)
class PersistentCheckpointOptions:
    """The persistent tier: saved rarely to storage that outlives the machine. Orbax's defaults."""

    save_interval_steps: int = 1000
    max_to_keep: int | None = None  # keep every step

    def __post_init__(self):
        _check_positive("PersistentCheckpointOptions.save_interval_steps", self.save_interval_steps,
                        "save every N steps")
        if self.max_to_keep is not None:
            _check_positive("PersistentCheckpointOptions.max_to_keep", self.max_to_keep,
                            "or None to keep every step")


@dataclasses.dataclass(frozen=True)
class CheckpointManagerOptions:
    """Options of a two-tier `CheckpointManager`.

    Raises:
      ValueError: the persistent interval is not a multiple of the local one. Then every
        persistent step is a local step too, and the schedule reads "every k steps
        locally, every m-th of those also persistently"; 25 against 10 is usually a typo.
    """

    local: LocalCheckpointOptions = dataclasses.field(default_factory=LocalCheckpointOptions)
    persistent: PersistentCheckpointOptions = dataclasses.field(default_factory=PersistentCheckpointOptions)
    cleanup_tmp_directories: bool = False  # the persistent tier's; the local tier's are always removed
    enable_async_checkpointing: bool = True

    def __post_init__(self):
        k_local, k_persistent = self.local.save_interval_steps, self.persistent.save_interval_steps
        if k_persistent % k_local:
            below = k_persistent // k_local * k_local
            nearest = " or ".join(str(k) for k in (below, below + k_local) if k)
            raise ValueError(
                f"persistent.save_interval_steps ({k_persistent}) must be a multiple of "
                f"local.save_interval_steps ({k_local}), so that every persistent step is also a local "
                f"step. Use {nearest}, or a local interval that divides {k_persistent}."
            )


class RestoredFrom(NamedTuple):
    """Which copy `restore` read, and why it passed over the newer ones."""

    step: int
    tier: str  # "local" or "persistent"
    skipped: tuple[str, ...]


def restore_order(local_steps: Iterable[int], persistent_steps: Iterable[int]) -> list[tuple[int, str]]:
    """Every saved copy as (step, tier), in the order `restore` tries them.

    Newest step first: it loses the least work. For one step, the local copy first: it is
    faster to read, and the persistent one is the fallback.
    """
    copies = [(step, LOCAL) for step in local_steps] + [(step, PERSISTENT) for step in persistent_steps]
    return sorted(copies, key=lambda copy: (-copy[0], copy[1] != LOCAL))


def _check_separate(local: pathlib.Path, persistent: pathlib.Path) -> None:
    local, persistent = local.resolve(), persistent.resolve()
    if local == persistent or local.is_relative_to(persistent) or persistent.is_relative_to(local):
        raise ValueError(
            f"the local tier ({local}) and the persistent tier ({persistent}) must be separate "
            "directories, neither inside the other: the persistent tier must survive losing the local "
            "one. Put the local tier on the machine (e.g. /dev/shm/run) and the persistent tier on "
            "storage that outlives it."
        )


class CheckpointManager:
    """Saves to a local and a persistent tier; restores the newest intact copy from either.

    Args:
      local_directory: the local tier's root, on storage that is fast but may be lost.
      persistent_directory: the persistent tier's root, on storage that outlives the machine.
      options: a `CheckpointManagerOptions`.

    Raises:
      ValueError: the two directories are the same, or one is inside the other.
    """

    def __init__(self, local_directory: str | pathlib.Path, persistent_directory: str | pathlib.Path,
                 *, options: CheckpointManagerOptions | None = None):
        options = options or CheckpointManagerOptions()
        _check_separate(pathlib.Path(local_directory), pathlib.Path(persistent_directory))

        def tier(directory, tier_options, cleanup):
            return manager_lib.CheckpointManager(directory, options=manager_lib.CheckpointManagerOptions(
                save_interval_steps=tier_options.save_interval_steps, max_to_keep=tier_options.max_to_keep,
                cleanup_tmp_directories=cleanup,
                enable_async_checkpointing=options.enable_async_checkpointing))

        # A local tier's leftovers are never worth keeping (orbax removes them too).
        self._tiers = {LOCAL: tier(local_directory, options.local, True),
                       PERSISTENT: tier(persistent_directory, options.persistent,
                                        options.cleanup_tmp_directories)}
        self._preemption_noticed = False  # set by the signal handler, read by save()
        self._preempted_step: int | None = None  # the step saved because of the notice
        self.last_restore: RestoredFrom | None = None

    @property
    def local(self) -> manager_lib.CheckpointManager:
        """The local tier's own manager (to list or inspect its steps)."""
        return self._tiers[LOCAL]

    @property
    def persistent(self) -> manager_lib.CheckpointManager:
        """The persistent tier's own manager."""
        return self._tiers[PERSISTENT]

    def all_steps(self) -> list[int]:
        """The steps committed in either tier, ascending."""
        return sorted(set(self.local.all_steps()) | set(self.persistent.all_steps()))

    def latest_step(self) -> int | None:
        """The newest committed step in either tier (a restore may find it damaged and go older)."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def reload(self) -> None:
        """Re-read both directories."""
        self.local.reload()
        self.persistent.reload()

    # Saving.

    def should_save(self, step: int) -> bool:
        """Whether `save(step, ...)` would write: a tier's interval is due, or a preemption notice came."""
        notice_pending = self._preemption_noticed and self._preempted_step is None
        return notice_pending or any(tier.should_save(step) for tier in self._tiers.values())

    def save(self, step: int, args: args_lib.CheckpointArgs | None = None, *, metrics: Any = None,
             force: bool = False) -> bool:
        """Save `step` to each tier whose interval is due (to both if `force`).

        After a preemption notice, save `step` to the local tier whatever its interval and
        wait until it is committed; `reached_preemption(step)` is then True.

        Returns:
          Whether a save was started in either tier.

        Raises:
          As `CheckpointManager.save` of either tier.
        """
        if self._preemption_noticed and self._preempted_step is None:
            self.local.wait_until_finished()  # the step before is committed first
            if step not in self.local.all_steps():
                self.local.save(step, args=args, metrics=metrics, force=True)
                self.local.wait_until_finished()  # on disk before the grace period ends
            self._preempted_step = step
            return True
        saved = [tier.save(step, args=args, metrics=metrics, force=force) for tier in self._tiers.values()]
        return any(saved)

    def notify_preemption(self) -> None:
        """Record a preemption notice; the next `save` acts on it. Safe to call from a signal handler."""
        self._preemption_noticed = True

    def reached_preemption(self, step: int) -> bool:
        """True once a step up to `step` has been saved because of a preemption notice.

        A notice that arrives after `save(step)` returned is acted on by the next `save`, so
        a loop that exits when this is True never exits with its last step unsaved.
        """
        return self._preempted_step is not None and step >= self._preempted_step

    def wait_until_finished(self) -> None:
        """Block until both tiers' saves are committed; raise the first error either had."""
        errors = []
        for tier in self._tiers.values():
            try:
                tier.wait_until_finished()
            except BaseException as error:  # wait for the other tier before raising
                errors.append(error)
        if errors:
            raise errors[0]

    def close(self) -> None:
        self.wait_until_finished()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # Restoring.

    def restore(self, step: int | None = None, args: args_lib.CheckpointArgs | None = None) -> Any:
        """Restore the newest intact copy of `step` (default: of any step), from either tier.

        Copies are tried in `restore_order`. One that is damaged, gone, or not this library's
        is skipped with a `CheckpointFallbackWarning`; a damaged one is moved aside (see the
        module docstring). `last_restore` then says which copy was read.

        Raises:
          FileNotFoundError: neither tier holds `step` (or any step).
          CheckpointCorruptedError: no copy could be restored (the message lists each problem).
          StructureMismatchError, KeyError, TypeError: `args` do not fit the checkpoint; these
            are the caller's mistakes, not damage, so no other copy is tried.
          OSError: a copy could not be read for a reason that is not damage (e.g. a permission).
        """
        copies = restore_order(self.local.all_steps(), self.persistent.all_steps())
        if step is not None:
            copies = [copy for copy in copies if copy[0] == step]
        if not copies:
            wanted = "any step" if step is None else f"step {step}"
            raise FileNotFoundError(f"neither tier holds {wanted}: local {self.local.all_steps()} in "
                                    f"{self.local.directory}, persistent {self.persistent.all_steps()} in "
                                    f"{self.persistent.directory}.")
        problems = []
        for copy_step, tier_name in copies:
            tier = self._tiers[tier_name]
            try:
                restored = tier.restore(copy_step, args=args)
            except (CheckpointCorruptedError, manager_lib.NotACheckpointError, FileNotFoundError) as error:
                done = _set_aside_if_damaged(tier, copy_step, error)
                where = f"step {copy_step} in the {tier_name} tier ({tier.directory})"
                problems.append(f"{where}: {error} {done}")
                warnings.warn(f"cannot restore {problems[-1]} Trying the next copy.",
                              CheckpointFallbackWarning, stacklevel=2)
                continue
            self.last_restore = RestoredFrom(copy_step, tier_name, tuple(problems))
            return restored
        raise CheckpointCorruptedError("no saved copy could be restored:\n  " + "\n  ".join(problems))


def _set_aside_if_damaged(tier: manager_lib.CheckpointManager, step: int, error: Exception) -> str:
    """Move a damaged copy aside and leave anything else where it is; say which, and why.

    Nothing is deleted: a folder whose metadata is not ours (NotACheckpointError) may be
    Orbax's or a newer version's, and a damaged one holds what a person needs to find out
    what went wrong.
    """
    folder = tier.directory / str(step)
    if isinstance(error, CheckpointCorruptedError):
        tier.wait_until_finished()  # the tier's listing changes below: no save of it may be running
        aside = atomic.quarantine(folder)
        tier.reload()
        return (f"Moved {folder} aside to {aside.name}, so that step {step} can be saved again; it is "
                "never listed or deleted: look at it, then delete it yourself.")
    if isinstance(error, FileNotFoundError):
        tier.reload()
        return f"{folder} was deleted after it was listed: nothing to move."
    return (f"Left {folder} as it is: this version of the library did not write it (another program such "
            "as Orbax did, or a newer version), so it is not this manager's to move or delete.")


def install_preemption_handler(manager: CheckpointManager,
                               signum: int = signal.SIGTERM) -> Any:
    """Make `signum` (a preemption notice) record itself on `manager`; return the old handler.

    The handler only calls `manager.notify_preemption()`; the save happens in the next
    `manager.save`, between two training steps (see the module docstring for why).

    Raises:
      RuntimeError: called outside the main thread (Python runs signal handlers there only).
    """
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("install_preemption_handler must be called from the main thread: Python runs "
                           "signal handlers only there. Call it where the training loop starts.")
    return signal.signal(signum, lambda received, frame: manager.notify_preemption())
