"""One checkpoint step written by several processes: each writes the shards it owns, one commits.

Mirrors orbax's multi-host save. In a job of several processes (multi-controller JAX),
every process calls `CheckpointManager.save` with the same arguments; each writes the
shards of every `jax.Array` that it addresses and whose `replica_id` is 0 (so a shard
held by several devices is written once), the processes meet at barriers
(`orbax.checkpoint.multihost.sync_global_processes`, replaceable through
`AsyncOptions(barrier_sync_fn=...)`), and the primary host alone
(`MultiprocessingOptions(primary_host=0)`) writes the metadata, commits the step and
deletes old ones. Here that is one function, `save_sharded_step`, called in every process:

    save_sharded_step(directory, step, args.Composite(state=args.StandardSave(sharded_state),
                                                      data=args.JsonSave(iterator_state)),
                      barrier=multihost_utils.sync_global_devices, is_primary=jax.process_index() == 0)

Three phases, with a barrier after each (its name is `checkpoint-<step>-<phase>`):

1. `created`: the primary makes `<step>.partial-sharded/`, a name every process knows,
   and one directory per standard item;
2. `written`: every process sizes each leaf's raw file (all to the same size) and writes
   the shards it owns at their offsets (`write_shards`);
3. `committed`: the primary checksums and fsyncs the files, writes each manifest
   (tree_files.py), the JSON items and the step's metadata (manager.py), renames the
   directory to `<step>` (atomic.py) and applies `max_to_keep`. The last barrier keeps
   every process from running ahead (or exiting) before the step exists.

The step is byte for byte what `CheckpointManager.save` writes for the same values, so
any number of processes, one included, restore it with `CheckpointManager`. A job killed
before the commit leaves `<step>.partial-sharded`, never a step: earlier steps are
intact, and the directory is removed by the next save of that step or by
`CheckpointManagerOptions(cleanup_tmp_directories=True)`.

Differences from Orbax: a function, not an option of `CheckpointManager`; synchronous;
every process writes into one raw file per array on a file system they all share (orbax
writes TensorStore/OCDBT chunks, each host its own, and the primary merges their
indexes); the barrier and `is_primary` are passed in, so this package needs no
`jax.distributed` (orbax builds its barrier from the distributed client); standard items
must hold only `jax.Array` leaves; no `active_processes` subset of the job.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import zlib
from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np

from stacklib.checkpoint import args as args_lib
from stacklib.checkpoint import atomic, manager, tree_files

_TEMPORARY = "sharded"  # `<step>.partial-sharded`: fixed, so that every process finds it
_CHUNK = 1 << 24  # bytes read at a time for a checksum


def owned_shards(array: jax.Array) -> list[jax.Shard]:
    """The shards of `array` this process writes: the ones it addresses with `replica_id` 0."""
    return [shard for shard in array.addressable_shards if shard.replica_id == 0]


def write_shards(file: pathlib.Path, array: jax.Array, shards: Iterable[jax.Shard] | None = None) -> None:
    """Write `shards` of `array` (default: `owned_shards(array)`) at their offsets in its raw file.

    The file is `array`'s bytes in C order, as `tree_files` writes a leaf. Every process
    sizes it to the whole array first (the same size, so no process truncates another's
    data); then each shard's block is written through a memory map, by its index.
    """
    nbytes = array.size * array.dtype.itemsize
    descriptor = os.open(file, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.ftruncate(descriptor, nbytes)
    finally:
        os.close(descriptor)
    shards = owned_shards(array) if shards is None else list(shards)
    if not shards or nbytes == 0:
        return
    blocks = np.memmap(file, dtype=array.dtype, mode="r+", shape=array.shape or (1,))
    for shard in shards:
        index = shard.index if array.shape else (0,)  # a scalar is one element
        blocks[index] = np.asarray(shard.data).reshape(blocks[index].shape)
    blocks.flush()
    del blocks  # unmap before the primary reads the file


def _checksum_and_fsync(file: pathlib.Path) -> int:
    """The CRC-32 of a file the processes wrote, after making its bytes durable."""
    checksum = 0
    with open(file, "rb+") as handle:
        while chunk := handle.read(_CHUNK):
            checksum = zlib.crc32(chunk, checksum)
        os.fsync(handle.fileno())
    return checksum


def _array_leaves(name: str, item: args_lib.CheckpointArgs) -> list[tuple[Any, jax.Array]]:
    """A StandardSave item's (key path, array) pairs; TypeError for any other item or leaf."""
    if not isinstance(item, args_lib.StandardSave):
        raise TypeError(f"item {name!r}: save_sharded_step takes StandardSave and JsonSave items, "
                        f"not {type(item).__name__}.")
    leaves = jax.tree_util.tree_flatten_with_path(item.item)[0]
    for key_path, leaf in leaves:
        if not isinstance(leaf, jax.Array):
            raise TypeError(
                f"item {name!r}: the leaf at {jax.tree_util.keystr(key_path)} is a {type(leaf).__name__}; "
                "save_sharded_step writes jax.Arrays only. Put it on the mesh with jax.device_put, or "
                "save it as a JsonSave item."
            )
    return leaves


def save_sharded_step(directory: str | os.PathLike, step: int, args: args_lib.CheckpointArgs, *,
                      barrier: Callable[[str], None], is_primary: bool, max_to_keep: int | None = None,
                      metrics: Any = None, custom_metadata: dict | None = None) -> None:
    """Save `step` from every process of a job; call it in each, with the same arguments.

    Args:
      directory: the checkpoint root, on a file system every process shares.
      step: the step number; it must not be saved already.
      args: `StandardSave` items (pytrees of `jax.Array`s, sharded any way) and `JsonSave`
        items, alone or in an `args.Composite`, as for `CheckpointManager.save`.
      barrier: `barrier(name)` returns once every process has called it with `name`
        (e.g. `jax.experimental.multihost_utils.sync_global_devices`).
      is_primary: True in exactly one process: it creates, finalizes and commits the step.
      max_to_keep: after the commit, the primary deletes all but the newest this many steps.
      metrics, custom_metadata: stored in the step's metadata, as by `CheckpointManager.save`.

    Raises:
      StepAlreadyExistsError: `step` is already saved (raised in every process).
      TypeError, ValueError: `step` is not a non-negative int (`manager.check_step`).
      TypeError: an item is not StandardSave/JsonSave, or a standard leaf is not a jax.Array.
    """
    step = manager.check_step(step)
    root = pathlib.Path(directory)
    final = root / str(step)
    temporary = final.with_name(f"{step}{atomic.PARTIAL}{_TEMPORARY}")
    items = args_lib.as_items(args)
    # Checked in every process before the first barrier, so that a bad argument stops them all.
    texts = {name: manager.json_item_text(name, item.item)
             for name, item in items.items() if isinstance(item, args_lib.JsonSave)}
    trees = {name: _array_leaves(name, item) for name, item in items.items() if name not in texts}
    formats = {name: "json" if name in texts else "standard" for name in items}
    metadata = manager.step_metadata_text(step, formats, metrics, custom_metadata)
    if final.exists():  # no process has passed the first barrier yet: all see the same answer
        raise manager.StepAlreadyExistsError(f"checkpoint for step {step} already exists in {root}.")
    if is_primary:
        shutil.rmtree(temporary, ignore_errors=True)  # left by a job killed mid-save
        temporary.mkdir(parents=True)
        for name in trees:
            (temporary / name).mkdir()
    barrier(f"checkpoint-{step}-created")
    files = {name: [tree_files.leaf_file_name(index, jax.tree_util.keystr(key_path))
                    for index, (key_path, _) in enumerate(leaves)] for name, leaves in trees.items()}
    for name, leaves in trees.items():
        for file, (_, leaf) in zip(files[name], leaves, strict=True):
            write_shards(temporary / name / file, leaf)
    barrier(f"checkpoint-{step}-written")
    if is_primary:
        for name, text in texts.items():
            tree_files.write_json(temporary / name, text)
        for name, leaves in trees.items():
            entries = [tree_files.manifest_entry(
                jax.tree_util.keystr(key_path), tree_files.encode_key_path(key_path), "jax",
                leaf.dtype, leaf.shape, file, _checksum_and_fsync(temporary / name / file))
                for file, (key_path, leaf) in zip(files[name], leaves, strict=True)]
            tree_files.write_manifest(temporary / name, entries)
        tree_files.write_file(temporary / manager.METADATA, metadata.encode())
        atomic.commit(temporary, final)
        options = manager.CheckpointManagerOptions(max_to_keep=max_to_keep, enable_async_checkpointing=False)
        manager.CheckpointManager(root, options=options).delete_expired_steps()
    barrier(f"checkpoint-{step}-committed")
