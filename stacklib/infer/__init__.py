"""stacklib.infer: LLM inference like vLLM, for the chapter-12 model.

    from stacklib.infer import LLM, SamplingParams
    llm = LLM("stdlib-bytes")
    llm.generate(["def f("], SamplingParams(temperature=0, max_tokens=32))

    python -m stacklib.infer.serve --model stdlib-bytes --port 8000   # OpenAI-compatible server

The pieces, one file each:
  sampling_params.py  SamplingParams (vLLM's names and defaults) and the sampling rule
  outputs.py          RequestOutput, CompletionOutput, Logprob
  block_pool.py       the paged KV cache's blocks: free queue, block tables, prefix hashes
  scheduler.py        continuous batching: admission, budgets, preemption by recomputation
  model_runner.py     compiled prefill/decode over the paged cache (gather through block tables)
  engine.py           LLMEngine (add_request / step / abort_request) and LLM.generate
  serve.py            /v1/completions, /v1/chat/completions, /v1/models, /health on stacklib.http

Layer 4: it imports llm (layer 3), nn and http (layer 1).
"""

from stacklib.infer.engine import LLM, LLMEngine
from stacklib.infer.outputs import CompletionOutput, Logprob, RequestOutput
from stacklib.infer.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "LLMEngine", "Logprob", "RequestOutput", "SamplingParams"]
