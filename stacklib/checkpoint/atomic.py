"""Making a checkpoint appear all at once: write aside, fsync, rename.

A checkpoint is many files. A crash (a killed job, a preempted VM, a full disk) can
stop the writer between any two bytes, so a reader must never see a half-written
step. The protocol, which orbax also follows on local file systems:

1. write everything into a temporary directory next to the final one
   (`7.partial-1a2b3c4d`), which no reader looks at;
2. `fsync` every file and then the directories, so the data and the names are on the
   disk, not only in the operating system's page cache (this matters for power loss
   and kernel crashes; a killed process loses nothing the kernel already has);
3. `rename` the temporary directory to its final name (`7`). On POSIX file systems a
   rename within one file system is atomic: other processes see either no `7` or
   the complete one. Then fsync the parent, so the rename itself is durable.

Deleting an old step runs the same way backwards: rename `3` to `3.deleting-...`
(atomic, so the step disappears at once), then remove the files. A crash in the middle
leaves a `.partial-` or `.deleting-` directory behind, which is never mistaken for a
step and is removed by `cleanup_temporary_directories`.

A damaged step is not deleted but set aside: `quarantine` renames `3` to
`3.damaged-...`, which is never listed as a step (so the step number can be saved
again) and which nothing here ever removes: a person decides, after looking at it.

Differences from orbax: orbax's local protocol is the same rename (its temporary
directories end in `.orbax-checkpoint-tmp-<n>`, and it writes a `commit_success.txt`
on file systems without atomic rename, such as GCS); we only do the local one.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import uuid

PARTIAL = ".partial-"
DELETING = ".deleting-"
DAMAGED = ".damaged-"


def fsync_directory(path: pathlib.Path) -> None:
    """Make the directory's entries (file names, renames) durable."""
    descriptor = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def temporary_directory(final: pathlib.Path) -> pathlib.Path:
    """A fresh name beside `final` to write into: `<final>.partial-<random>` (not created)."""
    return final.with_name(f"{final.name}{PARTIAL}{uuid.uuid4().hex[:8]}")


def commit(temporary: pathlib.Path, final: pathlib.Path) -> None:
    """Atomically publish `temporary` (whose files are already fsynced) as `final`.

    Raises:
      FileExistsError: `final` exists already; a step is never overwritten.
    """
    for directory, _, _ in os.walk(temporary, topdown=False):  # children first, then the top
        fsync_directory(pathlib.Path(directory))
    if final.exists():
        raise FileExistsError(f"{final} already exists; a checkpoint step is never overwritten.")
    os.rename(temporary, final)
    fsync_directory(final.parent)


def remove(final: pathlib.Path) -> None:
    """Delete a committed directory so that it disappears at once, then free its files."""
    doomed = final.with_name(f"{final.name}{DELETING}{uuid.uuid4().hex[:8]}")
    os.rename(final, doomed)
    fsync_directory(final.parent)
    shutil.rmtree(doomed)


def quarantine(final: pathlib.Path) -> pathlib.Path:
    """Rename a damaged committed directory out of the way; return its new name, `<name>.damaged-<random>`.

    Nothing is deleted: the files stay for a person to inspect (which bytes went wrong,
    and why) and to delete. The new name is not a step number, so no manager lists it, and
    it is not temporary, so `cleanup_temporary_directories` leaves it alone.
    """
    aside = final.with_name(f"{final.name}{DAMAGED}{uuid.uuid4().hex[:8]}")
    os.rename(final, aside)
    fsync_directory(final.parent)
    return aside


def is_temporary(path: pathlib.Path) -> bool:
    return PARTIAL in path.name or DELETING in path.name


def cleanup_temporary_directories(root: pathlib.Path) -> list[pathlib.Path]:
    """Remove what interrupted saves and deletions left behind; return what was removed."""
    leftovers = [path for path in root.iterdir() if path.is_dir() and is_temporary(path)]
    for path in leftovers:
        shutil.rmtree(path, ignore_errors=True)
    return leftovers
