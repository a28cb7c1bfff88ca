"""The compiled step: one forward pass over every scheduled token, prefill chunks and decodes mixed.

The cache is a pool of blocks, two arrays `(n_layers, num_blocks, block_size, n_kv_heads,
head_dim)`. A step runs the tokens the scheduler chose, sequence after sequence, as one
ragged batch laid end to end in a single row:

    tokens, positions, slot_mapping   (1, N)   what to run, where it sits in its sequence,
                                               and the pool slot its key/value goes to
    block_tables                      (S, M)   each sequence's blocks (M = max per sequence)
    kv_lens, query_start_loc          (S,), (S + 1,)   cached positions after the step, and
                                               where each sequence's tokens start in the row

and runs chapter 12's model itself, the one forward pass, with a `llm.PagedKVCache` built
from those arrays: the model's layers write their keys and values to the pool and attend
through `stacklib.kernels.ragged_paged_attention`, whose registry picks the implementation
('xla' gathers the blocks; the Pallas kernel on a TPU looks them up block by block). A
decode is a sequence with one token, a prefill chunk one with many; the logits kept are
those at each sequence's last token. This file prepares inputs; it never re-implements a
layer.

Shapes are bucketed so XLA compiles a handful of programs once: N is padded up to a power
of two, S is always `max_num_seqs` (absent sequences have no tokens) and M the most blocks
a sequence can have. Padding tokens write into the null block 0 and are never read
unmasked. The most new tokens any sequence has, `max_query_len`, is bucketed on its own:
the Pallas kernel lays each sequence's queries out in that many rows, so a decode-only step
(one token per sequence) passes 1, not its token bucket N, and computes S rows instead of
S × N (`query_rows` counts them). `warmup()` compiles every bucket.

Mirrors vLLM's `GPUModelRunner` / TPU model runner (one flattened batch of scheduled
tokens, paddings as in `tpu_model_runner.py`). Differences: no CUDA graphs; the logits of
every token are computed and those at each sequence's end kept (vLLM computes only those rows).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import stacklib.nn as nnx
from stacklib.llm import PagedKVCache, Transformer


def _buckets(smallest: int, largest: int) -> list[int]:
    sizes, size = [], smallest
    while size < largest:
        sizes.append(size)
        size *= 2
    return sizes + [largest]


def bucket(size: int, sizes: list[int]) -> int:
    """The smallest bucket that holds `size`."""
    for candidate in sizes:
        if size <= candidate:
            return candidate
    raise ValueError(f"{size} is larger than the largest bucket {sizes[-1]}.")


@functools.partial(jax.jit, static_argnums=0, static_argnames="max_query_len", donate_argnums=(2, 3))
def paged_forward(graphdef, params, k_cache, v_cache, tokens, positions, slot_mapping, block_tables,
                  kv_lens, query_start_loc, *, max_query_len):
    """One step of chapter 12's model: the logits at each sequence's last token (S, vocab), and the pool."""
    cache = PagedKVCache(k_cache, v_cache, block_tables, slot_mapping, kv_lens, query_start_loc,
                         max_query_len)
    logits, cache = nnx.merge(graphdef, params)(tokens, positions, cache=cache)  # (1, N, vocab)
    last = jnp.maximum(query_start_loc[1:] - 1, 0)  # (S,); a sequence without tokens reads a padding row
    return logits[0, last], cache.k, cache.v


class ModelRunner:
    """Holds the model's parameters and the paged cache; runs one step of scheduled tokens.

    Args:
      model: a chapter-12 `Transformer`.
      num_blocks, block_size: the cache's size.
      max_model_len: the longest sequence (prompt + output).
      max_num_seqs: the most sequences in a step.
      max_num_batched_tokens: the most tokens in a step.
    """

    def __init__(self, model: Transformer, *, num_blocks: int, block_size: int, max_model_len: int,
                 max_num_seqs: int, max_num_batched_tokens: int):
        config = model.config
        self.graphdef, self.params = nnx.split(model, nnx.Param)
        self.block_size, self.max_model_len, self.max_num_seqs = block_size, max_model_len, max_num_seqs
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        shape = (config.n_layers, num_blocks, block_size, config.n_kv_heads, config.head_dim)
        self.k_cache, self.v_cache = jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32)
        most = min(max_num_batched_tokens, max_num_seqs * max_model_len)  # what a step can hold
        self.token_buckets = _buckets(min(4, most), most)
        self.num_steps = 0
        # Query rows the Pallas kernel computes (max_num_seqs × max_query_len per step), and what
        # they would be if every step padded its sequences' queries to the token bucket N.
        self.query_rows = {"computed": 0, "padded_to_token_bucket": 0}

    @property
    def cache_bytes(self) -> int:
        return 2 * self.k_cache.size * self.k_cache.dtype.itemsize

    def _table_row(self, block_table: list[int]) -> np.ndarray:
        row = np.zeros(self.max_blocks_per_seq, np.int32)  # the tail points at the null block
        row[: len(block_table)] = block_table
        return row

    def _slot(self, block_table: list[int], position: int) -> int:
        return block_table[position // self.block_size] * self.block_size + position % self.block_size

    def execute(self, chunks: list[tuple[list[int], int, list[int]]]) -> np.ndarray:
        """Run one step and return the logits at each chunk's last token, (len(chunks), vocab).

        Args:
          chunks: per sequence, (its new tokens, the position of the first of them, its block
            table): a decode is one token at the end of the sequence, a prefill chunk many.
        """
        if not 0 < len(chunks) <= self.max_num_seqs:
            raise ValueError(f"A step runs 1 to max_num_seqs={self.max_num_seqs} sequences, "
                             f"got {len(chunks)}.")
        N = bucket(sum(len(new) for new, _, _ in chunks), self.token_buckets)
        ids, positions, slots = (np.zeros((1, N), np.int32) for _ in range(3))  # padding -> slot 0
        tables = np.zeros((self.max_num_seqs, self.max_blocks_per_seq), np.int32)
        kv_lens = np.zeros(self.max_num_seqs, np.int32)
        starts = np.zeros(self.max_num_seqs + 1, np.int32)
        offset = 0
        for s, (new, start, table) in enumerate(chunks):
            span = slice(offset, offset + len(new))
            ids[0, span], positions[0, span] = new, np.arange(start, start + len(new))
            slots[0, span] = [self._slot(table, p) for p in range(start, start + len(new))]
            tables[s], kv_lens[s] = self._table_row(table), start + len(new)
            offset += len(new)
            starts[s + 1] = offset
        starts[len(chunks) + 1:] = offset  # absent sequences own no tokens
        max_query_len = 1 if all(len(new) == 1 for new, _, _ in chunks) else N  # decode-only: 1
        logits, self.k_cache, self.v_cache = paged_forward(
            self.graphdef, self.params, self.k_cache, self.v_cache, jnp.asarray(ids), jnp.asarray(positions),
            jnp.asarray(slots), jnp.asarray(tables), jnp.asarray(kv_lens), jnp.asarray(starts),
            max_query_len=max_query_len)
        self.num_steps += 1
        self.query_rows["computed"] += self.max_num_seqs * max_query_len
        self.query_rows["padded_to_token_bucket"] += self.max_num_seqs * N
        return np.asarray(logits)[: len(chunks)]

    def warmup(self) -> None:
        """Compile every bucket now, so that serving never waits for XLA."""
        table = [0] * self.max_blocks_per_seq  # writes land in the null block
        for N in self.token_buckets:
            lengths = [self.max_model_len] * (N // self.max_model_len) + [N % self.max_model_len]
            self.execute([([0] * n, 0, table) for n in lengths if n])
            decoding = min(N, self.max_num_seqs)  # a decode-only step of this bucket, if there is one
            if bucket(decoding, self.token_buckets) == N:
                self.execute([([0], 0, table)] * decoding)
        self.num_steps = 0
        self.query_rows = dict.fromkeys(self.query_rows, 0)
