"""Autoregressive generation, with and without a KV cache.

A language model gives a distribution over the next token; generating text is asking
it again and again, each time with the token just chosen appended. Two ways:

* **recompute** (`use_cache=False`): run the whole sequence through the model for every
  new token. Simple and obviously right, and O(T^2) work per token for attention plus
  O(T) for everything else: the reference.
* **KV cache** (`use_cache=True`): a token's keys and values never change once computed
  (attention is causal), so keep them. A *prefill* runs the prompt once and fills the
  cache; each *decode* step runs one token, writes its keys/values and attends to the
  cache. Same logits (to float32 rounding), a fraction of the work. This is the
  reference chapter 14's inference engine is tested against.

Both paths compile once: the recompute path runs a fixed-length buffer (future slots
are invisible to a causal model) and the cached path has one prefill and one decode
shape. Token t is chosen with `jax.random.fold_in(key, t)`, so both paths draw the same
sample from the same logits.

Mirrors the `generate` loop of nanoGPT (recompute) and the prefill/decode split of
MaxText's `maxengine.py` and vLLM. Differences: every prompt in a batch has the same
length (chapter 14 handles ragged batches); no top-k/top-p; no stop tokens.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import stacklib.nn as nnx
from stacklib.llm.kv_cache import KVCache
from stacklib.llm.model import Transformer


@functools.partial(jax.jit, static_argnums=0)
def _logits(graphdef, params, tokens):
    return nnx.merge(graphdef, params)(tokens)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=4)
def _logits_cached(graphdef, params, tokens, positions, cache):
    return nnx.merge(graphdef, params)(tokens, positions, cache=cache)


@jax.jit
def _sample(logits, key, temperature):
    return jax.random.categorical(key, logits / temperature, axis=-1).astype(jnp.int32)


def _choose(logits: jax.Array, t: int, temperature: float, key: jax.Array | None) -> jax.Array:
    """The token at position t from `logits` (B, vocab): argmax, or a sample at `temperature`."""
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return _sample(logits, jax.random.fold_in(key, t), jnp.float32(temperature))


def generate(model: Transformer, prompt, max_new_tokens: int, *, temperature: float = 0.0,
             key: jax.Array | None = None, use_cache: bool = True) -> np.ndarray:
    """Continue `prompt` by `max_new_tokens` tokens.

    Args:
      model: a `Transformer`.
      prompt: (B, T0) or (T0,) token ids; every row the same length.
      max_new_tokens: how many tokens to add.
      temperature: 0 picks the most likely token (greedy); > 0 samples from
        softmax(logits / temperature).
      key: a `jax.random.key`, needed when sampling.
      use_cache: decode with a KV cache (True) or recompute the whole sequence per token.

    Returns:
      (B, T0 + max_new_tokens) int32 ids (or (T0 + max_new_tokens,) for a 1-D prompt),
      the prompt included.

    Raises:
      ValueError: the result would be longer than the model's `max_seq_len`, or sampling
        without a key.
    """
    prompt = np.asarray(prompt, dtype=np.int32)
    squeeze = prompt.ndim == 1
    prompt = np.atleast_2d(prompt)
    B, T0 = prompt.shape
    total = T0 + max_new_tokens
    limit = model.config.max_seq_len
    if total > limit:
        raise ValueError(
            f"prompt ({T0} tokens) + max_new_tokens ({max_new_tokens}) = {total} exceeds the "
            f"model's max_seq_len={limit}. Keep prompt + new tokens within {limit}: e.g. "
            f"max_new_tokens={max(limit - T0, 0)}, or the prompt's last "
            f"{max(limit - max_new_tokens, 0)} tokens."
        )
    if temperature > 0 and key is None:
        raise ValueError("Sampling (temperature > 0) needs key=jax.random.key(seed).")
    if T0 == 0:
        raise ValueError("The prompt is empty; give at least one token (e.g. a newline, id 10).")
    graphdef, params = nnx.split(model, nnx.Param)
    tokens = np.zeros((B, total), np.int32)
    tokens[:, :T0] = prompt
    if use_cache:
        cache = KVCache.zeros(model.config, B, total)
        positions = jnp.broadcast_to(jnp.arange(T0, dtype=jnp.int32), (B, T0))
        logits, cache = _logits_cached(graphdef, params, jnp.asarray(prompt), positions, cache)  # prefill
        for t in range(T0, total):
            token = _choose(logits[:, -1], t, temperature, key)  # (B,)
            tokens[:, t] = np.asarray(token)
            if t + 1 < total:
                logits, cache = _logits_cached(graphdef, params, token[:, None],  # decode one token
                                               jnp.full((B, 1), t, jnp.int32), cache)
    else:
        for t in range(T0, total):
            logits = _logits(graphdef, params, jnp.asarray(tokens))  # (B, total, vocab); slots >= t unseen
            tokens[:, t] = np.asarray(_choose(logits[:, t - 1], t, temperature, key))
    return tokens[0] if squeeze else tokens
