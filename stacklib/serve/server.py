"""The model server's HTTP endpoints, on the shared `stacklib.http` layer.

    POST /v1/models/{name}/predict                    {"inputs": [[...], ...]} -> {"outputs": ...}
    POST /v1/models/{name}/versions/{version}/predict  the same, pinned to one version
    GET  /v1/models                                    every model and version, with states
    GET  /v1/models/{name}                             one model's versions and signatures
    GET  /health                                       {"status": "ok"} while the server runs
    GET  /metrics                                      requests, batch sizes, latency p50/p99

A predict request carries a batch of `inputs` (one row per instance, each the shape of
the model's input without its batch dimension). The endpoint checks them against the
artifact's signature *before* they reach the batcher, so a wrong shape is a 400 that
names the expected signature and never poisons the batch of other clients.

For a sequence model (chapter 12's language model, exported by `stacklib.serve.lm`)
each row is a list of token ids, and rows may differ in length: each is padded with the
manifest's `pad_value` to its length bucket (the smallest of 8, 16, ..., max_seq_len that
holds it) and joins that bucket's batcher, whose calls always have the shape
(rows per call, bucket): max_batch_size rows, or fewer for long buckets under the
server's max_batch_tokens. A row's answer therefore depends only on the row: never on
who else was calling, nor on the other rows of its own request.

Differences from TF Serving's REST API: `inputs` only (no `instances` form, no named
multi-input signatures), JSON only, metrics as JSON rather than Prometheus text.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from stacklib import http
from stacklib.serve.repository import ModelRepository

_LATENCIES_KEPT = 10_000


class Metrics:
    """Request counts and the latencies of the last requests, safe to update from any thread."""

    def __init__(self):
        self._lock = threading.Lock()
        self.requests: collections.Counter[str] = collections.Counter()
        self.latencies_ms: collections.deque[float] = collections.deque(maxlen=_LATENCIES_KEPT)

    def record(self, outcome: str, seconds: float | None = None) -> None:
        with self._lock:
            self.requests[outcome] += 1
            if seconds is not None:
                self.latencies_ms.append(1e3 * seconds)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            latencies = np.array(self.latencies_ms)
            requests = dict(self.requests)
        percentiles = {"p50": None, "p99": None}
        if len(latencies):
            percentiles = {f"p{q}": float(np.percentile(latencies, q)) for q in (50, 99)}
        return {"requests": requests, "latency_ms": {"count": len(latencies), **percentiles}}


def _expected(version) -> str:
    spec = version.model.manifest["inputs"][0]
    if version.length_buckets:
        vocab = version.model.manifest["metadata"].get("vocab_size")
        ids = f"ids 0..{vocab - 1}" if vocab else "non-negative ids"
        return (f"model {version.name!r} version {version.number} expects \"inputs\": a list of token rows, "
                f"each 1 to {version.length_buckets[-1]} {ids} (signature {version.model.signature}).")
    return (f"model {version.name!r} version {version.number} expects \"inputs\": a list of rows, "
            f"each of shape {tuple(spec['shape'][1:])} and dtype {spec['dtype']} "
            f"(signature {version.model.signature}).")


def _parse_sequences(payload: dict, version) -> list[np.ndarray]:
    """A sequence model's `inputs`: rows of token ids, lengths may differ, or a 400."""
    expected, manifest = _expected(version), version.model.manifest
    rows = payload["inputs"]
    if not isinstance(rows, list) or not rows or not all(isinstance(row, list) for row in rows):
        raise http.HTTPError(400, f"\"inputs\" must be a non-empty list of lists of token ids; {expected}")
    vocab = manifest["metadata"].get("vocab_size")
    limit = vocab if vocab is not None else int(np.iinfo(manifest["inputs"][0]["dtype"]).max) + 1
    parsed = []
    for i, row in enumerate(rows):
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in row):
            raise http.HTTPError(400, f"row {i} of \"inputs\" holds values that are not integer ids; "
                                      f"{expected}")
        if not 1 <= len(row) <= version.length_buckets[-1]:
            raise http.HTTPError(400, f"row {i} of \"inputs\" has {len(row)} tokens; {expected}")
        if min(row) < 0 or max(row) >= limit:
            raise http.HTTPError(400, f"row {i} of \"inputs\" has an id out of range; {expected}")
        parsed.append(np.asarray(row, manifest["inputs"][0]["dtype"]))
    return parsed


def _parse_inputs(payload: dict, version) -> np.ndarray | list[np.ndarray]:
    """The `inputs` of a request as an array of the model's dtype and shape, or a 400."""
    spec = version.model.manifest["inputs"][0]
    expected = _expected(version)
    if "inputs" not in payload:
        raise http.HTTPError(400, f"the request has no \"inputs\"; {expected}")
    if version.length_buckets:
        return _parse_sequences(payload, version)
    try:
        rows = np.asarray(payload["inputs"])
    except (ValueError, TypeError):
        raise http.HTTPError(400, f"\"inputs\" is ragged (rows of different lengths); {expected}") from None
    if rows.dtype.kind not in "biuf" or rows.ndim == 0:
        raise http.HTTPError(400, f"\"inputs\" holds {rows.dtype.kind!r}-kind values, not a list of numbers; "
                                  f"{expected}")
    if np.dtype(spec["dtype"]).kind in "iu" and rows.dtype.kind == "f":
        raise http.HTTPError(400, f"\"inputs\" holds floats; {expected}")
    if list(rows.shape[1:]) != list(spec["shape"][1:]) or len(rows) == 0:
        raise http.HTTPError(400, f"\"inputs\" has shape {rows.shape}; {expected}")
    return rows.astype(spec["dtype"])


async def _run_sequences(version, rows: list[np.ndarray]) -> np.ndarray:
    """Pad each row to its length bucket, submit each bucket's rows together, answer in order."""
    pad_value = version.model.manifest["pad_value"]
    groups: dict[int, list[int]] = {}
    for i, row in enumerate(rows):
        groups.setdefault(version.bucket(len(row)), []).append(i)
    submitted = []  # (row indices, future); a bucket's rows in chunks of its batcher's call size
    for length, indices in groups.items():
        batcher = version.batchers[length]
        for start in range(0, len(indices), batcher.max_batch_size):
            chunk = indices[start:start + batcher.max_batch_size]
            padded = np.full((len(chunk), length), pad_value, rows[0].dtype)
            for j, i in enumerate(chunk):
                padded[j, :len(rows[i])] = rows[i]
            submitted.append((chunk, batcher.submit(padded)))
    outputs: list = [None] * len(rows)
    for chunk, future in submitted:
        answered = await asyncio.wrap_future(future)
        for j, i in enumerate(chunk):
            outputs[i] = answered[j]
    return np.stack(outputs)


def create_app(repository: ModelRepository, *, max_body_bytes: int = http.MAX_BODY_BYTES) -> FastAPI:
    """The FastAPI app serving `repository` (which the caller starts and closes)."""
    app = http.create_app("stacklib.serve", max_body_bytes=max_body_bytes)
    metrics = Metrics()
    app.state.metrics = metrics

    def lookup(name: str, version: int | None):
        try:
            return repository.get(name, version)
        except KeyError as error:
            raise http.HTTPError(404, error.args[0]) from None

    async def predict(name: str, version_number: int | None, request: Request) -> dict:
        start = time.perf_counter()
        try:
            payload = await http.read_json(request)
            requested = payload.get("version", version_number)
            if requested is not None and (not isinstance(requested, int) or isinstance(requested, bool)):
                raise http.HTTPError(400, f"\"version\" must be an integer, got {requested!r}.")
            version = lookup(name, requested)
            rows = _parse_inputs(payload, version)
            if len(rows) > repository.max_batch_size:
                raise http.HTTPError(400, f"{len(rows)} rows in one request; the most is "
                                          f"{repository.max_batch_size} (the server's --max-batch-size).")
            if version.length_buckets:
                outputs = await _run_sequences(version, rows)
            else:
                outputs = await asyncio.wrap_future(version.batcher.submit(rows))
        except http.HTTPError:
            metrics.record("rejected")
            raise
        except Exception as error:
            metrics.record("failed")
            raise http.HTTPError(500, f"the model failed: {type(error).__name__}: {error}") from None
        metrics.record("ok", time.perf_counter() - start)
        # A JSONResponse skips FastAPI's jsonable_encoder, which walks every float of the
        # outputs in Python (256 logits a row for the language model: most of a request).
        return JSONResponse({"model": name, "version": version.number, "outputs": outputs.tolist()})

    @app.post("/v1/models/{name}/predict")
    async def predict_newest(name: str, request: Request):
        return await predict(name, None, request)

    @app.post("/v1/models/{name}/versions/{version}/predict")
    async def predict_pinned(name: str, version: int, request: Request):
        return await predict(name, version, request)

    @app.get("/v1/models")
    async def models():
        return repository.status()

    @app.get("/v1/models/{name}")
    async def model_status(name: str):
        try:
            return repository.status(name)
        except KeyError as error:
            raise http.HTTPError(404, error.args[0]) from None

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics_endpoint():
        return {**metrics.snapshot(), "batch_sizes": repository.batch_sizes()}

    return app
