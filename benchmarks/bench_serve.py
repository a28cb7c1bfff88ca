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

Then chapter 12's language model (the zoo's `stdlib-bytes`, exported by
`stacklib.serve.lm`: next-token logits, symbolic batch and length) is served the same
way over HTTP, one-row requests of real Python source, at two prompt lengths: 17-32
tokens (all padded into the 32 bucket) and 97-128 (the 128 bucket), with calls of up to
16 rows and 2048 tokens (`--max-batch-size 16 --max-batch-tokens 2048`); three runs of
each server, alternating, and the median reported (one pair of runs on the shared
machine has swung between 0.7x and 1.5x). Why 16 rows, not 64: every call is padded to
its full batch (the one-shape rule), and for a compute-bound call a 64-row call made for
the handful of prompts that arrived within the window costs as much as 64 prompts. Its call is heavy
enough that batching can beat the HTTP cost, but on a CPU a big call is compute-bound:
a (64, 128) call costs nearly 64 (1, 128) calls, so batching gains less as prompts grow.
The model alone is timed too (per-row cost at batch 1 against a full call), which is
the ceiling on what batching can buy at that length.

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

import stacklib.llm as llm
import stacklib.nn as nnx
import stacklib.serve as serve
from benchmarks.timing import median_seconds
from stacklib import hw
from stacklib.nn import digits_classifier
from stacklib.serve import lm
from stacklib.serve.batching import DynamicBatcher
from stacklib.serve.client import load_test

CLIENTS = 64
REPEATS = 5  # batcher runs per configuration; the median is reported
LM_PROMPTS = ((17, 32), (97, 128))  # token counts of the language model's prompts: buckets 32 and 128
LM_MAX_BATCH = 16  # rows per language-model call: see the module docstring for why not 64
LM_BATCH_TOKENS = 2048  # rows x length per call: 16 rows of up to 128 tokens
LM_REPEATS = 3  # server runs per configuration, alternating; the median is reported


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


def _server_run(model_dir: pathlib.Path, rows, max_batch_size: int, requests_each: int,
                name: str = "digits", options: tuple[str, ...] = ()) -> dict:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen([sys.executable, "-m", "stacklib.serve", "--model-dir", str(model_dir),
                                "--port", str(port), "--max-batch-size", str(max_batch_size), *options],
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
        load_test(url, name, rows, clients=8, requests_each=2)  # connections and caches warm
        result = load_test(url, name, rows, clients=CLIENTS, requests_each=requests_each)
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
        repeats = REPEATS if scale >= 0.5 else 1  # a tiny-scale run only shows that it runs
        one, batched = (_median_run([_batcher_run(model, rows, size, each) for _ in range(repeats)])
                        for size in (1, CLIENTS))
        _report(f"batcher alone (classifier, hidden {sizes.hidden}; median of {repeats})", one, batched,
                target=3.0)
        each = max(2, int(15 * scale))
        one, batched = (_server_run(model_dir, rows, size, each) for size in (1, CLIENTS))
        _report("HTTP server end to end", one, batched, target=None)
        _language_model(model_dir, scale)


def _prompts(low: int, high: int) -> list[list[int]]:
    """CLIENTS prompts of low..high tokens: slices of this library's own source, fixed by a seed."""
    text = pathlib.Path(llm.__file__).with_name("model.py").read_bytes()
    rng = np.random.default_rng(0)
    prompts = []
    for _ in range(CLIENTS):
        length = int(rng.integers(low, high + 1))
        start = int(rng.integers(0, len(text) - length))
        prompts.append(list(text[start:start + length]))
    return prompts


def _seconds_a_row(loaded, batch: int, length: int, repeats: int) -> float:
    tokens = lm.pad([[0] * length] * batch, length)
    return median_seconds(lambda: np.asarray(loaded(tokens)), repeats=repeats) / batch


def _language_model(model_dir: pathlib.Path, scale: float) -> None:
    model, _ = llm.pretrained("stdlib-bytes")
    lm.export(model, model_dir / "stdlib-bytes" / "1", platforms=("cpu",))
    loaded = serve.load(model_dir / "stdlib-bytes" / "1")
    each = max(2, int(8 * scale))
    # The tiny-scale test run only checks that it works: one prompt range, one run each.
    for low, high in LM_PROMPTS if scale >= 0.5 else LM_PROMPTS[:1]:
        per_row_1 = _seconds_a_row(loaded, 1, high, repeats=5)
        rows = min(LM_MAX_BATCH, LM_BATCH_TOKENS // high)
        per_row_full = _seconds_a_row(loaded, rows, high, repeats=3)
        print(f"language model alone, length {high}: {1e3 * per_row_1:.2f} ms a row at batch 1, "
              f"{1e3 * per_row_full:.2f} ms a row at batch {rows} -> at most "
              f"{per_row_1 / per_row_full:.2f}× from batching")
        prompts = _prompts(low, high)
        runs: dict[int, list[dict]] = {1: [], LM_MAX_BATCH: []}
        repeats = LM_REPEATS if scale >= 0.5 else 1
        for _ in range(repeats):  # alternating, so a burst of load elsewhere hits both alike
            for size in runs:
                runs[size].append(_server_run(model_dir, prompts, size, each, name="stdlib-bytes",
                                              options=("--max-batch-tokens", str(LM_BATCH_TOKENS))))
        for size, results in runs.items():
            print(f"  max batch {size}: " + ", ".join(f"{r['throughput']:.0f}" for r in results) + " req/s")
        _report(f"HTTP server end to end, language model, prompts of {low}-{high} tokens (median of "
                f"{repeats}; batches of up to {LM_MAX_BATCH})", _median_run(runs[1]),
                _median_run(runs[LM_MAX_BATCH]), target=3.0)


if __name__ == "__main__":
    main()
