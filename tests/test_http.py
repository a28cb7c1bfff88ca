"""stacklib.http: every error is an error body; bodies over the limit are refused, announced or streamed."""

import http.client
import json

import pytest
from fastapi import Request

from stacklib import http as stack_http


@pytest.fixture(scope="module")
def server():
    app = stack_http.create_app("test", max_body_bytes=1000)

    @app.post("/echo")
    async def echo(request: Request):
        return {"got": await stack_http.read_json(request)}

    @app.get("/teapot")
    async def teapot():
        raise stack_http.HTTPError(418, "short and stout", type="TeapotError")

    with stack_http.Server(app) as running:
        yield running


def _send(server, method, path, body=None, chunked=False):
    connection = http.client.HTTPConnection(server.host, server.port, timeout=30)
    if chunked:
        connection.request(method, path, body=iter([body[i:i + 100] for i in range(0, len(body), 100)]),
                           encode_chunked=True)
    else:
        connection.request(method, path, body=body)
    response = connection.getresponse()
    status, payload = response.status, json.loads(response.read())
    connection.close()
    return status, payload


def test_a_json_object_is_echoed(server):
    assert _send(server, "POST", "/echo", b'{"a": [1, 2]}') == (200, {"got": {"a": [1, 2]}})


@pytest.mark.parametrize("method, path, body, status, error_type", [
    ("POST", "/echo", b"{", 400, "BadRequestError"),
    ("POST", "/echo", b'"a string"', 400, "BadRequestError"),
    ("GET", "/teapot", None, 418, "TeapotError"),
    ("GET", "/missing", None, 404, "NotFoundError"),
    ("DELETE", "/echo", None, 405, "MethodNotAllowedError"),
    ("POST", "/echo", b'{"a": "' + b"x" * 2000 + b'"}', 413, "RequestTooLargeError"),
])
def test_every_error_is_an_error_body(server, method, path, body, status, error_type):
    got_status, payload = _send(server, method, path, body)
    assert got_status == status
    assert payload["error"]["code"] == status and payload["error"]["type"] == error_type
    assert payload["error"]["message"]


def test_a_streamed_body_over_the_limit_is_refused_while_it_is_read(server):
    status, payload = _send(server, "POST", "/echo", b'{"a": "' + b"x" * 5000 + b'"}', chunked=True)
    assert status == 413 and "larger than 1000 bytes" in payload["error"]["message"]
    assert _send(server, "POST", "/echo", b'{"a": 1}', chunked=True) == (200, {"got": {"a": 1}})
