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
  tables (chapter 14's engine builds one per step).

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
    """A pool of cache blocks shared by all sequences, and where this step's rows read and write.

    Shapes (L layers, N blocks of `block_size` slots, B rows of T tokens, M blocks per row):

        k, v             (L, N, block_size, K, D)  the pool; slot s is block s // block_size
        block_tables     (B, M)   the blocks of each row's sequence, in order
        slot_mapping     (B, T)   the pool slot each new key/value is written to
        kv_lens          (B,)     cached positions of each row after this step
        query_start_loc  (B + 1,) row b's real tokens, flattened: [start[b], start[b + 1])

    Row b's real tokens are its first `start[b + 1] - start[b]`; the rest is padding, written
    to the null block's slots and never read.
    """

    k: jax.Array
    v: jax.Array
    block_tables: jax.Array
    slot_mapping: jax.Array
    kv_lens: jax.Array
    query_start_loc: jax.Array

    @classmethod
    def for_step(cls, k: jax.Array, v: jax.Array, positions: jax.Array, slot_mapping: jax.Array,
                 block_tables: jax.Array, last_index: jax.Array) -> PagedKVCache:
        """The cache for one engine step whose row b has real tokens 0..last_index[b].

        Flattened, the real tokens are contiguous when B == 1 (a prefill) or T == 1 (a decode
        batch), the two steps chapter 14's engine runs.
        """
        B, T = positions.shape
        if B != 1 and T != 1:
            raise ValueError(f"A paged step is one prompt (B = 1) or a decode batch (T = 1), got (B, T) = "
                             f"{(B, T)}: flattened, other rows' padding would sit between real tokens.")
        q_lens = last_index + 1  # (B,)
        query_start_loc = jnp.concatenate([jnp.zeros(1, q_lens.dtype), jnp.cumsum(q_lens)])  # (B + 1,)
        kv_lens = positions[jnp.arange(B), last_index] + 1  # (B,): this step's keys included
        return cls(k, v, block_tables, slot_mapping, kv_lens, query_start_loc)

    def attend(self, layer: int, q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array,
               attention: Attention) -> tuple[jax.Array, PagedKVCache]:
        """Write k, v (B, T, K, D) to `slot_mapping` of `layer`; attend q (B, T, H, D) through the tables."""
        del positions, attention  # the tables and lengths say where each key sits; the kernel registry picks
        B, T, H, D = q.shape
        L, N, block_size, K, _ = self.k.shape

        def write(pool, new):  # the pool as (L, N * block_size, K, D) slots: a free reshape
            slots = pool.reshape(L, N * block_size, K, D)
            return slots.at[layer, self.slot_mapping].set(new.astype(pool.dtype)).reshape(pool.shape)

        cache = self._replace(k=write(self.k, k), v=write(self.v, v))
        out = kernels.ragged_paged_attention(  # (B*T, H, D); padding tokens give 0
            q.reshape(B * T, H, D), cache.k[layer], cache.v[layer], self.kv_lens, self.block_tables,
            self.query_start_loc, max_query_len=T)
        return out.reshape(B, T, H, D), cache
