"""The same model and train step in plain `flax.nnx` + `optax`: the baseline we compare with.

Chapter 12 claims that the model assembled from the book's own parts is the model a
reader would write with the real libraries, and trains the same way. This twin is that
model, written independently with `flax.nnx` layers, `jax.nn.dot_product_attention`
(grouped-query and causal, as the real attention API offers them) and the real optax.
Parameter paths and layouts equal ours, so `copy_params` moves weights key by key, and
tests/test_llm_parity.py checks that 50 steps on the same batches give the same losses;
benchmarks/bench_llm.py times both steps.

Used only for comparison: nothing in stacklib.llm depends on it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import stacklib.nn
from stacklib.llm import train
from stacklib.llm.config import Config


def _rope(x, positions, theta):
    """RoPE, rotate-half pairing, written out independently of model.py."""
    half = x.shape[-1] // 2
    freq = 1.0 / theta ** (jnp.arange(half, dtype=jnp.float32) * 2 / x.shape[-1])
    angle = positions[..., None, None].astype(jnp.float32) * freq  # (B, T, 1, half)
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * jnp.tile(jnp.cos(angle), 2) + rotated * jnp.tile(jnp.sin(angle), 2)


class Attention(nnx.Module):
    def __init__(self, c: Config, *, rngs: nnx.Rngs):
        self.q_proj = nnx.Linear(c.d_model, c.n_heads * c.head_dim, use_bias=False, rngs=rngs)
        self.k_proj = nnx.Linear(c.d_model, c.n_kv_heads * c.head_dim, use_bias=False, rngs=rngs)
        self.v_proj = nnx.Linear(c.d_model, c.n_kv_heads * c.head_dim, use_bias=False, rngs=rngs)
        self.o_proj = nnx.Linear(c.n_heads * c.head_dim, c.d_model, use_bias=False, rngs=rngs)
        self.c = c

    def __call__(self, x, positions):
        B, T, _ = x.shape
        q = self.q_proj(x).reshape(B, T, self.c.n_heads, self.c.head_dim)
        k = self.k_proj(x).reshape(B, T, self.c.n_kv_heads, self.c.head_dim)
        v = self.v_proj(x).reshape(B, T, self.c.n_kv_heads, self.c.head_dim)
        q, k = _rope(q, positions, self.c.rope_theta), _rope(k, positions, self.c.rope_theta)
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True)  # GQA: fewer k/v heads
        return self.o_proj(out.reshape(B, T, -1))


class MLP(nnx.Module):
    def __init__(self, c: Config, *, rngs: nnx.Rngs):
        self.gate_proj = nnx.Linear(c.d_model, c.d_ff, use_bias=False, rngs=rngs)
        self.up_proj = nnx.Linear(c.d_model, c.d_ff, use_bias=False, rngs=rngs)
        self.down_proj = nnx.Linear(c.d_ff, c.d_model, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.down_proj(nnx.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    def __init__(self, c: Config, *, rngs: nnx.Rngs):
        self.input_layernorm = nnx.RMSNorm(c.d_model, epsilon=c.norm_eps, rngs=rngs)
        self.self_attn = Attention(c, rngs=rngs)
        self.post_attention_layernorm = nnx.RMSNorm(c.d_model, epsilon=c.norm_eps, rngs=rngs)
        self.mlp = MLP(c, rngs=rngs)

    def __call__(self, x, positions):
        x = x + self.self_attn(self.input_layernorm(x), positions)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nnx.Module):
    def __init__(self, c: Config, *, rngs: nnx.Rngs):
        self.embed_tokens = nnx.Embed(c.vocab_size, c.d_model, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(c, rngs=rngs) for _ in range(c.n_layers)])
        self.norm = nnx.RMSNorm(c.d_model, epsilon=c.norm_eps, rngs=rngs)
        if not c.tie_embeddings:
            self.lm_head = nnx.Linear(c.d_model, c.vocab_size, use_bias=False, rngs=rngs)
        self.tie_embeddings = c.tie_embeddings

    def __call__(self, tokens):
        B, T = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(T), (B, T))
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x, positions)
        x = self.norm(x)
        logits = self.embed_tokens.attend(x) if self.tie_embeddings else self.lm_head(x)
        return logits.astype(jnp.float32)


def copy_params(ours: stacklib.nn.State, config: Config) -> tuple[nnx.GraphDef, nnx.State]:
    """The twin's (graphdef, params) holding exactly our weights, matched by path."""
    graphdef, params = nnx.split(Transformer(config, rngs=nnx.Rngs(0)), nnx.Param)
    # Copies, not views: our train step donates its buffers, which must not delete the twin's.
    copied = jax.tree.map(lambda x: jnp.array(x, copy=True), stacklib.nn.to_pure_dict(ours))
    nnx.replace_by_pure_dict(params, copied)
    return graphdef, params


def jitted_step(graphdef, tx, nnx_module=nnx, optax_module=optax):
    """`step(params, opt_state, batch) -> (params, opt_state, loss)`, jitted: train.py's loss and
    update written against whichever `nnx` and `optax` modules are passed (flax's and optax's by
    default; stacklib's for the capstone's swap matrix)."""

    def loss_fn(params, batch):
        logits = nnx_module.merge(graphdef, params)(batch[:, :-1])  # (B, T, vocab)
        return optax_module.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax_module.apply_updates(params, updates), opt_state, loss

    return step


def make_train_step(graphdef: nnx.GraphDef, config: Config):
    """(jitted step, optimizer): the same loss and optimizer as train.py, from flax and optax."""
    tx = train.make_optimizer(config, optax_module=optax)
    return jitted_step(graphdef, tx), tx
