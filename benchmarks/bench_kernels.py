"""Chunked attention on CPU: stacklib.kernels 'xla_chunked' vs tokamax 'xla_chunked' vs jax.nn.

The same self-attention (batch 1, 2 heads of 64, float32, not causal) at sequence lengths
1k to 16k, jitted, timed in alternating rounds (median), and the temporary memory of
each compiled program (XLA's `memory_analysis()`, a compile-time number). Both chunked
versions use tokamax's default chunk of 512 queries x 1024 keys. Targets: at least 0.9x
tokamax's speed, and no more temporary memory. `jax.nn.dot_product_attention` keeps the
whole T x T logits: it is timed only while that fits comfortably (temp <= 1.5 GB); beyond,
only its memory is printed.
"""

from __future__ import annotations

import jax
from absl import flags

from benchmarks.timing import median_seconds, print_ratio
from stacklib import kernels

LENGTHS = (1024, 2048, 4096, 8192, 16384)
HEADS, HEAD_DIM = 2, 64
MAX_TIMED_TEMP_BYTES = 1.5e9


def _attention(library: str):
    def attend(q, k, v):
        if library == "stacklib":
            return kernels.dot_product_attention(q, k, v, implementation="xla_chunked")
        if library == "tokamax":
            import tokamax

            return tokamax.dot_product_attention(q, k, v, implementation="xla_chunked")
        return jax.nn.dot_product_attention(q, k, v)

    return jax.jit(attend)


def _interleaved(runners: dict, rounds: int) -> dict:
    """Median seconds of each runner over `rounds` alternating rounds (same load on average)."""
    times = {name: [] for name in runners}
    for _ in range(rounds):
        for name, run in runners.items():
            times[name].append(median_seconds(run, repeats=1, warmup=0))
    return {name: sorted(values)[len(values) // 2] for name, values in times.items()}


def main(scale: float = 1.0) -> None:
    flags.FLAGS.mark_as_parsed()  # tokamax reads absl flags; this process has none of its own
    lengths = sorted({max(128, int(length * scale)) for length in LENGTHS})
    rounds = 3 if scale >= 1 else 1
    print(f"self-attention, batch 1, {HEADS} heads x {HEAD_DIM}, float32; "
          f"median of {rounds} alternating rounds")
    for T in lengths:
        keys = jax.random.split(jax.random.key(T), 3)
        q, k, v = (jax.random.normal(key, (1, T, HEADS, HEAD_DIM)) for key in keys)
        spec = jax.ShapeDtypeStruct(q.shape, q.dtype)
        compiled = {name: _attention(name).lower(spec, spec, spec).compile()
                    for name in ("stacklib", "tokamax", "jax.nn")}
        temp = {name: c.memory_analysis().temp_size_in_bytes for name, c in compiled.items()}
        timed = [name for name in compiled if name != "jax.nn" or temp[name] <= MAX_TIMED_TEMP_BYTES]
        runners = {name: (lambda c=compiled[name], args=(q, k, v): jax.block_until_ready(c(*args)))
                   for name in timed}
        for run in runners.values():
            run()  # warm-up
        times = _interleaved(runners, rounds)
        print_ratio(f"T={T:5d} xla_chunked", times["stacklib"], times["tokamax"], "tokamax", target=0.9)
        if "jax.nn" in times:
            print_ratio(f"T={T:5d} xla_chunked vs plain", times["stacklib"], times["jax.nn"], "jax.nn")
        else:
            print(f"T={T:5d} jax.nn not timed: its temporary memory would be {temp['jax.nn'] / 1e9:.1f} GB")
        verdict = "meets" if temp["stacklib"] <= temp["tokamax"] else "misses"
        print(f"T={T:5d} temporary MB: stacklib {temp['stacklib'] / 1e6:8.1f}, tokamax "
              f"{temp['tokamax'] / 1e6:8.1f}, jax.nn {temp['jax.nn'] / 1e6:8.1f} "
              f"({verdict} the target of <= tokamax's)")


if __name__ == "__main__":
    main()
