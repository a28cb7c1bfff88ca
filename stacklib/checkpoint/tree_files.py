"""A pytree as a directory of files: one raw file per leaf, and a manifest with checksums.

This is the "standard" format behind `args.StandardSave` / `args.StandardRestore`; it
plays the part of orbax's PyTree handler (which writes TensorStore arrays). A saved
pytree is a directory:

    manifest.json            for each leaf: its path in the tree, kind, dtype, shape,
                             file name and CRC-32 of its bytes
    00000.params.w.bin       the leaf's bytes, C order, exactly as in memory
    00001.params.b.bin       ...

Three steps, each for a reason:

1. `snapshot(tree)` copies every leaf to host memory *on the caller's thread*. After
   that the training step may overwrite its NumPy arrays or donate its device
   buffers: the checkpoint holds its own copy. This is the only part of an
   asynchronous save the caller waits for. (A jax array on the CPU is already in
   host memory and immutable, so there the snapshot keeps a reference instead of
   copying.)
2. `write_tree(directory, snapshot)` writes the files, each followed by `fsync`, so
   that when the directory is later renamed into place (atomic.py) its contents are on
   the disk, not only in the page cache.
3. `read_tree(directory, target)` checks each file's size and CRC-32 before using it,
   and raises `CheckpointCorruptedError` naming the damaged file. With a target it
   first compares structures and shapes and raises `StructureMismatchError` listing
   every differing path.

The manifest is written through four public functions, `leaf_file_name`,
`encode_key_path`, `manifest_entry` and `write_manifest`: `write_tree` uses them, and so
does sharded.py, whose processes write the leaf files themselves, so that both write the
same manifest.

Leaves are identified by their path (`jax.tree_util.keystr`, e.g. `['params']['w']`), so a
target of another container type with the same paths (an `nnx.State` for the dicts it
was saved from) restores.

Differences from orbax: no TensorStore, chunking, compression or OCDBT; no partial
restore; a restored dtype is cast to the target's, as in orbax, but shapes must match
exactly (orbax can pad or truncate when asked to).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import zlib
from typing import Any

import jax
import numpy as np

MANIFEST = "manifest.json"
FORMAT = "stacklib.checkpoint.tree/1"
_MAX_LISTED = 10  # paths named in one error message


class CheckpointCorruptedError(OSError):
    """A checkpoint file is missing, truncated, or fails its checksum."""


class StructureMismatchError(ValueError):
    """The restore target and the saved pytree differ in paths or shapes."""


@dataclasses.dataclass(frozen=True)
class HostLeaf:
    """One leaf copied to host memory, with what is needed to put it back."""

    path: str  # jax.tree_util.keystr of its key path
    keys: list  # the key path as JSON: [["dict", "params"], ["seq", 0], ["attr", "mu"], ...]
    kind: str  # what it was: "jax", "numpy", "numpy-scalar", "bool", "int" or "float"
    array: np.ndarray


def encode_key_path(key_path: tuple) -> list:
    """A jax key path as JSON, e.g. `[["dict", "params"], ["seq", 0]]`: rebuilds the tree without a target.

    Raises:
      TypeError: a key cannot be saved (a dict key that is not a str or int, an unknown key type).
    """
    return [_encode_key(key) for key in key_path]


def _encode_key(key: Any) -> list:
    if isinstance(key, jax.tree_util.DictKey):
        if not isinstance(key.key, str | int):
            raise TypeError(f"dict keys must be str or int to be saved, got {key.key!r}.")
        return ["dict", key.key]
    if isinstance(key, jax.tree_util.SequenceKey):
        return ["seq", key.idx]
    if isinstance(key, jax.tree_util.GetAttrKey):
        return ["attr", key.name]
    if isinstance(key, jax.tree_util.FlattenedIndexKey):
        return ["index", key.key]
    raise TypeError(f"unsupported pytree key {key!r}.")


def snapshot(tree: Any) -> list[HostLeaf]:
    """Copy every leaf of `tree` to host memory now; the copies belong to the checkpoint.

    Raises:
      TypeError: a leaf is not an array or a Python bool/int/float (the message names it).
    """
    leaves_with_paths = jax.tree_util.tree_flatten_with_path(tree)[0]
    for _, leaf in leaves_with_paths:
        if isinstance(leaf, jax.Array):
            leaf.copy_to_host_async()  # start every device->host transfer before waiting on any
    snapshot_leaves = []
    for key_path, leaf in leaves_with_paths:
        path = jax.tree_util.keystr(key_path)
        if isinstance(leaf, jax.Array):
            # On an accelerator this is the device->host copy. On CPU it is a view of the
            # device buffer, which is safe: jax arrays are immutable, and JAX will not
            # donate a buffer that a view still refers to (it copies instead).
            kind, array = "jax", np.asarray(leaf)
        elif isinstance(leaf, np.ndarray):
            kind, array = "numpy", np.array(leaf, copy=True)
        elif isinstance(leaf, np.generic):  # np.float32(0.5); orbax refuses these, we keep them
            kind, array = "numpy-scalar", np.asarray(leaf)
        elif isinstance(leaf, bool | int | float):
            kind, array = type(leaf).__name__, np.asarray(leaf)
        else:
            raise TypeError(
                f"cannot save the leaf at {path}: a {type(leaf).__name__}. StandardSave takes arrays and "
                "Python bool/int/float; save other values with args.JsonSave."
            )
        snapshot_leaves.append(HostLeaf(path, encode_key_path(key_path), kind, array))
    return snapshot_leaves


def _raw_bytes(array: np.ndarray) -> memoryview:
    """The array's bytes without a copy (C order), for any dtype including bfloat16."""
    return memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))


def write_file(path: pathlib.Path, data: bytes | memoryview) -> int:
    """Write `data` to a new file and fsync it; return its CRC-32."""
    checksum = zlib.crc32(data)
    with open(path, "xb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())
    return checksum


def leaf_file_name(index: int, path: str) -> str:
    """The file of the `index`-th leaf, at `path`: `00000.params.w.bin` (the number keeps names unique)."""
    words = re.findall(r"[A-Za-z0-9_]+", path)  # ['params']['w'] -> params.w
    return f"{index:05d}.{'.'.join(words)[:80] or 'leaf'}.bin"


def manifest_entry(path: str, keys: list, kind: str, dtype: Any, shape: tuple, file: str,
                   checksum: int) -> dict:
    """One leaf's entry in the manifest.

    Args:
      path: the leaf's `jax.tree_util.keystr`; `keys`: its `encode_key_path`.
      kind: what to restore it as without a target (see `HostLeaf.kind`).
      dtype, shape: the array's; `file`: its `leaf_file_name`; `checksum`: the CRC-32 of its bytes.
    """
    return {"path": path, "keys": keys, "kind": kind, "dtype": np.dtype(dtype).name, "shape": list(shape),
            "file": file, "crc32": checksum}


def write_manifest(directory: pathlib.Path, entries: list[dict]) -> None:
    """Write the manifest of `manifest_entry`s into `directory`, last: it completes the saved pytree."""
    write_file(directory / MANIFEST, json.dumps({"format": FORMAT, "leaves": entries}, indent=1).encode())


def write_tree(directory: pathlib.Path, leaves: list[HostLeaf]) -> None:
    """Write snapshotted leaves and their manifest into the new directory `directory`."""
    directory.mkdir()
    entries = []
    for index, leaf in enumerate(leaves):
        name = leaf_file_name(index, leaf.path)
        checksum = write_file(directory / name, _raw_bytes(leaf.array))
        entries.append(manifest_entry(leaf.path, leaf.keys, leaf.kind, leaf.array.dtype, leaf.array.shape,
                                      name, checksum))
    write_manifest(directory, entries)


def read_manifest(directory: pathlib.Path) -> list[dict]:
    """The manifest's leaf entries; CheckpointCorruptedError if it is missing or unreadable."""
    path = directory / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointCorruptedError(f"{path} is missing: {directory} is not a complete saved pytree.") \
            from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointCorruptedError(f"{path} is damaged (not valid JSON: {error}).") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointCorruptedError(f"{path} has format {manifest.get('format')!r}, expected {FORMAT!r}.")
    return manifest["leaves"]


def read_leaf(directory: pathlib.Path, entry: dict) -> np.ndarray:
    """Load one leaf's file, checking its size and CRC-32 against the manifest."""
    path = directory / entry["file"]
    dtype = np.dtype(entry["dtype"])
    array = np.empty(entry["shape"], dtype=dtype)
    expected = array.nbytes
    try:
        size = path.stat().st_size
        with open(path, "rb") as file:
            read = file.readinto(_raw_bytes(array)) if expected else 0
    except FileNotFoundError:
        raise CheckpointCorruptedError(f"{path} (leaf {entry['path']}) is missing.") from None
    if size != expected or read != expected:
        raise CheckpointCorruptedError(
            f"{path} (leaf {entry['path']}) has {size} bytes, expected {expected}: the file is truncated or "
            "damaged. Restore an earlier step."
        )
    checksum = zlib.crc32(_raw_bytes(array))
    if checksum != entry["crc32"]:
        raise CheckpointCorruptedError(
            f"{path} (leaf {entry['path']}) fails its checksum (CRC-32 {checksum:#010x}, saved "
            f"{entry['crc32']:#010x}): the file is damaged. Restore an earlier step."
        )
    return array


def _as_saved_kind(array: np.ndarray, kind: str) -> Any:
    if kind == "jax":
        return jax.device_put(array)
    if kind == "numpy":
        return array
    if kind == "numpy-scalar":
        return array[()]
    return {"bool": bool, "int": int, "float": float}[kind](array.item())


def _as_target(array: np.ndarray, target: Any, path: str) -> Any:
    """`array` in the target leaf's type, dtype and (for jax leaves) sharding."""
    if isinstance(target, jax.Array | jax.ShapeDtypeStruct):
        sharding = getattr(target, "sharding", None)
        return jax.device_put(array.astype(target.dtype, copy=False), sharding)
    if isinstance(target, np.ndarray):
        return np.asarray(array, dtype=target.dtype)
    if isinstance(target, np.generic):
        return array.astype(target.dtype)[()]
    if isinstance(target, bool | int | float):
        return type(target)(array.item())
    raise TypeError(f"cannot restore into the target leaf at {path}: a {type(target).__name__}. Use an array "
                    "or jax.ShapeDtypeStruct (jax.eval_shape gives one for every leaf).")


def _rebuild(entries: list[dict], leaves: list[Any]) -> Any:
    """Nested dicts and lists from the saved key paths (tuples and objects become dicts/lists)."""
    if not entries:
        return {}
    if len(entries) == 1 and not entries[0]["keys"]:
        return leaves[0]
    groups: dict[Any, tuple[str, list, list]] = {}
    for entry, leaf in zip(entries, leaves, strict=True):
        (kind, key), rest = entry["keys"][0], entry["keys"][1:]
        group = groups.setdefault(key, (kind, [], []))
        group[1].append({**entry, "keys": rest})
        group[2].append(leaf)
    children = {key: _rebuild(group_entries, group_leaves)
                for key, (_, group_entries, group_leaves) in groups.items()}
    if all(kind == "seq" for kind, _, _ in groups.values()):
        return [children[i] for i in sorted(children)]
    return children


def _mismatch_message(missing: list[str], unexpected: list[str], shapes: list[str]) -> str:
    lines = ["the restore target does not match the saved pytree:"]
    for title, paths in (("in the target but not in the checkpoint", missing),
                         ("in the checkpoint but not in the target", unexpected),
                         ("shapes differ (checkpoint vs target)", shapes)):
        if paths:
            more = f" ... and {len(paths) - _MAX_LISTED} more" if len(paths) > _MAX_LISTED else ""
            lines.append(f"  {title}: {', '.join(paths[:_MAX_LISTED])}{more}")
    lines.append("Build the target from the same model and optimizer configuration that saved it "
                 "(jax.eval_shape of the init function), or restore without a target to inspect it.")
    return "\n".join(lines)


def read_tree(directory: pathlib.Path, target: Any = None) -> Any:
    """Restore the pytree saved in `directory`, into `target`'s structure if given.

    Raises:
      StructureMismatchError: paths or shapes differ from the target (all are listed).
      CheckpointCorruptedError: a file is missing, truncated or fails its checksum.
    """
    entries = read_manifest(directory)
    if target is None:
        return _rebuild(entries, [_as_saved_kind(read_leaf(directory, e), e["kind"]) for e in entries])
    by_path = {entry["path"]: entry for entry in entries}
    leaves_with_paths, treedef = jax.tree_util.tree_flatten_with_path(target)
    paths = [jax.tree_util.keystr(key_path) for key_path, _ in leaves_with_paths]
    missing = [path for path in paths if path not in by_path]
    unexpected = [path for path in by_path if path not in set(paths)]
    shapes = [f"{path} {tuple(by_path[path]['shape'])} vs {tuple(np.shape(leaf))}"
              for path, (_, leaf) in zip(paths, leaves_with_paths, strict=True)
              if path in by_path and tuple(by_path[path]["shape"]) != tuple(np.shape(leaf))]
    if missing or unexpected or shapes:
        raise StructureMismatchError(_mismatch_message(missing, unexpected, shapes))
    restored = [_as_target(read_leaf(directory, by_path[path]), leaf, path)
                for path, (_, leaf) in zip(paths, leaves_with_paths, strict=True)]
    return jax.tree_util.tree_unflatten(treedef, restored)


def write_json(directory: pathlib.Path, text: str) -> None:
    """Write a JSON item (already serialised on the caller's thread) with its checksum."""
    directory.mkdir()
    checksum = write_file(directory / "item.json", text.encode())
    manifest = {"format": FORMAT, "json": "item.json", "crc32": checksum}
    write_file(directory / MANIFEST, json.dumps(manifest).encode())


def read_json(directory: pathlib.Path) -> Any:
    """Read a JSON item, checking its checksum.

    Raises:
      CheckpointCorruptedError: a file is missing, its manifest is not the JSON this module
        writes, or the item fails its checksum. Any other error (a permission denied, a disk
        error) is not damage to the files and is raised as it is.
    """
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
        data = (directory / manifest["json"]).read_bytes()
    except (FileNotFoundError, ValueError, KeyError, TypeError) as error:  # ValueError: not JSON or UTF-8
        raise CheckpointCorruptedError(f"{directory} is not a readable JSON item: {error}") from None
    if zlib.crc32(data) != manifest["crc32"]:
        damaged = directory / manifest["json"]
        raise CheckpointCorruptedError(f"{damaged} fails its checksum: the file is damaged.")
    return json.loads(data)
