"""Quantization: stacklib.quant against qwix on the same model, and what int8 weights buy.

- Quantize-a-model time: `quantize_model` with int8 weight-only PTQ rules, ours on a
  stacklib.nn MLP, qwix's on the same MLP in flax.nnx (same seed, same weights). Both run
  the model once eagerly, so the target is parity: at least 0.9x qwix's speed.
- Inference time of the two quantized models, jitted, on the same input (target >= 0.9x).
- Parameter bytes per format (int4 counted at 4 bits, as a TPU packs it).
- A decode-style (batch 1, memory-bound) matmul: an int8 weight dequantized inside the
  jitted matmul against the float32 matmul. Reported whichever way it goes: on a CPU, XLA
  may not fuse the dequantization into the product, and then int8 is not faster.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import qwix
from flax import nnx as flax_nnx

import stacklib.nn as nnx
import stacklib.quant as quant
from benchmarks.timing import median_seconds, print_ratio


def make_mlp(lib, width: int):
    class MLP(lib.Module):
        def __init__(self, rngs):
            self.hidden1 = lib.Linear(width, width, rngs=rngs)
            self.hidden2 = lib.Linear(width, width, rngs=rngs)
            self.out = lib.Linear(width, 16, rngs=rngs)

        def __call__(self, x):
            return self.out(lib.relu(self.hidden2(lib.relu(self.hidden1(x)))))

    return MLP(lib.Rngs(0))


def _param_bytes(model) -> int:
    total = 0
    for _, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        value = variable[...]
        total += value.nbytes if isinstance(value, quant.QArray) else value.size * value.dtype.itemsize
    return total


def _jitted_forward(lib, model, x):
    graphdef, state = lib.split(model)
    forward = jax.jit(lambda state, x: lib.merge(graphdef, state)(x))

    def run():
        jax.block_until_ready(forward(state, x))

    run()
    return run


def main(scale: float = 1.0) -> None:
    warnings.filterwarnings("ignore", category=DeprecationWarning)  # qwix reads flax's deprecated `.value`
    width = max(32, int(1024 * scale))
    batch = max(4, int(64 * scale))
    ours, theirs = make_mlp(nnx, width), make_mlp(flax_nnx, width)
    x = jax.random.normal(jax.random.key(1), (batch, width))
    rule = dict(module_path=".*", weight_qtype=jnp.int8)
    print(f"MLP {width}-{width}-{width}-16, batch {batch}, int8 weight-only PTQ")

    def quantize_ours():
        return quant.quantize_model(ours, quant.PtqProvider([quant.QuantizationRule(**rule)]), x)

    def quantize_theirs():
        return qwix.quantize_model(theirs, qwix.PtqProvider([qwix.QuantizationRule(**rule)]), x)

    ours_s = median_seconds(lambda: jax.block_until_ready(jax.tree.leaves(quantize_ours())), repeats=5)
    theirs_s = median_seconds(lambda: jax.block_until_ready(jax.tree.leaves(quantize_theirs())), repeats=5)
    print_ratio("quantize_model", ours_s, theirs_s, "qwix", target=0.9)
    ours_q, theirs_q = quantize_ours(), quantize_theirs()
    run_ours, run_theirs = _jitted_forward(nnx, ours_q, x), _jitted_forward(flax_nnx, theirs_q, x)
    times = {"ours": [], "theirs": []}
    for _ in range(7):  # alternate, so both see the same machine load
        times["ours"].append(median_seconds(run_ours, repeats=3, warmup=0))
        times["theirs"].append(median_seconds(run_theirs, repeats=3, warmup=0))
    median = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    print_ratio("quantized inference (jit)", median["ours"], median["theirs"], "qwix", target=0.9)

    formats = {
        "float32": None,
        "int8": quant.QuantizationRule(weight_qtype=jnp.int8),
        "int4": quant.QuantizationRule(weight_qtype=jnp.int4),
        "int4 tiles of 128": quant.QuantizationRule(weight_qtype=jnp.int4, tile_size=min(128, width)),
    }
    float_bytes = _param_bytes(ours)
    for name, format_rule in formats.items():
        provider = quant.PtqProvider([format_rule]) if format_rule else None
        model = quant.quantize_model(ours, provider, x) if provider else ours
        size = _param_bytes(model)
        print(f"parameter bytes, {name:18}: {size:>10,d} ({float_bytes / size:.2f}x smaller than float32)")

    n = max(64, int(4096 * scale))
    w = jax.random.normal(jax.random.key(2), (n, n))
    w8 = quant.quantize(w, jnp.int8, channelwise_axes=(1,))
    v = jax.random.normal(jax.random.key(3), (1, n))
    numbers = (((1,), (0,)), ((), ()))
    float_matmul = jax.jit(lambda v, w: jax.lax.dot_general(v, w, numbers))
    int8_matmul = jax.jit(lambda v, w8: jax.lax.dot_general(v, quant.dequantize(w8), numbers))
    float_s = median_seconds(lambda: jax.block_until_ready(float_matmul(v, w)), repeats=20)
    int8_s = median_seconds(lambda: jax.block_until_ready(int8_matmul(v, w8)), repeats=20)
    print(f"decode matmul (1, {n}) x ({n}, {n}) on {jax.devices()[0].platform}: ", end="")
    print_ratio("int8 weight vs float32", int8_s, float_s, "float32")
