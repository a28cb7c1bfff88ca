"""Training text that needs no download: the Python standard library's own source.

Every machine that runs Python has ~12 MB of well-written Python under
`sysconfig.get_paths()["stdlib"]`. The pipeline, built with `stacklib.data` (chapter 04):

1. a deterministic file list: every `.py` file under the stdlib directory, sorted by
   relative path, without tests and installed packages (`corpus_files`);
2. a held-out split *by file*, decided by a hash of each path (`split_files`): a file is
   all train or all held-out, so the held-out loss measures text the model never saw,
   and adding a file to the library never moves another one across the split;
3. packing: the files' bytes, joined with an end-of-document byte, cut into records of
   `seq_len + 1` tokens (inputs are the first `seq_len`, targets the last `seq_len`),
   each record starting where the previous one's inputs ended (`PackedSequences`);
4. a global shuffle of the records, reshuffled each epoch, batched; the iterator's
   `get_state()` is a small dict saved with every checkpoint (`train_dataset`).

Mirrors a Grain pipeline as MaxText builds one (`MapDataset.source(...).shuffle(seed)
.repeat().batch(...)`); MaxText packs documents with `grain`'s packing transformations
and segment ids, which we leave out (documents share a sequence, see model.py).

Several processes (multihost.py): each reads only its own share of every global batch,
as grain's `ShardOptions` / `ds[shard_index::shard_count]` do for MaxText. The slice is
taken over *per-process batches* of the globally shuffled records, so process p's step-s
rows are rows p*b..(p+1)*b-1 of the one-process run's step-s batch (b = batch_size / P):
the global batch, its row order and the iterator state (`next_index` = steps taken) are
the same whatever the number of processes.

Differences from MaxText's input pipeline: the corpus is fixed (no TFDS/ArrayRecord
files), packing concatenates documents into one stream instead of first-fit bins, and
every process reads the (small) corpus itself; only the records it batches differ.
"""

from __future__ import annotations

import functools
import os
import pathlib
import sysconfig
import zlib

import numpy as np

import stacklib.data as grain
from stacklib.llm.config import Config
from stacklib.llm.tokenizer import ByteTokenizer

_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})


def stdlib_root() -> pathlib.Path:
    """The directory of the running Python's standard library."""
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


@functools.lru_cache(maxsize=4)
def corpus_files(root: str | os.PathLike | None = None) -> tuple[str, ...]:
    """Every `.py` file under `root` (default: the stdlib), as sorted relative paths.

    Test suites and installed packages are skipped: they are not the library's source,
    and site-packages differs from one machine to the next.
    """
    root = pathlib.Path(root) if root is not None else stdlib_root()
    found = []
    for directory, subdirectories, files in os.walk(root):
        subdirectories[:] = sorted(d for d in subdirectories if d not in _SKIP_DIRS)
        relative = pathlib.Path(directory).relative_to(root)
        found += [(relative / name).as_posix() for name in files if name.endswith(".py")]
    if not found:
        raise FileNotFoundError(f"No .py files under {root}; pass a Python standard library directory.")
    return tuple(sorted(found))


def is_heldout(path: str, heldout_percent: int) -> bool:
    """Whether `path` belongs to the held-out split: a hash of the path, not its position."""
    return zlib.crc32(path.encode("utf-8")) % 100 < heldout_percent


def split_files(files, heldout_percent: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(train, heldout) file lists; each keeps the sorted order."""
    heldout = tuple(f for f in files if is_heldout(f, heldout_percent))
    train = tuple(f for f in files if not is_heldout(f, heldout_percent))
    return train, heldout


@functools.lru_cache(maxsize=4)
def token_stream(files: tuple[str, ...], root: str | None = None, max_bytes: int = 0) -> np.ndarray:
    """The files' bytes, each followed by `eos_id`, as one uint8 array (the packed stream).

    Stops after the file that takes the stream past `max_bytes` (0: read every file).
    """
    base = pathlib.Path(root) if root is not None else stdlib_root()
    eos = bytes([ByteTokenizer.eos_id])
    chunks, total = [], 0
    for name in files:
        data = (base / name).read_bytes().replace(eos, b"") + eos  # a stray NUL would fake a boundary
        chunks.append(data)
        total += len(data)
        if max_bytes and total >= max_bytes:
            break
    return np.frombuffer(b"".join(chunks), dtype=np.uint8)


class PackedSequences:
    """Random access to the records of a token stream: record i is `stream[i*L : i*L + L + 1]`.

    Consecutive records overlap by one token, so every token of the stream is a target
    exactly once (the last input of record i predicts the first token of record i + 1).
    A `stacklib.data` source: `__len__` and `__getitem__`.
    """

    def __init__(self, stream: np.ndarray, seq_len: int):
        if len(stream) < seq_len + 1:
            raise ValueError(
                f"The corpus has {len(stream)} tokens, fewer than one sequence of seq_len+1="
                f"{seq_len + 1}. Read more files (max_corpus_bytes=0) or lower seq_len."
            )
        self.stream, self.seq_len = stream, seq_len

    def __len__(self) -> int:
        return (len(self.stream) - 1) // self.seq_len

    def __getitem__(self, index: int) -> np.ndarray:
        if not 0 <= index < len(self):
            raise IndexError(f"record {index} of {len(self)}")
        start = index * self.seq_len
        return self.stream[start:start + self.seq_len + 1].astype(np.int32)  # (seq_len + 1,)


def streams(config: Config, root: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(train, heldout) token streams of the corpus, as the config splits and limits it."""
    train_files, heldout_files = split_files(corpus_files(root), config.heldout_percent)
    limit = config.max_corpus_bytes
    return (token_stream(train_files, root, limit),
            token_stream(heldout_files, root, limit * config.heldout_percent // 100 if limit else 0))


def train_dataset(config: Config, root: str | None = None, *, shard_index: int = 0,
                  shard_count: int = 1) -> grain.IterDataset:
    """Shuffled batches of (batch_size / shard_count, seq_len + 1) token records, forever.

    With `shard_count` processes, process `shard_index` gets its rows of each global
    batch (see the module docstring); the defaults give the whole batch. Iterate it and
    save `iterator.get_state()` with the model; `set_state` resumes at the same batch.

    Raises:
      ValueError: `batch_size` does not divide over `shard_count` processes.
    """
    if config.batch_size % shard_count or not 0 <= shard_index < shard_count:
        raise ValueError(
            f"batch_size={config.batch_size} must split evenly over {shard_count} processes "
            f"(and shard_index={shard_index} be below that); make batch_size a multiple of {shard_count}."
        )
    records = PackedSequences(streams(config, root)[0], config.seq_len)
    dataset = (grain.MapDataset.source(records).shuffle(seed=config.data_seed).repeat()
               .batch(config.batch_size // shard_count, drop_remainder=True))
    if shard_count > 1:
        dataset = dataset[shard_index::shard_count]  # grain's ShardOptions, at batch granularity
    # No read-ahead threads: batches are tiny slices, and threads cost more than they save
    # on a 2-core machine (PITFALLS.md).
    return dataset.to_iter_dataset(grain.ReadOptions(num_threads=0))


def heldout_batches(config: Config, root: str | None = None) -> list[np.ndarray]:
    """`eval_batches` fixed batches of held-out records, spread over the held-out files."""
    records = PackedSequences(streams(config, root)[1], config.seq_len)
    count = min(config.eval_batches * config.batch_size, len(records))
    if count < config.batch_size:
        raise ValueError(
            f"The held-out files give {len(records)} sequences, fewer than one batch of "
            f"{config.batch_size}. Raise heldout_percent or max_corpus_bytes, or lower batch_size."
        )
    picked = grain.MapDataset.source(records).shuffle(seed=12345)  # a fixed sample, the same every run
    batches = picked.batch(config.batch_size, drop_remainder=True)
    return [batches[i] for i in range(count // config.batch_size)]
