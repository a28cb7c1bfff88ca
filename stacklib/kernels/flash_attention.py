"""Flash attention in Pallas: forward with an online softmax, backward through `jax.custom_vjp`.

Attention is `softmax(q k^T * scale + mask) v`. Written plainly it materialises the [T, S]
logits for every head, which is O(T*S) memory traffic and storage. Flash attention never
does: the grid walks a query block (`block_q` rows) against one key/value block (`block_k`
rows) at a time and keeps, per query row, a running maximum `m`, a running denominator `l`
and a running weighted sum `acc` in VMEM scratch (the *online softmax*):

    s      = q_i k_j^T * scale                   (masked entries -inf)
    m_new  = max(m, rowmax(s))
    alpha  = exp(m - m_new)                      (rescales what was summed so far)
    p      = exp(s - m_new)
    l      = alpha * l + rowsum(p)
    acc    = alpha * acc + p v_j
    out    = acc / l,  lse = m + log(l)          (after the last key block)

Causal attention skips every key block that lies wholly above the diagonal (`pl.when`), and
its index map repeats the last useful block for those steps so that no DMA is issued for
them. Grouped-query attention (N query heads sharing K key/value heads, N % K == 0) needs no
copy of the keys: the key/value index map sends query head n to key head n // (N // K).

The backward pass (FlashAttention-2) recomputes `p = exp(s - lse)` block by block from the
saved log-sum-exp, with `D = rowsum(dO * O)`:

    dv_j += p^T dO_i          dp = dO_i v_j^T        ds = p * (dp - D)
    dq_i += ds k_j * scale    dk_j += ds^T q_i * scale

in two kernels: one over (query block, key blocks) accumulating dq, one over (key block,
the group's query heads, query blocks) accumulating dk and dv, so that GQA's sum over the
heads of a group happens in scratch. Both use the same `block_q`/`block_k` as the forward.

Masking and padding: T and S are padded up to the blocks; key positions at or beyond the
key length (S, or `key_value_seq_lengths[b]`) are masked, so padding never leaks in. A
query row that sees no key at all (a zero length) gets output 0 and `lse = +inf`, which
makes its recomputed `p` exactly 0 in the backward pass: no NaN anywhere.

Layout follows tokamax / `jax.nn.dot_product_attention`: query [B, T, N, H], key and value
[B, S, K, H]. Inside, heads move in front of the sequence ([B, N, T, H]) so that a block is
a (rows, H) matrix, the shape TPU vector units and the MXU work on.

Differences from `jax.experimental.pallas.ops.tpu.flash_attention`: tokamax's layout and
GQA by index map (the reference wants [B, N, T, H] and equal head counts), exact division
and f32 logits at HIGHEST precision (the reference trades accuracy for speed), fully masked
rows give 0, and one kernel per block pair without the reference's major/minor blocking.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from stacklib.kernels.backend import check_block, check_dtype, pallas_call, resolve_interpret, round_up

DEFAULT_BLOCK_Q = 128
DEFAULT_BLOCK_K = 128
SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16)

_HIGHEST = lax.Precision.HIGHEST
_NT = (((1,), (1,)), ((), ()))  # contract the last axes: a @ b.T
_TN = (((0,), (0,)), ((), ()))  # contract the first axes: a.T @ b
_NN = (((1,), (0,)), ((), ()))  # a @ b


def _dot(a, b, dims):
    return lax.dot_general(a, b, dims, precision=_HIGHEST, preferred_element_type=jnp.float32)


@dataclasses.dataclass(frozen=True)
class _Config:
    """Everything static about one call; the same object reaches forward and backward."""

    is_causal: bool
    scale: float
    block_q: int
    block_k: int
    groups: int  # N // K: query heads per key/value head
    interpret: Any


def _mask(config: _Config, q_start, k_start, kv_len):
    """True where query row may attend to key column, for the (block_q, block_k) tile."""
    shape = (config.block_q, config.block_k)
    cols = k_start + lax.broadcasted_iota(jnp.int32, shape, 1)
    mask = cols < kv_len
    if config.is_causal:
        rows = q_start + lax.broadcasted_iota(jnp.int32, shape, 0)
        mask = mask & (cols <= rows)
    return mask


def _block_is_live(config: _Config, q_start, k_start, kv_len):
    """False when the whole (query block, key block) tile is masked: skip its work."""
    live = k_start < kv_len
    if config.is_causal:
        live = live & (k_start <= q_start + config.block_q - 1)
    return live


def _last_key_block(config: _Config, i, j):
    """Causal index map: blocks past the diagonal re-use the last live one (no new DMA)."""
    if not config.is_causal:
        return j
    return jnp.minimum(j, (i * config.block_q + config.block_q - 1) // config.block_k)


def _first_query_block(config: _Config, j, i):
    """Causal index map for the dk/dv kernel: query blocks before the diagonal re-use the first live one."""
    if not config.is_causal:
        return i
    return jnp.maximum(i, (j * config.block_k) // config.block_q)


# ----------------------------------------------------------------------------- forward


def _forward_kernel(lengths_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, m_scratch, l_scratch, acc_scratch,
                    *, config: _Config):
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    q_start, k_start, kv_len = i * config.block_q, j * config.block_k, lengths_ref[b]

    @pl.when(j == 0)
    def _init():
        m_scratch[...] = jnp.full_like(m_scratch, -jnp.inf)
        l_scratch[...] = jnp.zeros_like(l_scratch)
        acc_scratch[...] = jnp.zeros_like(acc_scratch)

    @pl.when(_block_is_live(config, q_start, k_start, kv_len))
    def _step():
        s = _dot(q_ref[...], k_ref[...], _NT) * config.scale  # (block_q, block_k)
        mask = _mask(config, q_start, k_start, kv_len)
        s = jnp.where(mask, s, -jnp.inf)
        m_prev = m_scratch[...]  # (block_q, 1)
        m_new = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a row with nothing seen yet
        alpha = jnp.exp(m_prev - m_safe)
        p = jnp.exp(s - m_safe)  # masked entries: exp(-inf) = 0
        l_scratch[...] = alpha * l_scratch[...] + p.sum(axis=1, keepdims=True)
        v = v_ref[...]
        acc_scratch[...] = alpha * acc_scratch[...] + _dot(p.astype(v.dtype), v, _NN)
        m_scratch[...] = m_new

    @pl.when(j == pl.num_programs(3) - 1)
    def _finalize():
        seen = l_scratch[...] > 0  # False for a row that saw no key: output 0, lse +inf
        denominator = jnp.where(seen, l_scratch[...], 1.0)
        o_ref[...] = jnp.where(seen, acc_scratch[...] / denominator, 0.0).astype(o_ref.dtype)
        lse_ref[...] = jnp.where(seen, m_scratch[...] + jnp.log(denominator), jnp.inf)


def _forward(config: _Config, lengths, q, k, v):
    """q [B, N, Tp, H], k/v [B, K, Sp, H] (padded) -> out [B, N, Tp, H], lse [B, N, Tp, 1]."""
    B, N, Tp, H = q.shape
    Sp = k.shape[2]
    bq, bk, G = config.block_q, config.block_k, config.groups
    q_spec = pl.BlockSpec((None, None, bq, H), lambda b, n, i, j: (b, n, i, 0))
    kv_spec = pl.BlockSpec((None, None, bk, H),
                           lambda b, n, i, j: (b, n // G, _last_key_block(config, i, j), 0))  # GQA: n // G
    row_spec = pl.BlockSpec((None, None, bq, 1), lambda b, n, i, j: (b, n, i, 0))
    return pallas_call(
        functools.partial(_forward_kernel, config=config),
        name="flash_attention_fwd",
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((B, N, Tp, 1), jnp.float32)],
        grid=(B, N, Tp // bq, Sp // bk),
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), q_spec, kv_spec, kv_spec],
        out_specs=[q_spec, row_spec],
        scratch_shapes=[pltpu.VMEM((bq, 1), jnp.float32), pltpu.VMEM((bq, 1), jnp.float32),
                        pltpu.VMEM((bq, H), jnp.float32)],
        dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
        interpret=config.interpret,
    )(lengths, q, k, v)


# ----------------------------------------------------------------------------- backward


def _probabilities(config: _Config, q, k, lse, q_start, k_start, kv_len):
    """Recompute the tile's softmax probabilities from the saved log-sum-exp."""
    s = _dot(q, k, _NT) * config.scale
    return jnp.where(_mask(config, q_start, k_start, kv_len), jnp.exp(s - lse), 0.0)


def _dq_kernel(lengths_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, d_ref, dq_ref, dq_scratch,
               *, config: _Config):
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    q_start, k_start, kv_len = i * config.block_q, j * config.block_k, lengths_ref[b]

    @pl.when(j == 0)
    def _init():
        dq_scratch[...] = jnp.zeros_like(dq_scratch)

    @pl.when(_block_is_live(config, q_start, k_start, kv_len))
    def _step():
        k = k_ref[...]
        p = _probabilities(config, q_ref[...], k, lse_ref[...], q_start, k_start, kv_len)
        dp = _dot(do_ref[...], v_ref[...], _NT)  # (block_q, block_k)
        ds = p * (dp - d_ref[...])
        dq_scratch[...] += _dot(ds.astype(k.dtype), k, _NN) * config.scale

    @pl.when(j == pl.num_programs(3) - 1)
    def _finalize():
        dq_ref[...] = dq_scratch[...].astype(dq_ref.dtype)


def _dkv_kernel(lengths_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, d_ref, dk_ref, dv_ref,
                dk_scratch, dv_scratch, *, config: _Config):
    b, j, g, i = pl.program_id(0), pl.program_id(2), pl.program_id(3), pl.program_id(4)
    q_start, k_start, kv_len = i * config.block_q, j * config.block_k, lengths_ref[b]

    @pl.when((g == 0) & (i == 0))
    def _init():
        dk_scratch[...] = jnp.zeros_like(dk_scratch)
        dv_scratch[...] = jnp.zeros_like(dv_scratch)

    @pl.when(_block_is_live(config, q_start, k_start, kv_len))
    def _step():
        q, do = q_ref[...], do_ref[...]
        p = _probabilities(config, q, k_ref[...], lse_ref[...], q_start, k_start, kv_len)
        dv_scratch[...] += _dot(p.astype(do.dtype), do, _TN)  # (block_k, H)
        dp = _dot(do, v_ref[...], _NT)
        ds = p * (dp - d_ref[...])
        dk_scratch[...] += _dot(ds.astype(q.dtype), q, _TN) * config.scale

    @pl.when((g == pl.num_programs(3) - 1) & (i == pl.num_programs(4) - 1))
    def _finalize():
        dk_ref[...] = dk_scratch[...].astype(dk_ref.dtype)
        dv_ref[...] = dv_scratch[...].astype(dv_ref.dtype)


def _backward(config: _Config, residuals, d_out):
    lengths, q, k, v, out, lse = residuals
    B, N, Tp, H = q.shape
    K, Sp = k.shape[1], k.shape[2]
    bq, bk, G = config.block_q, config.block_k, config.groups
    # D = rowsum(dO * O): one number per query row, cheap in XLA.
    d = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1, keepdims=True)
    smem = pl.BlockSpec(memory_space=pltpu.SMEM)

    # dq: grid over (b, n, query block i, key block j); j is the reduction axis.
    q_spec = pl.BlockSpec((None, None, bq, H), lambda b, n, i, j: (b, n, i, 0))
    row_spec = pl.BlockSpec((None, None, bq, 1), lambda b, n, i, j: (b, n, i, 0))
    kv_spec = pl.BlockSpec((None, None, bk, H),
                           lambda b, n, i, j: (b, n // G, _last_key_block(config, i, j), 0))
    dq = pallas_call(
        functools.partial(_dq_kernel, config=config),
        name="flash_attention_dq",
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid=(B, N, Tp // bq, Sp // bk),
        in_specs=[smem, q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec],
        out_specs=q_spec,
        scratch_shapes=[pltpu.VMEM((bq, H), jnp.float32)],
        dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
        interpret=config.interpret,
    )(lengths, q, k, v, d_out, lse, d)

    # dk, dv: grid over (b, key head h, key block j, group member g, query block i);
    # (g, i) are reduction axes, so the sum over the group's query heads stays in scratch.
    def q_index(b, h, j, g, i):
        return (b, h * G + g, _first_query_block(config, j, i), 0)

    q_spec = pl.BlockSpec((None, None, bq, H), q_index)
    row_spec = pl.BlockSpec((None, None, bq, 1), q_index)
    kv_spec = pl.BlockSpec((None, None, bk, H), lambda b, h, j, g, i: (b, h, j, 0))
    dk, dv = pallas_call(
        functools.partial(_dkv_kernel, config=config),
        name="flash_attention_dkv",
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        grid=(B, K, Sp // bk, G, Tp // bq),
        in_specs=[smem, q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec],
        out_specs=[kv_spec, kv_spec],
        scratch_shapes=[pltpu.VMEM((bk, H), jnp.float32), pltpu.VMEM((bk, H), jnp.float32)],
        dimension_semantics=("parallel", "parallel", "parallel", "arbitrary", "arbitrary"),
        interpret=config.interpret,
    )(lengths, q, k, v, d_out, lse, d)
    return None, dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(config: _Config, lengths, q, k, v):
    return _forward(config, lengths, q, k, v)[0]


def _flash_fwd(config: _Config, lengths, q, k, v):
    out, lse = _forward(config, lengths, q, k, v)
    return out, (lengths, q, k, v, out, lse)


_flash.defvjp(_flash_fwd, _backward)


# ----------------------------------------------------------------------------- public API


def _check_inputs(query, key, value, key_value_seq_lengths):
    for name, x in (("query", query), ("key", key), ("value", value)):
        if getattr(x, "ndim", None) != 4:
            raise ValueError(
                f"{name} must have rank 4 ([batch, seq, heads, head_dim]), got shape "
                f"{getattr(x, 'shape', None)}. Add the missing axes, e.g. {name}[None] for one batch."
            )
        check_dtype(name, x, SUPPORTED_DTYPES)
    B, T, N, H = query.shape
    if key.shape != value.shape:
        raise ValueError(
            f"key and value must have the same shape, got key {key.shape} and value {value.shape}."
        )
    Bk, S, K, Hk = key.shape
    if Bk != B or Hk != H:
        raise ValueError(
            f"query {query.shape} and key {key.shape} must agree on batch (axis 0) and head_dim "
            f"(axis 3). Reshape them to [B, T, N, H] and [B, S, K, H]."
        )
    if N % K:
        raise ValueError(
            f"query has {N} heads and key/value have {K}: the query heads must be a multiple of "
            f"the key/value heads (grouped-query attention). Use K in "
            f"{[k for k in range(1, N + 1) if N % k == 0]}."
        )
    if not (query.dtype == key.dtype == value.dtype):
        raise ValueError(
            f"query, key and value must share a dtype, got {query.dtype}, {key.dtype}, {value.dtype}. "
            "Cast them to one."
        )
    if key_value_seq_lengths is not None:
        lengths = jnp.asarray(key_value_seq_lengths)
        if lengths.shape != (B,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
            raise ValueError(
                f"key_value_seq_lengths must be an integer array of shape ({B},) (one length per "
                f"batch row), got shape {lengths.shape} and dtype {lengths.dtype}."
            )


def flash_attention(query: jax.Array, key: jax.Array, value: jax.Array, *, is_causal: bool = False,
                    scale: float | None = None, key_value_seq_lengths: jax.Array | None = None,
                    block_q: int = DEFAULT_BLOCK_Q, block_k: int = DEFAULT_BLOCK_K,
                    interpret: Any = None) -> jax.Array:
    """Multi-head (and grouped-query) attention as Pallas kernels, differentiable.

    Args:
      query: [B, T, N, H], float32 or bfloat16 (accumulation is always float32).
      key, value: [B, S, K, H], the same dtype, with N % K == 0.
      is_causal: mask key j for query i when j > i (top-left aligned, as in
        `jax.nn.dot_product_attention`).
      scale: multiplies the logits; default 1 / sqrt(H).
      key_value_seq_lengths: optional int [B]: keys at or beyond this length are masked. A
        row with no visible key returns 0.
      block_q, block_k: rows of query / key per grid step, multiples of 8; a block larger than
        the (8-rounded) sequence shrinks to it. The same sizes tile the backward kernels.
      interpret: None (decide from `stacklib.hw`), True, False or `pltpu.InterpretParams()`.

    Returns:
      [B, T, N, H] in the dtype of `query`.

    Raises:
      ValueError: wrong ranks, mismatched shapes, N % K != 0, bad block sizes or lengths.
      TypeError: a bad `interpret`.
    """
    _check_inputs(query, key, value, key_value_seq_lengths)
    B, T, N, H = query.shape
    _, S, K, _ = key.shape
    bq = min(check_block("block_q", block_q), round_up(T, 8))
    bk = min(check_block("block_k", block_k), round_up(S, 8))
    if scale is None:
        scale = 1.0 / math.sqrt(H)
    config = _Config(bool(is_causal), float(scale), bq, bk, N // K, resolve_interpret(interpret))
    if key_value_seq_lengths is None:
        lengths = jnp.full((B,), S, jnp.int32)
    else:
        lengths = jnp.clip(jnp.asarray(key_value_seq_lengths, jnp.int32), 0, S)
    Tp, Sp = round_up(T, bq), round_up(S, bk)

    def heads_first(x, length, padded):  # [B, L, heads, H] -> [B, heads, L_padded, H]
        return jnp.pad(x.transpose(0, 2, 1, 3), ((0, 0), (0, 0), (0, padded - length), (0, 0)))

    q, k, v = heads_first(query, T, Tp), heads_first(key, S, Sp), heads_first(value, S, Sp)
    out = _flash(config, lengths, q, k, v)
    return out[:, :, :T].transpose(0, 2, 1, 3)  # [B, N, T, H] -> [B, T, N, H]


def reference_attention(query: jax.Array, key: jax.Array, value: jax.Array, *, is_causal: bool = False,
                        scale: float | None = None,
                        key_value_seq_lengths: jax.Array | None = None) -> jax.Array:
    """Plain attention with `jnp.einsum` at HIGHEST precision in float32: what the kernel must equal.

    Same arguments and layout as `flash_attention`; fully masked rows give 0.
    """
    B, T, N, H = query.shape
    _, S, K, _ = key.shape
    scale = 1.0 / math.sqrt(H) if scale is None else scale
    q = query.astype(jnp.float32).reshape(B, T, K, N // K, H)  # query head n = k * G + g
    logits = jnp.einsum("btkgh,bskh->bkgts", q, key.astype(jnp.float32), precision=_HIGHEST) * scale
    mask = jnp.ones((B, 1, 1, T, S), bool)
    if key_value_seq_lengths is not None:
        mask = mask & (jnp.arange(S) < jnp.asarray(key_value_seq_lengths)[:, None, None, None, None])
    if is_causal:
        mask = mask & (jnp.arange(S)[None, :] <= jnp.arange(T)[:, None])
    logits = jnp.where(mask, logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    p = jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0))
    denominator = p.sum(axis=-1, keepdims=True)
    weights = p / jnp.where(denominator > 0, denominator, 1.0)  # a fully masked row: weights 0
    out = jnp.einsum("bkgts,bskh->btkgh", weights, value.astype(jnp.float32), precision=_HIGHEST)
    return out.reshape(B, T, N, H).astype(query.dtype)  # (K, G) -> N, as in the kernel
