"""The FLOPs of a training step, counted by hand: 6N per token plus attention.

A matmul `(m, k) @ (k, n)` costs `2mkn` FLOPs. In a transformer almost every FLOP is a
matmul with a weight matrix, and each weight element takes part in one multiply-add per
token in the forward pass, so the forward pass costs `2N` FLOPs per token, N being the
number of weights used in matmuls (every parameter except the embedding table, which is
only looked up, and the norms' scales). The backward pass computes two matmuls for each
forward one (the gradient with respect to the input and to the weight), so a training
step costs

    6 N                                       per token, for the weights, plus
    6 * 2 * n_layers * T_attended * H * D     per token, for attention,

where attention's two matmuls (scores `q k^T` and `weights v`) each cost
`2 * T_attended * H * D` per query token, T_attended being how many keys a query is
multiplied with. Two conventions exist for causal attention:

* `causal=False` counts every score of the T x T matrix (T_attended = T): what a dense
  implementation computes, masked half included. XLA's count of our `dense` model.
* `causal=True` counts only the scores a causal query can use (on average
  T_attended = T / 2): what a kernel that skips masked blocks computes, and MaxText's
  convention for MFU ("model FLOPs", not "hardware FLOPs").

The elementwise work (softmax, norms, SiLU, the optimizer's update) is left out; it is
a few per cent at the sizes we train, which is why a within-5% agreement with XLA's
count of the whole compiled step is the test (tests/test_llm.py).

Mirrors MaxText's `calculate_tflops_training_per_device` (maxtext_utils.py), which
counts the same terms; its causal halving is our `causal=True`.
"""

from __future__ import annotations

import dataclasses

from stacklib.llm.config import Config


@dataclasses.dataclass(frozen=True)
class StepFlops:
    """The FLOPs of one training step, by term."""

    weights: float  # 6 * N * tokens
    attention: float  # scores and weighted values, forward and backward
    tokens: int  # tokens in the step (batch_size * seq_len)

    @property
    def total(self) -> float:
        return self.weights + self.attention

    @property
    def per_token(self) -> float:
        return self.total / self.tokens


def matmul_params(config: Config) -> int:
    """N: the weights that take part in a matmul per token (the embedding lookup does not)."""
    d, hd = config.d_model, config.head_dim
    attention = d * config.n_heads * hd * 2 + d * config.n_kv_heads * hd * 2  # q, o; k, v
    mlp = 3 * d * config.d_ff  # gate, up, down
    lm_head = d * config.vocab_size  # the output projection (the embedding itself when tied)
    return config.n_layers * (attention + mlp) + lm_head


def attended_keys(seq_len: int, *, causal: bool) -> float:
    """Keys per query token on average: T, or the lower triangle's (T + 1) / 2."""
    return (seq_len + 1) / 2 if causal else float(seq_len)


def training_flops(config: Config, *, causal: bool = True, batch_size: int | None = None,
                   seq_len: int | None = None) -> StepFlops:
    """The FLOPs of one training step (forward + backward) of `config`'s model.

    Args:
      config: the model and the step's sizes.
      causal: count only the causal half of attention (see the module docstring).
      batch_size, seq_len: override the config's.

    Returns:
      A `StepFlops`: `.total`, `.per_token`, and the two terms.
    """
    B = batch_size or config.batch_size
    T = seq_len or config.seq_len
    tokens = B * T
    weights = 6 * matmul_params(config) * tokens
    per_token_attention = 2 * 2 * config.n_heads * config.head_dim * attended_keys(T, causal=causal)
    attention = 3 * config.n_layers * per_token_attention * tokens
    return StepFlops(weights=float(weights), attention=float(attention), tokens=tokens)
