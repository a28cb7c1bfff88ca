"""An OpenAI-compatible server for `LLM`, like `vllm serve`, on the shared `stacklib.http` layer.

    python -m stacklib.infer.serve --model stdlib-bytes --port 8000
    python -m stacklib.infer.serve --model path/to/Qwen3-0.6B    # a Hugging Face checkpoint folder

    POST /v1/completions        {"model", "prompt", "max_tokens", "temperature", "stream", ...}
                                (prompt: a string, token ids, or a batch of either, as OpenAI's)
    POST /v1/chat/completions   {"model", "messages": [{"role", "content"}], ...}
    GET  /v1/models             the one model served
    GET  /health                200 while the engine loop runs

Every request, from every client, joins the same continuous batch: one thread runs the
engine's `step()` in a loop (async_engine.py), and each request waits on its own queue
for the outputs the loop hands back. The prompts of one request (a batch of prompts,
each with `n` completions) are queued together, so they start in the same step when the
batch has room for them. A streamed
response sends each choice's new text as a server-sent event and ends with
`data: [DONE]`; the text is whole characters and never what a stop string takes back
(detokenizer.py), so the events add up to exactly the text a non-streamed request with
the same seed gets. A client that disconnects mid-stream aborts its requests, and their
blocks go back to the pool.

The pieces: protocol.py parses and validates the request bodies; each endpoint here is
a module-level handler taking the parsed body and the `ServerState`, and `create_app`
only routes HTTP to them. Completions and chat share the rest: `_start` queues the
prompts, `_finals` waits for the answers, `_event_stream` streams them.

Errors are vLLM's bodies, `{"error": {"message", "type", "param", "code"}}`: 400 for
malformed JSON, missing or invalid fields, sampling values out of range and prompts or
`max_tokens` beyond the context; 404 for an unknown model. `param` is the field at
fault: pydantic's location for a malformed field, and for a value the engine refuses the
`param` of the `InvalidRequestError` that `SamplingParams` or `LLMEngine.add_request`
raised (in chat, a prompt too long is `messages`'s fault). A refused prompt in a batch
refuses the whole request, and none of its prompts stays queued.

Mirrors vLLM's `vllm/entrypoints/openai/api_server.py`, `serving_completion.py` and
`serving_chat.py` (a subset of the request fields; vLLM's extras `top_k`, `min_p`,
`min_tokens`, `ignore_eos`, `stop_token_ids`, `chat_template_kwargs` go in the body, with
the openai client's `extra_body`). Chat renders the messages with the model's own chat
template (tokenizer_config.json's) when its tokenizer has one, else with ours (the book's
byte-level models are not chat-tuned: they continue the text); a model with a tokenizer but
no template refuses chat with a 400, as vLLM does. Differences: log-probabilities in
non-streamed completions only (not in chat, not streamed); no tools or response formats, no
`--chat-template` override, no authentication; a prompt past the context is `param`
"prompt" or "messages" (vLLM: "input_tokens").
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import sys
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from stacklib import http
from stacklib.infer.async_engine import AsyncEngine
from stacklib.infer.config import EngineConfig
from stacklib.infer.engine import LLM
from stacklib.infer.outputs import RequestOutput
from stacklib.infer.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    completion_logprobs,
    parse_request,
    usage,
)
from stacklib.infer.sampling_params import InvalidRequestError
from stacklib.llm import zoo


@dataclasses.dataclass
class ServerState:
    """What every handler needs, like vLLM's `app.state`: the engine loop and the served model."""

    engine: AsyncEngine
    model_name: str
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))


async def _parse(request: Request, schema: type[GenerateRequest], state: ServerState) -> Any:
    """The body as `schema`, or the 400 (a malformed field) or 404 (another model) that says why not."""
    body = parse_request(schema, await http.read_json(request))
    if body.model != state.model_name:
        raise http.HTTPError(404, f"The model `{body.model}` does not exist; this server serves "
                                  f"`{state.model_name}`.", param="model")
    return body


def _start(state: ServerState, body: CompletionRequest | ChatCompletionRequest,
           ) -> list[AsyncIterator[RequestOutput]]:
    """Queue every prompt of the request together; their output streams, or a 400 naming the field at fault.

    This runs before a streamed response sends its 200, so a refused request still gets its 400.
    """
    try:
        prompts = body.prompts(state.engine.engine.tokenizer)  # chat: rendered with the model's template
        return state.engine.add_requests(prompts, body.sampling_params())
    except InvalidRequestError as error:
        raise http.HTTPError(400, str(error), param=body.request_field(error.param)) from None


async def _finals(streams: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    """Each stream's last output: its finished request."""
    async def last(stream):
        async for output in stream:
            final = output
        return final

    return await asyncio.gather(*(last(stream) for stream in streams))


async def _merged(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Every stream's outputs as they come, as (stream index, output), like vLLM's `merge_async_iterators`.

    Closing this generator (the client went away) cancels the tasks reading the streams,
    which closes the streams and so aborts their requests.
    """
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(p, stream):
        try:
            async for output in stream:
                await queue.put((p, output))
            await queue.put((p, None))
        except Exception as error:  # noqa: BLE001 - the engine failed: the response must end
            await queue.put((p, error))

    tasks = [asyncio.create_task(pump(p, stream)) for p, stream in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            p, output = await queue.get()
            if isinstance(output, Exception):
                raise output
            if output is None:
                running -= 1
            else:
                yield p, output
    finally:
        for task in tasks:
            task.cancel()


def _header(state: ServerState, prefix: str, kind: str) -> dict[str, Any]:
    """The fields a response, and each of its streamed chunks, starts with."""
    return {"id": f"{prefix}-{time.time_ns():x}", "object": kind, "created": int(time.time()),
            "model": state.model_name}


def _event_stream(streams: list[AsyncIterator[RequestOutput]],
                  body: CompletionRequest | ChatCompletionRequest, header: dict[str, Any],
                  content: Callable[[str], dict[str, Any]], opening: tuple[dict[str, Any], ...] = (),
                  ) -> StreamingResponse:
    """Completions and chat streamed alike: `opening`, then each choice's new text, then usage if asked.

    A chunk holds one choice, the text it gained in a step wrapped as its endpoint does
    (`{"text": ...}`, `{"delta": {"content": ...}}`), and its `finish_reason` in the step it
    finished; choice i of prompt p is index p * n + i. The engine's text only ever grows
    (detokenizer.py), so what is new is what follows the characters already sent.
    """
    async def chunks():
        for chunk in opening:
            yield chunk
        finals, sent, done = {}, {}, set()  # by choice index: characters sent; the choices finished
        async for p, output in _merged(streams):
            finals[p] = output
            for c in output.outputs:
                index = p * body.n + c.index
                text = c.text[sent.get(index, 0):]
                if index in done or not (text or c.finish_reason):
                    continue
                sent[index] = len(c.text)
                if c.finish_reason:
                    done.add(index)
                choice = {"index": index, **content(text), "logprobs": None,
                          "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                yield {**header, "choices": [choice]}
        if (body.stream_options or {}).get("include_usage"):
            yield {**header, "choices": [], "usage": usage(list(finals.values()))}

    return http.event_stream(chunks())


async def completions(body: CompletionRequest, state: ServerState) -> dict[str, Any] | StreamingResponse:
    """POST /v1/completions: choice i of prompt p has index p * n + i, as in vLLM."""
    streams = _start(state, body)
    header = _header(state, "cmpl", "text_completion")
    if body.stream:
        return _event_stream(streams, body, header, lambda text: {"text": text})
    outputs = await _finals(streams)
    return {**header, "usage": usage(outputs), "choices": [
        {"index": p * body.n + c.index, "text": c.text, "logprobs": completion_logprobs(c),
         "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        for p, output in enumerate(outputs) for c in output.outputs]}


async def chat_completions(body: ChatCompletionRequest, state: ServerState,
                           ) -> dict[str, Any] | StreamingResponse:
    """POST /v1/chat/completions: the messages through the model's chat template (or ours), one choice
    per `n`."""
    streams = _start(state, body)
    if body.stream:
        header = _header(state, "chatcmpl", "chat.completion.chunk")
        roles = tuple({**header, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                              "logprobs": None, "finish_reason": None}]}
                      for index in range(body.n))
        return _event_stream(streams, body, header, lambda text: {"delta": {"content": text}}, roles)
    outputs = await _finals(streams)
    return {**_header(state, "chatcmpl", "chat.completion"), "usage": usage(outputs), "choices": [
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
                        help=f"a zoo name ({', '.join(sorted(zoo.ZOO))}), a folder holding a Hugging Face "
                             "checkpoint (config.json, *.safetensors, tokenizer.json) or a model saved in "
                             "the zoo's format (default: %(default)s)")
    parser.add_argument("--tokenizer", default=None,
                        help="a folder holding tokenizer.json (default: the model folder's; bytes for a "
                             "zoo name)")
    parser.add_argument("--served-model-name", default=None, help="the name clients use (default: --model)")
    parser.add_argument("--host", default="127.0.0.1", help="(default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port (default: %(default)s)")
    EngineConfig.add_cli_args(parser)
    args = parser.parse_args(argv)
    if args.model not in zoo.ZOO and not os.path.isdir(args.model):
        parser.error(f"--model {args.model!r} is neither a zoo name ({', '.join(sorted(zoo.ZOO))}) nor a "
                     "folder holding a saved model.")
    if args.tokenizer is not None and not os.path.isdir(args.tokenizer):
        parser.error(f"--tokenizer {args.tokenizer!r} is not a folder; give the folder that holds "
                     "tokenizer.json.")
    try:
        config = EngineConfig.from_cli_args(args)  # a bad setting fails before any work
        sock = http.listen_socket(args.host, args.port)  # before loading: a taken port fails at once
        llm = LLM(args.model, tokenizer=args.tokenizer, **dataclasses.asdict(config))
    except (OSError, ValueError) as error:  # OSError: FileNotFoundError for a missing file too
        parser.error(str(error))
    host, port = sock.getsockname()
    print(f"serving {args.served_model_name or args.model} on http://{host}:{port}/v1", flush=True)
    http.serve(create_app(llm, args.served_model_name), sock)
    return 0


if __name__ == "__main__":
    sys.exit(main())
