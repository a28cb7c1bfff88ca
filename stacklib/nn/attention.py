"""Multi-head dot-product attention, with an optional causal mask.

Mirrors `flax.nnx.MultiHeadAttention`, `nnx.dot_product_attention` and
`nnx.make_causal_mask` (flax/nnx/nn/attention.py, flax 0.12.8), with flax's weight
layout so that parity tests copy weights key by key:

    query/key/value.kernel   (in_features, num_heads, head_dim)   LinearGeneral
    out.kernel               (num_heads, head_dim, out_features)  LinearGeneral over 2 axes

For each head h, with q, k, v of shape (length, head_dim):

    attention(q, k, v) = softmax(q k^T / sqrt(head_dim) + mask) v

where the mask puts -inf (in practice the dtype's most negative number) on the pairs
that may not attend; `is_causal=True` forbids attending to later positions, which is
what a language model needs.

Differences from flax.nnx:
- No autoregressive cache: `decode=True` raises NotImplementedError (chapter 14 builds
  a KV cache). flax 0.12.8's default `decode=None` raises at call time unless
  `decode=False` is passed; here None means False.
- No `normalize_qk`, `sow_weights`, `bias`, `*_dot_general`, `*_promote_dtype`, or
  sharding arguments; `attention_fn` must be `dot_product_attention`-compatible.
- `dot_product_attention` is written out in jnp (flax calls `jax.nn.dot_product_attention`
  when there is no dropout); results agree to float32 rounding.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from stacklib.nn import initializers
from stacklib.nn.linear import LinearGeneral, default_kernel_init, promote_dtype
from stacklib.nn.module import Module
from stacklib.nn.rngs import Rngs, RngStream


def make_causal_mask(x: jax.Array, dtype: Any = jnp.bool_) -> jax.Array:
    """A `(batch..., 1, length, length)` mask that is True where query i may see key j <= i."""
    idxs = jnp.broadcast_to(jnp.arange(x.shape[-1], dtype=jnp.int32), x.shape)
    mask = idxs[..., :, None] >= idxs[..., None, :]  # (batch..., length, length)
    return jnp.expand_dims(mask, axis=-3).astype(dtype)


def dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    mask: jax.Array | None = None,
    dropout_rng: jax.Array | None = None,
    dropout_rate: float = 0.0,
    broadcast_dropout: bool = True,
    deterministic: bool = False,
    dtype: Any | None = None,
    precision: Any = None,
    is_causal: bool = False,
) -> jax.Array:
    """Attention over `(batch..., length, heads, head_dim)` arrays; returns the same shape as query.

    Key/value may have fewer heads than the query (grouped-query attention): each
    key/value head then serves `heads_q / heads_kv` query heads.

    Args:
      query: `(batch..., q_length, num_heads, head_dim)`.
      key, value: `(batch..., kv_length, num_kv_heads, head_dim)`.
      mask: boolean, broadcastable to `(batch..., num_heads, q_length, kv_length)`; False masks.
      dropout_rng, dropout_rate, broadcast_dropout, deterministic: dropout on the weights.
      dtype: computation dtype (None: promote the inputs).
      precision: of the two einsums.
      is_causal: also mask keys after each query position.

    Returns:
      `(batch..., q_length, num_heads, head_dim)`.
    """
    query, key, value = promote_dtype((query, key, value), dtype)
    dtype = query.dtype
    heads_q, heads_kv = query.shape[-2], key.shape[-2]
    if heads_q != heads_kv:
        if heads_q % heads_kv:
            raise ValueError(f"query heads ({heads_q}) must be a multiple of key/value heads ({heads_kv}).")
        key = jnp.repeat(key, heads_q // heads_kv, axis=-2)  # (..., kv_length, heads_q, head_dim)
        value = jnp.repeat(value, heads_q // heads_kv, axis=-2)
    query = query / jnp.sqrt(query.shape[-1]).astype(dtype)
    weights = jnp.einsum("...qhd,...khd->...hqk", query, key, precision=precision)  # (..., heads, q, k)
    if is_causal:
        q_len, k_len = weights.shape[-2:]
        causal = jnp.tril(jnp.ones((q_len, k_len), dtype=jnp.bool_))
        mask = causal if mask is None else jnp.logical_and(mask, causal)
    if mask is not None:
        weights = jnp.where(mask, weights, jnp.finfo(dtype).min)
    weights = jax.nn.softmax(weights).astype(dtype)
    if not deterministic and dropout_rate > 0.0:
        keep_prob = 1.0 - dropout_rate
        # Broadcast dropout shares one mask across batch and heads: shape (1, ..., 1, q, k).
        shape = (1,) * (weights.ndim - 2) + weights.shape[-2:] if broadcast_dropout else weights.shape
        keep = jax.random.bernoulli(dropout_rng, keep_prob, shape)
        weights = weights * (keep.astype(dtype) / jnp.asarray(keep_prob, dtype=dtype))
    return jnp.einsum("...hqk,...khd->...qhd", weights, value, precision=precision)  # (..., q, heads, d)


class MultiHeadAttention(Module):
    """Multi-head attention: project to heads, attend, project back.

    Args:
      num_heads: number of attention heads.
      in_features: size of the inputs' last axis.
      qkv_features: total size of the query/key/value projections (default: in_features);
        must be divisible by `num_heads`.
      out_features: size of the output's last axis (default: in_features).
      num_kv_heads: key/value heads for grouped-query attention (default: num_heads).
      in_kv_features: size of the key/value inputs' last axis (default: in_features).
      dropout_rate: dropout on the attention weights.
      deterministic: turn that dropout off (can be overridden per call).
      decode: must be None or False here (no KV cache).
      rngs: keys for the initializers, and the dropout stream if `dropout_rate > 0`.
      (dtype, param_dtype, broadcast_dropout, precision, kernel_init, out_kernel_init,
      bias_init, out_bias_init, use_bias, attention_fn, normalize_qk, keep_rngs: as in flax)

    Raises:
      ValueError: `qkv_features` is not divisible by `num_heads`, or `num_heads` by
        `num_kv_heads`.
      NotImplementedError: `decode=True` or `normalize_qk=True`.
    """

    def __init__(
        self,
        num_heads: int,
        in_features: int,
        qkv_features: int | None = None,
        out_features: int | None = None,
        num_kv_heads: int | None = None,
        in_kv_features: int | None = None,
        *,
        dtype: Any | None = None,
        param_dtype: Any = jnp.float32,
        broadcast_dropout: bool = True,
        dropout_rate: float = 0.0,
        deterministic: bool | None = None,
        precision: Any = None,
        kernel_init: initializers.Initializer = default_kernel_init,
        out_kernel_init: initializers.Initializer | None = None,
        bias_init: initializers.Initializer = initializers.zeros,
        out_bias_init: initializers.Initializer | None = None,
        use_bias: bool = True,
        attention_fn: Callable[..., jax.Array] = dot_product_attention,
        decode: bool | None = None,
        normalize_qk: bool = False,
        rngs: Rngs,
        keep_rngs: bool = True,
    ):
        if decode or normalize_qk:
            raise NotImplementedError(
                "stacklib.nn.MultiHeadAttention has no decode cache or QK normalization; "
                "use flax.nnx.MultiHeadAttention for decode=True or normalize_qk=True."
            )
        self.num_heads = num_heads
        self.in_features = in_features
        self.qkv_features = qkv_features if qkv_features is not None else in_features
        self.out_features = out_features if out_features is not None else in_features
        self.in_kv_features = in_kv_features if in_kv_features is not None else in_features
        self.num_kv_heads = num_kv_heads if num_kv_heads is not None else num_heads
        if self.qkv_features % num_heads:
            raise ValueError(
                f"qkv_features ({self.qkv_features}) must be divisible by num_heads ({num_heads})."
            )
        if num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({num_heads}) must be divisible by num_kv_heads ({self.num_kv_heads})."
            )
        self.head_dim = self.qkv_features // num_heads
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.broadcast_dropout = broadcast_dropout
        self.dropout_rate = dropout_rate
        self.deterministic = deterministic
        self.precision = precision
        self.use_bias = use_bias
        self.attention_fn = attention_fn
        self.decode = decode
        self.normalize_qk = normalize_qk

        def projection(in_features, out_features, axis=-1, kernel_init=kernel_init, bias_init=bias_init):
            return LinearGeneral(
                in_features, out_features, axis=axis, use_bias=use_bias, dtype=dtype,
                param_dtype=param_dtype, kernel_init=kernel_init, bias_init=bias_init,
                precision=precision, rngs=rngs,
            )

        # The order of construction fixes which keys each kernel gets: query, key, value, out.
        self.query = projection(in_features, (num_heads, self.head_dim))
        self.key = projection(self.in_kv_features, (self.num_kv_heads, self.head_dim))
        self.value = projection(self.in_kv_features, (self.num_kv_heads, self.head_dim))
        self.out = projection(
            (num_heads, self.head_dim), self.out_features, axis=(-2, -1),
            kernel_init=out_kernel_init or kernel_init, bias_init=out_bias_init or bias_init,
        )
        self.rngs = rngs.dropout.fork() if keep_rngs and dropout_rate > 0 else None

    def __call__(
        self,
        inputs_q: jax.Array,
        inputs_k: jax.Array | None = None,
        inputs_v: jax.Array | None = None,
        *,
        mask: jax.Array | None = None,
        deterministic: bool | None = None,
        rngs: Rngs | RngStream | None = None,
        decode: bool | None = None,
        is_causal: bool = False,
    ) -> jax.Array:
        """Attend from `inputs_q` to `inputs_k`/`inputs_v` (self-attention if they are None).

        Args:
          inputs_q: `(batch..., length, in_features)`.
          inputs_k, inputs_v: `(batch..., kv_length, in_kv_features)`; default: inputs_q.
          mask: boolean, broadcastable to `(batch..., num_heads, length, kv_length)`.
          deterministic: override the constructor's setting for attention dropout.
          rngs: a stream for attention dropout, overriding the layer's own.
          decode: must be None or False.
          is_causal: each position attends only to itself and earlier positions.

        Returns:
          `(batch..., length, out_features)`.

        Raises:
          ValueError: `inputs_q`'s last axis is not `in_features` long, or dropout is on
            without a random stream.
        """
        if decode:
            raise NotImplementedError("stacklib.nn.MultiHeadAttention has no decode cache.")
        if inputs_k is None:
            if inputs_v is not None:
                raise ValueError("inputs_v was given without inputs_k; pass inputs_k as well.")
            inputs_k = inputs_q
        if inputs_v is None:
            inputs_v = inputs_k
        if inputs_q.shape[-1] != self.in_features:
            raise ValueError(
                f"MultiHeadAttention(in_features={self.in_features}) expects inputs_q of shape "
                f"(..., length, {self.in_features}), got shape {inputs_q.shape}."
            )
        query = self.query(inputs_q)  # (batch..., length, num_heads, head_dim)
        key = self.key(inputs_k)  # (batch..., kv_length, num_kv_heads, head_dim)
        value = self.value(inputs_v)
        dropout_rng = None
        if self.dropout_rate > 0.0:
            deterministic = deterministic if deterministic is not None else self.deterministic
            if deterministic is None:
                raise ValueError("Pass deterministic=True/False: attention dropout is configured.")
            if not deterministic:
                stream = rngs.dropout if isinstance(rngs, Rngs) else (rngs or self.rngs)
                if stream is None:
                    raise ValueError("Attention dropout is on but there is no stream: pass rngs=...")
                dropout_rng = stream()
        else:
            deterministic = True
        x = self.attention_fn(
            query, key, value, mask=mask, dropout_rng=dropout_rng, dropout_rate=self.dropout_rate,
            broadcast_dropout=self.broadcast_dropout, deterministic=deterministic, dtype=self.dtype,
            precision=self.precision, is_causal=is_causal,
        )
        return self.out(x)  # (batch..., length, out_features)
