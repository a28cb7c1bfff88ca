"""`SamplingParams`: how to choose each next token, with vLLM's names and defaults.

    SamplingParams(temperature=0.0, max_tokens=32)             # greedy
    SamplingParams(temperature=0.8, top_p=0.95, seed=0, n=2)   # sampled, reproducible

The rule, applied to one row of logits `z` (vocab,):
  1. before `min_tokens` tokens, the EOS ids and `stop_token_ids` are forbidden (logit -inf);
  2. temperature 0 (below 1e-5, as in vLLM) takes argmax z: greedy;
  3. otherwise p = softmax(z / temperature), then keep the `top_k` most likely tokens,
     the smallest set whose probability reaches `top_p`, and tokens with
     p >= `min_p` * max p; renormalise and draw.
Reported log-probabilities are those of the model's distribution, log softmax(z),
as vLLM reports them by default.

Sampling runs on the host in NumPy with one `numpy.random.Generator` per sequence,
seeded from `seed` (and the sequence's index among `n`), so a seeded request draws
the same tokens whatever else shares its batch.

Mirrors `vllm.SamplingParams` (a documented subset). Differences: no penalties
(presence, frequency, repetition), no `logit_bias`, no beam search, no guided decoding;
`logprobs` holds `{token_id: Logprob}` dicts like vLLM's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection

import numpy as np

_GREEDY_EPS = 1e-5


class InvalidRequestError(ValueError):
    """A request the engine refuses, with `param`: the field at fault, by its OpenAI/vLLM name.

    Raised where a request is checked (`SamplingParams`, `LLMEngine.add_request`), so the
    OpenAI server reports the field in its error body's `"param"` from the exception, not
    by reading the message. A `ValueError`, so offline callers catch it as before.

    # NB: vLLM's `vllm.exceptions.VLLMValidationError(message, parameter=..., value=...)`.
    """

    def __init__(self, message: str, *, param: str):
        super().__init__(message)
        self.param = param


@dataclasses.dataclass
class SamplingParams:
    """Sampling parameters for one request (vLLM's names and defaults).

    Attributes:
      n: completions per prompt.
      temperature: 0 for greedy; larger flattens the distribution.
      top_p: keep the smallest set of tokens whose probability reaches top_p (1 keeps all).
      top_k: keep the k most likely tokens (0 or -1 keeps all).
      min_p: keep tokens at least min_p times as likely as the most likely one.
      seed: seed of this request's random draws (None: from the engine's seed).
      stop: strings that end the completion (not included in the text).
      stop_token_ids: token ids that end the completion (kept in `token_ids`).
      max_tokens: the most tokens to generate.
      min_tokens: tokens to generate before EOS or stop_token_ids may end it.
      logprobs: how many most-likely tokens' log-probabilities to return per step
        (the chosen one always included); None for none.
      ignore_eos: keep generating after EOS.

    Raises:
      InvalidRequestError: a value out of range; its `param` names the attribute.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    ignore_eos: bool = False

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        checks = [  # (holds, the field at fault, what is wrong)
            (self.n >= 1, "n", f"n must be at least 1, got {self.n}."),
            (self.temperature >= 0, "temperature",
             f"temperature must be non-negative, got {self.temperature}."),
            (0 < self.top_p <= 1, "top_p", f"top_p must be in (0, 1], got {self.top_p}."),
            (self.top_k >= -1, "top_k",
             f"top_k must be -1 (disable), 0 (disable) or at least 1, got {self.top_k}."),
            (0 <= self.min_p <= 1, "min_p", f"min_p must be in [0, 1], got {self.min_p}."),
            (self.seed is None or self.seed >= 0, "seed", f"seed must be non-negative, got {self.seed}."),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens",
             f"max_tokens must be at least 1, got {self.max_tokens}."),
            (self.min_tokens >= 0, "min_tokens", f"min_tokens must be non-negative, got {self.min_tokens}."),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
             f"min_tokens={self.min_tokens} must not exceed max_tokens={self.max_tokens}."),
            (self.logprobs is None or self.logprobs >= 0, "logprobs",
             f"logprobs must be non-negative, got {self.logprobs}."),
            (all(s for s in self.stop), "stop", "stop strings must not be empty."),
        ]
        for ok, param, message in checks:
            if not ok:
                raise InvalidRequestError(message, param=param)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    z = z - z.max()
    return z - np.log(np.exp(z).sum())


def filter_probs(probs: np.ndarray, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """`probs` (vocab,) with the tokens that top-k, top-p and min-p reject set to 0, renormalised."""
    keep = np.ones(probs.shape, bool)
    order = np.argsort(-probs, kind="stable")  # most likely first; ties by token id
    if top_k > 0:
        keep[order[top_k:]] = False
    if top_p < 1.0:
        before = np.concatenate([[0.0], np.cumsum(probs[order])[:-1]])  # mass of the more likely tokens
        keep[order[before >= top_p]] = False  # the token that crosses top_p is kept
    if min_p > 0.0:
        keep &= probs >= min_p * probs.max()
    filtered = np.where(keep, probs, 0.0)
    return filtered / filtered.sum()


def sample_token(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator,
                 num_generated: int, eos_token_ids: Collection[int] = ()) -> int:
    """The next token for one sequence from its logits (vocab,); `eos_token_ids` end a text."""
    if num_generated < params.min_tokens:
        banned = list(params.stop_token_ids) + sorted(eos_token_ids)
        logits = logits.copy()
        logits[banned] = -np.inf
    if params.greedy:
        return int(np.argmax(logits))
    probs = np.exp(log_softmax(logits / params.temperature))
    probs = filter_probs(probs, params.top_k, params.top_p, params.min_p)
    return int(rng.choice(len(probs), p=probs))
