"""The compiled steps: prefill and decode over a paged KV cache, in fixed shape buckets.

The cache is a pool of blocks, two arrays `(n_layers, num_blocks, block_size, n_kv_heads,
head_dim)`. A step receives, per sequence:

    tokens, positions      (B, T)  what to run, where it sits in its sequence
    slot_mapping           (B, T)  the pool slot each new key/value is written to
    block_tables           (B, M)  each sequence's blocks (M = max blocks per sequence)

and runs chapter 12's model itself, the one forward pass, with a `llm.PagedKVCache` built
from those arrays: the model's layers write their keys and values to the pool and attend
through `stacklib.kernels.ragged_paged_attention`, whose registry picks the implementation
('xla' gathers the blocks; the Pallas kernel on a TPU looks them up block by block). This
file prepares inputs; it never re-implements a layer.

Shapes are bucketed so XLA compiles a handful of programs once: prefill pads T up to a
power of two (B = 1: one prompt per call), decode pads B up to a power of two (T = 1),
and M is always the most blocks a sequence can have. Padding tokens write into the
null block 0 and are never read unmasked. `warmup()` compiles every bucket.

Mirrors vLLM's `GPUModelRunner` / TPU model runner (paddings as in `tpu_model_runner.py`).
Differences: prefill and decode are separate calls (vLLM v1 mixes them in one batch and
chunks long prompts); no CUDA graphs; the logits of every position are computed and those
at `last_index` kept (vLLM computes only those rows).
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


@functools.partial(jax.jit, static_argnums=0, donate_argnums=(2, 3))
def paged_forward(graphdef, params, k_cache, v_cache, tokens, positions, slot_mapping, block_tables,
                  last_index):
    """One step of chapter 12's model: logits at `last_index` of each row (B, vocab), and the new pool."""
    B = tokens.shape[0]
    cache = PagedKVCache.for_step(k_cache, v_cache, positions, slot_mapping, block_tables, last_index)
    logits, cache = nnx.merge(graphdef, params)(tokens, positions, cache=cache)  # (B, T, vocab)
    return logits[jnp.arange(B), last_index], cache.k, cache.v


class ModelRunner:
    """Holds the model's parameters and the paged cache; runs prefill and decode steps.

    Args:
      model: a chapter-12 `Transformer`.
      num_blocks, block_size: the cache's size.
      max_model_len: the longest sequence (prompt + output).
      max_num_seqs: the largest decode batch.
    """

    def __init__(self, model: Transformer, *, num_blocks: int, block_size: int, max_model_len: int,
                 max_num_seqs: int):
        config = model.config
        self.graphdef, self.params = nnx.split(model, nnx.Param)
        self.block_size, self.max_model_len = block_size, max_model_len
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        shape = (config.n_layers, num_blocks, block_size, config.n_kv_heads, config.head_dim)
        self.k_cache, self.v_cache = jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32)
        self.prefill_buckets = _buckets(min(16, max_model_len), max_model_len)
        self.decode_buckets = _buckets(1, max_num_seqs)
        self.num_calls = {"prefill": 0, "decode": 0}

    @property
    def cache_bytes(self) -> int:
        return 2 * self.k_cache.size * self.k_cache.dtype.itemsize

    def _run(self, tokens, positions, slot_mapping, block_tables, last_index) -> np.ndarray:
        logits, self.k_cache, self.v_cache = paged_forward(
            self.graphdef, self.params, self.k_cache, self.v_cache, jnp.asarray(tokens),
            jnp.asarray(positions), jnp.asarray(slot_mapping), jnp.asarray(block_tables),
            jnp.asarray(last_index))
        return np.asarray(logits)

    def _table_row(self, block_table: list[int]) -> np.ndarray:
        row = np.zeros(self.max_blocks_per_seq, np.int32)  # the tail points at the null block
        row[: len(block_table)] = block_table
        return row

    def _slot(self, block_table: list[int], position: int) -> int:
        return block_table[position // self.block_size] * self.block_size + position % self.block_size

    def prefill(self, tokens: list[int], start: int, block_table: list[int]) -> np.ndarray:
        """Run `tokens[start:]` (the first `start` are cached) and return the last logits (vocab,)."""
        new = tokens[start:]
        T = bucket(len(new), self.prefill_buckets)
        ids, positions, slots = (np.zeros((1, T), np.int32) for _ in range(3))  # padding -> slot 0
        ids[0, : len(new)] = new
        positions[0, : len(new)] = np.arange(start, len(tokens))
        slots[0, : len(new)] = [self._slot(block_table, p) for p in range(start, len(tokens))]
        self.num_calls["prefill"] += 1
        logits = self._run(ids, positions, slots, self._table_row(block_table)[None],
                           np.array([len(new) - 1], np.int32))
        return logits[0]

    def decode(self, last_tokens: list[int], positions: list[int],
               block_tables: list[list[int]]) -> np.ndarray:
        """One new token per sequence: logits (len(last_tokens), vocab)."""
        n = len(last_tokens)
        B = bucket(n, self.decode_buckets)
        ids, pos, slots = (np.zeros((B, 1), np.int32) for _ in range(3))
        tables = np.zeros((B, self.max_blocks_per_seq), np.int32)
        rows = zip(last_tokens, positions, block_tables, strict=True)
        for row, (token, position, table) in enumerate(rows):
            ids[row, 0], pos[row, 0] = token, position
            slots[row, 0] = self._slot(table, position)
            tables[row] = self._table_row(table)
        self.num_calls["decode"] += 1
        return self._run(ids, pos, slots, tables, np.zeros(B, np.int32))[:n]

    def warmup(self) -> None:
        """Compile every bucket now, so that serving never waits for XLA."""
        table = [0] * self.max_blocks_per_seq  # writes land in the null block
        for T in self.prefill_buckets:
            self.prefill([0] * T, 0, table)
        for B in self.decode_buckets:
            self.decode([0] * B, [0] * B, [table] * B)
        self.num_calls = {"prefill": 0, "decode": 0}
