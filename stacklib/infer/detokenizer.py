"""Token ids to text one step at a time, so that text once shown is never taken back.

A byte-level model writes "é" as two tokens, 0xC3 then 0xA9. Decoding the whole
completion after each step gives "\\ufffd" after the first and "é" after the second:
a stream that sent the difference has already sent the wrong character, and the
length did not change, so it never sends the right one. A stop string has the same
problem in words: with stop="\\n\\n", the first "\\n" looks like text until the second
one arrives and makes it the stop string, which must not be shown.

`IncrementalDetokenizer` therefore holds back

  * the bytes of a character not yet complete (Python's incremental UTF-8 decoder
    keeps them; bytes that cannot become a character are U+FFFD at once), and
  * while the completion runs, its last `len(longest stop string) - 1` characters,
    which a stop string could still turn out to start with.

What `output_text(finished=False)` gives is then a prefix of every later text, so a
stream of differences adds up to exactly the final text, which is what decoding all the
tokens at once gives (cut before the stop string that ended it, if one did).

Stop strings are searched for only where a new one can be: in the new text and the
`len(stop) - 1` characters before it, not in the whole text at every step. Text from
before the completion had `min_tokens` tokens is not searched (a stop string that
starts there and ends later still counts).

With a sub-word tokenizer (`stacklib.llm.hf_tokenizer.HFTokenizer`) a token is several
bytes, and a character can still straddle two tokens (a BPE learned from code splits "😀"
into byte tokens). The same holding back is then done in tokens, with vLLM's prefix and read
offsets: the text of the tokens after `read_offset` is shown once decoding them (after a
few tokens of context from `prefix_offset`) ends in a whole character, not U+FFFD, and the
final step shows whatever is left. Special tokens (an EOS like `<|im_end|>`) are not shown.

Mirrors vLLM's `vllm/v1/engine/detokenizer.py` (`IncrementalDetokenizer.update`
returning the stop string found; `get_next_output_text` holding back
`stop_buffer_length` characters), `detokenize_incrementally` (prefix and read offsets)
and `StopChecker.check_stop_strings`. Differences: for bytes, Python's incremental UTF-8
decoder (and a byte model's EOS, byte 0, stays in the text, as it always has); for a
sub-word tokenizer, the offsets start at the completion's first token (vLLM starts them a
few tokens into the prompt, which matters only for tokenizers whose decoding of a token
depends on the one before it, like SentencePiece's leading spaces); no
`include_stop_str_in_output`, special tokens are always skipped.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Sequence
from typing import Any

from stacklib.llm.tokenizer import ByteTokenizer


class _Utf8Bytes:
    """The text of byte tokens: Python's incremental decoder keeps a character's first bytes."""

    def __init__(self):
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def step(self, new_token_ids: list[int], final: bool) -> str:
        return self._decoder.decode(bytes(new_token_ids), final=final)


class _SubwordTokens:
    """The text of sub-word tokens, held back while it would end in a cut character (vLLM's offsets).

    `token_ids[prefix_offset:read_offset]` is context already shown; the text of the tokens
    after it is new once decoding all of them from `prefix_offset` grows by whole characters.
    """

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.prefix_offset = self.read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def step(self, new_token_ids: list[int], final: bool) -> str:
        self.token_ids += new_token_ids
        shown = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        text = self._decode(self.token_ids[self.prefix_offset:])
        if not final and (len(text) <= len(shown) or text.endswith("\ufffd")):
            return ""  # a character not yet whole (or nothing new): wait for the next tokens
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return text[len(shown):]


class IncrementalDetokenizer:
    """One completion's text, grown a step's tokens at a time (see the module docstring).

    Args:
      stop: strings that end the completion; the text is cut before the first one found.
      min_tokens: stop strings count only once the completion has this many tokens.
      tokenizer: what the ids are: None or a `ByteTokenizer` for bytes, else a sub-word
        tokenizer with `decode(ids, skip_special_tokens=True)` (`HFTokenizer`).
    """

    def __init__(self, stop: Sequence[str] = (), min_tokens: int = 0, tokenizer: Any = None):
        self.stop, self.min_tokens = list(stop), min_tokens
        self.token_ids: list[int] = []
        self.text = ""  # everything decoded so far, cut at a stop string once one is found
        self.stop_buffer_length = max((len(s) for s in self.stop), default=1) - 1
        bytes_ = tokenizer is None or isinstance(tokenizer, ByteTokenizer)
        self._decoder = _Utf8Bytes() if bytes_ else _SubwordTokens(tokenizer)
        self._searched = 0  # no stop string ends inside text[:_searched]

    def update(self, new_token_ids: Iterable[int], final: bool = False) -> str | None:
        """Decode a step's tokens and look for a stop string in what they add.

        Args:
          new_token_ids: the tokens sampled this step.
          final: the completion ends with these tokens (EOS, a stop token, its length):
            an unfinished character left at the end becomes U+FFFD.

        Returns:
          The stop string found (the text is now cut before it), or None.
        """
        new_token_ids = list(new_token_ids)
        self.token_ids += new_token_ids
        self.text += self._decoder.step(new_token_ids, final)
        if len(self.token_ids) < self.min_tokens:
            self._searched = len(self.text)
            return None
        for stop in self.stop:  # the first one listed wins, as in vLLM
            at = self.text.find(stop, max(0, self._searched - len(stop) + 1))
            if at >= 0:
                self.text = self.text[:at]
                return stop
        self._searched = len(self.text)
        return None

    def output_text(self, finished: bool) -> str:
        """The text safe to show: all of it once finished, else without what a stop string may take back."""
        if finished or not self.stop_buffer_length:
            return self.text
        return self.text[:-self.stop_buffer_length]
