"""The pure functions every post-training loss is made of: log-probs, masks, KL, aggregation.

Mirrors `tunix.rl.common` (google-tunix 0.1.7): `selective_log_softmax`,
`compute_per_token_logps`, `make_completion_mask`, `compute_kl_divergence`,
`aggregate_loss`, and `tunix.rl.algo_core.masked_mean`. Same names, argument names,
defaults and formulas, so tests/test_align_parity.py compares them on the same inputs.

A completion's log-probability under a model is the sum over its tokens of

    log p(c_t | prompt, c_<t) = logits[t-1][c_t] - logsumexp(logits[t-1])

where `logits[t-1]` is the model's output at the position *before* token t: a causal
LM predicts the next token. Every loss here (SFT's cross-entropy, DPO's preference
loss, GRPO's clipped ratio and its KL penalty) is a function of these per-token numbers
and of a mask saying which tokens count.

Differences from tunix:
- `per_token_logps` runs our `stacklib.llm.Transformer`, which has no attention mask:
  prompts are left-padded with the tokenizer's document separator (id 0), which the
  model attends to like the start of a document, and positions run 0..T-1 over the
  padded sequence (tunix builds positions and a causal mask from a pad mask). Rollouts
  (rl_cluster.py) sample with the same layout, so both see the same inputs.
- `make_completion_mask` is tunix's; the stop token here is the task's "\n", not the
  tokenizer's EOS (our sampler has no stop tokens and always writes max_tokens).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import stacklib.nn as nnx

KL_METHODS = ("kl", "mse_kl", "low_var_kl")
LOSS_AGG_MODES = ("token-mean", "sequence-mean-token-mean", "sequence-mean-token-scale",
                  "seq-mean-token-sum", "sequence-mean-token-sum-norm")


def selective_log_softmax(logits: jax.Array, input_ids: jax.Array) -> jax.Array:
    """log softmax(logits)[input_ids] without materialising the whole log-softmax.

    Args: logits (..., vocab), input_ids (...) integer. Returns (...) float32.
    """
    target = jnp.take_along_axis(logits, input_ids[..., None], axis=-1)[..., 0].astype(jnp.float32)
    return target - jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)


def logps_from_logits(logits: jax.Array, input_tokens: jax.Array, logits_to_keep: int,
                      temperature: float = 1.0) -> jax.Array:
    """Log-probs of the last `logits_to_keep` tokens of `input_tokens` given `logits` of the whole row.

    Args:
      logits: (B, T, vocab), the model's output for `input_tokens` (B, T).
      logits_to_keep: C, the completion's length: tokens T-C..T-1 are scored, each by the
        logits one position earlier.
      temperature: divide the logits first (tunix does this so that the log-probs are those of
        the distribution the rollout sampled from).

    Returns:
      (B, C) float32.
    """
    logits = logits[:, -logits_to_keep - 1:-1, :]  # (B, C, vocab): the positions that predict c_0..c_{C-1}
    if temperature not in (0.0, 1.0):
        logits = logits / temperature
    return selective_log_softmax(logits, input_tokens[:, -logits_to_keep:])


def per_token_logps(model: Any, prompt_tokens: jax.Array, completion_tokens: jax.Array, *,
                    temperature: float = 1.0, stop_gradient: bool = True) -> jax.Array:
    """`tunix.rl.common.compute_per_token_logps` for a `stacklib.llm.Transformer`.

    Args:
      model: the policy or reference model: tokens (B, T) -> logits (B, T, vocab).
      prompt_tokens: (B, P) left-padded prompts.
      completion_tokens: (B, C) completions (anything after the stop token is masked later).
      temperature: the rollout's sampling temperature.
      stop_gradient: detach the result (True for the reference and the "old" policy).

    Returns:
      (B, C) float32 log p(completion token | everything before it).
    """
    tokens = jnp.concatenate([prompt_tokens, completion_tokens], axis=1)  # (B, P + C)
    logps = logps_from_logits(model(tokens), tokens, completion_tokens.shape[1], temperature)
    return jax.lax.stop_gradient(logps) if stop_gradient else logps


@functools.partial(jax.jit, static_argnums=0)
def _per_token_logps_jit(graphdef, params, prompt_tokens, completion_tokens, temperature):
    model = nnx.merge(graphdef, params)
    tokens = jnp.concatenate([prompt_tokens, completion_tokens], axis=1)  # (B, P + C)
    logits = model(tokens)[:, prompt_tokens.shape[1] - 1:-1, :] / temperature  # (B, C, vocab)
    return selective_log_softmax(logits, completion_tokens)


def compute_per_token_logps(model: Any, prompt_tokens, completion_tokens, *,
                            temperature: float = 1.0) -> jax.Array:
    """`per_token_logps` compiled once per shape, for frozen models (reference, old policy)."""
    graphdef, params = nnx.split(model)
    temperature = 1.0 if temperature == 0.0 else temperature  # greedy rollouts: the model's own logits
    return _per_token_logps_jit(graphdef, params, jnp.asarray(prompt_tokens), jnp.asarray(completion_tokens),
                                jnp.float32(temperature))


def make_completion_mask(completion_ids: jax.Array, eos_tok: int = 0) -> jax.Array:
    """1 for every token up to and including the first `eos_tok`, 0 after it.

    A row without `eos_tok` is kept whole. Args: completion_ids (B, C). Returns (B, C) int32.
    """
    is_eos = completion_ids == eos_tok  # (B, C)
    C = is_eos.shape[1]
    eos_index = jnp.where(is_eos.any(axis=1), jnp.argmax(is_eos, axis=1), C)  # (B,): C if none
    return (jnp.arange(C)[None, :] <= eos_index[:, None]).astype(jnp.int32)


def np_make_completion_mask(completion_ids: np.ndarray, eos_tok: int = 0) -> np.ndarray:
    """`make_completion_mask` in NumPy, for host-side rollouts."""
    is_eos = np.asarray(completion_ids) == eos_tok
    C = is_eos.shape[1]
    eos_index = np.where(is_eos.any(axis=1), np.argmax(is_eos, axis=1), C)
    return (np.arange(C)[None, :] <= eos_index[:, None]).astype(np.int32)


def compute_kl_divergence(per_token_logps: jax.Array, ref_per_token_logps: jax.Array,
                          method: str = "low_var_kl", clamp_value: float | None = None) -> jax.Array:
    """Per-token estimate of KL(policy || reference) from the sampled tokens' log-probs.

    With d = ref_logp - logp (tokens sampled from the policy):
      "kl":         -d              unbiased, high variance (can be negative)
      "mse_kl":     d^2 / 2         biased, low variance
      "low_var_kl": exp(d) - d - 1  unbiased and never negative (Schulman's k3)

    Raises:
      ValueError: an unknown `method`.

    Reference: J. Schulman, "Approximating KL divergence" (2020).
    """
    if method not in KL_METHODS:
        raise ValueError(f"method={method!r} is not a KL estimator; use one of {KL_METHODS}.")
    logp = per_token_logps.astype(jnp.float32)
    ref = ref_per_token_logps.astype(jnp.float32)
    if method == "kl":
        kl = logp - ref
    elif method == "mse_kl":
        kl = 0.5 * jnp.square(logp - ref)
    else:
        diff = ref - logp
        kl = jnp.exp(diff) - diff - 1
    if clamp_value is not None:
        kl = jnp.clip(kl, -clamp_value, clamp_value)
    return kl


def masked_mean(x: jax.Array, mask: jax.Array, axis: int | None = None) -> jax.Array:
    """Mean of `x` over the entries where `mask` is nonzero (tunix's algo_core.masked_mean)."""
    return (x * mask).sum(axis=axis) / (mask.sum(axis=axis) + 1e-8)


def aggregate_loss(per_token_loss: jax.Array, completion_mask: jax.Array, loss_agg_mode: str,
                   **kwargs: Any) -> jax.Array:
    """Reduce a (B, C) per-token loss to a scalar, counting only the masked-in tokens.

    "token-mean": every token in the batch weighs the same (long answers weigh more).
    "sequence-mean-token-mean": the mean over each row's tokens, then over rows (GRPO's
      paper; every answer weighs the same whatever its length).
    "sequence-mean-token-scale": each row's sum / `norm` (default C), then over rows.
    "seq-mean-token-sum": each row's sum, then the mean over non-empty rows.
    "sequence-mean-token-sum-norm": the batch's sum / `norm` (default the non-empty rows).
    Rows with no masked-in token do not count.

    Raises:
      ValueError: an unknown mode, or a `norm` that is not a positive number.
    """
    per_token_loss = per_token_loss.astype(jnp.float32)
    masked = per_token_loss * completion_mask
    tokens_per_row = completion_mask.sum(axis=-1)  # (B,)
    non_empty_rows = jnp.clip((tokens_per_row > 0).sum(), min=1)
    if loss_agg_mode == "token-mean":
        return masked.sum() / jnp.clip(completion_mask.sum(), min=1)
    if loss_agg_mode == "sequence-mean-token-mean":
        return (masked.sum(axis=-1) / jnp.clip(tokens_per_row, min=1)).sum() / non_empty_rows
    if loss_agg_mode == "sequence-mean-token-scale":
        norm = _norm(kwargs, per_token_loss.shape[-1])
        return (masked.sum(axis=-1) / jnp.clip(norm, min=1e-6)).sum() / non_empty_rows
    if loss_agg_mode == "seq-mean-token-sum":
        row_has_tokens = (tokens_per_row > 0).astype(jnp.float32)
        return (masked.sum(axis=-1) * row_has_tokens).sum() / jnp.clip(row_has_tokens.sum(), min=1e-6)
    if loss_agg_mode == "sequence-mean-token-sum-norm":
        return masked.sum() / jnp.clip(_norm(kwargs, non_empty_rows), min=1e-6)
    raise ValueError(f"loss_agg_mode={loss_agg_mode!r} is not supported; use one of {LOSS_AGG_MODES}.")


def _norm(kwargs: dict[str, Any], default: Any) -> Any:
    norm = kwargs.get("norm", default)
    numeric = isinstance(norm, (int, float, jax.Array, np.ndarray))
    if not numeric or isinstance(norm, (int, float)) and norm <= 0:
        raise ValueError(f"norm={norm!r} must be a positive number (the divisor of each row's summed loss).")
    return norm


__all__ = [
    "KL_METHODS", "LOSS_AGG_MODES", "aggregate_loss", "compute_kl_divergence", "compute_per_token_logps",
    "logps_from_logits", "make_completion_mask", "masked_mean", "np_make_completion_mask", "per_token_logps",
    "selective_log_softmax",
]
