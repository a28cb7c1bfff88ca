"""The book on a GPU or TPU: what `make test-accelerator` checks beyond running every chapter there.

`make test-accelerator` installs the accelerator build of the pinned JAX when the machine
has a GPU or TPU (`stacklib.hw.install_accelerator_support`), then runs these tests and,
under nbval, every chapter at its `hw.PROBLEM_SIZES` accelerator row. On a machine where
JAX sees only a CPU every test here is reported as skipped, with the reason: none passes
without an accelerator to run on.

What is checked, and why:
- Pallas kernels: on a TPU they compile natively (Mosaic), not in the interpreter, and equal
  their XLA references. Our kernels are TPU-style (they accumulate across a sequential grid
  axis in scratch), so on a GPU they run in Pallas's interpreter: the test states that (the
  switch says interpret) and checks they are still right there.
- Chapter 12's step time and MFU at the accelerator row, against the chip's measured
  float32 matmul peak: printed, and asserted only to be a fraction in (0, 1].
- The inference and serving benchmarks, at full scale: they run to the end.

The figures are appended as JSON lines to `accelerator_results.jsonl` in the working
directory, for the accelerator table in CONTRIBUTING.md ("Accelerators and Python 3.13").
"""

import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stacklib import hw, kernels
from stacklib.kernels import backend as kernel_backend

ROOT = pathlib.Path(__file__).resolve().parents[2]
BACKEND = jax.default_backend()
RESULTS = pathlib.Path("accelerator_results.jsonl")

pytestmark = pytest.mark.skipif(
    BACKEND not in ("gpu", "tpu"),
    reason=f"JAX sees no GPU or TPU here (backend {BACKEND!r}): run `make test-accelerator` on a GPU or "
           "TPU machine, or in a Colab TPU runtime (benchmarks/run_accelerator_tests.ipynb).")


def record(**figures) -> None:
    with RESULTS.open("a") as results:
        device = jax.devices()[0].device_kind
        results.write(json.dumps({"backend": BACKEND, "device": device, **figures}) + "\n")
    print(figures)


def _inputs(seed, *shapes, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    return [jax.random.normal(k, s, dtype) for k, s in zip(keys, shapes, strict=True)]


KERNEL_CASES = {
    # name: (our kernel on the inputs, the XLA reference, input shapes, tolerance)
    "matmul": (lambda x, y, i: kernels.matmul(x, y, interpret=i), kernels.matmul_reference,
               [(512, 384), (384, 256)], 1e-4),
    "softmax": (lambda x, i: kernels.softmax(x, interpret=i), kernels.softmax_reference, [(512, 256)], 1e-6),
    "rms_norm": (lambda x, s, i: kernels.rms_norm(x, s, interpret=i), kernels.rms_norm_reference,
                 [(512, 256), (256,)], 1e-5),
    "flash_attention": (lambda q, k, v, i: kernels.flash_attention(q, k, v, is_causal=True, interpret=i),
                        lambda q, k, v: kernels.reference_attention(q, k, v, is_causal=True),
                        [(2, 256, 4, 64), (2, 256, 2, 64), (2, 256, 2, 64)], 2e-3),
}


@pytest.mark.parametrize("name", sorted(KERNEL_CASES))
def test_each_pallas_kernel_runs_natively_on_tpu_or_stated_interpreted_on_gpu_and_equals_xla(name):
    ours, reference, shapes, tolerance = KERNEL_CASES[name]
    interpret = kernel_backend.resolve_interpret(None)
    if BACKEND == "tpu":
        assert interpret is False, "on a TPU the kernels must compile natively"
        hlo = jax.jit(lambda *a: ours(*a, None)).lower(*_inputs(0, *shapes)).as_text()
        assert "tpu_custom_call" in hlo, "no Mosaic kernel in the lowered program"
    else:
        assert interpret is True, "on a GPU our TPU-style kernels run in the interpreter (backend.py)"
    arrays = _inputs(0, *shapes)
    got, expected = ours(*arrays, None), reference(*arrays)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=tolerance, atol=tolerance)
    record(kernel=name, native=not interpret)


def test_chapter_12s_model_at_the_accelerator_row_reports_its_step_time_and_mfu():
    from stacklib.llm import train
    from stacklib.llm.config import load_config

    sizes = vars(hw.sizes("llm_train"))
    config = load_config(None, **{**sizes, "steps": 30, "checkpoint_every": 1000, "progress": False,
                                  "eval_batches": 0, "max_corpus_bytes": 20_000_000})
    result = train.train(config)
    steady = result.history[5:]
    step_time = float(np.median([r["step_time"] for r in steady]))
    mfu = float(np.median([r["mfu"] for r in steady]))
    record(chapter=12, step_seconds=step_time, mfu=mfu, matmul_peak_tflops=result.peak_flops / 1e12,
           tokens_per_second=config.batch_size * config.seq_len / step_time)
    assert 0 < mfu <= 1, f"MFU {mfu} is not a fraction of the measured peak"
    assert result.history[-1]["loss"] < result.history[0]["loss"]


@pytest.mark.parametrize("name", ["infer", "serve"])
def test_the_inference_and_serving_benchmarks_run_at_full_scale(name):
    done = subprocess.run([sys.executable, "-m", "benchmarks", name], cwd=ROOT, capture_output=True,
                          text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    record(benchmark=name, output=done.stdout[-4000:])
