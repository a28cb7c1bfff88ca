"""The chapter-09 kernels against their XLA references, block arithmetic, and bad input.

Tolerances: the kernels compute in float32 like their references, so the differences are
summation order only: 1e-6 absolute on O(1) values (matmul: relative, its sums have K terms).
Shapes are chosen so that no dimension divides its block: padding is always exercised.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from stacklib.kernels import (
    block_bytes,
    elementwise,
    flash_attention_cost,
    live_blocks,
    matmul,
    matmul_cost,
    matmul_reference,
    record_calls,
    resolve_interpret,
    rms_norm,
    rms_norm_reference,
    softmax,
    softmax_reference,
    vmem_footprint,
)
from stacklib.kernels.blocks import TPU_VMEM_BYTES, tile_shape
from stacklib.kernels.norms import layer_norm, layer_norm_reference


def _normal(*shape, seed=0, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), dtype)


TPU_INTERPRET = pltpu.InterpretParams(detect_races=True)  # emulated VMEM/DMA: keep grids tiny


@pytest.mark.parametrize("interpret", [True, TPU_INTERPRET], ids=["generic", "tpu-interpret"])
def test_matmul_equals_xla_on_ragged_shapes(interpret):
    x, y = _normal(20, 44, seed=1), _normal(44, 36, seed=2)  # grid (3, 3, 3) with 8/16 blocks
    out = matmul(x, y, block_m=8, block_n=16, block_k=16, interpret=interpret)
    np.testing.assert_allclose(out, matmul_reference(x, y), rtol=1e-6, atol=1e-5)


def test_matmul_records_the_grid_its_blocks_imply():
    with record_calls() as calls:
        jax.make_jaxpr(lambda x, y: matmul(x, y, block_m=8, block_n=16, block_k=32))(
            jnp.zeros((20, 64)), jnp.zeros((64, 40)))
    assert [(c.name, c.grid) for c in calls] == [("matmul", (3, 3, 2))]


def test_matmul_bfloat16_accumulates_in_float32():
    x, y = _normal(16, 256, seed=3, dtype=jnp.bfloat16), _normal(256, 16, seed=4, dtype=jnp.bfloat16)
    out = matmul(x, y, block_m=16, block_n=16, block_k=32)
    expected = jnp.dot(x, y, preferred_element_type=jnp.float32)  # f32 sums of bf16 products
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(out.astype(jnp.float32), expected, rtol=1e-2, atol=1e-2)  # one bf16 rounding


@pytest.mark.parametrize("interpret", [True, TPU_INTERPRET], ids=["generic", "tpu-interpret"])
def test_softmax_equals_xla(interpret):
    x = 3 * _normal(3, 7, 40, seed=5)  # 21 rows: blocks of 8 pad to 24
    np.testing.assert_allclose(softmax(x, block_rows=8, interpret=interpret), softmax_reference(x),
                               rtol=0, atol=1e-6)


@pytest.mark.parametrize("interpret", [True, TPU_INTERPRET], ids=["generic", "tpu-interpret"])
def test_norms_equal_xla(interpret):
    x, scale, offset = _normal(2, 11, 48, seed=6), _normal(48, seed=7), _normal(48, seed=8)
    np.testing.assert_allclose(rms_norm(x, scale, block_rows=8, interpret=interpret),
                               rms_norm_reference(x, scale), rtol=0, atol=2e-6)
    np.testing.assert_allclose(layer_norm(x, scale, offset, block_rows=8, interpret=interpret),
                               layer_norm_reference(x, scale, offset), rtol=0, atol=2e-6)


@pytest.mark.parametrize("interpret", [True, TPU_INTERPRET], ids=["generic", "tpu-interpret"])
def test_fused_elementwise_equals_xla(interpret):
    x, w, b = _normal(5, 300, seed=9), _normal(5, 300, seed=10), _normal(5, 300, seed=11)

    def fn(x, w, b):
        return jax.nn.gelu(x * w + b)

    out = elementwise(fn, x, w, b, block_rows=8, block_cols=128, interpret=interpret)  # grid (1, 3)
    np.testing.assert_allclose(out, fn(x, w, b), rtol=0, atol=1e-6)


def test_none_means_interpret_on_this_cpu():
    assert resolve_interpret(None) is (jax.default_backend() != "tpu")
    assert resolve_interpret(TPU_INTERPRET) is TPU_INTERPRET


# ---------------------------------------------------------------- block arithmetic


def test_blocks_are_counted_in_whole_8_by_128_tiles():
    assert tile_shape((128, 1), jnp.float32) == (128, 128)  # a column still costs 128 lanes
    assert tile_shape((None, None, 8, 64), jnp.float32) == (8, 128)  # squeezed axes cost nothing
    assert tile_shape((8, 128), jnp.bfloat16) == (16, 128)  # bf16 packs 16 rows to a tile
    assert block_bytes((256, 512), jnp.float32) == 256 * 512 * 4


def test_vmem_footprint_double_buffers_blocks_not_scratch():
    blocks = [((128, 128), jnp.float32)] * 3  # x, y and out blocks of a matmul
    scratch = [((128, 128), jnp.float32)]  # the accumulator
    assert vmem_footprint(blocks, scratch) == (2 * 3 + 1) * 128 * 128 * 4


def test_matmul_intensity_grows_with_the_block():
    small = matmul_cost(4096, 4096, 4096, block_m=128, block_n=128)
    large = matmul_cost(4096, 4096, 4096, block_m=512, block_n=512)
    assert small.flops == large.flops == 2 * 4096**3
    assert large.intensity > 3.5 * small.intensity  # ~4x fewer re-reads of x and y


def test_causal_flash_attention_computes_about_half_the_blocks():
    assert live_blocks(1024, 1024, block_q=128, block_k=128, is_causal=False) == 64
    assert live_blocks(1024, 1024, block_q=128, block_k=128, is_causal=True) == 36  # 8 * 9 / 2
    full = flash_attention_cost(1, 1024, 1024, 8, 8, 64, block_q=128, block_k=128)
    assert full.flops == 4 * 8 * 1024 * 1024 * 64


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: matmul(jnp.zeros((4, 8)), jnp.zeros((4, 8))), r"columns \(8\) must equal y's rows \(4\)"),
        (lambda: matmul(jnp.zeros((4,)), jnp.zeros((4, 8))), "x must be a matrix"),
        (lambda: matmul(jnp.zeros((8, 8)), jnp.zeros((8, 8)), block_k=10), "block_k must be a positive"),
        (lambda: matmul(jnp.zeros((4096, 4096)), jnp.zeros((4096, 4096)), block_m=2048, block_n=2048,
                        block_k=1024), "MiB of VMEM"),
        (lambda: matmul(jnp.zeros((8, 8), jnp.int32), jnp.zeros((8, 8), jnp.int32)), "x has dtype int32"),
        (lambda: softmax(jnp.zeros((8, 2**20))), "block_rows=8 with rows of 1048576 need"),
        (lambda: rms_norm(jnp.zeros((8, 16)), jnp.zeros((8,))), r"scale must have shape \(16,\)"),
        (lambda: elementwise(jnp.add, jnp.zeros((8, 8)), jnp.zeros((8, 4))), r"arrays\[1\] has shape"),
        (lambda: elementwise(jnp.negative, jnp.zeros((8, 8)), block_cols=64), "block_cols must be a"),
    ],
)
def test_bad_input_is_named_before_any_kernel_runs(call, match):
    with record_calls() as calls, pytest.raises(ValueError, match=match):
        call()
    assert calls == []


def test_vmem_limit_is_the_default_scoped_limit():
    assert TPU_VMEM_BYTES == 16 * 2**20
