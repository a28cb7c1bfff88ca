"""The model server: predict/status/health/metrics over HTTP, bad input, versions, load.

Every server runs on a free localhost port, started and stopped by its test; every
client loop is bounded in requests and in time.
"""

import concurrent.futures
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import ROOT, stop_process

import stacklib.nn as nnx
import stacklib.serve as serve
from stacklib import http as stack_http
from stacklib.nn import digits_classifier
from stacklib.serve.repository import AVAILABLE, FAILED, ModelRepository
from stacklib.serve.server import create_app

CLIENTS, REQUESTS_EACH, WAIT = 64, 4, 60.0
MAX_BATCH = 16


def _export(directory, seed):
    predict, params = digits_classifier.predict_function(digits_classifier.Classifier(rngs=nnx.Rngs(seed)))
    serve.export(predict, params, (np.zeros((1, 64), np.float32),), directory, platforms=("cpu",))


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    """Two versions of the classifier (different seeds), exported once for the module."""
    root = tmp_path_factory.mktemp("exports")
    for version, seed in ((1, 0), (2, 1)):
        _export(root / str(version), seed)
    return root


@pytest.fixture
def server(artifacts, tmp_path):
    """A server over models/digits/1 only, with a fast rescan."""
    models = tmp_path / "models"
    shutil.copytree(artifacts / "1", models / "digits" / "1")
    repository = ModelRepository(models, max_batch_size=MAX_BATCH, batch_timeout=0.002, poll_interval=0.1)
    repository.start()
    with stack_http.Server(create_app(repository, max_body_bytes=64 << 10)) as running:
        running.models, running.repository = models, repository
        yield running
    repository.close()


def _request(server, method, path, body=None):
    connection = http.client.HTTPConnection(server.host, server.port, timeout=WAIT)
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    connection.request(method, path, body=data, headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    status, payload = response.status, json.loads(response.read())
    connection.close()
    return status, payload


def _inputs(n, seed=0):
    return np.random.default_rng(seed).random((n, 64), dtype=np.float32)


def _served(directory, x):
    """What the server must answer: the artifact run on batches padded to MAX_BATCH rows.

    The padding matters for bitwise equality: XLA compiles one program per batch size,
    and on CPU a row's logits at batch 1 and batch 16 differ in the last bit.
    """
    model, outputs = serve.load(directory), []
    for start in range(0, len(x), MAX_BATCH):
        chunk = x[start:start + MAX_BATCH]
        padded = np.concatenate([chunk, np.repeat(chunk[-1:], MAX_BATCH - len(chunk), 0)])
        outputs.append(np.asarray(model(padded))[:len(chunk)])
    return np.concatenate(outputs)


def _wait_until(condition, what):
    deadline = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_predict_returns_what_the_loaded_artifact_computes(server, artifacts):
    x = _inputs(3)
    status, payload = _request(server, "POST", "/v1/models/digits/predict", {"inputs": x.tolist()})
    assert status == 200 and payload["version"] == 1
    # JSON carries floats as decimal text that round-trips float32 exactly.
    assert np.array_equal(np.array(payload["outputs"], np.float32), _served(artifacts / "1", x))
    assert _request(server, "GET", "/health") == (200, {"status": "ok"})
    status, payload = _request(server, "GET", "/v1/models/digits")
    assert payload["default_version"] == 1
    assert payload["versions"][0]["signature"] == "(float32[b,64]) -> (float32[b,10])"


@pytest.mark.parametrize("body, message", [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "must be a JSON object"),
    ({"instances": [[0.0] * 64]}, "no \"inputs\""),
    ({"inputs": [[0.0] * 63]}, r"has shape \(1, 63\)"),
    ({"inputs": [[0.0] * 64, [0.0] * 3]}, "ragged"),
    ({"inputs": [["a"] * 64]}, "not a list of numbers"),
    ({"inputs": []}, r"has shape \(0,\)"),
    ({"inputs": [[0.0] * 64] * 17}, "the most is 16"),
    ({"inputs": [[0.0] * 64], "version": "one"}, "must be an integer"),
])
def test_malformed_requests_get_a_400_naming_the_signature_and_the_server_keeps_serving(server, body,
                                                                                       message):
    status, payload = _request(server, "POST", "/v1/models/digits/predict", body)
    assert status == 400, payload
    assert set(payload["error"]) == {"message", "type", "code"} and payload["error"]["code"] == 400
    assert re.search(message, payload["error"]["message"]), payload
    if "shape" in message:
        assert "float32[b,64]" in payload["error"]["message"]  # the expected signature, named
    assert _request(server, "POST", "/v1/models/digits/predict", {"inputs": _inputs(1).tolist()})[0] == 200


def test_unknown_models_versions_routes_and_oversized_bodies_get_error_bodies(server):
    for method, path, body, code in [("POST", "/v1/models/nope/predict", {"inputs": []}, 404),
                                     ("POST", "/v1/models/digits/versions/7/predict", {"inputs": []}, 404),
                                     ("GET", "/v1/models/nope", None, 404),
                                     ("GET", "/nowhere", None, 404),
                                     ("GET", "/v1/models/digits/predict", None, 405),
                                     ("POST", "/v1/models/digits/predict", b"0" * (65 << 10), 413)]:
        status, payload = _request(server, method, path, body)
        assert status == code and payload["error"]["code"] == code, (path, payload)


def test_64_concurrent_clients_lose_no_request_and_share_model_calls(server):
    x = _inputs(CLIENTS)

    def client(i):
        connection = http.client.HTTPConnection(server.host, server.port, timeout=WAIT)
        outputs = []
        for _ in range(REQUESTS_EACH):
            body = json.dumps({"inputs": [x[i].tolist()]})
            connection.request("POST", "/v1/models/digits/predict", body=body)
            response = connection.getresponse()
            assert response.status == 200
            outputs.append(json.loads(response.read())["outputs"][0])
        connection.close()
        return outputs

    with concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
        results = list(pool.map(client, range(CLIENTS), timeout=WAIT))
    expected = _served(server.models / "digits" / "1", x)
    for i, outputs in enumerate(results):  # bitwise, whoever shared the call with this request
        assert len(outputs) == REQUESTS_EACH
        assert np.array_equal(np.array(outputs, np.float32), np.repeat(expected[i:i + 1], REQUESTS_EACH, 0))
    metrics = _request(server, "GET", "/metrics")[1]
    assert metrics["requests"]["ok"] == CLIENTS * REQUESTS_EACH
    rows_served = sum(int(size) * calls for size, calls in metrics["batch_sizes"].items())
    assert rows_served == CLIENTS * REQUESTS_EACH  # every row went through the model exactly once
    assert metrics["latency_ms"]["p99"] >= metrics["latency_ms"]["p50"] > 0


def test_a_new_version_is_picked_up_without_restart_and_a_pinned_one_stays_reachable(server, artifacts):
    x = _inputs(2)
    shutil.copytree(artifacts / "2", server.models / "digits" / "2.partial-0000")  # a copy in progress
    os.rename(server.models / "digits" / "2.partial-0000", server.models / "digits" / "2")
    _wait_until(lambda: _request(server, "GET", "/v1/models/digits")[1]["default_version"] == 2, "version 2")
    newest = _request(server, "POST", "/v1/models/digits/predict", {"inputs": x.tolist()})[1]
    pinned = _request(server, "POST", "/v1/models/digits/versions/1/predict", {"inputs": x.tolist()})[1]
    assert (newest["version"], pinned["version"]) == (2, 1)
    assert np.array_equal(np.array(newest["outputs"], np.float32), _served(artifacts / "2", x))
    assert np.array_equal(np.array(pinned["outputs"], np.float32), _served(artifacts / "1", x))


def test_a_broken_version_never_replaces_a_working_one_and_is_retried_when_fixed(server, artifacts):
    broken = server.models / "digits" / "3"
    shutil.copytree(artifacts / "2", broken)
    kernel = next((broken / "weights").glob("*kernel*"))
    good_bytes = kernel.read_bytes()
    kernel.write_bytes(good_bytes[:-4])  # truncated
    (server.models / "digits" / "4").mkdir()  # a folder still empty: no manifest yet
    repository = server.repository

    def states():
        return {v["version"]: v["state"] for v in repository.status("digits")["versions"]}

    _wait_until(lambda: states() == {1: AVAILABLE, 3: FAILED, 4: FAILED}, "versions 3 and 4 to fail")
    status = repository.status("digits")
    assert status["default_version"] == 1
    assert "fails its SHA-256 check" in status["versions"][1]["error"]
    assert "manifest.json is missing" in status["versions"][2]["error"]
    one_row = {"inputs": _inputs(1).tolist()}
    assert _request(server, "POST", "/v1/models/digits/predict", one_row)[1]["version"] == 1
    kernel.write_bytes(good_bytes)  # the copy finishes: the next scan retries and serves it
    _wait_until(lambda: states()[3] == AVAILABLE, "version 3 to load once fixed")
    assert _request(server, "POST", "/v1/models/digits/predict", one_row)[1]["version"] == 3


def test_the_command_line_server_starts_serves_and_stops(artifacts, tmp_path):
    shutil.copytree(artifacts / "1", tmp_path / "models" / "digits" / "1")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "stacklib.serve", "--model-dir", str(tmp_path / "models"),
               "--port", str(port), "--max-batch-size", "8"]
    process = subprocess.Popen(command, cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        endpoint = type("Endpoint", (), {"host": "127.0.0.1", "port": port})

        def healthy():
            try:
                return _request(endpoint, "GET", "/health")[0] == 200
            except OSError:
                assert process.poll() is None, process.stdout.read()
                return False

        _wait_until(healthy, "the server to start")
        request = {"inputs": _inputs(2).tolist()}
        status, payload = _request(endpoint, "POST", "/v1/models/digits/predict", request)
        assert status == 200 and np.array(payload["outputs"]).shape == (2, 10)
    finally:
        stop_process(process, signal.SIGINT)
