"""An OpenAI-compatible server for `LLM`, like `vllm serve`, on the shared `stacklib.http` layer.

    python -m stacklib.infer.serve --model stdlib-bytes --port 8000

    POST /v1/completions        {"model", "prompt", "max_tokens", "temperature", "stream", ...}
                                (prompt: a string, token ids, or a batch of either, as OpenAI's)
    POST /v1/chat/completions   {"model", "messages": [{"role", "content"}], ...}
    GET  /v1/models             the one model served
    GET  /health                200 while the engine loop runs

Every request, from every client, joins the same continuous batch: one thread runs the
engine's `step()` in a loop (`AsyncEngine`), and each request waits on its own queue
for the outputs the loop hands back. A streamed response sends each step's new text as
a server-sent event and ends with `data: [DONE]`; a client that disconnects mid-stream
aborts its request, and its blocks go back to the pool.

Each endpoint is a module-level handler taking the parsed body and the `ServerState`;
`create_app` only routes HTTP to them. Completions and chat share the rest: `_start`
admits the prompts, `_finals` waits for the answers, `_event_stream` streams them.

Errors are vLLM's bodies, `{"error": {"message", "type", "param", "code"}}`: 400 for
malformed JSON, missing or invalid fields, sampling values out of range and prompts or
`max_tokens` beyond the context; 404 for an unknown model. `param` is the field at
fault: pydantic's location for a malformed field, and for a value the engine refuses the
`param` of the `InvalidRequestError` that `SamplingParams` or `LLMEngine.add_request`
raised (in chat, a prompt too long is `messages`'s fault).

Mirrors vLLM's `vllm/entrypoints/openai/api_server.py` and `protocol.py` (a subset of
the request fields; vLLM's extras `top_k`, `min_p`, `min_tokens`, `ignore_eos`,
`stop_token_ids` go in the body, with the openai client's `extra_body`). Differences:
log-probabilities in non-streamed completions only (not in chat, not streamed); no
tools or response formats, no authentication; the chat template is ours (the model is
not chat-tuned: it continues the text); a prompt past the context is `param` "prompt"
or "messages" (vLLM: "input_tokens").
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import itertools
import os
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from stacklib import http
from stacklib.infer.config import EngineConfig
from stacklib.infer.engine import LLM, LLMEngine
from stacklib.infer.outputs import CompletionOutput, RequestOutput
from stacklib.infer.sampling_params import InvalidRequestError, SamplingParams
from stacklib.llm import zoo


class _GenerateRequest(pydantic.BaseModel):
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
        """`SamplingParams` from this request's fields of the same names, then `overrides`."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(SamplingParams)
                  if f.name in type(self).model_fields}
        return SamplingParams(**{**fields, **overrides})

    def request_field(self, param: str) -> str:
        """This request's name for the engine's field `param` (an `InvalidRequestError`'s)."""
        return param


PROMPT_FORMS = "a string, a list of strings, a list of token ids, or a list of lists of token ids"
MAX_LOGPROBS = 20  # vLLM's default --max-logprobs


class CompletionRequest(_GenerateRequest):
    prompt: str | list[int] | list[str] | list[list[int]]  # what OpenAI's API accepts
    logprobs: int | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request: one, or a batch (`["a", "b"]`, `[[1, 2], [3]]`)."""
        if isinstance(self.prompt, str) or all(isinstance(token, int) for token in self.prompt):
            return [self.prompt]
        return list(self.prompt)

    def sampling_params(self, **overrides: Any) -> SamplingParams:
        if self.logprobs is not None and self.logprobs > MAX_LOGPROBS:
            raise InvalidRequestError(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}.",
                                      param="logprobs")
        return super().sampling_params(**overrides)


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


class ChatMessage(pydantic.BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class ChatCompletionRequest(_GenerateRequest):
    messages: list[ChatMessage] = pydantic.Field(min_length=1)
    max_completion_tokens: int | None = None

    def prompts(self) -> list[str]:
        return [apply_chat_template(self.messages)]

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
    """Our chat template: each turn as `<|role|>\\ncontent\\n`, then the assistant's header."""
    turns = "".join(f"<|{m.role}|>\n{m.content}\n" for m in messages)
    return turns + "<|assistant|>\n"


class AsyncEngine:
    """One thread stepping an `LLMEngine`; requests from any asyncio task join its batch.

    The engine is not thread-safe, so every call into it holds `_lock`; the loop sleeps
    on `_wakeup` while there is nothing to do.
    """

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._lock, self._wakeup = threading.Lock(), threading.Event()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ids = itertools.count()
        self._stopping = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, daemon=True, name="engine-loop")
        self._thread.start()

    def _loop(self) -> None:
        while not self._stopping:
            with self._lock:
                busy = self.engine.has_unfinished_requests()
                try:
                    outputs = self.engine.step() if busy else []
                except Exception as error:  # noqa: BLE001 - every waiting client must hear of it
                    self.error = error
                    outputs = [error]
                for output in outputs:  # under the lock: a request may be leaving meanwhile
                    targets = list(self._queues) if isinstance(output, Exception) else [output.request_id]
                    for request_id in targets:
                        if request_id in self._queues:
                            loop, queue = self._queues[request_id]
                            loop.call_soon_threadsafe(queue.put_nowait, output)
            if not busy:
                self._wakeup.wait(0.5)
                self._wakeup.clear()

    async def generate(self, prompt: str | list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its outputs step by step; closing the iterator aborts it.

        Raises:
          InvalidRequestError: the engine refuses the request (before anything is yielded).
        """
        request_id = f"req-{next(self._ids)}"
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            self.engine.add_request(request_id, prompt, params)
            self._queues[request_id] = (asyncio.get_running_loop(), queue)
        self._wakeup.set()
        finished = False
        try:
            while not finished:
                output = await queue.get()
                if isinstance(output, Exception):
                    raise RuntimeError(f"the engine failed: {type(output).__name__}: {output}")
                finished = output.finished
                yield output
        finally:
            with self._lock:
                self._queues.pop(request_id, None)
                if not finished:
                    self.engine.abort_request(request_id)

    def close(self) -> None:
        self._stopping = True
        self._wakeup.set()
        self._thread.join(10)


@dataclasses.dataclass
class ServerState:
    """What every handler needs, like vLLM's `app.state`: the engine loop and the served model."""

    engine: AsyncEngine
    model_name: str
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))


async def _parse(request: Request, schema: type[_GenerateRequest], state: ServerState) -> Any:
    """The body as `schema`, or the 400 (a malformed field) or 404 (another model) that says why not."""
    payload = await http.read_json(request)
    try:
        body = schema.model_validate(payload)
    except pydantic.ValidationError as error:
        first = error.errors()[0]
        if first["loc"][:1] == ("prompt",):  # pydantic would name a member of the union
            raise http.HTTPError(400, f"invalid request: prompt must be {PROMPT_FORMS}.",
                                 param="prompt") from None
        param = ".".join(str(part) for part in first["loc"]) or None
        raise http.HTTPError(400, f"invalid request: {param}: {first['msg']}", param=param) from None
    if body.model != state.model_name:
        raise http.HTTPError(404, f"The model `{body.model}` does not exist; this server serves "
                                  f"`{state.model_name}`.", param="model")
    return body


async def _prepend(first: RequestOutput, rest: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    """A primed stream made whole again: `first`, then `rest`."""
    yield first
    async for output in rest:
        yield output


async def _start(state: ServerState, body: CompletionRequest | ChatCompletionRequest,
                 ) -> list[AsyncIterator[RequestOutput]]:
    """Every prompt's output stream, each primed with its first output, or a 400 naming the field at fault.

    Priming makes a refused request fail here, before a streamed response has sent its 200.
    All or none: when one prompt of a batch is refused, the ones already admitted are aborted.
    """
    started = []  # (first output, the rest) per prompt
    try:
        params = body.sampling_params()
        for prompt in body.prompts():
            stream = state.engine.generate(prompt, params)
            started.append((await anext(stream), stream))
    except InvalidRequestError as error:
        for _, stream in started:
            await stream.aclose()
        raise http.HTTPError(400, str(error), param=body.request_field(error.param)) from None
    return [_prepend(first, rest) for first, rest in started]


async def _finals(streams: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    """Each stream's last output: its finished request."""
    async def last(stream):
        async for output in stream:
            final = output
        return final

    return await asyncio.gather(*(last(stream) for stream in streams))


async def _steps(streams: list[AsyncIterator[RequestOutput]], n: int):
    """Every step of every stream as it comes: (prompt index, output, changes).

    `changes` lists each choice the step advanced as (choice index, new text, finish_reason,
    stop_reason). Closing this generator (the client went away) cancels the tasks that read
    the streams, which aborts their requests.
    """
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(p, stream):
        sent = [0] * n  # characters of each choice's text already sent
        try:
            async for output in stream:
                changes = []
                for c in output.outputs:
                    if len(c.text) > sent[c.index] or c.finish_reason:
                        changes.append((c.index, c.text[sent[c.index]:], c.finish_reason, c.stop_reason))
                        sent[c.index] = len(c.text)
                await queue.put((p, output, changes))
            await queue.put((p, None, None))
        except Exception as error:  # noqa: BLE001 - the engine failed: the response must end
            await queue.put((p, error, None))

    tasks = [asyncio.create_task(pump(p, stream)) for p, stream in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            p, output, changes = await queue.get()
            if isinstance(output, Exception):
                raise output
            if output is None:
                running -= 1
            else:
                yield p, output, changes
    finally:
        for task in tasks:
            task.cancel()


def _usage(outputs: list[RequestOutput]) -> dict[str, int]:
    """OpenAI's `usage`, summed over the prompts and their choices."""
    prompt = sum(len(output.prompt_token_ids) for output in outputs)
    completion = sum(len(c.token_ids) for output in outputs for c in output.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _header(state: ServerState, prefix: str, kind: str) -> dict[str, Any]:
    """The fields a response, and each of its streamed chunks, starts with."""
    return {"id": f"{prefix}-{time.time_ns():x}", "object": kind, "created": int(time.time()),
            "model": state.model_name}


def _event_stream(streams: list[AsyncIterator[RequestOutput]],
                  body: CompletionRequest | ChatCompletionRequest, header: dict[str, Any],
                  content: Callable[[str], dict[str, Any]], opening: tuple[dict[str, Any], ...] = (),
                  ) -> StreamingResponse:
    """Completions and chat streamed alike: `opening`, a chunk per choice per step, usage if asked.

    A step's chunk holds one choice whose new text `content` wraps as its endpoint does
    (`{"text": ...}`, `{"delta": {"content": ...}}`); choice i of prompt p is index p * n + i.
    """
    async def chunks():
        for chunk in opening:
            yield chunk
        finals = {}
        async for p, output, changes in _steps(streams, body.n):
            finals[p] = output
            for index, text, finish, stop in changes:
                yield {**header, "choices": [{"index": p * body.n + index, **content(text), "logprobs": None,
                                              "finish_reason": finish, "stop_reason": stop}]}
        if (body.stream_options or {}).get("include_usage"):
            yield {**header, "choices": [], "usage": _usage(list(finals.values()))}

    return http.event_stream(chunks())


async def completions(body: CompletionRequest, state: ServerState) -> dict[str, Any] | StreamingResponse:
    """POST /v1/completions: choice i of prompt p has index p * n + i, as in vLLM."""
    streams = await _start(state, body)
    header = _header(state, "cmpl", "text_completion")
    if body.stream:
        return _event_stream(streams, body, header, lambda text: {"text": text})
    outputs = await _finals(streams)
    return {**header, "usage": _usage(outputs), "choices": [
        {"index": p * body.n + c.index, "text": c.text, "logprobs": completion_logprobs(c),
         "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        for p, output in enumerate(outputs) for c in output.outputs]}


async def chat_completions(body: ChatCompletionRequest, state: ServerState,
                           ) -> dict[str, Any] | StreamingResponse:
    """POST /v1/chat/completions: the messages through our chat template, one choice per `n`."""
    streams = await _start(state, body)
    if body.stream:
        header = _header(state, "chatcmpl", "chat.completion.chunk")
        roles = tuple({**header, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                              "logprobs": None, "finish_reason": None}]}
                      for index in range(body.n))
        return _event_stream(streams, body, header, lambda text: {"delta": {"content": text}}, roles)
    outputs = await _finals(streams)
    return {**_header(state, "chatcmpl", "chat.completion"), "usage": _usage(outputs), "choices": [
        {"index": c.index, "message": {"role": "assistant", "content": c.text},
         "logprobs": None, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        for c in outputs[0].outputs]}


def models(state: ServerState) -> dict[str, Any]:
    """GET /v1/models: the one model served, with its context length (vLLM's `max_model_len`)."""
    return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                        "owned_by": "stacklib", "root": state.model_name,
                                        "max_model_len": state.engine.engine.max_model_len}]}


def health(state: ServerState) -> dict[str, str]:
    """GET /health: ok while the engine loop runs; 500 once a step has failed."""
    if state.engine.error is not None:
        raise http.HTTPError(500, f"the engine failed: {state.engine.error}")
    return {"status": "ok"}


def create_app(llm: LLM, served_model_name: str | None = None) -> FastAPI:
    """The OpenAI-compatible app serving `llm` (its engine loop starts now, stops at shutdown)."""
    state = ServerState(AsyncEngine(llm.llm_engine), served_model_name or llm.model_name)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        state.engine.close()

    app = http.create_app("stacklib.infer", error_param=True)
    app.router.lifespan_context = lifespan

    @app.post("/v1/completions")
    async def _completions(request: Request):
        return await completions(await _parse(request, CompletionRequest, state), state)

    @app.post("/v1/chat/completions")
    async def _chat_completions(request: Request):
        return await chat_completions(await _parse(request, ChatCompletionRequest, state), state)

    @app.get("/v1/models")
    async def _models():
        return models(state)

    @app.get("/health")
    async def _health():
        return health(state)

    return app


def main(argv: list[str] | None = None) -> int:
    """`python -m stacklib.infer.serve --model NAME ...`; a user mistake exits with status 2."""
    parser = argparse.ArgumentParser(prog="python -m stacklib.infer.serve",
                                     description="An OpenAI-compatible server for a stacklib.llm model, "
                                                 "like `vllm serve`.")
    parser.add_argument("--model", default="stdlib-bytes",
                        help=f"a zoo name ({', '.join(sorted(zoo.ZOO))}) or a folder holding a model saved "
                             "in the zoo's format (default: %(default)s)")
    parser.add_argument("--served-model-name", default=None, help="the name clients use (default: --model)")
    parser.add_argument("--host", default="127.0.0.1", help="(default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port (default: %(default)s)")
    EngineConfig.add_cli_args(parser)
    args = parser.parse_args(argv)
    if args.model not in zoo.ZOO and not os.path.isdir(args.model):
        parser.error(f"--model {args.model!r} is neither a zoo name ({', '.join(sorted(zoo.ZOO))}) nor a "
                     "folder holding a saved model.")
    try:
        config = EngineConfig.from_cli_args(args)  # a bad setting fails before any work
        sock = http.listen_socket(args.host, args.port)  # before loading: a taken port fails at once
        llm = LLM(args.model, **dataclasses.asdict(config))
    except (OSError, ValueError) as error:
        parser.error(str(error))
    host, port = sock.getsockname()
    print(f"serving {args.served_model_name or args.model} on http://{host}:{port}/v1", flush=True)
    http.serve(create_app(llm, args.served_model_name), sock)
    return 0


if __name__ == "__main__":
    sys.exit(main())
