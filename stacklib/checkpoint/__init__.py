"""Checkpointing: a subset of `orbax.checkpoint`'s `CheckpointManager` API.

Mirrors `ocp.CheckpointManager`, `ocp.CheckpointManagerOptions` and `ocp.args`
(orbax-checkpoint 0.12.8), so that

    import orbax.checkpoint as ocp          # the real library
    import stacklib.checkpoint as ocp       # ours: the training loop below does not change

    manager = ocp.CheckpointManager(path, options=ocp.CheckpointManagerOptions(max_to_keep=3))
    manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                               data=ocp.args.JsonSave(iterator.get_state())))
    restored = manager.restore(manager.latest_step(), args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))

runs with both. The pieces, one file each:

  args.py        what to save and how: StandardSave/Restore, JsonSave/Restore, Composite
  tree_files.py  a pytree as files: host snapshot, one file per leaf, CRC-32 checksums,
                 restore into a target's structure, dtypes and shardings
  atomic.py      write aside, fsync, rename: a step appears complete or not at all
  retention.py   which steps to save (interval) and keep (latest N, best N by a metric)
  manager.py     CheckpointManager: asynchronous saves in a background thread
  multitier.py   two tiers (Orbax's emergency checkpointing): frequent local saves, rare
                 persistent ones, restore from the newest intact copy, a save on SIGTERM
  sharded.py     one step written by several processes: each its own shards, one commits
  zoo.py         a model cache the book's zoos share: built once per machine in a fixed
                 process (1 CPU device, 1 core), locked, written atomically, rebuilt if corrupt

Differences from orbax (each file lists its own): one process per manager (several
processes save together only through `sharded.save_sharded_step`); our own on-disk
format (raw files plus a JSON manifest) instead of TensorStore/OCDBT; checksums on
every file; only the standard and JSON item types; committed steps only in
`all_steps()`; no custom policies; preemption is handled only
by `multitier`, with a SIGTERM handler of its own.
"""

from stacklib.checkpoint import args, multitier
from stacklib.checkpoint.manager import (
    CheckpointManager,
    CheckpointManagerOptions,
    NotACheckpointError,
    StepAlreadyExistsError,
)
from stacklib.checkpoint.tree_files import CheckpointCorruptedError, StructureMismatchError

__all__ = [
    "CheckpointCorruptedError",
    "CheckpointManager",
    "CheckpointManagerOptions",
    "NotACheckpointError",
    "StepAlreadyExistsError",
    "StructureMismatchError",
    "args",
    "multitier",
]
