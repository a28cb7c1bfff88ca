"""Kernels written in Pallas, proved equal to XLA's reference ops (chapters 09 and 10).

Chapter 09 builds TPU-style Pallas kernels, one concept per file, each with an XLA
reference it is tested against:

* `elementwise` — any elementwise function of same-shaped arrays as one fused kernel;
* `matmul` — a tiled matmul with an f32 accumulator in VMEM scratch (`matmul.py`);
* `softmax` — a fused row softmax; `rms_norm` and `norms.layer_norm` — fused norms
  (`norms.py`; the package-level `layer_norm` is chapter 10's tokamax-like API);
* `flash_attention` — attention with an online softmax, causal block skipping and
  grouped-query heads; differentiable through a `custom_vjp` whose backward is Pallas too
  (`flash_attention.py`); `reference_attention` is the einsum it must equal;
* `backend.py` — the one switch that decides native vs interpreted (`resolve_interpret`),
  and `record_calls`, which lists the kernels traced (grid and blocks) for tests;
* `blocks.py` — what a block costs: `vmem_footprint` (double buffering, (8, 128) tiles)
  and the FLOPs and HBM bytes of each kernel as a function of its blocks (`KernelCost`).

Mirrors `jax.experimental.pallas` and its reference kernels in
`jax.experimental.pallas.ops.tpu`; each file's docstring lists its differences.

Chapter 10 puts kernels behind tokamax's API (`import stacklib.kernels as tokamax`):

* `dot_product_attention`, `layer_norm`, `gated_linear_unit` — one function per op, an
  `implementation=` name, sequence or None, checked arguments (`api.py`);
* `ATTENTION`, `LAYER_NORM`, `GATED_LINEAR_UNIT` — registries declaring what each
  implementation supports, and the fallback order (`registry.py`); 'xla' (`xla_attention.py`),
  'xla_chunked' (`xla_chunked.py`, memory linear in the sequence), 'pallas' (flash attention);
* `autotune`, `autotuning_cache_miss_fallback` — block sizes timed once and cached on disk
  (`autotuning.py`).

Chapter 14's inference engine attends through the same machinery:

* `ragged_paged_attention` and its registry `PAGED_ATTENTION` — decode and chunked prefill
  of a ragged batch against a paged KV cache via block tables; 'xla' gathers the blocks,
  'pallas' is a kernel whose index map looks the blocks up in scalar-prefetched block
  tables (`paged_attention.py`, after vLLM TPU's ragged paged attention).
"""

from stacklib.kernels.api import (
    ATTENTION,
    GATED_LINEAR_UNIT,
    LAYER_NORM,
    PAGED_ATTENTION,
    dot_product_attention,
    gated_linear_unit,
    layer_norm,
    ragged_paged_attention,
)
from stacklib.kernels.autotuning import autotune, autotuning_cache_miss_fallback
from stacklib.kernels.backend import KernelCall, record_calls, resolve_interpret
from stacklib.kernels.blocks import (
    KernelCost,
    block_bytes,
    flash_attention_cost,
    live_blocks,
    matmul_cost,
    rowwise_cost,
    vmem_footprint,
)
from stacklib.kernels.elementwise import elementwise
from stacklib.kernels.flash_attention import flash_attention, reference_attention
from stacklib.kernels.matmul import matmul, matmul_reference
from stacklib.kernels.norms import rms_norm, rms_norm_reference
from stacklib.kernels.registry import NoImplementationError
from stacklib.kernels.softmax import softmax, softmax_reference
from stacklib.kernels.xla_chunked import AttentionConfig

__all__ = [
    "ATTENTION",
    "AttentionConfig",
    "GATED_LINEAR_UNIT",
    "LAYER_NORM",
    "PAGED_ATTENTION",
    "NoImplementationError",
    "autotune",
    "autotuning_cache_miss_fallback",
    "dot_product_attention",
    "gated_linear_unit",
    "layer_norm",
    "KernelCall",
    "KernelCost",
    "block_bytes",
    "elementwise",
    "flash_attention",
    "flash_attention_cost",
    "live_blocks",
    "matmul",
    "matmul_cost",
    "matmul_reference",
    "ragged_paged_attention",
    "record_calls",
    "reference_attention",
    "resolve_interpret",
    "rms_norm",
    "rms_norm_reference",
    "rowwise_cost",
    "softmax",
    "softmax_reference",
    "vmem_footprint",
]
