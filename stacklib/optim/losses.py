"""The two classification losses a training loop needs.

Mirrors `optax.softmax_cross_entropy` and `optax.softmax_cross_entropy_with_integer_labels`
(optax/losses/_classification.py, optax 0.2.8). They live in `stacklib.optim` because
optax exports them at its top level, so training code that says
`optax.softmax_cross_entropy_with_integer_labels(...)` runs unchanged on ours.

Differences from optax: `axis` is a single int and there is no `where` argument.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def softmax_cross_entropy(logits: jax.Array, labels: jax.Array, axis: int = -1) -> jax.Array:
    """Cross-entropy between a softmax over `logits` and target distributions `labels`.

        loss = -sum_c labels_c * log_softmax(logits)_c

    Args:
      logits: unnormalized scores, shape `(..., num_classes)`.
      labels: probabilities of the same shape (e.g. one-hot rows).
      axis: the class axis.

    Returns:
      The loss of each example, shape `logits.shape` without `axis`.
    """
    return -(labels * jax.nn.log_softmax(logits, axis)).sum(axis)


def softmax_cross_entropy_with_integer_labels(
    logits: jax.Array, labels: jax.Array, axis: int = -1
) -> jax.Array:
    """Cross-entropy with integer class labels: `logsumexp(logits) - logits[label]`.

    Only the correct class's logit is gathered, so the log-softmax of the other classes
    is never formed.

    Args:
      logits: unnormalized scores, shape `(..., num_classes)`.
      labels: integer classes, shape `(...)`.
      axis: the class axis.

    Returns:
      The loss of each example, shape `labels.shape`.

    Raises:
      ValueError: `labels` is not an integer array, or its shape does not match `logits`.
    """
    if not jnp.issubdtype(jnp.asarray(labels).dtype, jnp.integer):
        raise ValueError(f"labels must be integers (class indices), got dtype {jnp.asarray(labels).dtype}.")
    axis = axis % logits.ndim
    expected = logits.shape[:axis] + logits.shape[axis + 1 :]
    if labels.shape != expected:
        raise ValueError(
            f"labels has shape {labels.shape}, but logits of shape {logits.shape} need "
            f"labels of shape {expected} (one class index per example)."
        )
    label_logits = jnp.take_along_axis(logits, jnp.expand_dims(labels, axis), axis=axis).squeeze(axis)
    return jax.nn.logsumexp(logits, axis=axis) - label_logits
