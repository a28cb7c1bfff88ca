"""stacklib.infer: LLM inference like vLLM, for the chapter-12 model.

    from stacklib.infer import LLM, SamplingParams
    llm = LLM("stdlib-bytes")
    llm.generate(["def f("], SamplingParams(temperature=0, max_tokens=32))
    LLM("path/to/Qwen3-0.6B", max_model_len=2048)   # a Hugging Face checkpoint, its BPE and chat template

    python -m stacklib.infer.serve --model stdlib-bytes --port 8000   # OpenAI-compatible server

The pieces, one file each:
  config.py           EngineConfig: every engine setting, for LLMEngine, LLM and the command line
  sampling_params.py  SamplingParams (vLLM's names and defaults) and the sampling rule
  outputs.py          RequestOutput, CompletionOutput, Logprob
  block_pool.py       the paged KV cache's blocks: free queue, block tables, prefix hashes
  scheduler.py        continuous batching, chunked prefill, preemption, stop rules; owns the cache
  model_runner.py     one compiled step (decodes and prompt chunks): chapter 12's model, PagedKVCache
  quantization.py     weight-only int8/int4 serving with stacklib.quant's rules
  detokenizer.py      token ids (bytes or BPE) to text a step at a time: whole characters, stop strings
  engine.py           LLMEngine (add_request / step / abort_request) and LLM.generate
  async_engine.py     the engine stepped in a thread, for the server's asyncio requests
  protocol.py         the OpenAI API's request bodies (pydantic), chat templates, pieces of its answers
  serve.py            /v1/completions, /v1/chat/completions, /v1/models, /health on stacklib.http

Layer 4: it imports llm (layer 3), quant (layer 2), nn and http (layer 1).
"""

from stacklib.infer.config import EngineConfig
from stacklib.infer.engine import LLM, LLMEngine
from stacklib.infer.outputs import CompletionOutput, Logprob, RequestOutput
from stacklib.infer.sampling_params import InvalidRequestError, SamplingParams

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "InvalidRequestError", "LLMEngine",
           "Logprob", "RequestOutput", "SamplingParams"]
