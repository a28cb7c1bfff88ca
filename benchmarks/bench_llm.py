"""stacklib.llm's train step against the same model and step in flax.nnx + optax.

Both steps train the chapter 12 model (base config: d_model 128, 4 layers, sequences of
128 bytes, batch 16, about 0.9 M parameters) on the same batch from the same weights:

* ours: `train.compile_step`, the step `python -m stacklib.llm.train` runs (stacklib.nn,
  stacklib.optim, compiled ahead of time on a one-device mesh, state donated);
* the twin: `stacklib.llm.twin`, written with flax.nnx layers, `jax.nn.dot_product_attention`
  and the real optax, under `jax.jit` with `nnx.split`/`nnx.merge` (the fast path of
  PITFALLS.md, not `nnx.jit`).

Printed: the time per step of each and their ratio (target ≥ 1.0×), tokens/s, and MFU:
the step's FLOPs counted by stacklib.compile over step time times the machine's measured
float32 matmul peak (stacklib.profile; target ≥ 35% at this size). Rounds of `steps`
steps alternate between the two, and each figure is the median round.
"""

from __future__ import annotations

import statistics
import time

import jax
import numpy as np

import stacklib.nn as nnx
from benchmarks.timing import print_ratio
from stacklib import hw, profile
from stacklib.llm import data, train, twin
from stacklib.llm.config import load_config


def _size(scale: float) -> dict:
    d_model = max(32, int(128 * scale) // 32 * 32)
    return dict(d_model=d_model, head_dim=d_model // 4, d_ff=3 * d_model, n_layers=max(1, int(4 * scale)),
                seq_len=max(16, int(128 * scale)), batch_size=max(4, int(16 * scale)), progress=False)


def main(scale: float = 1.0) -> None:
    config = load_config(None, **_size(scale), max_corpus_bytes=2_000_000)
    steps, rounds = max(2, int(10 * scale)), max(2, int(7 * scale))
    graphdef, params = nnx.split(train.make_model(config), nnx.Param)
    count = sum(int(np.size(x)) for x in jax.tree.leaves(params))  # before our step donates them
    tx = train.make_optimizer(config)
    twin_graphdef, twin_params = twin.copy_params(params, config)
    twin_step, twin_tx = twin.make_train_step(twin_graphdef, config)
    twin_state = [twin_params, twin_tx.init(twin_params)]
    opt_state = tx.init(params)
    ours = train.compile_step(config, graphdef, params, opt_state, tx)
    flops = train.step_flops(config, graphdef, params, opt_state, tx)
    our_state = list(ours.place(params, opt_state))
    batch = next(iter(data.train_dataset(config)))
    our_batch = jax.device_put(batch, ours.batch_sharding)

    def run_ours():
        for _ in range(steps):
            our_state[0], our_state[1], metrics = ours(our_state[0], our_state[1], our_batch)
        jax.block_until_ready(metrics["loss"])

    def run_twin():
        for _ in range(steps):
            twin_state[0], twin_state[1], loss = twin_step(twin_state[0], twin_state[1], batch)
        jax.block_until_ready(loss)

    run_ours(), run_twin()  # compile and warm up
    times = {"ours": [], "twin": []}
    for _ in range(rounds):
        for name, run in (("ours", run_ours), ("twin", run_twin)):
            start = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - start) / steps)
    ours_s, twin_s = statistics.median(times["ours"]), statistics.median(times["twin"])
    peak = profile.measure_matmul_peak(hw.sizes("profile_peaks").matmul_n, repeats=5)
    tokens = config.batch_size * config.seq_len
    print(f"model d_model {config.d_model}, {config.n_layers} layers, seq {config.seq_len}, batch "
          f"{config.batch_size}: {count:,} parameters, "
          f"{flops / 1e9:.2f} GFLOP per step (stacklib.compile)")
    print_ratio("train step", ours_s, twin_s, "flax+optax", target=1.0)
    print(f"tokens/s: stacklib {tokens / ours_s:,.0f}, flax+optax {tokens / twin_s:,.0f}")
    mfu_ours, mfu_twin = profile.mfu(flops, ours_s, peak), profile.mfu(flops, twin_s, peak)
    print(f"MFU: stacklib {mfu_ours:.1%}, flax+optax {mfu_twin:.1%} of a measured {peak / 1e9:.0f} GFLOP/s "
          "matmul peak (target ≥ 35%)")
