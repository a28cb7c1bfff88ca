"""Stage 6: serve the model two ways, each started, queried and stopped by this code.

1. The inference engine (`stacklib.infer.LLM`, chapter 14; int8 weights in the book's run,
   through the paged-attention kernel) behind its OpenAI-compatible server, on a free
   localhost port, queried with the real `openai` client. Greedy completions through the
   server must equal the engine's own `generate`, and a burst of concurrent requests
   measures the served throughput (continuous batching).
2. The model exported as an artifact (`stacklib.serve.lm.export`, chapter 15): its
   next-token function as StableHLO with a symbolic batch and length, plus its weights,
   loaded in a fresh Python process that never imports the model's code. Its logits must
   equal the jitted function's bitwise, and greedy generation from it must give
   `stacklib.llm.generate`'s tokens.

Every wait is bounded: the server starts within `stacklib.http.Server`'s timeout, each
request has a client timeout and no retries, the child process has a timeout.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np

import stacklib.nn as nnx
from stacklib import http
from stacklib.infer import LLM, SamplingParams
from stacklib.infer.serve import create_app
from stacklib.llm import generate
from stacklib.serve import lm

REQUEST_TIMEOUT = 120.0  # seconds per HTTP request (a loaded 2-core machine)
CHILD_TIMEOUT = 300.0


@dataclasses.dataclass
class ServeResult:
    """What stage 6 measured."""

    url: str  # where the server listened (it is stopped now)
    prompts: list  # text, or token ids
    completions: list[str]  # through the server, with the openai client
    engine_completions: list[str]  # `LLM.generate` on the same engine, before serving
    burst_requests: int
    burst_tokens: int  # completion tokens generated during the burst
    burst_seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.burst_tokens / self.burst_seconds


def serve_with_openai(model: nnx.Module, prompts: list[str] | list[list[int]], *, max_tokens: int = 24,
                      burst: int = 16, name: str = "capstone",
                      quantization: str | None = None) -> ServeResult:
    """Serve `model` with the OpenAI-compatible server; query it with the `openai` client.

    Args:
      model: a chapter-12 Transformer.
      quantization: None (float weights), 'int8' or 'int4': the engine quantizes the weights
        with `stacklib.quant` and serves them (chapter 14).
      prompts: text or token ids (OpenAI's completions take both); greedy completions of
        these are compared with the engine's.
      max_tokens: tokens per completion.
      burst: concurrent requests sent at once to measure throughput.
      name: the served model's name.
    """
    import openai

    llm = LLM(model, max_num_seqs=8, block_size=4, quantization=quantization)
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens)
    as_inputs = [p if isinstance(p, str) else {"prompt_token_ids": list(p)} for p in prompts]
    engine = [output.outputs[0].text for output in llm.generate(as_inputs, greedy)]
    with http.Server(create_app(llm, served_model_name=name)) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                               timeout=REQUEST_TIMEOUT)
        served = [client.completions.create(model=name, prompt=p, max_tokens=max_tokens, temperature=0)
                  .choices[0].text for p in prompts]

        def one(i: int) -> int:
            response = client.completions.create(model=name, prompt=prompts[i % len(prompts)],
                                                 max_tokens=max_tokens, temperature=0.8, seed=i)
            return response.usage.completion_tokens

        began = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(burst) as pool:
            tokens = sum(pool.map(one, range(burst), timeout=REQUEST_TIMEOUT * 2))
        seconds = time.perf_counter() - began
        url = server.url
    return ServeResult(url, list(prompts), served, engine, burst, tokens, seconds)


# -- the exported artifact ----------------------------------------------------------------------

CHILD = """
import json, sys
import numpy as np
import stacklib.serve as serve
from stacklib.serve import lm
directory, scratch, max_new_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
model = serve.load(directory)
tokens = np.load(scratch + "/tokens.npy")
np.save(scratch + "/logits.npy", np.asarray(model(tokens)))
np.save(scratch + "/generated.npy", lm.generate(model, tokens, max_new_tokens))
model_code = sorted(m for m in sys.modules if m.split(".")[0] == "flax"
                    or m.startswith(("stacklib.nn", "stacklib.llm", "stacklib.quant")))
print(json.dumps({"model_code_imported": model_code}))
"""


@dataclasses.dataclass
class ExportResult:
    directory: pathlib.Path
    manifest: dict
    bitwise: bool  # the fresh process's next-token logits equal the jitted function's
    generated_equal: bool  # its greedy tokens equal stacklib.llm.generate's (no KV cache)
    generated: np.ndarray  # (B, T0 + new) ids generated in the fresh process
    model_code_imported: list[str]  # modules of model code the fresh process imported (none)


def export_and_load_elsewhere(model: nnx.Module, tokens: np.ndarray, max_new_tokens: int,
                              directory: str | os.PathLike | None = None) -> ExportResult:
    """Export `model` with chapter 15's `stacklib.serve.lm`; load and run it in a fresh process.

    The artifact is the model's next-token function with a symbolic batch and length. The
    fresh process loads it (verifying every hash), computes the next-token logits of
    `tokens` and generates `max_new_tokens` greedily from them; both must equal what this
    process computes from the model's own code.

    Args:
      model: a chapter-12 Transformer.
      tokens: (B, T0) int32 prompt ids, every row the same length.
      max_new_tokens: tokens to generate from the artifact.
      directory: where to write the artifact (must not exist; default: a new temporary folder).
    """
    directory = pathlib.Path(directory or pathlib.Path(tempfile.mkdtemp(prefix="capstone-export-")) / "1")
    manifest = lm.export(model, directory, platforms=("cpu", "tpu", "cuda"), metadata={"stage": "capstone"})
    fn, params = lm.next_token_function(model)
    expected_logits = np.asarray(jax.jit(fn)(params, tokens))  # the jitted reference (chapter 15)
    expected_tokens = generate(model, tokens, max_new_tokens, use_cache=False)
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="capstone-check-"))  # the arrays both processes read
    np.save(scratch / "tokens.npy", tokens)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(pathlib.Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, "-c", CHILD, str(directory), str(scratch), str(max_new_tokens)]
    child = subprocess.run(command, capture_output=True, text=True, timeout=CHILD_TIMEOUT, env=env)
    if child.returncode != 0:
        raise RuntimeError(f"loading the artifact in a fresh process failed:\n{child.stderr[-3000:]}")
    report = json.loads(child.stdout.strip().splitlines()[-1])
    logits, generated = np.load(scratch / "logits.npy"), np.load(scratch / "generated.npy")
    return ExportResult(directory, manifest, bool(np.array_equal(logits, expected_logits)),
                        bool(np.array_equal(generated, expected_tokens)), generated,
                        report["model_code_imported"])
