"""A small client for the model server, and a bounded load test (the chapter and benchmark use it).

`predict(url, name, inputs)` posts one request. `load_test(...)` runs `clients` threads,
each sending `requests_each` requests over its own keep-alive connection, and reports
throughput, latency percentiles and every failure: a load test that could hang or
silently drop requests would prove nothing, so each request has a timeout and the
report counts answers, not attempts.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import time
import urllib.parse
from typing import Any

import numpy as np


class _Connection:
    def __init__(self, url: str, timeout: float):
        parts = urllib.parse.urlsplit(url)
        self._http = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)

    def post(self, path: str, payload: dict) -> tuple[int, dict]:
        headers = {"Content-Type": "application/json"}
        self._http.request("POST", path, body=json.dumps(payload), headers=headers)
        response = self._http.getresponse()
        return response.status, json.loads(response.read())

    def close(self) -> None:
        self._http.close()


def predict(url: str, name: str, inputs: Any, *, version: int | None = None, timeout: float = 60.0) -> dict:
    """POST `inputs` to `name`'s predict endpoint; the JSON answer, or RuntimeError with its error body."""
    connection = _Connection(url, timeout)
    try:
        path = f"/v1/models/{name}" + (f"/versions/{version}" if version is not None else "") + "/predict"
        status, payload = connection.post(path, {"inputs": np.asarray(inputs).tolist()})
    finally:
        connection.close()
    if status != 200:
        raise RuntimeError(f"HTTP {status}: {payload}")
    return payload


def metrics(url: str, *, timeout: float = 60.0) -> dict:
    """The server's /metrics: request counts, latency percentiles, batch sizes."""
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        connection.request("GET", "/metrics")
        return json.loads(connection.getresponse().read())
    finally:
        connection.close()


def load_test(url: str, name: str, rows: Any, *, clients: int, requests_each: int,
              timeout: float = 60.0) -> dict[str, Any]:
    """`clients` concurrent clients each send `requests_each` one-row requests (row i % len(rows)).

    `rows` is an array, or a list of token rows of different lengths (a language model).

    Returns:
      {"ok", "failed", "seconds", "throughput" (requests/s), "p50_ms", "p99_ms",
       "versions" (version -> answers), "errors" (the first few failures)}.
    """
    def client(index: int) -> list[tuple[float, int | None, str | None]]:
        connection, results = _Connection(url, timeout), []
        row = {"inputs": [np.asarray(rows[index % len(rows)]).tolist()]}
        for _ in range(requests_each):
            start = time.perf_counter()
            try:
                status, payload = connection.post(f"/v1/models/{name}/predict", row)
                error = None if status == 200 else f"HTTP {status}: {payload}"
                version = payload.get("version") if status == 200 else None
            except (OSError, http.client.HTTPException, ValueError) as failure:
                connection.close()
                connection = _Connection(url, timeout)
                error, version = f"{type(failure).__name__}: {failure}", None
            results.append((time.perf_counter() - start, version, error))
        connection.close()
        return results

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        outcomes = [r for results in pool.map(client, range(clients)) for r in results]
    seconds = time.perf_counter() - start
    latencies = np.array([t for t, _, error in outcomes if error is None]) * 1e3
    errors = [error for _, _, error in outcomes if error is not None]
    versions: dict[int, int] = {}
    for _, version, error in outcomes:
        if error is None:
            versions[version] = versions.get(version, 0) + 1
    return {"ok": len(latencies), "failed": len(errors), "seconds": seconds,
            "throughput": len(latencies) / seconds,
            "p50_ms": float(np.percentile(latencies, 50)) if len(latencies) else float("nan"),
            "p99_ms": float(np.percentile(latencies, 99)) if len(latencies) else float("nan"),
            "versions": versions, "errors": errors[:5]}
