"""stacklib.llm: a small language model trainer, like MaxText, from the book's own parts.

    python -m stacklib.llm.train stacklib/llm/configs/base.yml steps=300 d_model=128

    from stacklib import llm
    from stacklib.llm import train
    config = llm.load_config(None, "steps=300")          # configs/base.yml + overrides
    result = train.train(config)                          # metrics, checkpoints, goodput
    ids = llm.generate(result.model, prompt_ids, 100)     # greedy, with a KV cache
    model, tokenizer = llm.pretrained("stdlib-bytes")     # trained once, cached
    config, model = llm.hf.load_pretrained("Qwen3-0.6B/") # an open checkpoint (import stacklib.llm.hf)

The pieces, one file each:
  config.py     Config (one dataclass), configs/base.yml, key=value overrides, checks
  model.py      Transformer: embedding, RoPE, RMSNorm, GQA causal attention, SwiGLU
  kv_cache.py   the caches one forward pass reads and extends: KVCache (contiguous), PagedKVCache
  tokenizer.py  ByteTokenizer: one token per UTF-8 byte
  data.py       the Python standard library's source: split by file, packed, shuffled
  train.py      the sharded, checkpointed training loop; MFU and goodput per step
  pipeline.py   pipeline_parallelism: the layers in stages on a `pipeline` mesh axis (GPipe)
  multihost.py  one process per host: jax.distributed from the environment, checkpoints from all
  flops.py      FLOPs of a training step by hand: 6N plus attention, both causal conventions
  sample.py     generate: greedy or temperature, with or without a KV cache
  zoo.py        pretrained(name): train once, cache under $STACKLIB_CACHE, safe in parallel
  twin.py       the same model and step in flax.nnx + optax, for parity tests and benchmarks
  hf.py         Hugging Face checkpoints (config.json + safetensors) of Llama 3 and Qwen3, in and out
  hf_tokenizer.py  HFTokenizer: an open model's tokenizer.json, chat template and EOS ids
  hf_tunix.py   the same checkpoints in tunix's Qwen3 and Llama 3, for hf.py's parity tests and chapter 18

Layer 3: it imports nn, optim, data, checkpoint, compile, profile (layer 1) and
parallel, kernels (layer 2). Each file's docstring says how it differs from MaxText.
"""

from stacklib.llm.config import Config, ConfigError, load_config
from stacklib.llm.flops import StepFlops, matmul_params, training_flops
from stacklib.llm.kv_cache import KVCache, PagedKVCache
from stacklib.llm.model import Transformer, count_params
from stacklib.llm.sample import generate
from stacklib.llm.tokenizer import ByteTokenizer


def pretrained(name: str = "stdlib-bytes") -> tuple[Transformer, ByteTokenizer]:
    """`stacklib.llm.zoo.pretrained`: a trained model and its tokenizer, trained once and cached.

    Imported on first use, so that `python -m stacklib.llm.train` does not find its own
    module already imported by the package (runpy warns about that).
    """
    from stacklib.llm import zoo

    return zoo.pretrained(name)


__all__ = [
    "ByteTokenizer", "Config", "ConfigError", "KVCache", "PagedKVCache", "StepFlops", "Transformer",
    "count_params", "generate", "load_config", "matmul_params", "pretrained", "training_flops",
]
