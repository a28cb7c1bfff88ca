"""The one HTTP layer of the book's servers: a FastAPI app, error bodies, limits, a runner.

Chapter 15's model server (`stacklib.serve`) and chapter 14's OpenAI-compatible
inference server (`stacklib.infer.serve`) are built on it. What they share:

  * errors as one JSON shape, the one vLLM's and OpenAI's servers return:
    `{"error": {"message": ..., "type": ..., "code": <HTTP status>}}` — for our own
    `HTTPError`, for FastAPI's validation errors, for unknown routes and methods
    (with `create_app(..., error_param=True)` also vLLM's `"param"`: the request field
    at fault, or null);
  * `event_stream(chunks)`: server-sent events, one `data: {json}` per chunk, ending
    with `data: [DONE]` as OpenAI's streaming API does;
  * a request body limit enforced while the body is read (413 before it is buffered);
  * `read_json(request)`: a JSON object or a 400 that says what was wrong;
  * `Server`: uvicorn in a background thread on a port the OS picks, started and
    stopped by the caller (tests, notebooks, benchmarks), or `serve()` in the foreground.

Differences from vLLM's server: no authentication, no CORS; one uvicorn worker.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

MAX_BODY_BYTES = 1 << 20
_TYPES = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowedError",
          413: "RequestTooLargeError", 422: "UnprocessableEntityError", 500: "InternalServerError",
          503: "ServiceUnavailableError"}


class HTTPError(Exception):
    """Raise in an endpoint to answer `status` with an error body carrying `message`."""

    def __init__(self, status: int, message: str, type: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.type = type or _TYPES.get(status, "Error")


def error_response(status: int, message: str, type: str | None = None, *, param: str | None = None,
                   with_param: bool = False) -> JSONResponse:
    """`{"error": {"message", "type", "code"}}` with HTTP status `status` (and `"param"` if asked)."""
    error = {"message": message, "type": type or _TYPES.get(status, "Error"), "code": status}
    if with_param or param is not None:
        error["param"] = param
    return JSONResponse({"error": error}, status_code=status)


def event_stream(chunks: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    """Server-sent events: `data: <chunk as JSON>` per chunk, then `data: [DONE]`.

    When the client disconnects, Starlette cancels the response, which closes `chunks`
    (an async generator's `finally:` runs): that is where a producer stops its work.
    """
    async def lines():
        async for chunk in chunks:
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(lines(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


class _BodyLimit:
    """ASGI middleware: refuse bodies over `limit` bytes, whether announced or streamed."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            return await self._too_large(scope, receive, send)
        received = 0

        async def counting_receive():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.limit:
                raise _TooLarge()
            return message

        try:
            await self.app(scope, counting_receive, send)
        except _TooLarge:
            await self._too_large(scope, receive, send)

    async def _too_large(self, scope, receive, send):
        response = error_response(413, f"the request body is larger than {self.limit} bytes; send fewer "
                                       "instances per request.")
        await response(scope, receive, send)


class _TooLarge(Exception):
    pass


def create_app(title: str, *, max_body_bytes: int = MAX_BODY_BYTES, error_param: bool = False) -> FastAPI:
    """A FastAPI app whose every error, ours or the framework's, is an error body.

    `error_param=True` adds vLLM's `"param"` field to every error body.
    """
    app = FastAPI(title=title)

    @app.exception_handler(HTTPError)
    async def _ours(request: Request, error: HTTPError):
        return error_response(error.status, error.message, error.type, param=error.param,
                              with_param=error_param)

    @app.exception_handler(StarletteHTTPException)
    async def _framework(request: Request, error: StarletteHTTPException):
        return error_response(error.status_code, str(error.detail), with_param=error_param)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, error: RequestValidationError):
        return error_response(400, f"invalid request: {error.errors()}", with_param=error_param)

    app.add_middleware(_BodyLimit, limit=max_body_bytes)
    return app


async def read_json(request: Request) -> dict[str, Any]:
    """The request body as a JSON object, or HTTPError 400 saying why it is not one."""
    body = await request.body()
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError) as error:
        raise HTTPError(400, f"the request body is not valid JSON ({error}).") from None
    if not isinstance(payload, dict):
        raise HTTPError(400, f"the request body must be a JSON object, got {type(payload).__name__}.")
    return payload


class Server:
    """Run `app` with uvicorn in a background thread: `with Server(app) as server: server.url`.

    The socket is bound before the thread starts (port 0: the OS picks a free one), so
    `url` is valid at once and two tests never race for a port.
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0):
        self.socket = listen_socket(host, port)
        self.host, self.port = self.socket.getsockname()
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                                timeout_keep_alive=30, backlog=256)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self.socket]},
                                        daemon=True, name=f"uvicorn:{self.port}")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> Server:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP server on {self.url} did not start within {timeout} s.")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout)
        self.socket.close()

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port, for a server to listen on.

    The command-line servers bind before they load their model, so a port already in use
    fails at once, with the fix, not after a minute of loading.

    Raises:
      OSError: the address cannot be bound (in use, not this machine's, or privileged).
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {error.strerror}. Choose another --port (0 lets "
                      "the system pick a free one) or --host.") from None
    return sock


def serve(app: FastAPI, sock: socket.socket) -> None:
    """Run `app` on a bound socket in the foreground until interrupted (the command-line servers)."""
    uvicorn.Server(uvicorn.Config(app, log_level="info")).run(sockets=[sock])
