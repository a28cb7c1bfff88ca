"""Ragged paged attention: a batch of sequences' new query tokens against a paged KV cache.

An inference engine runs one step for many sequences at once. Each sequence s brings
`q_len[s]` new query tokens (1 when decoding, more when a prompt is prefilled in chunks,
0 for a padding slot) and has `kv_len[s]` keys and values in the cache, the new ones
included. The query tokens of all sequences are concatenated along one token axis (the
batch is *ragged*); `query_start_loc` holds the cumulative offsets, so sequence s owns
tokens `query_start_loc[s] : query_start_loc[s + 1]`. The cache is *paged*: a pool of
`num_blocks` blocks of `block_size` token slots, and sequence s's position p lives in slot
`p % block_size` of block `block_tables[s, p // block_size]`. Causality is aligned to the
end of the sequence: query i of sequence s sits at position `kv_len[s] - q_len[s] + i`
and attends to the positions at or before it:

    out[t] = softmax_p(scale · q[t] · k[s, p] over p <= pos(t)) · v[s, p]

Two implementations of the same contract:

* `paged_attention_xla` gives every query token its sequence's blocks, gathered through
  the block table into a contiguous (max_blocks * block_size, K, D) view, and runs masked
  softmax attention in f32 at HIGHEST precision. Vectorised, static shapes, and its cost
  follows the step's tokens, however they split into decodes and prefill chunks.
* `paged_attention_pallas` never materialises that view. Its grid is (sequence, kv block
  of that sequence). The block tables, kv lengths and query lengths are *scalar
  prefetch* operands (`pltpu.PrefetchScalarGridSpec`): they sit in SMEM before the grid
  starts, and the key/value BlockSpec's index map reads them to name the *physical*
  block to copy into VMEM for step (s, j), `block_tables[s, j]`. An online softmax keeps
  the running max `m`, denominator `l` and weighted sum `acc` of every (kv head, query
  row) in VMEM scratch across the sequence's blocks; blocks at or past `kv_len[s]` do no
  work, and their index map repeats the last live block so that no new copy is issued.

Both are forward only (this is an inference op; there is no `custom_vjp`). Query rows
that see no key (padding tokens past `query_start_loc[S]`, rows of a q_len-0 sequence)
give 0.

Mirrors the contract of `jax.experimental.pallas.ops.tpu.ragged_paged_attention` (vLLM
TPU / tpu-inference): queries [tokens, heads, head_dim], `kv_lens`, `page_indices` (our
`block_tables`), `cu_q_lens` (our `query_start_loc`, vLLM's name), causal from the end.

Differences from the real kernel: separate key and value caches in the engine's layout
(the real one interleaves K and V heads in one `kv_pages` array); every sequence in the
arrays is processed (no `num_seqs` scalar: pad with q_len-0 sequences instead); the Pallas
grid walks (sequence, one block) with the copies left to BlockSpecs, where the real kernel
walks (head block, block of concatenated query tokens), copies several pages per step with
hand-written double-buffered DMAs and loops over the sequences that a query block
touches; our queries are regrouped per sequence (padded to `max_query_len`) in XLA
before the kernel. No sliding window, soft cap, or quantized (fp8/int8) cache.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from stacklib.kernels.backend import resolve_interpret, tpu_params

_HIGHEST = lax.Precision.HIGHEST
_NT = (((1,), (1,)), ((), ()))  # a @ b.T
_NN = (((1,), (0,)), ((), ()))  # a @ b


def _dot(a, b, dims):
    return lax.dot_general(a, b, dims, precision=_HIGHEST, preferred_element_type=jnp.float32)


# ----------------------------------------------------------------------------- ragged <-> per sequence


def _per_sequence(queries, query_start_loc, max_query_len):
    """(T, H, D) ragged tokens -> (S, max_query_len, H, D), zero rows past each sequence's q_len."""
    T = queries.shape[0]
    starts, q_lens = query_start_loc[:-1], jnp.diff(query_start_loc)  # (S,), (S,)
    i = jnp.arange(max_query_len)
    tokens = starts[:, None] + i  # (S, max_q): the token each padded row reads
    valid = i < q_lens[:, None]
    padded = queries[jnp.clip(tokens, 0, T - 1)]  # (S, max_q, H, D)
    return jnp.where(valid[:, :, None, None], padded, 0)


def _ragged(per_sequence, query_start_loc, num_tokens):
    """(S, max_q, H, D) per sequence -> (T, H, D) ragged tokens; tokens no sequence owns get 0."""
    S, max_q = per_sequence.shape[:2]
    t = jnp.arange(num_tokens)
    seq = jnp.searchsorted(query_start_loc[1:], t, side="right")  # (T,): the sequence owning token t
    owned = seq < S
    seq = jnp.minimum(seq, S - 1)
    row = jnp.clip(t - query_start_loc[seq], 0, max_q - 1)  # (T,): its row within the sequence
    out = per_sequence[seq, row]  # (T, H, D)
    return jnp.where(owned[:, None, None], out, 0)


# ----------------------------------------------------------------------------- XLA


@functools.partial(jax.jit, static_argnames=("scale", "max_query_len", "config"))
def paged_attention_xla(queries: jax.Array, key_cache: jax.Array, value_cache: jax.Array,
                        kv_lens: jax.Array, block_tables: jax.Array, query_start_loc: jax.Array, *,
                        scale: float, max_query_len: int, config: Any = None) -> jax.Array:
    """Each query token gathers its sequence's blocks and attends to them, masked: no padding per sequence.

    Shapes as in `stacklib.kernels.ragged_paged_attention`. Working token by token keeps the
    cost proportional to the step's tokens whatever mix of decodes and prefill chunks they are
    (a per-sequence layout would pad every decode to the longest chunk). `max_query_len` and
    `config` are unused (the Pallas kernel's bound, and the registry's hook for tunable
    implementations).
    """
    del max_query_len, config
    T, H, D = queries.shape
    _, block_size, K, _ = key_cache.shape
    S, M = block_tables.shape
    G, L = H // K, M * block_size
    t = jnp.arange(T)
    seq = jnp.searchsorted(query_start_loc[1:], t, side="right")  # (T,): the sequence owning token t
    owned = seq < S  # tokens past query_start_loc[S] are padding
    seq = jnp.minimum(seq, S - 1)
    q_lens = jnp.diff(query_start_loc)  # (S,)
    position = kv_lens[seq] - q_lens[seq] + t - query_start_loc[seq]  # (T,): aligned to the sequence's end
    keys = key_cache[block_tables[seq]].reshape(T, L, K, D)  # (T, M, bs, K, D) -> (T, L, K, D)
    values = value_cache[block_tables[seq]].reshape(T, L, K, D)
    q = queries.astype(jnp.float32).reshape(T, K, G, D)  # query head n = k * G + g
    logits = jnp.einsum("tkgd,tlkd->tkgl", q, keys.astype(jnp.float32), precision=_HIGHEST) * scale
    p = jnp.arange(L)
    mask = (p <= position[:, None]) & (p < kv_lens[seq][:, None]) & owned[:, None]  # (T, L)
    logits = jnp.where(mask[:, None, None], logits, -jnp.inf)
    m = logits.max(axis=-1, keepdims=True)
    e = jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0))
    denominator = e.sum(axis=-1, keepdims=True)
    weights = e / jnp.where(denominator > 0, denominator, 1.0)  # a row that sees nothing: weights 0
    out = jnp.einsum("tkgl,tlkd->tkgd", weights, values.astype(jnp.float32), precision=_HIGHEST)
    return out.reshape(T, H, D).astype(queries.dtype)  # (K, G) -> H


# ----------------------------------------------------------------------------- Pallas


def _kernel(kv_lens_ref, tables_ref, q_lens_ref, q_ref, k_ref, v_ref, o_ref, m_scratch, l_scratch,
            acc_scratch, *, scale: float, block_size: int, groups: int):
    """One grid step (s, j): sequence s's query rows (all heads) against its j-th block."""
    s, j = pl.program_id(0), pl.program_id(1)
    kv_len, q_len = kv_lens_ref[s], q_lens_ref[s]
    K, R, _ = q_ref.shape  # R = max_query_len * groups rows per kv head, row r = query (r // G), head g

    @pl.when(j == 0)
    def _init():
        m_scratch[...] = jnp.full_like(m_scratch, -jnp.inf)
        l_scratch[...] = jnp.zeros_like(l_scratch)
        acc_scratch[...] = jnp.zeros_like(acc_scratch)

    @pl.when((j * block_size < kv_len) & (q_len > 0))  # a block past the sequence's end does nothing
    def _step():
        query = lax.broadcasted_iota(jnp.int32, (R, block_size), 0) // groups
        col = j * block_size + lax.broadcasted_iota(jnp.int32, (R, block_size), 1)
        mask = (col <= kv_len - q_len + query) & (col < kv_len) & (query < q_len)
        for h in range(K):  # static: each kv head with its group of query heads
            logits = _dot(q_ref[h], k_ref[:, h, :], _NT) * scale  # (R, D) x (bs, D)^T -> (R, bs)
            logits = jnp.where(mask, logits, -jnp.inf)
            m_prev = m_scratch[h]  # (R, 1)
            m_new = jnp.maximum(m_prev, logits.max(axis=1, keepdims=True))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a row with nothing seen yet
            alpha = jnp.exp(m_prev - m_safe)
            p = jnp.exp(logits - m_safe)
            l_scratch[h] = alpha * l_scratch[h] + p.sum(axis=1, keepdims=True)
            v = v_ref[:, h, :]  # (bs, D)
            acc_scratch[h] = alpha * acc_scratch[h] + _dot(p.astype(v.dtype), v, _NN)
            m_scratch[h] = m_new

    @pl.when(j == pl.num_programs(1) - 1)
    def _finalize():
        seen = l_scratch[...] > 0  # False for a row that saw no key: output 0
        o_ref[...] = jnp.where(seen, acc_scratch[...] / jnp.where(seen, l_scratch[...], 1.0),
                               0.0).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "max_query_len", "config", "interpret"))
def paged_attention_pallas(queries: jax.Array, key_cache: jax.Array, value_cache: jax.Array,
                           kv_lens: jax.Array, block_tables: jax.Array, query_start_loc: jax.Array, *,
                           scale: float, max_query_len: int, config: Any = None,
                           interpret: Any = None) -> jax.Array:
    """The TPU-style Pallas kernel: grid (sequence, kv block), block tables as scalar prefetch.

    Shapes as in `stacklib.kernels.ragged_paged_attention`. `interpret`: None (native on
    TPU, the generic interpreter elsewhere), True, False or `pltpu.InterpretParams()`.
    """
    del config
    T, H, D = queries.shape
    _, block_size, K, _ = key_cache.shape
    S, M = block_tables.shape
    G = H // K
    R = max_query_len * G
    q_lens = jnp.diff(query_start_loc).astype(jnp.int32)
    kv_lens = kv_lens.astype(jnp.int32)
    tables = block_tables.astype(jnp.int32).reshape(S * M)  # 1-D: SMEM pads a 2-D array's rows
    q = _per_sequence(queries, query_start_loc, max_query_len)  # (S, max_q, H, D)
    q = q.reshape(S, max_query_len, K, G, D).transpose(0, 2, 1, 3, 4).reshape(S, K, R, D)  # rows (i, g)

    def kv_index(s, j, kv_lens_ref, tables_ref, q_lens_ref):
        # The physical block for step (s, j); past the end, repeat the last live block (no new copy).
        last = jnp.maximum(kv_lens_ref[s] - 1, 0) // block_size
        return tables_ref[s * M + jnp.minimum(j, last)], 0, 0, 0

    q_spec = pl.BlockSpec((None, K, R, D), lambda s, j, *_: (s, 0, 0, 0))
    kv_spec = pl.BlockSpec((None, block_size, K, D), kv_index)
    out = pl.pallas_call(
        functools.partial(_kernel, scale=scale, block_size=block_size, groups=G),
        out_shape=jax.ShapeDtypeStruct((S, K, R, D), queries.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3, grid=(S, M), in_specs=[q_spec, kv_spec, kv_spec], out_specs=q_spec,
            scratch_shapes=[pltpu.VMEM((K, R, 1), jnp.float32), pltpu.VMEM((K, R, 1), jnp.float32),
                            pltpu.VMEM((K, R, D), jnp.float32)]),
        compiler_params=tpu_params("parallel", "arbitrary"),
        interpret=resolve_interpret(interpret),
        name="ragged_paged_attention",
    )(kv_lens, tables, q_lens, q, key_cache, value_cache)
    out = out.reshape(S, K, max_query_len, G, D).transpose(0, 2, 1, 3, 4).reshape(S, max_query_len, H, D)
    return _ragged(out, query_start_loc, T)
