"""Attention in plain XLA operations: the reference every other implementation is held to.

`xla_attention` is tokamax's `'xla'` implementation (`tokamax/_src/ops/attention/base.py`):
materialize the logits, mask them, softmax, weight the values. Its temporary memory is
the logits, B·N·T·S numbers, so it grows with the *square* of the sequence length;
`xla_chunked.py` computes the same thing in blocks to make it linear.

The rule, for query position t and key position s of one head (tokamax's order of steps):

    logits[t, s] = scale · q[t]·k[s] + bias[t, s]
    logits[t, s] = cap · tanh(logits[t, s] / cap)                (if logits_soft_cap)
    logits[t, s] = finfo.min  where the mask forbids (t, s)
    out[t]       = Σ_s softmax(logits[t])[s] · v[s]

The mask combines every masking option of the API: the boolean `mask`, `is_causal`
(s <= t), the per-example lengths (t < query_seq_lengths[b], s < key_value_seq_lengths[b])
and a local window (t - before <= s <= t + after). Forbidden logits are set to the
dtype's most negative *finite* number, not -inf, as tokamax does: a row with no allowed
key then gets uniform weights (the mean of the values) instead of NaN.

Layouts are tokamax's: query [*B, T, N, H], key [*B, S, K, H], value [*B, S, K, h], with
K dividing N (grouped-query attention: query heads n = k·G … k·G + G - 1 share key/value
head k). Inside, the batch dims are flattened to one and the query heads are split into
(K, G), so no key or value is ever copied G times.

Differences from tokamax: no dropout, no paged KV cache, no quantized (QArray) inputs,
no `precision` argument (XLA's default for the dtype; bfloat16 inputs accumulate in
float32, as tokamax's default does), and a local window is measured from the query's
index (tokamax measures it from the key index, which is the same when T == S).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def batch_size(shape: tuple[int, ...]) -> int:
    return math.prod(shape[:-3])


def grouped(x: jax.Array | None, batch: tuple[int, ...], num_kv_heads: int) -> jax.Array | None:
    """A bias or mask broadcastable to [*B, N, T, S], as [B or 1, K or 1, G or 1, T or 1, S or 1].

    Broadcast dims stay of size 1, so a [T, S] bias is never copied per batch or head.
    """
    if x is None:
        return None
    x = x.reshape((1,) * (len(batch) + 3 - x.ndim) + x.shape)  # to rank len(B) + 3
    *x_batch, heads, t, s = x.shape
    if all(d == 1 for d in x_batch):
        x = x.reshape(1, heads, t, s)
    else:
        x = jnp.broadcast_to(x, (*batch, heads, t, s)).reshape(-1, heads, t, s)
    if heads == 1:
        return x[:, :, None]  # [B|1, 1, 1, T|1, S|1]
    return x.reshape(x.shape[0], num_kv_heads, heads // num_kv_heads, t, s)


def allowed(q_index: jax.Array, k_index: jax.Array, mask_block: jax.Array | None, *, is_causal: bool,
            query_seq_lengths: jax.Array | None, key_value_seq_lengths: jax.Array | None,
            local_window_size: tuple[int, int] | None) -> jax.Array | None:
    """Which (query, key) pairs may attend, for query indices `q_index` [t] and keys `k_index` [s].

    Returns a boolean array broadcastable to [B, K, G, t, s], or None if everything is allowed.
    `mask_block` is the caller's boolean mask already cut to these rows and columns.
    """
    q, k = q_index[:, None], k_index[None, :]
    conditions = [] if mask_block is None else [mask_block]
    if is_causal:
        conditions.append(k <= q)
    if local_window_size is not None:
        before, after = local_window_size
        conditions.append((k >= q - before) & (k <= q + after))
    if query_seq_lengths is not None:  # [B] -> [B, 1, 1, 1, 1]
        conditions.append(q < query_seq_lengths.reshape(-1, 1, 1, 1, 1))
    if key_value_seq_lengths is not None:
        conditions.append(k < key_value_seq_lengths.reshape(-1, 1, 1, 1, 1))
    if not conditions:
        return None
    result = conditions[0]
    for condition in conditions[1:]:
        result = result & condition
    return result


def logits_of(q: jax.Array, k: jax.Array, bias: jax.Array | None, *, scale: float,
              logits_soft_cap: float | None, heads_first: bool = False) -> jax.Array:
    """scale · q·k + bias, soft-capped, in float32, as [B, K, G, t, s].

    q is [B, t, K, G, H] and k [B, s, K, H], or with `heads_first` [B, K, G, t, H] and [B, K, s, H]
    (the layout in which the product comes out as [.., t, s] with no transpose).
    """
    spec = "bkgth,bksh->bkgts" if heads_first else "btkgh,bskh->bkgts"
    logits = jnp.einsum(spec, q, k, preferred_element_type=jnp.float32)
    logits = logits * scale
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)
    if logits_soft_cap is not None:
        logits = logits_soft_cap * jnp.tanh(logits / logits_soft_cap)
    return logits


def mask_value() -> float:
    """What forbidden logits become: float32's most negative finite number (as in tokamax)."""
    return float(jnp.finfo(jnp.float32).min)


def xla_attention(query: jax.Array, key: jax.Array, value: jax.Array, bias: jax.Array | None = None,
                  mask: jax.Array | None = None, query_seq_lengths: jax.Array | None = None,
                  key_value_seq_lengths: jax.Array | None = None, *, scale: float, is_causal: bool = False,
                  local_window_size: tuple[int, int] | None = None, logits_soft_cap: float | None = None,
                  config: None = None) -> jax.Array:
    """Attention with the whole [B, N, T, S] logits in memory (tokamax's 'xla').

    Arguments are those of `stacklib.kernels.dot_product_attention`, already checked and
    canonicalized (a `scale`, a `(before, after)` window); `config` is unused (nothing to tune).

    Returns:
      [*B, T, N, h] in the query's dtype.
    """
    del config
    *batch, T, N, H = query.shape
    S, K, h = key.shape[-3], key.shape[-2], value.shape[-1]
    B, G = batch_size(query.shape), N // K
    q = query.reshape(B, T, K, G, H)  # query head n = k·G + g
    k = key.reshape(B, S, K, H)
    v = value.reshape(B, S, K, h)

    logits = logits_of(q, k, grouped(bias, tuple(batch), K), scale=scale, logits_soft_cap=logits_soft_cap)
    ok = allowed(jnp.arange(T), jnp.arange(S), grouped(mask, tuple(batch), K), is_causal=is_causal,
                 query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
                 local_window_size=local_window_size)
    if ok is not None:
        logits = jnp.where(ok, logits, mask_value())
    weights = jax.nn.softmax(logits, axis=-1)  # [B, K, G, T, S], float32
    out = jnp.einsum("bkgts,bskh->btkgh", weights, v.astype(jnp.float32))
    return out.astype(query.dtype).reshape(*batch, T, N, h)
