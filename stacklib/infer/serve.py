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

Errors are vLLM's bodies, `{"error": {"message", "type", "param", "code"}}`: 400 for
malformed JSON, missing or invalid fields, sampling values out of range and prompts or
`max_tokens` beyond the context; 404 for an unknown model.

Mirrors vLLM's `vllm/entrypoints/openai/api_server.py` and `protocol.py` (a subset of
the request fields; vLLM's extras `top_k`, `min_p`, `min_tokens`, `ignore_eos`,
`stop_token_ids` go in the body, with the openai client's `extra_body`). Differences:
log-probabilities in non-streamed completions only (not in chat, not streamed); no
tools or response formats, no authentication; the chat template is ours (the model is
not chat-tuned: it continues the text).
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
from collections.abc import AsyncIterator
from typing import Any, Literal

import pydantic
from fastapi import FastAPI, Request

from stacklib import http
from stacklib.infer.config import EngineConfig
from stacklib.infer.engine import LLM, LLMEngine
from stacklib.infer.outputs import RequestOutput
from stacklib.infer.sampling_params import SamplingParams
from stacklib.llm import zoo


class _Sampling(pydantic.BaseModel):
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

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        return SamplingParams(n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              min_p=self.min_p, seed=self.seed, stop=self.stop,
                              stop_token_ids=self.stop_token_ids, max_tokens=max_tokens,
                              min_tokens=self.min_tokens, ignore_eos=self.ignore_eos)


PROMPT_FORMS = "a string, a list of strings, a list of token ids, or a list of lists of token ids"


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]  # what OpenAI's API accepts
    logprobs: int | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request: one, or a batch (`["a", "b"]`, `[[1, 2], [3]]`)."""
        if isinstance(self.prompt, str) or all(isinstance(token, int) for token in self.prompt):
            return [self.prompt]
        if not self.prompt:
            raise ValueError("The prompt is empty; give at least one token.")
        return list(self.prompt)

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        params = super().sampling_params(max_tokens)
        params.logprobs = self.logprobs
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be between 0 and 20, got {self.logprobs}.")
        return params


def completion_logprobs(completion) -> dict[str, list] | None:
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


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = pydantic.Field(min_length=1)
    max_completion_tokens: int | None = None


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
          ValueError: the prompt or params do not fit the engine (before anything is yielded).
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


def _completion_id(prefix: str) -> str:
    return f"{prefix}-{time.time_ns():x}"


def create_app(llm: LLM, served_model_name: str | None = None) -> FastAPI:
    """The OpenAI-compatible app serving `llm` (its engine loop starts now, stops at shutdown)."""
    name = served_model_name or llm.model_name
    engine = AsyncEngine(llm.llm_engine)
    tokenizer = llm.get_tokenizer()
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        engine.close()

    app = http.create_app("stacklib.infer", error_param=True)
    app.router.lifespan_context = lifespan
    app.state.engine = engine

    async def parse(request: Request, model: type[_Sampling]) -> _Sampling:
        payload = await http.read_json(request)
        try:
            body = model.model_validate(payload)
        except pydantic.ValidationError as error:
            first = error.errors()[0]
            if first["loc"][:1] == ("prompt",):  # pydantic would name a member of the union
                raise http.HTTPError(400, f"invalid request: prompt must be {PROMPT_FORMS}.",
                                     param="prompt") from None
            param = ".".join(str(part) for part in first["loc"]) or None
            raise http.HTTPError(400, f"invalid request: {param}: {first['msg']}", param=param) from None
        if body.model != name:
            raise http.HTTPError(404, f"The model `{body.model}` does not exist; this server serves "
                                      f"`{name}`.", param="model")
        return body

    async def start(prompt, body: _Sampling, max_tokens) -> AsyncIterator[RequestOutput]:
        """The request's output stream, primed: errors in the request surface here as 400s."""
        try:
            params = body.sampling_params(max_tokens)
            stream = engine.generate(prompt, params)
            first = await anext(stream)
        except ValueError as error:
            message = str(error)
            # SamplingParams' messages start with the field's name; the engine's name the context.
            first_word = message.split()[0]
            param = (first_word if first_word in SamplingParams.__dataclass_fields__
                     else "max_tokens" if "Reduce max_tokens" in message else "prompt")
            raise http.HTTPError(400, message, param=param) from None

        async def chained():
            yield first
            async for output in stream:
                yield output
        return chained()

    def usage(output: RequestOutput) -> dict[str, int]:
        completion = sum(len(c.token_ids) for c in output.outputs)
        return {"prompt_tokens": len(output.prompt_token_ids), "completion_tokens": completion,
                "total_tokens": len(output.prompt_token_ids) + completion}

    def deltas(outputs: AsyncIterator[RequestOutput], n: int):
        """(output, [(index, new text, finish_reason, stop_reason)]) per step."""
        async def gen():
            sent = [0] * n
            async for output in outputs:
                changes = []
                for c in output.outputs:
                    if len(c.text) > sent[c.index] or c.finish_reason:
                        changes.append((c.index, c.text[sent[c.index]:], c.finish_reason, c.stop_reason))
                        sent[c.index] = len(c.text)
                yield output, changes
        return gen()

    async def last(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
        async for output in outputs:
            final = output
        return final

    async def start_all(prompts, body: CompletionRequest) -> list[AsyncIterator[RequestOutput]]:
        """Every prompt's stream, or none: a bad prompt aborts the ones already started."""
        streams = []
        try:
            for prompt in prompts:
                streams.append(await start(prompt, body, body.max_tokens))
        except http.HTTPError:
            for stream in streams:
                await stream.aclose()
            raise
        return streams

    async def merged(streams: list[AsyncIterator[RequestOutput]], n: int):
        """(prompt index, output, changes) from all streams as they come; cancelling aborts them all."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index, stream):
            try:
                async for output, changes in deltas(stream, n):
                    await queue.put((index, output, changes))
                await queue.put((index, None, None))
            except Exception as error:  # noqa: BLE001 - the engine failed: the response must end
                await queue.put((index, error, None))

        tasks = [asyncio.create_task(pump(index, stream)) for index, stream in enumerate(streams)]
        try:
            running = len(tasks)
            while running:
                index, output, changes = await queue.get()
                if isinstance(output, Exception):
                    raise output
                if output is None:
                    running -= 1
                else:
                    yield index, output, changes
        finally:
            for task in tasks:
                task.cancel()

    def total_usage(outputs: list[RequestOutput]) -> dict[str, int]:
        each = [usage(output) for output in outputs]
        return {key: sum(u[key] for u in each) for key in each[0]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await parse(request, CompletionRequest)
        try:
            prompts = body.prompts()
        except ValueError as error:
            raise http.HTTPError(400, str(error), param="prompt") from None
        streams = await start_all(prompts, body)
        base = {"id": _completion_id("cmpl"), "object": "text_completion", "created": int(time.time()),
                "model": name}
        # Choice i of prompt p has index p * n + i, as in vLLM.
        if not body.stream:
            outputs = await asyncio.gather(*(last(stream) for stream in streams))
            return {**base, "usage": total_usage(outputs), "choices": [
                {"index": p * body.n + c.index, "text": c.text, "logprobs": completion_logprobs(c),
                 "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                for p, output in enumerate(outputs) for c in output.outputs]}

        async def chunks():
            finals = {}
            async for p, output, changes in merged(streams, body.n):
                finals[p] = output
                for index, text, finish, stop in changes:
                    yield {**base, "choices": [{"index": p * body.n + index, "text": text, "logprobs": None,
                                                "finish_reason": finish, "stop_reason": stop}]}
            if (body.stream_options or {}).get("include_usage"):
                yield {**base, "choices": [], "usage": total_usage(list(finals.values()))}
        return http.event_stream(chunks())

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await parse(request, ChatCompletionRequest)
        max_tokens = body.max_completion_tokens or body.max_tokens
        outputs = await start(apply_chat_template(body.messages), body, max_tokens)
        base = {"id": _completion_id("chatcmpl"), "object": "chat.completion", "created": int(time.time()),
                "model": name}
        if not body.stream:
            output = await last(outputs)
            return {**base, "usage": usage(output), "choices": [
                {"index": c.index, "message": {"role": "assistant", "content": c.text},
                 "logprobs": None, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                for c in output.outputs]}
        base["object"] = "chat.completion.chunk"

        async def chunks():
            for index in range(body.n):
                yield {**base, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}]}
            final = None
            async for output, changes in deltas(outputs, body.n):
                final = output
                for index, text, finish, stop in changes:
                    yield {**base, "choices": [{"index": index, "delta": {"content": text}, "logprobs": None,
                                                "finish_reason": finish, "stop_reason": stop}]}
            if (body.stream_options or {}).get("include_usage"):
                yield {**base, "choices": [], "usage": usage(final)}
        return http.event_stream(chunks())

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created,
                                            "owned_by": "stacklib", "root": name,
                                            "max_model_len": llm.llm_engine.max_model_len}]}

    @app.get("/health")
    async def health():
        if engine.error is not None:
            raise http.HTTPError(500, f"the engine failed: {engine.error}")
        return {"status": "ok"}

    app.state.tokenizer = tokenizer
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
