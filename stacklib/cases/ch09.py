"""Chapter 09 exercises: an index map for a transposed operand, the online-softmax update,
the causal block-skip condition, a matmul's VMEM footprint, and a fused kernel of your own.

Cases that run a learner's Pallas code use the generic interpreter (`interpret=True`) on
grids of a few steps, so they cost a compilation each (about a second) and no more.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from stacklib.grading import Exercise, call_on_copies, expect, expect_close
from stacklib.kernels import live_blocks, vmem_footprint

KERNEL_TIME_LIMIT_S = 300.0  # a compilation on a loaded 2-core machine; never the answer's fault


def _normal(*shape, seed):
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


# ---------------------------------------------------------------- 09.transposed_index_map

transposed_index_map = Exercise("09.transposed_index_map", "An index map for a transposed operand")


def _matmul_transposed_rhs(x, yt, rhs_index_map, *, block_m, block_n, block_k):
    """x [M, K] @ yt.T where yt is [N, K], on the chapter's (i, j, k) grid, yt's blocks by `rhs_index_map`."""
    (M, K), N = x.shape, yt.shape[0]

    def kernel(x_ref, yt_ref, o_ref, acc_ref):
        @pl.when(pl.program_id(2) == 0)
        def _init():
            acc_ref[...] = jnp.zeros_like(acc_ref)

        acc_ref[...] += lax.dot_general(x_ref[...], yt_ref[...], (((1,), (1,)), ((), ())),
                                        precision=lax.Precision.HIGHEST)  # x_block @ yt_block.T

        @pl.when(pl.program_id(2) == pl.num_programs(2) - 1)
        def _finalize():
            o_ref[...] = acc_ref[...]

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((M, N), jnp.float32),
        grid=(M // block_m, N // block_n, K // block_k),
        in_specs=[pl.BlockSpec((block_m, block_k), lambda i, j, k: (i, k)),
                  pl.BlockSpec((block_n, block_k), rhs_index_map)],
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j, k: (i, j)),
        scratch_shapes=[pltpu.VMEM((block_m, block_n), jnp.float32)],
        interpret=True,
    )(x, yt)


@transposed_index_map.case(hint="yt's block rows are indexed by the output column block j, its block "
                                "columns by the reduction block k: the map returns (j, k).")
def returns_the_block_of_yt_each_step_needs(index_map):
    for i, j, k in [(0, 0, 0), (1, 2, 3), (3, 1, 2)]:
        got = index_map(i, j, k)
        expect(isinstance(got, tuple) and len(got) == 2,
               f"index_map({i}, {j}, {k}) must return a tuple of two block indices, got {got!r:.60}")
        expect(tuple(int(g) for g in got) == (j, k),
               f"index_map({i}, {j}, {k}) returned {tuple(int(g) for g in got)}; which block of yt "
               f"[N, K] holds the columns of output block j and the reduction slice k?")


def _check_transposed_matmul(index_map, M, N, K, block_m, block_n, block_k, seed):
    x, yt = _normal(M, K, seed=seed), _normal(N, K, seed=seed + 1)
    expected = x @ yt.T
    got = _matmul_transposed_rhs(jnp.asarray(x), jnp.asarray(yt), index_map,
                                 block_m=block_m, block_n=block_n, block_k=block_k)
    expect_close(got, expected, rtol=1e-5, atol=1e-4,
                 what=f"x [{M}, {K}] @ yt.T with yt [{N}, {K}], blocks ({block_m}, {block_n}, {block_k})")


@transposed_index_map.case(points=2, time_limit_s=KERNEL_TIME_LIMIT_S,
                           hint="Run the kernel on square blocks: every (i, j, k) must fetch yt's block "
                                "(j, k), whatever i is.")
def a_matmul_with_square_blocks_is_right(index_map):
    _check_transposed_matmul(index_map, 32, 32, 32, 16, 16, 16, seed=0)


@transposed_index_map.case(points=2, time_limit_s=KERNEL_TIME_LIMIT_S,
                           hint="With block_n != block_k the block shape of yt is (block_n, block_k): "
                                "its first index counts blocks of N, its second blocks of K.")
def a_matmul_with_rectangular_blocks_is_right(index_map):
    _check_transposed_matmul(index_map, 16, 48, 32, 16, 16, 32, seed=2)


# ---------------------------------------------------------------- 09.online_softmax

online_softmax = Exercise("09.online_softmax", "The online-softmax update of flash attention")


def _run_online(update, s, v, block):
    """Feed update() the key blocks of logits s [R, S] and values v [S, H]; return acc / l."""
    R, S = s.shape
    m, denominator = np.full(R, -np.inf, np.float32), np.zeros(R, np.float32)
    acc = np.zeros((R, v.shape[1]), np.float32)
    for start in range(0, S, block):
        state = call_on_copies(update, m, denominator, acc, s[:, start:start + block], v[start:start + block],
                               what="online_softmax_update")
        m, denominator, acc = (np.asarray(a, np.float64) for a in state)
    return acc / denominator[:, None]


def _softmax_weighted(s, v):
    s = s.astype(np.float64)
    p = np.exp(s - s.max(axis=1, keepdims=True))
    return (p / p.sum(axis=1, keepdims=True)) @ v


@online_softmax.case(hint="From the empty state (m = -inf, l = 0, acc = 0) one block must give "
                          "l = sum(exp(s - m_new)) and acc = exp(s - m_new) @ v with m_new = max(s).")
def one_block_gives_the_softmax(update):
    s, v = _normal(4, 16, seed=10), _normal(16, 8, seed=11)
    expect_close(_run_online(update, s, v, 16), _softmax_weighted(s, v), rtol=1e-5, atol=1e-5,
                 what="acc / l after one block")


@online_softmax.case(points=2, hint="When the maximum grows from m to m_new, what was summed so far was "
                                    "relative to m: multiply l and acc by alpha = exp(m - m_new).")
def many_blocks_give_the_softmax(update):
    s, v = 3 * _normal(4, 64, seed=12), _normal(64, 8, seed=13)
    s[:, 40:] += 5.0  # later blocks hold the larger logits: the maximum moves
    expect_close(_run_online(update, s, v, 16), _softmax_weighted(s, v), rtol=1e-5, atol=1e-5,
                 what="acc / l after four blocks")


@online_softmax.case(hint="exp(1000) overflows float32: subtract the running maximum before exp.")
def large_logits_do_not_overflow(update):
    s, v = 1000.0 + _normal(2, 32, seed=14), _normal(32, 4, seed=15)
    s[:, 16:] += 2.0  # and the maximum moves
    expect_close(_run_online(update, s, v, 16), _softmax_weighted(s, v), rtol=1e-5, atol=1e-5,
                 what="acc / l for logits near 1000")


@online_softmax.case(points=2, hint="A block whose logits are all -inf (masked) leaves m_new = -inf, and "
                                    "exp(-inf - (-inf)) is NaN: use 0 in place of an infinite m_new.")
def a_masked_block_changes_nothing(update):
    s, v = _normal(3, 32, seed=16), _normal(32, 4, seed=17)
    s[:, :16] = -np.inf  # the first block is masked for every row
    got = _run_online(update, s, v, 16)
    expect(bool(np.all(np.isfinite(got))), "a fully masked first block produced NaN or inf")
    expect_close(got, _softmax_weighted(s[:, 16:], v[16:]), rtol=1e-5, atol=1e-5,
                 what="acc / l after a masked block and a visible one")


# ---------------------------------------------------------------- 09.causal_block_skip

causal_block_skip = Exercise("09.causal_block_skip", "When a causal attention block can be skipped")


def _brute_force_live(i, j, block_q, block_k):
    rows = np.arange(i * block_q, (i + 1) * block_q)[:, None]
    cols = np.arange(j * block_k, (j + 1) * block_k)[None, :]
    return bool(np.any(cols <= rows))


def _check_live(fn, block_q, block_k):
    for i in range(6):
        for j in range(6):
            expected = _brute_force_live(i, j, block_q, block_k)
            got = fn(i, j, block_q, block_k)
            expect(bool(got) == expected,
                   f"block_is_live(i={i}, j={j}, block_q={block_q}, block_k={block_k}) returned {bool(got)}; "
                   f"rows {i * block_q}..{(i + 1) * block_q - 1} and keys {j * block_k}.."
                   f"{(j + 1) * block_k - 1} {'do' if expected else 'do not'} share a visible pair")


@causal_block_skip.case(points=2, hint="Query row r sees key c when c <= r. The block has a visible pair "
                                       "when its first key is at most its last query row.")
def square_blocks(fn):
    _check_live(fn, 8, 8)


@causal_block_skip.case(points=2, hint="With block_q != block_k, compare positions, not block indices: "
                                       "j * block_k <= i * block_q + block_q - 1.")
def rectangular_blocks(fn):
    _check_live(fn, 16, 8)
    _check_live(fn, 8, 32)
    got = sum(bool(fn(i, j, 64, 32)) for i in range(4) for j in range(7))
    expected = live_blocks(200, 200, block_q=64, block_k=32, is_causal=True)
    expect(got == expected,
           f"counted {got} live blocks for T = S = 200, blocks (64, 32); expected {expected}")


@causal_block_skip.case(hint="Inside a kernel i and j are traced integers: Python's `if`, `and` and "
                                "`bool()` fail on them. Return the comparison itself (use & to combine).")
def works_on_traced_grid_indices(fn):
    live = jax.jit(lambda i, j: jnp.asarray(fn(i, j, 16, 16)))
    expect(bool(live(2, 2)) and not bool(live(1, 2)),
           "under jax.jit: expected (2, 2) live and (1, 2) skipped")


# ---------------------------------------------------------------- 09.matmul_vmem

matmul_vmem = Exercise("09.matmul_vmem", "The VMEM footprint of a tiled matmul's blocks")


@matmul_vmem.case(points=2, hint="Pallas double-buffers every input and output block: 2 x (x block + y "
                                 "block + out block) x itemsize, plus the f32 accumulator once.")
def float32_blocks(fn):
    for bm, bn, bk in [(128, 128, 128), (256, 512, 128), (512, 256, 1024)]:
        expected = vmem_footprint([((bm, bk), jnp.float32), ((bk, bn), jnp.float32), ((bm, bn), jnp.float32)],
                                  [((bm, bn), jnp.float32)])
        expect_close(fn(bm, bn, bk, 4), expected, rtol=0, atol=0, what=f"bytes for f32 blocks {(bm, bn, bk)}")


@matmul_vmem.case(hint="In bfloat16 the blocks take 2 bytes an element, but the accumulator is float32 "
                       "whatever the inputs: 4 bytes an element.")
def bfloat16_blocks_with_a_float32_accumulator(fn):
    bm, bn, bk = 256, 256, 512
    expected = vmem_footprint([((bm, bk), jnp.bfloat16), ((bk, bn), jnp.bfloat16), ((bm, bn), jnp.bfloat16)],
                              [((bm, bn), jnp.float32)])
    expect_close(fn(bm, bn, bk, 2), expected, rtol=0, atol=0, what=f"bytes for bf16 blocks {(bm, bn, bk)}")


# ---------------------------------------------------------------- 09.fused_kernel

fused_kernel = Exercise("09.fused_kernel", "A fused SwiGLU kernel of your own")


def _run_swiglu(kernel, gate, up):
    spec = pl.BlockSpec((8, 128), lambda i, j: (i, j))
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct(gate.shape, gate.dtype),
        grid=(gate.shape[0] // 8, gate.shape[1] // 128),
        in_specs=[spec, spec], out_specs=spec, interpret=True,
    )(gate, up)


@fused_kernel.case(points=2, time_limit_s=KERNEL_TIME_LIMIT_S,
                   hint="Load both blocks with ref[...], compute silu(gate) * up = gate * sigmoid(gate) * "
                        "up, and store into o_ref[...].")
def float32_matches_xla(kernel):
    gate, up = _normal(24, 256, seed=20), _normal(24, 256, seed=21)
    expected = jax.nn.silu(gate) * up
    expect_close(_run_swiglu(kernel, jnp.asarray(gate), jnp.asarray(up)), expected, rtol=0, atol=1e-6,
                 what="the kernel's output on (24, 256) float32, blocks (8, 128)")


@fused_kernel.case(time_limit_s=KERNEL_TIME_LIMIT_S,
                   hint="Compute in float32 (x.astype(jnp.float32)) and store o_ref.dtype: "
                        "o_ref[...] = result.astype(o_ref.dtype).")
def bfloat16_inputs_give_a_bfloat16_output(kernel):
    gate, up = _normal(16, 128, seed=22), _normal(16, 128, seed=23)
    gate16, up16 = jnp.asarray(gate, jnp.bfloat16), jnp.asarray(up, jnp.bfloat16)
    g32, u32 = gate16.astype(jnp.float32), up16.astype(jnp.float32)
    expected = (jax.nn.silu(g32) * u32).astype(jnp.bfloat16)
    got = _run_swiglu(kernel, gate16, up16)
    expect(got.dtype == jnp.bfloat16, f"expected a bfloat16 output, got {got.dtype}")
    expect_close(got.astype(jnp.float32), expected.astype(jnp.float32), rtol=2**-8, atol=1e-6,
                 what="the bfloat16 output (within one rounding of the float32 result)")
