"""Chapter 12's language model as an artifact: a next-token function of any batch and length.

What is exported is not the raw forward pass `tokens (B, T) -> logits (B, T, vocab)` but
the function a server and a generation loop need:

    next_token_logits(params, tokens)    int32[b, t] -> float32[b, vocab],  t <= max_seq_len

Each row of `tokens` is a prompt followed by `PAD` (-1) up to the row's length `t`; the
output is the logits of the token after the row's last real one. Both `b` and `t` are
symbolic, and `t`'s bound is a `jax.export` constraint, `"t <= 128"`: the model's Python
code compares `T > max_seq_len` while tracing, which only a bounded `t` can answer, and
the loaded program refuses a longer `t` by itself.

Why -1 pads: every id 0..255 is a byte, so padding needs a value outside the vocabulary.
The function looks up 0 in the pad slots and ignores what comes out there: the model is
causal, so positions after a row's end never change the logits at its end. That is what
lets the server put prompts of different lengths into one call, and a client run greedy
generation with one fixed-shape buffer (one compile for the whole loop), as
`stacklib.llm.generate(use_cache=False)` does.

This module imports `stacklib.nn` only inside `next_token_function` (the export side), so
a client that loads the artifact and calls `generate` never imports the model's code.
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from stacklib.serve import artifact

if TYPE_CHECKING:
    from stacklib.llm.model import Transformer

PAD = -1


def _str_keys(tree: Any) -> Any:
    """nnx.to_pure_dict's integer keys (layers/0/...) as strings: checkpoints and jax.export want str."""
    return {str(k): _str_keys(v) for k, v in tree.items()} if isinstance(tree, dict) else tree


def _int_keys(tree: Any) -> Any:
    return ({int(k) if k.isdigit() else k: _int_keys(v) for k, v in tree.items()}
            if isinstance(tree, dict) else tree)


def next_token_function(model: Transformer):
    """`(fn, params)`: `fn(params, tokens)` gives the next-token logits of PAD-padded rows.

    Args:
      model: a `stacklib.llm.Transformer` (e.g. `stacklib.llm.pretrained("stdlib-bytes")[0]`).

    Returns:
      `fn(params, tokens int32 (B, T)) -> float32 (B, vocab)`, pure, and `params` as
      nested dicts with str keys (what `stacklib.serve.export` takes).
    """
    import jax
    import jax.numpy as jnp

    import stacklib.nn as nnx

    # The artifact serves every length up to max_seq_len, and of the kernel library's attention
    # implementations only 'xla' takes a symbolic length (the blocked ones cut tiles when traced):
    # pin it, so that the jitted function and the exported one are the same program.
    exportable = model.config.replace(attention="xla")
    graphdef = nnx.graphdef(jax.eval_shape(lambda: type(model)(exportable, rngs=nnx.Rngs(0))))
    state = nnx.state(model, nnx.Param)

    def next_token_logits(params, tokens):
        lengths = jnp.sum(tokens >= 0, axis=1)  # (B,): real tokens come first, PAD after
        logits = nnx.merge(graphdef, _int_keys(params), copy=True)(jnp.where(tokens >= 0, tokens, 0))
        return logits[jnp.arange(tokens.shape[0]), lengths - 1]  # (B, vocab): after each row's last token

    return next_token_logits, _str_keys(nnx.to_pure_dict(state))


def export(model: Transformer, directory: str | pathlib.Path, *, platforms: Sequence[str] = ("cpu",),
           metadata: dict | None = None) -> dict:
    """Export `model`'s next-token function with symbolic batch `b` and length `t <= max_seq_len`."""
    fn, params = next_token_function(model)
    config = model.config
    return artifact.export(
        fn, params, (np.zeros((1, 8), np.int32),), directory, platforms=platforms,
        polymorphic_shapes=["b, t"], constraints=[f"t <= {config.max_seq_len}"], pad_value=PAD,
        metadata={"kind": "next_token_logits", "vocab_size": config.vocab_size,
                  "max_seq_len": config.max_seq_len, **(metadata or {})})


def pad(rows: Sequence[Sequence[int]], length: int) -> np.ndarray:
    """Token rows (each 1..length ids) as one int32 (len(rows), length) array padded with PAD."""
    out = np.full((len(rows), length), PAD, np.int32)
    for i, row in enumerate(rows):
        if not 1 <= len(row) <= length:
            raise ValueError(f"row {i} has {len(row)} tokens; it must have between 1 and {length}.")
        out[i, :len(row)] = row
    return out


def generate(loaded: artifact.LoadedModel, prompt: Any, max_new_tokens: int) -> np.ndarray:
    """Greedy generation driven from a loaded artifact: one next-token call per new token.

    The buffer is (B, prompt + new tokens) from the start, PAD after the tokens chosen
    so far, so every call has the same shape and the program compiles once. Equals
    `stacklib.llm.generate(model, prompt, max_new_tokens, use_cache=False)` token for token.

    Returns:
      (B, T0 + max_new_tokens) int32 ids (or 1-D for a 1-D prompt), the prompt included.
    """
    prompt = np.asarray(prompt, dtype=np.int32)
    squeeze = prompt.ndim == 1
    prompt = np.atleast_2d(prompt)
    batch, t0 = prompt.shape
    total = t0 + max_new_tokens
    limit = loaded.manifest["metadata"].get("max_seq_len")
    if limit is not None and total > limit:
        raise ValueError(f"prompt ({t0} tokens) + max_new_tokens ({max_new_tokens}) = {total} exceeds the "
                         f"model's max_seq_len={limit}; ask for at most {max(limit - t0, 0)} new tokens.")
    tokens = np.full((batch, total), PAD, np.int32)
    tokens[:, :t0] = prompt
    for t in range(t0, total):
        tokens[:, t] = np.argmax(np.asarray(loaded(tokens)), axis=-1)
    return tokens[0] if squeeze else tokens
