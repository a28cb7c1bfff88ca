"""Serving: dynamic batching against one request per model call, at 64 concurrent clients.

The chapter-02 digits classifier (the CPU size from `stacklib.hw`) is exported once and
served two ways, each at 64 concurrent clients sending one-row requests:

- through the batcher alone (`DynamicBatcher` in this process, no HTTP): what batching
  buys when the model call is the only shared resource. Target: >= 3x the throughput of
  `max_batch_size=1`; the median of five runs of each, since one run on a shared 2-core
  machine swings between about 2.7x and 3.9x.
- end to end over HTTP (`python -m stacklib.serve` in its own process, clients here):
  what a user sees. On a 2-core CPU with a model this small, the time goes to HTTP and
  JSON in Python (about 1 ms a request), not to the model (tens of microseconds a call),
  so batching can only remove the small model share; reported as measured.

Throughput is requests answered per second; p50/p99 are per-request latencies.
"""

from __future__ import annotations

import http.client
import pathlib
import socket
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

import stacklib.nn as nnx
import stacklib.serve as serve
from stacklib import hw
from stacklib.examples import digits_classifier
from stacklib.serve.batching import DynamicBatcher
from stacklib.serve.client import load_test

CLIENTS = 64
REPEATS = 5  # batcher runs per configuration; the median is reported


def _median_run(runs: list[dict]) -> dict:
    """The run with the median throughput (its latencies with it): one noisy run decides nothing."""
    return sorted(runs, key=lambda run: run["throughput"])[len(runs) // 2]


def _batcher_run(model, rows, max_batch_size: int, requests_each: int) -> dict:
    batcher = DynamicBatcher(model, max_batch_size=max_batch_size, batch_timeout=0.002)
    batcher.warm_up(rows[0])
    latencies: list[float] = []

    def client(index: int) -> None:
        for _ in range(requests_each):
            start = time.perf_counter()
            batcher.submit(rows[index % len(rows)][None]).result(timeout=60)
            latencies.append(time.perf_counter() - start)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    seconds = time.perf_counter() - start
    batcher.close()
    assert len(latencies) == CLIENTS * requests_each, "a request was lost"
    return {"throughput": len(latencies) / seconds, "p50_ms": 1e3 * float(np.percentile(latencies, 50)),
            "p99_ms": 1e3 * float(np.percentile(latencies, 99))}


def _server_run(model_dir: pathlib.Path, rows, max_batch_size: int, requests_each: int) -> dict:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen([sys.executable, "-m", "stacklib.serve", "--model-dir", str(model_dir),
                                "--port", str(port), "--max-batch-size", str(max_batch_size)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                connection.request("GET", "/health")
                connection.getresponse().read()
                break
            except OSError:
                if time.monotonic() > deadline or process.poll() is not None:
                    raise RuntimeError("the model server did not start") from None
                time.sleep(0.1)
        url = f"http://127.0.0.1:{port}"
        load_test(url, "digits", rows, clients=8, requests_each=2)  # connections and caches warm
        result = load_test(url, "digits", rows, clients=CLIENTS, requests_each=requests_each)
        assert result["failed"] == 0, result["errors"]
        return result
    finally:
        process.terminate()
        process.wait(timeout=30)


def _report(what: str, one: dict, batched: dict, target: float | None) -> None:
    ratio = batched["throughput"] / one["throughput"]
    verdict = f" ({'meets' if ratio >= target else 'misses'} the target of ≥ {target}×)" if target else ""
    print(f"{what}, {CLIENTS} clients: one-at-a-time {one['throughput']:.0f} req/s "
          f"(p50 {one['p50_ms']:.1f} ms, p99 {one['p99_ms']:.1f} ms), dynamic batching "
          f"{batched['throughput']:.0f} req/s (p50 {batched['p50_ms']:.1f} ms, "
          f"p99 {batched['p99_ms']:.1f} ms) "
          f"-> {ratio:.2f}× the speed{verdict}")


def main(scale: float = 1.0) -> None:
    sizes = hw.sizes("digits_mlp")
    predict, params = digits_classifier.predict_function(
        digits_classifier.Classifier(sizes.hidden, rngs=nnx.Rngs(0)))
    rows = np.random.default_rng(0).random((CLIENTS, 64), dtype=np.float32)
    with tempfile.TemporaryDirectory(prefix="bench_serve_") as root:
        model_dir = pathlib.Path(root)
        serve.export(predict, params, (rows[:1],), model_dir / "digits" / "1", platforms=("cpu",))
        model = serve.load(model_dir / "digits" / "1")
        each = max(2, int(30 * scale))
        one, batched = (_median_run([_batcher_run(model, rows, size, each) for _ in range(REPEATS)])
                        for size in (1, CLIENTS))
        _report(f"batcher alone (classifier, hidden {sizes.hidden}; median of {REPEATS})", one, batched,
                target=3.0)
        each = max(2, int(15 * scale))
        one, batched = (_server_run(model_dir, rows, size, each) for size in (1, CLIENTS))
        _report("HTTP server end to end", one, batched, target=None)


if __name__ == "__main__":
    main()
