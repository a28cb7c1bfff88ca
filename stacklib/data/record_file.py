"""Records on disk with random access: `write_record_file` and `RecordFileDataSource`.

Plays the part of grain's `ArrayRecordDataSource`: a source whose records live in files
and are read one at a time by index, which is what a global shuffle needs. A sequential
format (one record after another, like TFRecord) can only be read from the start, so
"record 7,351,204" means reading the seven million before it.

The format is the smallest one that allows random access:

    b"STKRECS1"                       8 bytes of magic
    record 0 | record 1 | ...         the raw bytes, back to back
    offsets                           (n + 1) little-endian uint64: record i is bytes
                                      offsets[i]:offsets[i + 1] of the file
    n, offsets_position               two little-endian uint64
    b"STKRECS1"                       the magic again, so a truncated file is detected

Reading record i is one `os.pread` of its offset pair and one of its bytes. `pread`
takes the position as an argument, so threads can share one open file without a lock.

Differences from grain's `ArrayRecordDataSource`: our own format, not ArrayRecord (no
chunks, no compression, no checksums); records are `bytes`, decoded by a `map`.
"""

from __future__ import annotations

import os
import pathlib
import struct
import threading
from collections.abc import Iterable, Sequence

import numpy as np

MAGIC = b"STKRECS1"
_FOOTER = struct.Struct("<QQ8s")  # record count, position of the offsets, magic


def write_record_file(path: str | os.PathLike, records: Iterable[bytes]) -> int:
    """Write `records` (each a bytes-like object) to a new record file at `path`.

    Returns:
      The number of records written.

    Raises:
      TypeError: a record is not bytes-like (the message gives its index).
    """
    offsets = [len(MAGIC)]
    with open(path, "wb") as file:
        file.write(MAGIC)
        for index, record in enumerate(records):
            if not isinstance(record, bytes | bytearray | memoryview):
                raise TypeError(f"write_record_file: record {index} is a {type(record).__name__}, not bytes. "
                                "Serialise it first, e.g. with array.tobytes() or json.dumps(x).encode().")
            file.write(record)
            offsets.append(offsets[-1] + len(record))
        file.write(np.asarray(offsets, dtype="<u8").tobytes())
        file.write(_FOOTER.pack(len(offsets) - 1, offsets[-1], MAGIC))
    return len(offsets) - 1


class RecordFileDataSource:
    """Random access to the records of one or more record files, as if concatenated.

    Args:
      paths: a path or a list of paths of files written by `write_record_file`.

    Raises:
      ValueError: a file is not a record file, or is truncated (the message names it).
    """

    def __init__(self, paths: str | os.PathLike | Sequence[str | os.PathLike]):
        if isinstance(paths, str | os.PathLike):
            paths = [paths]
        self._paths = [str(pathlib.Path(p)) for p in paths]
        self._offsets = [self._read_offsets(p) for p in self._paths]
        self._starts = np.cumsum([0] + [len(o) - 1 for o in self._offsets])  # first index of each file
        self._descriptors: list[int] | None = None  # opened on first read, in the process that reads
        self._lock = threading.Lock()

    @staticmethod
    def _read_offsets(path: str) -> np.ndarray:
        size = os.path.getsize(path)
        with open(path, "rb") as file:
            head = file.read(len(MAGIC))
            if size < len(MAGIC) + _FOOTER.size or head != MAGIC:
                raise ValueError(f"{path} is not a record file (no {MAGIC!r} header); "
                                 "write one with stacklib.data.write_record_file.")
            file.seek(size - _FOOTER.size)
            count, position, magic = _FOOTER.unpack(file.read(_FOOTER.size))
            if magic != MAGIC or position + 8 * (count + 1) + _FOOTER.size != size:
                raise ValueError(f"{path} is truncated or damaged: its footer does not match its size.")
            file.seek(position)
            return np.frombuffer(file.read(8 * (count + 1)), dtype="<u8").astype(np.int64)

    def __len__(self) -> int:
        return int(self._starts[-1])

    def _descriptor(self, file_index: int) -> int:
        if self._descriptors is None:
            with self._lock:  # reader threads may get here together; open the files once
                if self._descriptors is None:
                    self._descriptors = [os.open(path, os.O_RDONLY) for path in self._paths]
        return self._descriptors[file_index]

    def __getitem__(self, index: int) -> bytes:
        if not 0 <= index < len(self):
            raise IndexError(f"record {index} is out of range for {len(self)} records in {self._paths}.")
        file_index = int(np.searchsorted(self._starts, index, side="right")) - 1
        offsets = self._offsets[file_index]
        local = index - int(self._starts[file_index])
        start, stop = int(offsets[local]), int(offsets[local + 1])
        return os.pread(self._descriptor(file_index), stop - start, start)

    def __getstate__(self) -> dict:
        # Descriptors and locks mean nothing in another process: a worker reopens the files.
        return {key: value for key, value in self.__dict__.items() if key not in ("_descriptors", "_lock")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _descriptors=None, _lock=threading.Lock())

    def __del__(self):
        for descriptor in getattr(self, "_descriptors", None) or ():
            os.close(descriptor)

    def __repr__(self) -> str:
        return f"RecordFileDataSource({len(self)} records in {len(self._paths)} file(s))"
