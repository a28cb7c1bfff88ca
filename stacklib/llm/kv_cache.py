"""The key/value caches the forward pass reads and extends: contiguous (chapter 12) and paged (chapter 14).

A decoder's forward pass is the same whether it trains, pre-fills a prompt or decodes one
token; what differs is where the keys and values of earlier positions live. So the model is
written once (model.py) and a cache object owns that difference. Each layer's attention calls

    out, cache = cache.attend(layer, q, k, v, positions, attention)

which writes this call's keys and values into the cache, then attends the queries over
everything cached, and returns the output and the cache with layer `layer` updated. Two
caches implement it:

* `KVCache`, contiguous: slot j of row b is position j of sequence b, so a cache is a
  `(n_layers, batch, max_len, n_kv_heads, head_dim)` array per side, and attention is chapter
  10's `dot_product_attention` with a causal mask on positions (what `llm.generate` uses);
* `PagedKVCache`, paged as vLLM pages it: the cache is a pool of fixed-size blocks
  `(n_layers, num_blocks, block_size, n_kv_heads, head_dim)`, a sequence owns a list of
  blocks (its row of `block_tables`), new keys go to the pool slots of `slot_mapping`, and
  attention is `stacklib.kernels.ragged_paged_attention`, which reads the blocks through the
  tables (chapter 14's engine builds one per step, for a ragged batch of decodes and prompt
  chunks laid end to end).

Both are NamedTuples of arrays, so they pass through `jax.jit` and can be donated.

Mirrors how vLLM's model files take an `AttentionMetadata` (block tables, slot mapping,
sequence lengths) and leave the cache layout to an attention backend, and MaxText's
`page_state` for its paged-attention decode. Differences: one metadata object per cache kind
instead of a backend registry, and the contiguous cache stays a second kind instead of the
paged one with a single block per sequence.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

import stacklib.kernels as kernels

# attention(q, k, v, mask) -> out: the model's own choice of dot_product_attention implementation.
Attention = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


def causal_mask(q_positions: jax.Array, k_positions: jax.Array) -> jax.Array:
    """True where a query may attend to a key: the key's position is not after the query's.

    Args: q_positions (B, T), k_positions (B, S). Returns (B, T, S) booleans.
    """
    return k_positions[:, None, :] <= q_positions[:, :, None]


class KVCache(NamedTuple):
    """Keys and values of every layer for the positions seen so far, one row per sequence.

    `k[i, b, j]` holds layer i's key for sequence b at position j (slot j is position j),
    so a forward with positions p writes slots p and attends to slots <= p.
    Shapes: `(n_layers, batch, max_len, n_kv_heads, head_dim)` for both.
    """

    k: jax.Array
    v: jax.Array

    @classmethod
    def zeros(cls, config: Any, batch: int, max_len: int | None = None,
              dtype: Any = jnp.float32) -> KVCache:
        """An empty cache for `batch` sequences of up to `max_len` (default max_seq_len) tokens."""
        max_len = max_len or config.max_seq_len
        if max_len > config.max_seq_len:
            raise ValueError(
                f"A cache of max_len={max_len} exceeds the model's max_seq_len={config.max_seq_len}; "
                f"use max_len<={config.max_seq_len}."
            )
        shape = (config.n_layers, batch, max_len, config.n_kv_heads, config.head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

    def attend(self, layer: int, q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array,
               attention: Attention) -> tuple[jax.Array, KVCache]:
        """Write k, v (B, T, K, D) at `positions` (B, T) of `layer`; attend q (B, T, H, D) over the cache."""
        B, S = q.shape[0], self.k.shape[2]
        rows = jnp.arange(B)[:, None]  # (B, 1), broadcast against positions (B, T)
        cache = KVCache(self.k.at[layer, rows, positions].set(k.astype(self.k.dtype)),
                        self.v.at[layer, rows, positions].set(v.astype(self.v.dtype)))
        slots = jnp.broadcast_to(jnp.arange(S), (B, S))  # (B, S): slot j holds position j
        mask = causal_mask(positions, slots)[:, None]  # (B, 1, T, S): empty and future slots hidden
        return attention(q, cache.k[layer], cache.v[layer], mask), cache


class PagedKVCache(NamedTuple):
    """A pool of cache blocks shared by all sequences, and where this step's tokens read and write.

    The step's tokens are the new tokens of S sequences laid end to end (a ragged batch in
    one row: tokens (1, N)); sequence s owns tokens `query_start_loc[s] : query_start_loc[s + 1]`,
    which sit at the end of its first `kv_lens[s]` positions. Shapes (L layers, N tokens,
    M blocks per sequence):

        k, v             (L, num_blocks, block_size, K, D)  the pool; slot i is block i // block_size
        block_tables     (S, M)   each sequence's blocks, in order
        slot_mapping     (1, N)   the pool slot each new key/value is written to
        kv_lens          (S,)     cached positions of each sequence after this step
        query_start_loc  (S + 1,) where each sequence's tokens start in the row
        max_query_len    a static int: the most new tokens any sequence has (None: N). The
                         Pallas kernel pads every sequence's queries to it, so a decode-only
                         step passes 1 rather than its token bucket.

    Tokens past `query_start_loc[S]` are padding, written to the null block's slots and never read.
    """

    k: jax.Array
    v: jax.Array
    block_tables: jax.Array
    slot_mapping: jax.Array
    kv_lens: jax.Array
    query_start_loc: jax.Array
    max_query_len: int | None = None

    def attend(self, layer: int, q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array,
               attention: Attention) -> tuple[jax.Array, PagedKVCache]:
        """Write k, v (1, N, K, D) to `slot_mapping` of `layer`; attend q (1, N, H, D) through the tables."""
        del positions, attention  # the tables and lengths say where each key sits; the kernel registry picks
        B, T, H, D = q.shape
        L, num_blocks, block_size, K, _ = self.k.shape
        M = self.block_tables.shape[1]

        def write(pool, new):  # the pool as (L, num_blocks * block_size, K, D) slots: a free reshape
            slots = pool.reshape(L, num_blocks * block_size, K, D)
            return slots.at[layer, self.slot_mapping].set(new.astype(pool.dtype)).reshape(pool.shape)

        cache = self._replace(k=write(self.k, k), v=write(self.v, v))
        out = kernels.ragged_paged_attention(  # (B*T, H, D); padding tokens give 0
            q.reshape(B * T, H, D), cache.k[layer], cache.v[layer], self.kv_lens, self.block_tables,
            self.query_start_loc,
            max_query_len=min(self.max_query_len or T, T, M * block_size))  # no sequence has more
        return out.reshape(B, T, H, D), cache
