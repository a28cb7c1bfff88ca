"""The OpenAI API's request bodies as pydantic models, and the pieces of its answers built from outputs.

    body = parse_request(CompletionRequest, {"model": "stdlib-bytes", "prompt": "def f(", "n": 2})
    body.prompts(tokenizer), body.sampling_params()    # -> ["def f("], SamplingParams(n=2, ...)

A request is validated twice: here its fields' types (a 400 naming the field pydantic
found at fault), then its values by `SamplingParams` and `LLMEngine.add_request`, which
raise `InvalidRequestError` with the field's engine name; `request_field` turns that
into the request's own name (in chat, a prompt too long is `messages`'s fault).

A chat's messages become one prompt through the model's own chat template when its
tokenizer has one (`HFTokenizer.apply_chat_template`, rendered from tokenizer_config.json,
encoded without adding special tokens), and through ours (`apply_chat_template` here) for
the book's byte-level models, which were never chat-tuned.

Mirrors vLLM's `vllm/entrypoints/openai/protocol.py` (`CompletionRequest`,
`ChatCompletionRequest`, `to_sampling_params`, `chat_template_kwargs`). Differences: a
subset of the fields (vLLM's extras `top_k`, `min_p`, `min_tokens`, `ignore_eos`,
`stop_token_ids` included); responses are plain dicts, not pydantic models; a message's
content is a string (no parts, images or tool calls).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import pydantic

from stacklib import http
from stacklib.infer.outputs import CompletionOutput, RequestOutput
from stacklib.infer.sampling_params import InvalidRequestError, SamplingParams
from stacklib.llm.tokenizer import ByteTokenizer

PROMPT_FORMS = "a string, a list of strings, a list of token ids, or a list of lists of token ids"
MAX_LOGPROBS = 20  # vLLM's default --max-logprobs


class GenerateRequest(pydantic.BaseModel):
    """The request fields shared by completions and chat (OpenAI's names, vLLM's extras)."""

    model_config = pydantic.ConfigDict(extra="ignore")
    model: str
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    top_k: int = 0
    min_p: float = 0.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None

    def sampling_params(self, **overrides: Any) -> SamplingParams:
        """`SamplingParams` from this request's fields of the same names, then `overrides`.

        Raises:
          InvalidRequestError: a value out of range (`param` is the engine's field name).
        """
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(SamplingParams)
                  if f.name in type(self).model_fields}
        return SamplingParams(**{**fields, **overrides})

    def request_field(self, param: str) -> str:
        """This request's name for the engine's field `param` (an `InvalidRequestError`'s)."""
        return param


class CompletionRequest(GenerateRequest):
    prompt: str | list[int] | list[str] | list[list[int]]  # what OpenAI's API accepts
    logprobs: int | None = None

    def prompts(self, tokenizer: Any = None) -> list[str | list[int]]:
        """The prompts of this request: one, or a batch (`["a", "b"]`, `[[1, 2], [3]]`); the engine
        encodes text with its tokenizer."""
        if isinstance(self.prompt, str) or all(isinstance(token, int) for token in self.prompt):
            return [self.prompt]
        return list(self.prompt)

    def sampling_params(self, **overrides: Any) -> SamplingParams:
        if self.logprobs is not None and self.logprobs > MAX_LOGPROBS:
            raise InvalidRequestError(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}.",
                                      param="logprobs")
        return super().sampling_params(**overrides)


class ChatMessage(pydantic.BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class ChatCompletionRequest(GenerateRequest):
    messages: list[ChatMessage] = pydantic.Field(min_length=1)
    max_completion_tokens: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: more template variables

    def prompts(self, tokenizer: Any = None) -> list[str | list[int]]:
        """The one prompt of the conversation: the model's template's token ids, or our template's text.

        Raises:
          InvalidRequestError: the model has no chat template, the template refused the messages
            (its `raise_exception`), or a message is not valid Unicode (`param` "prompt").
        """
        if tokenizer is None or isinstance(tokenizer, ByteTokenizer):
            return [apply_chat_template(self.messages)]
        messages = [message.model_dump() for message in self.messages]
        try:
            return [tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  **(self.chat_template_kwargs or {}))]
        except ValueError as error:  # no template, a refusal, or a UnicodeEncodeError
            raise InvalidRequestError(f"The messages cannot be made a prompt: {error}",
                                      param="prompt") from None

    def sampling_params(self, **overrides: Any) -> SamplingParams:
        return super().sampling_params(max_tokens=self.max_completion_tokens or self.max_tokens, **overrides)

    def request_field(self, param: str) -> str:
        """The prompt is made of the messages; `max_completion_tokens`, when given, is the length."""
        if param == "prompt":
            return "messages"
        if param == "max_tokens" and self.max_completion_tokens:
            return "max_completion_tokens"
        return param


def apply_chat_template(messages: list[ChatMessage]) -> str:
    """Our chat template, for models without one: each turn as `<|role|>\\ncontent\\n`, then the
    assistant's header."""
    turns = "".join(f"<|{m.role}|>\n{m.content}\n" for m in messages)
    return turns + "<|assistant|>\n"


def parse_request(schema: type[GenerateRequest], payload: dict[str, Any]) -> Any:
    """`payload` as a `schema`, or an `HTTPError` 400 whose `param` is the first field at fault."""
    try:
        return schema.model_validate(payload)
    except pydantic.ValidationError as error:
        first = error.errors()[0]
        if first["loc"][:1] == ("prompt",):  # pydantic would name a member of the union
            raise http.HTTPError(400, f"invalid request: prompt must be {PROMPT_FORMS}.",
                                 param="prompt") from None
        param = ".".join(str(part) for part in first["loc"]) or None
        raise http.HTTPError(400, f"invalid request: {param}: {first['msg']}", param=param) from None


def completion_logprobs(completion: CompletionOutput) -> dict[str, list] | None:
    """OpenAI's completions `logprobs` object from a `CompletionOutput`'s per-token dicts."""
    if completion.logprobs is None:
        return None
    tokens, offsets, offset = [], [], 0
    for token_id, step in zip(completion.token_ids, completion.logprobs, strict=True):
        tokens.append(step[token_id].decoded_token)
        offsets.append(offset)
        offset += len(tokens[-1])
    return {"tokens": tokens,
            "token_logprobs": [step[t].logprob for t, step in zip(completion.token_ids, completion.logprobs,
                                                                   strict=True)],
            "top_logprobs": [{lp.decoded_token: lp.logprob for lp in step.values()}
                             for step in completion.logprobs],
            "text_offset": offsets}


def usage(outputs: list[RequestOutput]) -> dict[str, int]:
    """OpenAI's `usage`, summed over the prompts and their choices."""
    prompt = sum(len(output.prompt_token_ids) for output in outputs)
    completion = sum(len(c.token_ids) for output in outputs for c in output.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
