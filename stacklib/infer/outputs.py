"""What `LLM.generate` returns: `RequestOutput`s holding `CompletionOutput`s, as in vLLM.

Mirrors `vllm.outputs.RequestOutput` / `CompletionOutput` and `vllm.sequence.Logprob`.
Differences: no `prompt_logprobs`, no metrics object, no LoRA request.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Logprob:
    """A token's log-probability, its rank (1 = most likely) and its text."""

    logprob: float
    rank: int
    decoded_token: str


@dataclasses.dataclass
class CompletionOutput:
    """One completion of a prompt.

    Attributes:
      index: which of the request's `n` completions.
      text: the generated text (a stop string, if one ended it, is cut off). While the
        completion runs: whole characters only, without the last characters a stop string
        could still take back, so each text starts with the one before (detokenizer.py).
      token_ids: the generated token ids.
      cumulative_logprob: sum of the chosen tokens' log-probabilities.
      logprobs: per generated token, `{token_id: Logprob}` (None unless asked for).
      finish_reason: None while generating, then "stop" (EOS, a stop string or token)
        or "length" (max_tokens or the context ran out).
      stop_reason: the stop string or stop token id that ended it; None for EOS/length.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    """A request's prompt and its completions so far (`finished` once all are done)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
