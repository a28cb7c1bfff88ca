"""A diffusion transformer (DiT): patchify, timestep and class embedding, adaLN-Zero blocks.

Peebles & Xie, "Scalable Diffusion Models with Transformers" (2023), in one file, in the
order the data flows (nanoGPT's layout). An image is cut into p×p patches, each patch is a
token; the noise level t and the class y become one conditioning vector c; every block
normalises its input and then *scales and shifts* it by amounts computed from c (adaptive
LayerNorm), and gates its residual branch by a third amount initialised to zero, so that
each block starts as the identity ("adaLN-Zero"). The last layer maps tokens back to
patches, and unpatchify back to an image of the input's shape: the prediction (the noise
ε, or the velocity v of flow matching, per objectives.py). Which of the two the weights
predict is `DiTConfig.objective`: the model carries it, and the samplers refuse a method
that does not fit it.

    model = DiT(DiTConfig(image_size=8, patch_size=2, d_model=64), rngs=nnx.Rngs(0))
    out = model(x, t, y)        # x (B, H, W, C) in [-1, 1]; t (B,) in [0, 1]; y (B,) ints

Class `num_classes` is the "no class" label: classifier-free guidance (samplers.py) runs the
model with it to get the unconditional prediction, and training drops labels to it.

Mirrors the DiT that MaxDiffusion and diffusers ship (`DiTTransformer2DModel`: patch
embedding, `TimestepEmbedding` of sinusoidal features, `LabelEmbedding` with a null class,
`AdaLayerNormZero`). Differences: fixed 2-D sin-cos positions computed on the fly (no
buffer to save); attention through `stacklib.kernels.dot_product_attention`; no learned
variance (DiT predicts Σ too; we predict only the mean, as in DDPM's simple loss); no
dropout, no cross-attention to text (Stable Diffusion's conditioning), float32 only.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import stacklib.kernels as kernels
import stacklib.nn as nnx
from stacklib.diffusion.objectives import OBJECTIVES

zeros = nnx.initializers.zeros_init()


@dataclasses.dataclass(frozen=True)
class DiTConfig:
    """The architecture (what decides the parameters' shapes) and the objective (what they predict)."""

    image_size: int = 8       # H = W
    channels: int = 1         # C
    patch_size: int = 2       # p: (H/p)·(W/p) tokens of p·p·C values each
    d_model: int = 64         # D: width of every token
    n_layers: int = 4
    n_heads: int = 4
    mlp_ratio: int = 4        # the MLP's hidden width is mlp_ratio · D
    num_classes: int = 10     # labels 0..num_classes-1; num_classes itself means "no class"
    frequency_dim: int = 64   # sinusoidal features of t before the timestep MLP
    objective: str = "flow"   # what the output is: "flow" the velocity v, "ddpm" the noise ε (objectives.py)

    def __post_init__(self):
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective={self.objective!r} is not one of {', '.join(OBJECTIVES)}.")
        if self.image_size % self.patch_size:
            raise ValueError(f"patch_size={self.patch_size} does not divide image_size={self.image_size}: "
                             "patches must tile the image. Choose a divisor of image_size.")
        if self.d_model % self.n_heads:
            divisors = [h for h in range(1, self.d_model + 1) if self.d_model % h == 0]
            raise ValueError(f"n_heads={self.n_heads} does not divide d_model={self.d_model}; choose n_heads "
                             f"among {divisors}.")
        if self.d_model % 4:
            raise ValueError(f"d_model={self.d_model} must be a multiple of 4 (2-D sin-cos positions).")

    @property
    def tokens(self) -> int:
        return (self.image_size // self.patch_size) ** 2


def patchify(x: jax.Array, p: int) -> jax.Array:
    """(B, H, W, C) -> (B, H/p · W/p, p·p·C): row-major patches, each flattened (p, p, C)."""
    B, H, W, C = x.shape
    x = x.reshape(B, H // p, p, W // p, p, C)          # (B, h, p, w, p, C)
    x = x.transpose(0, 1, 3, 2, 4, 5)                   # (B, h, w, p, p, C)
    return x.reshape(B, (H // p) * (W // p), p * p * C)


def unpatchify(tokens: jax.Array, p: int, channels: int) -> jax.Array:
    """The inverse of `patchify`: (B, h·w, p·p·C) -> (B, h·p, w·p, C) for a square image."""
    B, T, _ = tokens.shape
    h = w = int(round(T ** 0.5))
    x = tokens.reshape(B, h, w, p, p, channels)         # (B, h, w, p, p, C)
    x = x.transpose(0, 1, 3, 2, 4, 5)                   # (B, h, p, w, p, C)
    return x.reshape(B, h * p, w * p, channels)


def timestep_features(t: jax.Array, dim: int, max_period: float = 10_000.0) -> jax.Array:
    """Sinusoidal features of t (B,) -> (B, dim): cos then sin at geometric frequencies.

    t is in [0, 1]; scaled by 1000 first, as DiT's integer timesteps are, so that the
    fastest frequencies resolve neighbouring steps.
    """
    half = dim // 2
    freqs = jnp.exp(-np.log(max_period) * jnp.arange(half) / half)   # (half,)
    args = 1000.0 * t[:, None] * freqs[None]                          # (B, half)
    return jnp.concatenate([jnp.cos(args), jnp.sin(args)], axis=-1)


def positions_2d(grid: int, dim: int) -> np.ndarray:
    """Fixed 2-D sin-cos position embedding (grid·grid, dim): half the features per axis."""
    def one_axis(pos, d):                                             # (N,) -> (N, d)
        omega = 1.0 / 10_000 ** (np.arange(d // 2) / (d / 2))
        out = pos[:, None] * omega[None]
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)
    rows, cols = np.meshgrid(np.arange(grid), np.arange(grid), indexing="ij")
    return np.concatenate([one_axis(rows.ravel(), dim // 2), one_axis(cols.ravel(), dim // 2)],
                          axis=1).astype(np.float32)


def modulate(x: jax.Array, shift: jax.Array, scale: jax.Array) -> jax.Array:
    """adaLN: x (B, T, D) normalised, then scaled and shifted per example by (B, D) amounts."""
    return x * (1 + scale[:, None]) + shift[:, None]


class Attention(nnx.Module):
    """Bidirectional multi-head self-attention over the patch tokens."""

    def __init__(self, d_model: int, n_heads: int, *, rngs: nnx.Rngs):
        self.n_heads = n_heads
        self.qkv = nnx.Linear(d_model, 3 * d_model, rngs=rngs)
        self.proj = nnx.Linear(d_model, d_model, rngs=rngs)

    def __call__(self, x):
        B, T, D = x.shape
        qkv = self.qkv(x).reshape(B, T, 3, self.n_heads, D // self.n_heads)  # (B, T, 3, N, H)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]                    # (B, T, N, H) each
        out = kernels.dot_product_attention(q, k, v, implementation="xla")   # no mask: images see all
        return self.proj(out.reshape(B, T, D))                               # (B, T, N·H) -> (B, T, D)


class DiTBlock(nnx.Module):
    """x + gate·Attn(modulate(LN(x))), then x + gate·MLP(modulate(LN(x))): six amounts from c."""

    def __init__(self, config: DiTConfig, *, rngs: nnx.Rngs):
        D = config.d_model
        self.norm1 = nnx.LayerNorm(D, use_scale=False, use_bias=False, rngs=rngs)
        self.attn = Attention(D, config.n_heads, rngs=rngs)
        self.norm2 = nnx.LayerNorm(D, use_scale=False, use_bias=False, rngs=rngs)
        self.fc1 = nnx.Linear(D, config.mlp_ratio * D, rngs=rngs)
        self.fc2 = nnx.Linear(config.mlp_ratio * D, D, rngs=rngs)
        # adaLN-Zero: the gates start at zero, so the block starts as the identity.
        self.adaLN_modulation = nnx.Linear(D, 6 * D, kernel_init=zeros, rngs=rngs)

    def __call__(self, x, c):
        shift1, scale1, gate1, shift2, scale2, gate2 = jnp.split(
            self.adaLN_modulation(nnx.silu(c)), 6, axis=-1)                   # six (B, D)
        x = x + gate1[:, None] * self.attn(modulate(self.norm1(x), shift1, scale1))
        h = self.fc2(nnx.gelu(self.fc1(modulate(self.norm2(x), shift2, scale2))))
        return x + gate2[:, None] * h


class FinalLayer(nnx.Module):
    """adaLN (shift, scale) then a zero-initialised projection of each token to its patch."""

    def __init__(self, config: DiTConfig, *, rngs: nnx.Rngs):
        D, p, C = config.d_model, config.patch_size, config.channels
        self.norm = nnx.LayerNorm(D, use_scale=False, use_bias=False, rngs=rngs)
        self.adaLN_modulation = nnx.Linear(D, 2 * D, kernel_init=zeros, rngs=rngs)
        self.linear = nnx.Linear(D, p * p * C, kernel_init=zeros, rngs=rngs)

    def __call__(self, x, c):
        shift, scale = jnp.split(self.adaLN_modulation(nnx.silu(c)), 2, axis=-1)
        return self.linear(modulate(self.norm(x), shift, scale))               # (B, T, p·p·C)


class DiT(nnx.Module):
    """The whole model: (x, t, y) -> a prediction of x's shape."""

    def __init__(self, config: DiTConfig, *, rngs: nnx.Rngs):
        D = config.d_model
        self.config = config
        self.x_embedder = nnx.Linear(config.patch_size ** 2 * config.channels, D, rngs=rngs)
        self.t_embedder = nnx.Sequential(nnx.Linear(config.frequency_dim, D, rngs=rngs), nnx.silu,
                                         nnx.Linear(D, D, rngs=rngs))
        self.y_embedder = nnx.Embed(config.num_classes + 1, D, rngs=rngs)   # + the null class
        self.blocks = nnx.List([DiTBlock(config, rngs=rngs) for _ in range(config.n_layers)])
        self.final_layer = FinalLayer(config, rngs=rngs)

    def __call__(self, x: jax.Array, t: jax.Array, y: jax.Array) -> jax.Array:
        cfg = self.config
        B, H, W, C = x.shape
        if (H, W, C) != (cfg.image_size, cfg.image_size, cfg.channels):
            raise ValueError(f"x has shape {x.shape}; this DiT takes (B, {cfg.image_size}, {cfg.image_size}, "
                             f"{cfg.channels}) images. Resize the images or build DiTConfig(image_size={H}, "
                             f"channels={C}).")
        pos = positions_2d(cfg.image_size // cfg.patch_size, cfg.d_model)        # (T, D), a constant
        h = self.x_embedder(patchify(x, cfg.patch_size)) + pos[None]             # (B, T, D)
        c = self.t_embedder(timestep_features(t, cfg.frequency_dim)) + self.y_embedder(y)  # (B, D)
        for block in self.blocks:
            h = block(h, c)
        return unpatchify(self.final_layer(h, c), cfg.patch_size, C)             # (B, H, W, C)


def count_params(model: nnx.Module) -> int:
    return sum(int(np.prod(p.shape)) for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
