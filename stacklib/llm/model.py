"""A decoder-only transformer language model, built with `stacklib.nn` (chapter 02).

The architecture is Llama's, which most open models share (and MaxText's default
decoder): token embedding -> n_layers x [RMSNorm -> grouped-query causal attention with
RoPE -> residual; RMSNorm -> SwiGLU MLP -> residual] -> RMSNorm -> logits. No biases,
no dropout, no learned positions.

Parameters are named as in Hugging Face's Llama checkpoints, with flax's layouts
(`kernel` stored `(in, out)`, the transpose of PyTorch's `weight`):

    embed_tokens/embedding                   (vocab, d_model)
    layers/{i}/input_layernorm/scale         (d_model,)
    layers/{i}/self_attn/q_proj/kernel       (d_model, n_heads * head_dim)
    layers/{i}/self_attn/k_proj/kernel       (d_model, n_kv_heads * head_dim)   and v_proj
    layers/{i}/self_attn/o_proj/kernel       (n_heads * head_dim, d_model)
    layers/{i}/self_attn/q_norm/scale        (head_dim,)  and k_norm   (only with qk_norm: Qwen3)
    layers/{i}/post_attention_layernorm/scale
    layers/{i}/mlp/gate_proj/kernel          (d_model, d_ff)                     and up_proj
    layers/{i}/mlp/down_proj/kernel          (d_ff, d_model)
    norm/scale                               (d_model,)
    lm_head/kernel                           (d_model, vocab)  (absent with tie_embeddings)

so converting a real Llama or Qwen3 checkpoint is a rename and a transpose (`stacklib.llm.hf`,
chapter 18). Two options of the config cover what those families add: `qk_norm` (Qwen3 normalises
each head's queries and keys) and `rope_scaling="llama3"` (Llama 3.1's slower low frequencies).
Each weight also carries logical axis names (`nnx.with_partitioning`), which `stacklib.parallel` maps to
mesh axes with `SHARDING_RULES` (train.py).

The forward pass takes explicit `positions` and an optional cache (kv_cache.py: the
contiguous `KVCache`, or the `PagedKVCache` of chapter 14's engine), so the same code
trains on packed sequences, pre-fills a prompt, and decodes one token at a time, and the
engine runs this forward pass, not a copy of it:

    logits = model(tokens)                                    # training: (B, T, vocab)
    logits, cache = model(prompt, positions, cache=cache)     # prefill
    logits, cache = model(next_token, positions, cache=cache) # decode: T == 1

References: Touvron et al. 2023 (Llama), Su et al. 2021 (RoPE), Ainslie et al. 2023
(GQA), Shazeer 2020 (SwiGLU); nanoGPT's model.py for the shape of this file.

Differences from MaxText's decoder: no scanned layers (a Python loop over a list, so the
parameter paths read like a checkpoint's; compile time grows with depth), remat of
whole layers only (no policies), no segment ids (attention runs across the document
boundaries inside a packed sequence, as in nanoGPT), no dropout, no MoE.
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax
import jax.numpy as jnp

import stacklib.kernels as kernels
import stacklib.nn as nnx
from stacklib.llm.config import Config, RopeScaling
from stacklib.llm.kv_cache import KVCache, PagedKVCache

init = nnx.initializers


def _partitioned(initializer: Any, *names: str) -> Any:
    return nnx.with_partitioning(initializer, names)


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> jax.Array:
    """RoPE's angular frequency of each feature pair, `(head_dim // 2,)` radians per position.

    Pair i turns by `theta ** (-2i / head_dim)` per position: fast rotations for the first
    pairs, slow ones for the last. With Llama 3's `scaling` (Hugging Face's
    `rope_type: llama3`), the slow pairs, whose wavelength `2 pi / frequency` is longer
    than `original_max_len / low_freq_factor`, are slowed by `factor`, so positions far past
    the pre-training context look like positions inside it; pairs with wavelengths shorter
    than `original_max_len / high_freq_factor` keep their frequency; the band between is
    interpolated: `(1 - s) * f / factor + s * f` with `s = (original_max_len / wavelength -
    low_freq_factor) / (high_freq_factor - low_freq_factor)`.
    """
    inv_freq = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)  # (D/2,)
    if scaling is None:
        return inv_freq
    factor, low, high, original = scaling
    wavelength = 2 * jnp.pi / inv_freq  # (D/2,) positions per turn
    smooth = (original / wavelength - low) / (high - low)  # 0 at the long end of the band, 1 at the short
    interpolated = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return jnp.where(wavelength < original / high, inv_freq,  # short wavelengths: unchanged
                     jnp.where(wavelength > original / low, inv_freq / factor, interpolated))


def rope_angles(positions: jax.Array, head_dim: int, theta: float,
                scaling: RopeScaling | None = None) -> tuple[jax.Array, jax.Array]:
    """cos and sin of RoPE's rotation angles, each `(*positions.shape, head_dim // 2)`.

    The angle of pair i at position p is `p * rope_frequencies(head_dim, theta, scaling)[i]`.
    """
    inv_freq = rope_frequencies(head_dim, theta, scaling)  # (D/2,)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # (..., D/2)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate feature pairs (j, j + D/2) of `x` (B, T, heads, D) by the angles (B, T, D/2).

    The "rotate half" pairing of Hugging Face's Llama (GPT-NeoX style); Meta's original
    code pairs adjacent features (2j, 2j+1), which is the same up to a permutation of
    the q/k projection's columns.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]  # (B, T, heads, D/2) each
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # (B, T, 1, D/2): the same angle for every head
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


# The attention implementations tried, in order, when the config says attention="auto": chapter 09's
# flash attention on a TPU, cuDNN's on a GPU (bfloat16 only; else the next), chapter 10's chunked
# attention, and 'xla', which can serve any call (a symbolic sequence length, under jax.export, rules
# out the blocked ones). On a CPU, 'xla' alone: at the sequence lengths a CPU trains, the chunked
# heuristic's tile is the whole sequence, so chunking saves nothing, and its loops cost compile time
# (chapter 12's step: 3.8 s instead of 2.9 s). A name in the config replaces the list.
AUTO_ATTENTION = {"tpu": ("pallas", "xla_chunked", "xla"), "gpu": ("cudnn", "xla_chunked", "xla"),
                  "cpu": ("xla",)}


def attention_implementations(config: Config) -> tuple[str, ...]:
    """The `stacklib.kernels.ATTENTION` implementations the model asks for, first choice first."""
    if config.attention == "auto":
        return AUTO_ATTENTION[jax.default_backend()]
    return (config.attention,)


class Attention(nnx.Module):
    """Grouped-query self-attention with RoPE and an optional KV cache."""

    def __init__(self, config: Config, *, rngs: nnx.Rngs):
        d, h, kv, hd = config.d_model, config.n_heads, config.n_kv_heads, config.head_dim
        kernel = init.lecun_normal()
        self.q_proj = nnx.Linear(d, h * hd, use_bias=False, rngs=rngs,
                                 kernel_init=_partitioned(kernel, "embed", "q_heads"))
        self.k_proj = nnx.Linear(d, kv * hd, use_bias=False, rngs=rngs,
                                 kernel_init=_partitioned(kernel, "embed", "kv_heads"))
        self.v_proj = nnx.Linear(d, kv * hd, use_bias=False, rngs=rngs,
                                 kernel_init=_partitioned(kernel, "embed", "kv_heads"))
        self.o_proj = nnx.Linear(h * hd, d, use_bias=False, rngs=rngs,
                                 kernel_init=_partitioned(kernel, "q_heads", "embed"))
        if config.qk_norm:  # Qwen3: each head's queries and keys are RMS-normalised before RoPE
            self.q_norm = _norm(config, rngs, hd)
            self.k_norm = _norm(config, rngs, hd)
        self.qk_norm = config.qk_norm
        self.n_heads, self.n_kv_heads, self.head_dim = h, kv, hd
        self.implementations = attention_implementations(config)
        self.tile = kernels.AttentionConfig(config.attention_block, config.attention_block) \
            if config.attention_block else None  # None: the autotuning cache, else the heuristic

    def __call__(self, x, cos, sin, positions, cache=None, layer=0):
        """x (B, T, d_model) -> (B, T, d_model), and `cache` with this layer's keys and values written."""
        B, T, _ = x.shape
        q = self.q_proj(x).reshape(B, T, self.n_heads, self.head_dim)  # (B, T, H, D)
        k = self.k_proj(x).reshape(B, T, self.n_kv_heads, self.head_dim)  # (B, T, K, D)
        v = self.v_proj(x).reshape(B, T, self.n_kv_heads, self.head_dim)  # (B, T, K, D)
        if self.qk_norm:  # over each head's D features, one scale shared by all heads
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is None:  # training and scoring: row t attends to tokens 0..t of its row
            out = self._attend(q, k, v, is_causal=True, implementation=self.implementations)
        else:  # the cache writes k, v where they belong and attends over what it holds (kv_cache.py)
            out, cache = cache.attend(layer, q, k, v, positions, self._attend_masked)
        out = out.reshape(B, T, self.n_heads * self.head_dim)  # (B, T, H*D): concatenate the heads
        return self.o_proj(out), cache

    def _attend_masked(self, q, k, v, mask):
        # Flash attention takes no mask: 'xla' is the fallback that always can.
        fallback = tuple(dict.fromkeys((*self.implementations, "xla")))
        return self._attend(q, k, v, mask=mask, implementation=fallback)

    def _attend(self, q, k, v, **options):
        # Chapter 10's API: the first implementation that can serve the call runs, with its tile
        # from the config, else the autotuning cache, else the heuristic.
        with kernels.autotuning.pinned(self.tile) if self.tile else contextlib.nullcontext():
            return kernels.dot_product_attention(q, k, v, **options)


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: Config, *, rngs: nnx.Rngs):
        d, f = config.d_model, config.d_ff
        kernel = init.lecun_normal()
        self.gate_proj = nnx.Linear(d, f, use_bias=False, rngs=rngs,
                                    kernel_init=_partitioned(kernel, "embed", "mlp"))
        self.up_proj = nnx.Linear(d, f, use_bias=False, rngs=rngs,
                                  kernel_init=_partitioned(kernel, "embed", "mlp"))
        self.down_proj = nnx.Linear(f, d, use_bias=False, rngs=rngs,
                                    kernel_init=_partitioned(kernel, "mlp", "embed"))

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(nnx.silu(self.gate_proj(x)) * self.up_proj(x))


def _norm(config: Config, rngs: nnx.Rngs, features: int | None = None) -> nnx.RMSNorm:
    return nnx.RMSNorm(features or config.d_model, epsilon=config.norm_eps, rngs=rngs,
                       scale_init=_partitioned(init.ones, "norm"))


class DecoderLayer(nnx.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: Config, *, rngs: nnx.Rngs):
        self.input_layernorm = _norm(config, rngs)
        self.self_attn = Attention(config, rngs=rngs)
        self.post_attention_layernorm = _norm(config, rngs)
        self.mlp = MLP(config, rngs=rngs)

    def __call__(self, x, cos, sin, positions, cache=None, layer=0):
        attn_out, cache = self.self_attn(self.input_layernorm(x), cos, sin, positions, cache, layer)
        x = x + attn_out
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, cache


def _layer_forward(layer: DecoderLayer, x, cos, sin, positions):
    return layer(x, cos, sin, positions)[0]


# Recompute a layer's activations in the backward pass instead of keeping them: memory
# for compute (about one more forward). The layer is a pytree (stacklib.nn modules are),
# so jax.checkpoint can take it as an argument.
_layer_forward_remat = jax.checkpoint(_layer_forward)


class Transformer(nnx.Module):
    """The language model: tokens (B, T) -> logits (B, T, vocab_size)."""

    def __init__(self, config: Config, *, rngs: nnx.Rngs):
        self.config = config
        self.embed_tokens = nnx.Embed(
            config.vocab_size, config.d_model, rngs=rngs,
            embedding_init=_partitioned(nnx.linear.default_embed_init, "vocab", "embed"))
        self.layers = [DecoderLayer(config, rngs=rngs) for _ in range(config.n_layers)]
        self.norm = _norm(config, rngs)
        if not config.tie_embeddings:
            self.lm_head = nnx.Linear(config.d_model, config.vocab_size, use_bias=False, rngs=rngs,
                                      kernel_init=_partitioned(init.lecun_normal(), "embed", "vocab"))

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None, *,
                 cache: KVCache | PagedKVCache | None = None):
        """Logits for every position; with a cache, also the cache with these positions written.

        Args:
          tokens: (B, T) integer ids.
          positions: (B, T) position of each token (default 0..T-1 in every row). Without a
            cache, a token attends to the tokens before it in its row.
          cache: a `KVCache` (contiguous, `llm.generate`) or a `PagedKVCache` (blocks and block
            tables, chapter 14's engine) to read and extend: prefill with T > 1, decode with T == 1.

        Returns:
          logits (B, T, vocab) in float32, or `(logits, cache)` when a cache is given.

        Raises:
          ValueError: T is longer than the model's `max_seq_len` (without a paged cache).
        """
        B, T = tokens.shape
        # A paged step's row holds several sequences' tokens end to end; each one's positions stay
        # below max_seq_len (the engine's max_model_len), which is what the model cares about.
        if T > self.config.max_seq_len and not isinstance(cache, PagedKVCache):
            raise ValueError(
                f"A sequence of {T} tokens is longer than the model's max_seq_len="
                f"{self.config.max_seq_len}. Cut the input to its last {self.config.max_seq_len} "
                "tokens, or train a model with a larger max_seq_len."
            )
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))  # (B, T)
        cos, sin = rope_angles(positions, self.config.head_dim, self.config.rope_theta,  # (B, T, D/2)
                               self.config.rope_scaling_params)
        x = self.embed_tokens(tokens)  # (B, T, d_model)
        for i, layer in enumerate(self.layers):
            if cache is not None:
                x, cache = layer(x, cos, sin, positions, cache, i)
            elif self.config.remat:
                x = _layer_forward_remat(layer, x, cos, sin, positions)
            else:
                x = _layer_forward(layer, x, cos, sin, positions)
        logits = self.head(x)
        return logits if cache is None else (logits, cache)

    def head(self, x: jax.Array) -> jax.Array:
        """The final RMSNorm and the output projection: hidden states (B, T, d_model) -> float32 logits.

        A method of its own because a pipelined model (pipeline.py) runs the layers apart
        from the embedding and this end, and must end exactly as `__call__` does.
        """
        x = self.norm(x)
        if self.config.tie_embeddings:
            logits = self.embed_tokens.attend(x)  # (B, T, vocab): x @ embedding.T
        else:
            logits = self.lm_head(x)  # (B, T, vocab)
        return logits.astype(jnp.float32)


def count_params(params: Any) -> int:
    """Number of parameters in a state (or any pytree of arrays)."""
    return sum(int(x.size) for x in jax.tree.leaves(params))
