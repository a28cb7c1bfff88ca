"""`CheckpointManager`: numbered, atomic, asynchronous checkpoints of a training run.

Mirrors `orbax.checkpoint.CheckpointManager` and `CheckpointManagerOptions` for the
calls a training loop makes:

    options = CheckpointManagerOptions(max_to_keep=3, save_interval_steps=100)
    with CheckpointManager("/ckpt", options=options) as manager:
        if manager.latest_step() is not None:                  # resume
            restored = manager.restore(manager.latest_step(), args=args.Composite(
                state=args.StandardRestore(abstract_state), data=args.JsonRestore()))
        for step in ...:
            manager.save(step, args=args.Composite(             # returns at once
                state=args.StandardSave(state), data=args.JsonSave(iterator.get_state())))

The directory holds one subdirectory per step, named by the step number:

    /ckpt/200/_CHECKPOINT_METADATA      JSON: the items and their formats, metrics, time
    /ckpt/200/state/manifest.json ...   one directory per item (tree_files.py)
    /ckpt/300.partial-1a2b3c4d/          a save in progress, invisible until renamed

What happens in `save(step, args=...)`:
1. on the caller: decide (`should_save`), wait for the previous save, and snapshot
   every item to host memory (tree_files.snapshot); this is all the caller waits for;
2. in a background thread (or inline if `enable_async_checkpointing=False`): write
   the files into a temporary directory, fsync, rename it to `<step>` (atomic.py),
   then delete the steps the retention policy drops (retention.py).

A step is visible to `all_steps()` only once it is complete, so a reader, or a job
restarting after a crash, sees either the whole step or none of it.

A manager deletes only what it wrote. A step folder whose metadata is not this library's
(Orbax wrote it, a newer version of this library did, or it cannot be read) is listed, so
that restoring it says what it is, but it is never counted by the keep policy, deleted or
overwritten, and it does not stop later steps from being saved.

Differences from orbax: single process (no multi-host barriers or primary host; sharded.py
saves one step from several processes); `all_steps()` and `latest_step()` list only
committed steps (orbax also counts the one being written); `restore()` without args works
for every item, because the step's metadata records each item's format; `save` refuses a
step that is negative, fractional or a bool (orbax writes `-1/`, `5.0/` or `True/` and then
never lists it); retention and `delete` leave step folders another program wrote alone (orbax
manages every step folder it lists); no `item_handlers`, step-name formats, custom
save-decision or preservation policy objects, `todelete_subdir` or background deletion.
"""

from __future__ import annotations

import dataclasses
import json
import numbers
import pathlib
import shutil
import threading
import time
from collections.abc import Callable, Container
from typing import Any

from stacklib.checkpoint import args as args_lib
from stacklib.checkpoint import atomic, retention, tree_files

METADATA = "_CHECKPOINT_METADATA"
STEP_FORMAT = "stacklib.checkpoint.step/1"


def check_step(step: Any) -> int:
    """`step` as an int, if it names a step folder that `all_steps()` will list; else an error with the fix.

    A step is saved under the folder `str(step)`, and only folders named by a non-negative
    integer are listed: `-1`, `5.0` or `True` would be written and then never seen again.
    NumPy integers (a step counter kept in an array) are welcome and become ints.

    Raises:
      TypeError: `step` is not an integer, or is a bool.
      ValueError: `step` is negative.
    """
    def refused(fix: str) -> str:
        return (f"step must be a non-negative int (it names the step's folder, which all_steps() lists), "
                f"got {step!r} ({type(step).__name__}): {fix}.")

    if isinstance(step, bool):
        raise TypeError(refused("a bool is not a step number; pass the training step counter"))
    if not isinstance(step, numbers.Integral):
        raise TypeError(refused("pass a whole number, e.g. int(step) if a float counts the steps"))
    if step < 0:
        raise ValueError(refused("steps count from 0, the first step of a run"))
    return int(step)


def step_metadata_text(step: int, item_formats: dict[str, str], metrics: Any,
                       custom_metadata: dict | None) -> str:
    """A step's METADATA file: its items and their formats ("standard" or "json"), metrics, the time.

    Also written by sharded.py, whose primary process commits a step that several wrote.

    Raises:
      TypeError: `metrics` or `custom_metadata` is not JSON-serialisable.
    """
    return json.dumps({"format": STEP_FORMAT, "step": step, "items": item_formats, "metrics": metrics,
                       "custom_metadata": custom_metadata or {}, "timestamp": time.time()})


def json_item_text(name: str, value: Any) -> str:
    """A JsonSave item's text; TypeError naming the item if `value` is not JSON-serialisable."""
    try:
        return json.dumps(value)
    except TypeError as error:
        raise TypeError(f"item {name!r}: JsonSave needs a JSON-serialisable value ({error}).") from None


class StepAlreadyExistsError(ValueError):
    """`save` was asked to write a step that is already saved."""


class NotACheckpointError(ValueError):
    """A directory that should hold a checkpoint step does not."""


@dataclasses.dataclass(frozen=True)
class CheckpointManagerOptions:
    """Options of a `CheckpointManager`; same names and defaults as orbax's.

    Args:
      save_interval_steps: save steps that are multiples of this (plus the first save).
      max_to_keep: keep at most this many steps (None keeps all).
      best_fn: if set, keep the `max_to_keep` steps with the best `best_fn(metrics)`.
      best_mode: "max" or "min": which `best_fn` values are best.
      keep_checkpoints_without_metrics: with `best_fn`, never delete steps saved without metrics.
      create: create the directory if it does not exist.
      cleanup_tmp_directories: on start, remove what interrupted saves left behind.
      save_on_steps: also save these steps, whatever the interval.
      read_only: never save or delete.
      enable_async_checkpointing: write in a background thread; `save` returns after the snapshot.
    """

    save_interval_steps: int = 1
    max_to_keep: int | None = None
    best_fn: Callable[[Any], float] | None = None
    best_mode: str = "max"
    keep_checkpoints_without_metrics: bool = True
    create: bool = True
    cleanup_tmp_directories: bool = False
    save_on_steps: Container[int] | None = None
    read_only: bool = False
    enable_async_checkpointing: bool = True

    def __post_init__(self):
        if self.best_mode not in ("max", "min"):
            raise ValueError(f"best_mode must be 'max' or 'min', got {self.best_mode!r}.")
        if self.max_to_keep is not None and self.max_to_keep < 0:
            raise ValueError(f"max_to_keep must be None or >= 0, got {self.max_to_keep}.")


class CheckpointManager:
    """Saves, lists, prunes and restores the numbered checkpoints in one directory.

    Args:
      directory: the root directory (one subdirectory per step).
      options: a `CheckpointManagerOptions`; defaults as in orbax.
      item_names: if given, the only item names `save` accepts (catches typos early).

    Raises:
      FileNotFoundError: the directory does not exist and `options.create` is False.
      NotADirectoryError: the path is a file.
      NotACheckpointError: the path is a single step's directory, not the root.
    """

    def __init__(self, directory: str | pathlib.Path, options: CheckpointManagerOptions | None = None,
                 *, item_names: tuple[str, ...] | None = None):
        self._directory = pathlib.Path(directory)
        self._options = options or CheckpointManagerOptions()
        self._item_names = tuple(item_names) if item_names is not None else None
        if self._directory.exists() and not self._directory.is_dir():
            raise NotADirectoryError(f"{self._directory} is a file; a CheckpointManager needs a directory.")
        if not self._directory.exists():
            if not self._options.create:
                raise FileNotFoundError(f"{self._directory} does not exist; create it, or pass "
                                        "CheckpointManagerOptions(create=True).")
            self._directory.mkdir(parents=True)
        if (self._directory / METADATA).exists():
            raise NotACheckpointError(
                f"{self._directory} is the directory of one checkpoint step, not a checkpoint root. "
                f"Pass its parent: CheckpointManager({str(self._directory.parent)!r})."
            )
        if self._options.cleanup_tmp_directories:
            atomic.cleanup_temporary_directories(self._directory)
        self._lock = threading.Lock()  # guards _checkpoints (the writer thread updates it) and _not_ours
        self._checkpoints, self._not_ours = self._scan()
        self._thread: threading.Thread | None = None
        self._in_flight: int | None = None
        self._error: BaseException | None = None

    # What is there.

    def _scan(self) -> tuple[list[tuple[int, Any]], set[int]]:
        """The listed steps as [(step, metrics)], ascending, and those of them this library did not write.

        A folder named by a number with a METADATA file is listed whoever wrote it, so that
        restoring it raises the error that says what it is. Only a step whose metadata is
        ours is this manager's to count and delete: one Orbax or a newer version wrote, or
        whose metadata cannot be read, might be anyone's.
        """
        found, not_ours = [], set()
        for path in self._directory.iterdir():
            if path.is_dir() and path.name.isdigit() and (path / METADATA).is_file():
                try:
                    metrics = self._read_metadata(path).get("metrics")
                except (NotACheckpointError, tree_files.CheckpointCorruptedError):
                    metrics = None
                    not_ours.add(int(path.name))
                found.append((int(path.name), metrics))
        return sorted(found), not_ours

    def _read_metadata(self, step_dir: pathlib.Path) -> dict:
        path = step_dir / METADATA
        try:
            metadata = json.loads(path.read_text())
        except FileNotFoundError:
            raise NotACheckpointError(f"{step_dir} is not a checkpoint step: it has no {METADATA} file. "
                                      "Was it written by something else, or copied incompletely?") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise tree_files.CheckpointCorruptedError(f"{path} is damaged: {error}") from None
        if metadata.get("format") != STEP_FORMAT:
            raise NotACheckpointError(f"{path} has format {metadata.get('format')!r}, not {STEP_FORMAT!r}: "
                                      "this is not a stacklib checkpoint.")
        return metadata

    @property
    def directory(self) -> pathlib.Path:
        return self._directory

    def all_steps(self) -> list[int]:
        """The committed steps, ascending."""
        with self._lock:
            return [step for step, _ in self._checkpoints]

    def latest_step(self) -> int | None:
        """The newest committed step, or None."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def metrics(self, step: int) -> Any:
        """The metrics saved with `step` (None if it had none)."""
        with self._lock:
            for saved, metrics in self._checkpoints:
                if saved == step:
                    return metrics
        raise self._no_such_step(step)

    def _no_such_step(self, step: int) -> FileNotFoundError:
        return FileNotFoundError(f"no checkpoint for step {step} in {self._directory}; "
                                 f"saved steps: {self.all_steps()}.")

    def best_step(self) -> int | None:
        """The step with the best metrics under `best_fn` (the latest step if there is no `best_fn`)."""
        options = self._options
        if options.best_fn is None:
            return self.latest_step()
        with self._lock:
            scored = [(step, m) for step, m in self._checkpoints if m is not None]
        if not scored:
            return None
        ranked = sorted(scored, key=lambda pair: options.best_fn(pair[1]), reverse=options.best_mode == "min")
        return ranked[-1][0]

    def reload(self) -> None:
        """Re-read the directory (after another process wrote to it)."""
        self.wait_until_finished()
        with self._lock:
            self._checkpoints, self._not_ours = self._scan()

    # Saving.

    def _own_checkpoints(self) -> list[tuple[int, Any]]:
        with self._lock:
            return [(step, metrics) for step, metrics in self._checkpoints if step not in self._not_ours]

    def should_save(self, step: int) -> bool:
        """Whether `save(step, ...)` would write (interval, first save, newer than the latest).

        "The latest" is the latest step this library wrote: a folder another program wrote
        never makes later steps wait, though its own step number is never due.
        """
        if self._options.read_only or (self._directory / str(step)).exists():
            return False
        steps = [step for step, _ in self._own_checkpoints()]
        steps += [self._in_flight] if self._in_flight is not None else []
        return retention.should_save(step, steps, save_interval_steps=self._options.save_interval_steps,
                                     save_on_steps=self._options.save_on_steps)

    def _prepare(self, name: str, item: args_lib.CheckpointArgs) -> tuple[str, Any]:
        """Snapshot one item on the caller's thread: host copies of arrays, JSON text."""
        if isinstance(item, args_lib.StandardSave):
            return "standard", tree_files.snapshot(item.item)
        if isinstance(item, args_lib.JsonSave):
            return "json", json_item_text(name, item.item)
        raise TypeError(f"item {name!r}: cannot save with {type(item).__name__}; "
                        "use StandardSave or JsonSave.")

    def save(self, step: int, args: args_lib.CheckpointArgs | None = None, *, metrics: Any = None,
             force: bool = False, custom_metadata: dict | None = None) -> bool:
        """Save the items in `args` as checkpoint `step`, if the options say it is due.

        Returns:
          Whether a save was started (False: not due, and not `force`d).

        Raises:
          StepAlreadyExistsError: `step` is already saved, or its folder exists (steps are never
            overwritten).
          TypeError, ValueError: `step` is not a non-negative int (`check_step`).
          TypeError: `args` is not checkpoint args, or an item cannot be saved as asked.
          Whatever the previous asynchronous save raised (it is reported here or in
          `wait_until_finished`, never lost).
        """
        step = check_step(step)
        if args is None:
            raise ValueError("save needs args, e.g. save(step, args=args.StandardSave(state)).")
        items = args_lib.as_items(args)
        if self._item_names is not None and not set(items) <= set(self._item_names):
            raise ValueError(f"items {sorted(set(items) - set(self._item_names))} are not among this "
                             f"manager's item_names {self._item_names}.")
        if self._options.read_only or (not force and not self.should_save(step)):
            return False
        self.wait_until_finished()  # one save at a time; raises the previous one's error
        if step in [saved for saved, _ in self._own_checkpoints()]:
            raise StepAlreadyExistsError(f"checkpoint for step {step} already exists in {self._directory}.")
        if (self._directory / str(step)).exists():
            raise StepAlreadyExistsError(
                f"{self._directory / str(step)} already exists and was not written by this library (Orbax's, "
                f"a newer version's, or its metadata cannot be read): it is never overwritten. Move it out "
                f"of {self._directory} to save step {step} here.")
        prepared = {name: self._prepare(name, item) for name, item in items.items()}
        # fails here, on the caller, if metrics are not JSON
        metadata_text = step_metadata_text(step, {n: p[0] for n, p in prepared.items()}, metrics,
                                           custom_metadata)
        self._in_flight = step
        if not self._options.enable_async_checkpointing:
            try:
                self._write(step, prepared, metadata_text, metrics)
            finally:
                self._in_flight = None
            return True
        # Not a daemon thread: a normal interpreter exit waits for the save to finish.
        self._thread = threading.Thread(target=self._write_in_background, name=f"stacklib-checkpoint-{step}",
                                        args=(step, prepared, metadata_text, metrics))
        self._thread.start()
        return True

    def _write_in_background(self, *args) -> None:
        try:
            self._write(*args)
        except BaseException as error:  # kept and raised on the caller's thread later
            self._error = error

    def _write(self, step: int, prepared: dict, metadata_text: str, metrics: Any) -> None:
        final = self._directory / str(step)
        temporary = atomic.temporary_directory(final)
        temporary.mkdir()
        try:
            for name, (kind, payload) in prepared.items():
                if kind == "standard":
                    tree_files.write_tree(temporary / name, payload)
                else:
                    tree_files.write_json(temporary / name, payload)
            tree_files.write_file(temporary / METADATA, metadata_text.encode())
            atomic.commit(temporary, final)
        except BaseException:
            shutil.rmtree(temporary, ignore_errors=True)  # a crash would leave it; an error need not
            raise
        with self._lock:
            self._checkpoints = sorted(self._checkpoints + [(step, metrics)])
        self.delete_expired_steps()

    def delete_expired_steps(self) -> None:
        """Delete the steps the keep policy (`max_to_keep`, `best_fn`) no longer keeps.

        `save` calls this after every commit; sharded.py calls it after a step that several
        processes wrote. Only steps this library wrote are counted or deleted.
        """
        options = self._options
        own = self._own_checkpoints()
        steps = [step for step, _ in own]
        metrics = [m for _, m in own]
        keep = set(retention.steps_to_keep(
            steps, metrics, max_to_keep=options.max_to_keep, best_fn=options.best_fn,
            best_mode=options.best_mode,
            keep_checkpoints_without_metrics=options.keep_checkpoints_without_metrics,
        ))
        for step in steps:
            if step not in keep:
                self._delete_committed(step)

    def _delete_committed(self, step: int) -> None:
        with self._lock:  # unlisted first: a step is never listed while it is being deleted
            self._checkpoints = [(s, m) for s, m in self._checkpoints if s != step]
        atomic.remove(self._directory / str(step))

    def delete(self, step: int) -> None:
        """Delete a saved step.

        Raises:
          FileNotFoundError: no such step.
          NotACheckpointError: this library did not write the step's folder; it is never deleted.
        """
        self.wait_until_finished()
        if step not in self.all_steps():
            raise self._no_such_step(step)
        if step in self._not_ours:
            raise NotACheckpointError(
                f"{self._directory / str(step)} was not written by this library (Orbax's, a newer "
                "version's, or its metadata cannot be read), so a manager never deletes it. Remove it "
                "yourself (shutil.rmtree) if you mean to.")
        self._delete_committed(step)

    def is_saving_in_progress(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait_until_finished(self) -> None:
        """Block until the background save (if any) is committed; raise its error if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            self._in_flight = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def close(self) -> None:
        """Finish the save in progress (raising its error, if any)."""
        self.wait_until_finished()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # Restoring.

    def restore(self, step: int | None = None, args: args_lib.CheckpointArgs | None = None) -> Any:
        """Restore checkpoint `step` (default: the latest).

        Args:
          step: which step; None means `latest_step()`.
          args: `StandardRestore(target)` / `JsonRestore()` for a single-item checkpoint, or a
            `Composite` of them naming the items to restore. None restores every item as saved.

        Returns:
          The item, for a checkpoint saved with a single (non-composite) args object and
          restored without a `Composite`; otherwise a `Composite` of the restored items.

        Raises:
          FileNotFoundError: no such step (the message lists the saved ones).
          KeyError: an item is requested that the step does not have.
          NotACheckpointError: the step's directory is not a stacklib checkpoint.
          StructureMismatchError, CheckpointCorruptedError: see tree_files.read_tree.
        """
        if self._in_flight is not None and step in (None, self._in_flight):
            self.wait_until_finished()
        if step is None:
            step = self.latest_step()
            if step is None:
                raise FileNotFoundError(f"{self._directory} holds no checkpoint yet (all_steps() is empty).")
        step_dir = self._directory / str(step)
        if not step_dir.is_dir():
            raise self._no_such_step(step)
        saved = self._read_metadata(step_dir)["items"]
        if args is None:
            requested = {name: args_lib.StandardRestore() if kind == "standard" else args_lib.JsonRestore()
                         for name, kind in saved.items()}
        else:
            requested = args_lib.as_items(args)
        restored = {}
        for name, item in requested.items():
            if name not in saved:
                raise KeyError(f"step {step} has no item {name!r}; it has {sorted(saved)}.")
            expected = {"standard": args_lib.StandardRestore, "json": args_lib.JsonRestore}[saved[name]]
            if not isinstance(item, expected):
                raise TypeError(f"item {name!r} of step {step} was saved as {saved[name]}; "
                                f"restore it with {expected.__name__}, not {type(item).__name__}.")
            if saved[name] == "standard":
                restored[name] = tree_files.read_tree(step_dir / name, item.item)
            else:
                restored[name] = tree_files.read_json(step_dir / name)
        if not isinstance(args, args_lib.Composite) and list(restored) == ["default"]:
            return restored["default"]
        return args_lib.Composite(**restored)
