"""LLM inference: continuous batching against sequential and static batching; TTFT and TPOT.

The zoo model (`stdlib-bytes`) serves one fixed workload of mixed prompt and output
lengths (greedy, every request runs to its max_tokens): most requests want a short
answer, a few a long one, as in real traffic. Three ways to serve it, all through the
same engine and the same compiled programs, so only the scheduling differs:

- sequential: one request at a time (`max_num_seqs=1`), chapter 12's way;
- static batching: groups of `max_num_seqs` requests, each group run until its longest
  request finishes before the next group starts;
- continuous batching: every request queued at once; a finished sequence's slot is
  refilled in the next step.

Target: continuous >= 3x sequential in output tokens/s. Model calls (prefill + decode
steps) are counted too: they do not depend on the machine's load.

Then a Poisson arrival load (requests arrive at random, `RATE` per second on average)
gives time-to-first-token (arrival -> first token) and time-per-output-token (the rest
of the tokens) at p50 and p99, twice: with the default token budget (a whole prompt runs in
the step that admits it) and with `CHUNKED_BUDGET` tokens per step (a longer prompt is
pre-filled in chunks, sharing its steps with the running sequences' decodes). A plot of
both goes to `_build/bench/infer.png`.
"""

from __future__ import annotations

import pathlib
import time

import numpy as np

from stacklib import llm
from stacklib.infer import LLM, SamplingParams

PLOT = pathlib.Path(__file__).resolve().parents[1] / "_build" / "bench" / "infer.png"
MAX_NUM_SEQS, BLOCK_SIZE = 16, 8
CHUNKED_BUDGET = 32  # tokens per step in the chunked-prefill run: 16 decodes + a 16-token chunk
REPEATS = 3  # runs of each way, interleaved; the median time is reported (the machine is shared)


def workload(n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt ids, max_tokens) pairs: prompts 4-48 tokens, 80% answers of 4-16 tokens, 20% of 48-72."""
    rng = np.random.default_rng(seed)
    requests = []
    for _ in range(n):
        prompt = rng.integers(32, 127, size=int(rng.integers(4, 49))).tolist()
        long = rng.random() < 0.2
        requests.append((prompt, int(rng.integers(48, 73) if long else rng.integers(4, 17))))
    return requests


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _run(engine: LLM, groups: list[list[tuple[list[int], int]]]) -> tuple[float, int, int]:
    """Serve each group to completion in turn: (seconds, output tokens, model calls)."""
    runner = engine.llm_engine.runner
    calls_before = runner.num_steps
    start, tokens = time.perf_counter(), 0
    for group in groups:
        outputs = engine.generate([{"prompt_token_ids": p} for p, _ in group], [_params(m) for _, m in group])
        tokens += sum(len(o.outputs[0].token_ids) for o in outputs)
    return time.perf_counter() - start, tokens, runner.num_steps - calls_before


def poisson_latencies(engine: LLM, requests, rate: float, seed: int = 1) -> dict[str, float]:
    """Feed `requests` at Poisson arrival times; TTFT and TPOT percentiles in milliseconds."""
    core = engine.llm_engine
    arrivals = np.cumsum(np.random.default_rng(seed).exponential(1 / rate, len(requests)))
    start, next_request = time.perf_counter(), 0
    arrived, first, done = {}, {}, {}
    while next_request < len(requests) or core.has_unfinished_requests():
        now = time.perf_counter() - start
        while next_request < len(requests) and arrivals[next_request] <= now:
            prompt, max_tokens = requests[next_request]
            core.add_request(str(next_request), prompt, _params(max_tokens))
            arrived[str(next_request)] = arrivals[next_request]
            next_request += 1
        if not core.has_unfinished_requests():
            time.sleep(max(0.0, arrivals[next_request] - now))
            continue
        for output in core.step():
            now = time.perf_counter() - start
            first.setdefault(output.request_id, now)
            if output.finished:
                done[output.request_id] = (now, len(output.outputs[0].token_ids))
    ttft = np.array([first[r] - arrived[r] for r in arrived]) * 1e3
    tpot = np.array([(done[r][0] - first[r]) / (done[r][1] - 1) for r in arrived if done[r][1] > 1]) * 1e3
    return {f"{name}_p{q}": float(np.percentile(values, q))
            for name, values in (("ttft", ttft), ("tpot", tpot)) for q in (50, 99)}


def main(scale: float = 1.0) -> None:
    model = llm.pretrained("stdlib-bytes")[0]
    requests = workload(max(8, int(96 * scale)))
    # A tiny-scale run only shows that it runs: a 64-token step budget compiles fewer step buckets.
    budget = {} if scale >= 1 else {"max_num_batched_tokens": 64}
    sequential = LLM(model, max_num_seqs=1, block_size=BLOCK_SIZE, enable_prefix_caching=False, **budget)
    batched = LLM(model, max_num_seqs=MAX_NUM_SEQS, block_size=BLOCK_SIZE, enable_prefix_caching=False,
                  **budget)
    ways = {
        "sequential": (sequential, [[r] for r in requests]),
        "static batching": (batched, [requests[i:i + MAX_NUM_SEQS]
                                      for i in range(0, len(requests), MAX_NUM_SEQS)]),
        "continuous batching": (batched, [requests]),
    }
    runs = {name: [] for name in ways}
    for _ in range(REPEATS if scale >= 1 else 1):  # a tiny-scale run only shows that it runs
        for name, (engine, groups) in ways.items():
            runs[name].append(_run(engine, groups))
    results = {name: sorted(r)[len(r) // 2] for name, r in runs.items()}
    print(f"{len(requests)} requests, {results['sequential'][1]} output tokens, max_num_seqs {MAX_NUM_SEQS}")
    base = results["sequential"][1] / results["sequential"][0]
    for name, (seconds, tokens, calls) in results.items():
        print(f"{name:>20}: {tokens / seconds:8,.0f} tokens/s ({tokens / seconds / base:.2f}x sequential), "
              f"{calls} model calls")
    speed = results["continuous batching"][1] / results["continuous batching"][0] / base
    static = results["static batching"][0] / results["continuous batching"][0]
    verdict = "meets" if speed >= 3 else "misses"
    print(f"continuous batching speed: {speed:.2f}x sequential ({verdict} the target of ≥ 3×), "
          f"{static:.2f}x static batching")
    rate = 40.0
    chunked = LLM(model, max_num_seqs=MAX_NUM_SEQS, block_size=BLOCK_SIZE, enable_prefix_caching=False,
                  max_num_batched_tokens=CHUNKED_BUDGET)
    latencies = {}
    for name, engine in ((f"budget {batched.llm_engine.config.max_num_batched_tokens}", batched),
                         (f"budget {CHUNKED_BUDGET} (chunked prefill)", chunked)):
        latencies[name] = found = poisson_latencies(engine, requests, rate)
        print(f"Poisson arrivals at {rate:.0f} requests/s, {name}: TTFT p50 {found['ttft_p50']:.1f} ms, "
              f"p99 {found['ttft_p99']:.1f} ms; TPOT p50 {found['tpot_p50']:.2f} ms, "
              f"p99 {found['tpot_p99']:.2f} ms")
    _plot(results, latencies, rate)


def _plot(results, latencies, rate) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3))
    left.barh(list(results), [tokens / seconds for seconds, tokens, _ in results.values()])
    left.set(xlabel="output tokens / s", title="throughput (median of runs)")
    names = ["ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99"]
    width = 0.8 / len(latencies)
    for i, (label, found) in enumerate(latencies.items()):
        right.bar(np.arange(len(names)) + i * width, [found[n] for n in names], width, label=label)
    right.set_xticks(np.arange(len(names)) + width * (len(latencies) - 1) / 2, names)
    right.set(ylabel="ms", title=f"latency, Poisson arrivals at {rate:.0f}/s")
    right.legend()
    fig.tight_layout()
    PLOT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(PLOT, dpi=100)
    print(f"plot: {PLOT}")


if __name__ == "__main__":
    main()
