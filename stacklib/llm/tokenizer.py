"""A byte-level tokenizer: one token per UTF-8 byte.

Every string is a sequence of bytes, so a vocabulary of 256 needs no training, never
meets an unknown token, and round-trips any text exactly. The price is length: a
sub-word tokenizer (BPE) packs ~3-4 bytes of English or code into a token, so the same
context window sees 3-4 times more text. For a model small enough to train on a CPU in a
minute that is a fair trade, and it makes the loss easy to read: nats per token are
nats per byte, and `loss / ln 2` is bits per byte, comparable across tokenizers.

Mirrors the interface of Hugging Face's ByT5 tokenizer (`encode`/`decode`, an
`eos_id`), without its special-token offset: byte b is token b.

Differences from ByT5: no pad/unk tokens and no offset of 3; the document separator
(`eos_id`) is byte 0 (NUL), which never occurs in source code; no BPE option (a real
model's BPE tokenizer and chat template: hf_tokenizer.py's `HFTokenizer`, the same interface).
"""

from __future__ import annotations

import numpy as np


class ByteTokenizer:
    """Text <-> token ids, one id per UTF-8 byte."""

    vocab_size = 256
    eos_id = 0  # separates documents in a packed stream; NUL does not occur in text files
    eos_token_ids = frozenset({eos_id})  # what generation stops on (a real model may have several)

    def encode(self, text: str) -> np.ndarray:
        """The UTF-8 bytes of `text` as int32 ids, shape (len(text.encode()),)."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        """The text of `ids`; bytes that do not form valid UTF-8 (a cut multi-byte
        character, a sample from an untrained model) become U+FFFD."""
        ids = np.asarray(ids)
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise ValueError(f"Byte ids must lie in [0, 256), got values in [{ids.min()}, {ids.max()}].")
        return ids.astype(np.uint8).tobytes().decode("utf-8", errors="replace")
