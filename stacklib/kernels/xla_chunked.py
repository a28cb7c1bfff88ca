"""Chunked attention in XLA: the same result as `xla_attention`, in memory linear in the sequence.

Tokamax's `'xla_chunked'` (`tokamax/_src/ops/attention/xla_chunked.py`, after Rabe & Staats,
"Self-attention does not need O(n²) memory", arXiv:2112.05682). The queries are cut
into blocks of `block_q` rows and the keys into blocks of `block_k`. For one query block
a loop walks the key blocks and keeps, per query row, a running maximum `m`, a running
denominator `l` and a running weighted sum `acc` — the *online softmax*:

    s      = logits of this (query block, key block)           [block_q, block_k]
    m_new  = max(m, max_s s)
    p      = exp(s - m_new)
    alpha  = exp(m - m_new)                                     rescales what came before
    l      = alpha · l + Σ_s p
    acc    = alpha · acc + p @ v_block
    out    = acc / l                                            after the last key block

Only one [block_q, block_k] tile of logits exists at a time, so the forward pass needs
O(block_q·block_k) temporary memory per head instead of O(T·S); the loops read the inputs
where they lie and write each query block straight into the output.

Sequences that the blocks do not divide are padded; padded keys get zero weight and
padded query rows are dropped. Masks are computed per tile from the indices (causal,
lengths, window), so — unlike tokamax, which materializes the whole boolean mask first —
a causal call stays linear too.

The gradient: each query block's loop is wrapped in `jax.checkpoint`, so the backward
pass recomputes one query block's tiles at a time instead of storing every tile of the
forward pass. It uses the same `block_q`, `block_k` as the forward by construction (it is
the transpose of the same loops): a tuned config reaches the backward pass too.

Differences from tokamax: tokamax remats each key block and so stores one carry per
(query block, key block) for the backward pass, which grows as T·S/block_k; we remat per
query block (memory linear in S). No dropout, no paged KV cache.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from stacklib.kernels.xla_attention import allowed, batch_size, grouped, logits_of, mask_value


@dataclasses.dataclass(frozen=True, order=True)
class AttentionConfig:
    """Block sizes of a blocked attention: query rows and key columns per tile."""

    block_q: int
    block_k: int

    def __post_init__(self):
        for name in ("block_q", "block_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"AttentionConfig.{name} must be a positive int, got {value!r}; "
                                 f"e.g. AttentionConfig(block_q=512, block_k=1024).")


def _pad_axis(x: jax.Array | None, axis: int, size: int, value=0) -> jax.Array | None:
    """Pad `axis` of x to `size` (axes of size 1 are broadcast and stay as they are)."""
    if x is None or x.shape[axis] in (1, size):
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


def _block(x: jax.Array | None, start: jax.Array, size: int, axis: int) -> jax.Array | None:
    if x is None or x.shape[axis] == 1:
        return x
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis)


def _varying_like(carry, *arrays):
    """`carry` marked as varying over the mesh axes any of `arrays` varies over (inside shard_map).

    A loop's carry must have the same type on the way in and out; under `shard_map` that type
    includes the axes a value differs along, and the running max/sum/output of the online softmax
    vary wherever the queries, keys or values do, while the constants they start from do not.
    """
    axes = set()
    for x in arrays:
        if x is not None:
            axes |= jax.typeof(x).manual_axis_type.varying
    if not axes:
        return carry
    return jax.tree.map(lambda c: jax.lax.pcast(c, tuple(sorted(axes)), to="varying"), carry)


def xla_chunked_attention(query: jax.Array, key: jax.Array, value: jax.Array, bias: jax.Array | None = None,
                          mask: jax.Array | None = None, query_seq_lengths: jax.Array | None = None,
                          key_value_seq_lengths: jax.Array | None = None, *, scale: float,
                          is_causal: bool = False, local_window_size: tuple[int, int] | None = None,
                          logits_soft_cap: float | None = None,
                          config: AttentionConfig = AttentionConfig(512, 1024)) -> jax.Array:
    """Attention computed tile by tile with an online softmax (tokamax's 'xla_chunked').

    Arguments are those of `stacklib.kernels.dot_product_attention`, already checked and
    canonicalized. `config` gives the tile: blocks larger than the sequence shrink to it.

    Returns:
      [*B, T, N, h] in the query's dtype; equal to `xla_attention` up to float rounding.
    """
    *batch, T, N, H = query.shape
    S, K, h = key.shape[-3], key.shape[-2], value.shape[-1]
    B, G = batch_size(query.shape), N // K
    bq, bk = min(config.block_q, T), min(config.block_k, S)
    nq, nk = -(-T // bq), -(-S // bk)
    Tp, Sp = nq * bq, nk * bk

    q = _pad_axis(query.reshape(B, T, N, H), 1, Tp)
    k = _pad_axis(key.reshape(B, S, K, H), 1, Sp)
    v = _pad_axis(value.reshape(B, S, K, h), 1, Sp)
    bias = _pad_axis(_pad_axis(grouped(bias, tuple(batch), K), 3, Tp), 4, Sp)
    mask = _pad_axis(_pad_axis(grouped(mask, tuple(batch), K), 3, Tp, True), 4, Sp, True)
    masked = dict(is_causal=is_causal, query_seq_lengths=query_seq_lengths,
                  key_value_seq_lengths=key_value_seq_lengths, local_window_size=local_window_size)

    @jax.checkpoint  # the backward pass recomputes one query block's tiles at a time
    def query_block(q_block, q_start, k, v, bias, mask):
        q_index = q_start + jnp.arange(bq)

        def key_block(j, carry):
            m, denom, acc = carry  # [B, K, G, bq], [B, K, G, bq], [B, K, G, bq, h]: heads first, so
            # that each tile's products come out of the dot as [.., rows, keys] with no transpose
            k_start = j * bk
            k_index = k_start + jnp.arange(bk)
            bias_tile = _block(_block(bias, q_start, bq, 3), k_start, bk, 4)
            k_tile = _block(k, k_start, bk, 1).transpose(0, 2, 1, 3)  # [B, K, bk, H]
            s = logits_of(q_block, k_tile, bias_tile, scale=scale,
                          logits_soft_cap=logits_soft_cap, heads_first=True)  # [B, K, G, bq, bk]
            ok = allowed(q_index, k_index, _block(_block(mask, q_start, bq, 3), k_start, bk, 4), **masked)
            if ok is not None:
                s = jnp.where(ok, s, mask_value())
            if Sp != S:  # padded keys weigh nothing (-inf, not finfo.min: they are not masked keys)
                s = jnp.where(k_index < S, s, -jnp.inf)
            m_new = jax.lax.stop_gradient(jnp.maximum(m, s.max(axis=-1)))  # out does not depend on m
            p = jnp.exp(s - m_new[..., None])
            alpha = jnp.exp(m - m_new)
            denom = alpha * denom + p.sum(axis=-1)
            v_tile = _block(v, k_start, bk, 1).transpose(0, 2, 1, 3).astype(jnp.float32)  # [B, K, bk, h]
            acc = acc * alpha[..., None] + jnp.einsum("bkgts,bksh->bkgth", p, v_tile)
            return m_new, denom, acc

        init = (jnp.full((B, K, G, bq), mask_value()), jnp.zeros((B, K, G, bq)), jnp.zeros((B, K, G, bq, h)))
        init = _varying_like(init, q_block, k, v, bias, mask)
        _, denom, acc = jax.lax.fori_loop(0, nk, key_block, init)
        return (acc / denom[..., None]).transpose(0, 3, 1, 2, 4)  # [B, bq, K, G, h]

    def step(q_start, _):
        q_block = jax.lax.dynamic_slice_in_dim(q, q_start, bq, 1).reshape(B, bq, K, G, H)  # head n = k·G + g
        q_block = q_block.transpose(0, 2, 3, 1, 4)  # [B, K, G, bq, H]
        return q_start + bq, query_block(q_block, q_start, k, v, bias, mask)

    _, out = jax.lax.scan(step, 0, length=nq)  # [nq, B, bq, K, G, h]
    out = jnp.moveaxis(out, 0, 1).reshape(B, Tp, N, h)
    if Tp != T:
        out = out[:, :T]
    return out.astype(query.dtype).reshape(*batch, T, N, h)
