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

from stacklib.grading import CaseFailure, Exercise, call_on_copies, expect, expect_close
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


@transposed_index_map.case(hint="yt is stored [N, K]: its first axis runs along the output's columns, its "
                                "second along the reduction. Which grid index walks each of those? See 'The "
                                "Pallas model' (index maps return block indices) and 'A tiled matmul'.")
def returns_the_block_of_yt_each_step_needs(index_map):
    for i, j, k in [(0, 0, 0), (1, 2, 3), (3, 1, 2)]:
        got = index_map(i, j, k)
        expect(isinstance(got, tuple) and len(got) == 2,
               f"index_map({i}, {j}, {k}) must return a tuple of two block indices, got {got!r:.60}")
        expect(tuple(int(g) for g in got) == (j, k),
               f"index_map({i}, {j}, {k}) returned {tuple(int(g) for g in got)}: step ({i}, {j}, {k}) adds "
               f"x's block ({i}, {k}) times this block of yt, transposed, into output block ({i}, {j})")


def _check_transposed_matmul(index_map, M, N, K, block_m, block_n, block_k, seed):
    x, yt = _normal(M, K, seed=seed), _normal(N, K, seed=seed + 1)
    expected = x @ yt.T
    got = _matmul_transposed_rhs(jnp.asarray(x), jnp.asarray(yt), index_map,
                                 block_m=block_m, block_n=block_n, block_k=block_k)
    expect_close(got, expected, rtol=1e-5, atol=1e-4,
                 what=f"x [{M}, {K}] @ yt.T with yt [{N}, {K}], blocks ({block_m}, {block_n}, {block_k})")


@transposed_index_map.case(points=2, time_limit_s=KERNEL_TIME_LIMIT_S,
                           hint="Each grid step must fetch the yt block that holds the output block's "
                                "columns and the reduction slice that x's block covers, whatever the "
                                "row block i is. See 'A tiled matmul' for the three index maps.")
def a_matmul_with_square_blocks_is_right(index_map):
    _check_transposed_matmul(index_map, 32, 32, 32, 16, 16, 16, seed=0)


@transposed_index_map.case(points=2, time_limit_s=KERNEL_TIME_LIMIT_S,
                           hint="Here the grid has 2 row blocks, 3 column blocks and 2 reduction blocks, "
                                "and yt's blocks are (block_n, block_k): each of its block indices must "
                                "come from the grid axis that walks the same axis of the problem.")
def a_matmul_with_rectangular_blocks_is_right(index_map):
    _check_transposed_matmul(index_map, 32, 48, 64, 16, 16, 32, seed=2)


# ---------------------------------------------------------------- 09.online_softmax

online_softmax = Exercise("09.online_softmax", "The online-softmax update of flash attention")


def _update_once(update, m, ell, acc, s, v):
    """One call of the learner's update on copies of the state; the new state, checked for shape.

    The chapter's kernel keeps m and l as (block_q, 1) columns; this exercise passes them flat,
    (rows,). An answer written for columns fails on the first broadcast (a TypeError from jnp,
    a ValueError from NumPy), so such an error is reported with the shapes it was given.
    """
    R, H = acc.shape
    given = f"m {m.shape}, l {ell.shape}, acc {acc.shape}, s {s.shape}, v {v.shape}"
    expected_shapes = (f"m and l of shape ({R},) (one number per query row, not a ({R}, 1) column) "
                       f"and acc ({R}, {H})")
    try:
        state = call_on_copies(update, m, ell, acc, s, v, what="online_softmax_update")
    except (TypeError, ValueError) as error:
        if "shape" not in str(error) and "broadcast" not in str(error):
            raise
        raised = f"{type(error).__name__}: {str(error).rstrip('.')}"
        raise CaseFailure(f"online_softmax_update, given {given}, raised {raised}. It must work on, and "
                          f"return, {expected_shapes}") from error
    expect(isinstance(state, tuple | list) and len(state) == 3,
           f"expected the new state (m, l, acc), got {state!r:.80}")
    m_new, ell_new, acc_new = (np.asarray(a, np.float64) for a in state)
    got_shapes = f"m {m_new.shape}, l {ell_new.shape}, acc {acc_new.shape}"
    expect((m_new.shape, ell_new.shape, acc_new.shape) == (m.shape, ell.shape, acc.shape),
           f"given {given}, it returned {got_shapes}; expected {expected_shapes}")
    return m_new, ell_new, acc_new


def _run_online(update, s, v, block):
    """Feed update() the key blocks of logits s [R, S] and values v [S, H]; return acc / l."""
    R, S = s.shape
    m, denominator = np.full(R, -np.inf, np.float32), np.zeros(R, np.float32)
    acc = np.zeros((R, v.shape[1]), np.float32)
    for start in range(0, S, block):
        m, denominator, acc = _update_once(update, m, denominator, acc, s[:, start:start + block],
                                           v[start:start + block])
    return acc / denominator[:, None]


def _softmax_weighted(s, v):
    s = s.astype(np.float64)
    p = np.exp(s - s.max(axis=1, keepdims=True))
    return (p / p.sum(axis=1, keepdims=True)) @ v


@online_softmax.case(hint="From the empty state (m = -inf, l = 0, acc = 0) one block must give the softmax "
                          "of its logits: see 'Flash attention', where the update is written out.")
def one_block_gives_the_softmax(update):
    s, v = _normal(4, 16, seed=10), _normal(16, 8, seed=11)
    expect_close(_run_online(update, s, v, 16), _softmax_weighted(s, v), rtol=1e-5, atol=1e-5,
                 what="acc / l after one block")


@online_softmax.case(hint="The state is defined per query row: m is the row's largest logit so far (-inf "
                          "while the row has seen nothing), l the sum of exp(logit - m), acc the sum of "
                          "exp(logit - m) * value, each with that row's own m.")
def the_state_holds_each_rows_maximum_and_sums(update):
    s, v = _normal(3, 16, seed=18) - 3.0, _normal(16, 4, seed=19)  # row maxima below zero
    s[1] = -np.inf  # row 1 sees no key in this block
    m, ell, acc = _update_once(update, np.full(3, -np.inf, np.float32), np.zeros(3, np.float32),
                               np.zeros((3, 4), np.float32), s, v)
    row_max = s.astype(np.float64).max(axis=1)
    p = np.exp(s - np.where(np.isneginf(row_max), 0.0, row_max)[:, None])
    after = "after one block from the empty state (row 1 fully masked)"
    expect_close(m, row_max, what=f"m {after}")
    expect_close(ell, p.sum(axis=1), rtol=1e-5, what=f"l {after}")
    expect_close(acc, p @ v, rtol=1e-5, atol=1e-6, what=f"acc {after}")


@online_softmax.case(points=2, hint="When the maximum grows from m to m_new, what was summed so far is "
                                    "relative to the old m: re-express both sums relative to m_new.")
def many_blocks_give_the_softmax(update):
    s, v = 3 * _normal(4, 64, seed=12), _normal(64, 8, seed=13)
    s[:, 40:] += 5.0  # later blocks hold the larger logits: the maximum moves
    expect_close(_run_online(update, s, v, 16), _softmax_weighted(s, v), rtol=1e-5, atol=1e-5,
                 what="acc / l after four blocks")


@online_softmax.case(points=2, hint="exp(1000) overflows float32 and exp(-1000) underflows to 0: each row "
                                    "must subtract its own running maximum before exp.")
def logits_far_from_zero_neither_overflow_nor_underflow(update):
    s, v = _normal(3, 32, seed=14), _normal(32, 4, seed=15)
    s += np.array([[1000.0], [-1000.0], [0.0]], np.float32)  # one row far above zero, one far below
    s[:, 16:] += 2.0  # and the maximum moves
    expect_close(_run_online(update, s, v, 16), _softmax_weighted(s, v), rtol=1e-5, atol=1e-5,
                 what="acc / l for rows of logits near 1000, -1000 and 0")


@online_softmax.case(points=2, hint="A row whose logits are all -inf (masked) still has m_new = -inf, and "
                                    "exp(-inf - (-inf)) is NaN: see how 'Flash attention' treats a row that "
                                    "has seen nothing yet, and keep m itself at -inf.")
def a_masked_block_changes_nothing(update):
    s, v = _normal(3, 32, seed=16), _normal(32, 4, seed=17)
    s[[0, 2], :16] = -np.inf  # the first block is masked for rows 0 and 2, not for row 1
    s[2, 16:] -= 1000.0  # and row 2's visible logits are far below zero
    got = _run_online(update, s, v, 16)
    expect(bool(np.all(np.isfinite(got))), f"a fully masked first block (rows 0 and 2) produced NaN or inf: "
                                           f"acc / l =\n{np.round(got, 4)}")
    expected = np.concatenate([_softmax_weighted(s[[0], 16:], v[16:]), _softmax_weighted(s[[1]], v),
                               _softmax_weighted(s[[2], 16:], v[16:])])
    expect_close(got, expected, rtol=1e-5, atol=1e-5,
                 what="acc / l after a block masked for rows 0 and 2, then a visible one")


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


@causal_block_skip.case(points=2, hint="Query row r sees key c when c <= r. Which key of block j is the "
                                       "easiest to see, and which row of block i sees the most keys? See "
                                       "'Causal skipping and grouped-query heads, in the index maps'.")
def square_blocks(fn):
    _check_live(fn, 8, 8)


@causal_block_skip.case(points=2, hint="With block_q != block_k, block i and block j cover different spans: "
                                       "compare positions (row and key numbers), not block indices.")
def rectangular_blocks(fn):
    _check_live(fn, 16, 8)
    _check_live(fn, 8, 32)
    got = sum(bool(fn(i, j, 64, 32)) for i in range(4) for j in range(7))
    expected = live_blocks(200, 200, block_q=64, block_k=32, is_causal=True)
    expect(got == expected,
           f"counted {got} live blocks for T = S = 200, blocks (64, 32); expected {expected}")


@causal_block_skip.case(points=2, hint="When neither block size divides the other, a query block starts and "
                                       "ends part-way through key blocks: work with the positions of its "
                                       "rows and keys, not with block counts rounded down.")
def block_sizes_that_do_not_divide_each_other(fn):
    for block_q, block_k in [(24, 16), (16, 24), (3, 5), (5, 3)]:
        _check_live(fn, block_q, block_k)


@causal_block_skip.case(points=2, hint="Inside a kernel i and j are traced integers: Python's `if`, `and` "
                                       "and `bool()` fail on them. Return the comparison itself (& combines "
                                       "two).")
def works_on_traced_grid_indices(fn):
    live = jax.jit(lambda i, j: jnp.asarray(fn(i, j, 16, 16)))
    expect(bool(live(2, 2)) and not bool(live(1, 2)),
           "under jax.jit: expected (2, 2) live and (1, 2) skipped")


# ---------------------------------------------------------------- 09.matmul_vmem

matmul_vmem = Exercise("09.matmul_vmem", "The VMEM footprint of a tiled matmul's blocks")


def _is_number(n):
    return not isinstance(n, bool) and isinstance(n, int | float | np.integer | np.floating)


def _readable_bytes(n):
    """'2,359,296 bytes (2.25 MiB)' for a number of bytes; anything else as its type and repr."""
    return f"{n:,} bytes ({n / 2**20:.2f} MiB)" if _is_number(n) else f"{type(n).__name__} {n!r:.60}"


def _check_vmem(fn, block_m, block_n, block_k, dtype):
    x_block, y_block, out_block = (block_m, block_k), (block_k, block_n), (block_m, block_n)
    expected = vmem_footprint([(x_block, dtype), (y_block, dtype), (out_block, dtype)],
                              [(out_block, jnp.float32)])
    got = fn(block_m, block_n, block_k, jnp.dtype(dtype).itemsize)
    expect(_is_number(got) and got == expected,
           f"VMEM for {jnp.dtype(dtype).name} blocks (block_m, block_n, block_k) = "
           f"{(block_m, block_n, block_k)}: expected {_readable_bytes(expected)}, got {_readable_bytes(got)}")


@matmul_vmem.case(points=2, hint="Count every buffer: how many copies of each input and output block does "
                                 "double buffering keep, and how many of the scratch accumulator? See "
                                 "'Pipelining, and why a block must fit'.")
def float32_blocks(fn):
    for blocks in [(128, 128, 128), (256, 512, 128), (512, 256, 1024)]:
        _check_vmem(fn, *blocks, jnp.float32)


@matmul_vmem.case(points=2, hint="In bfloat16 the blocks take 2 bytes an element, but the accumulator is "
                                 "float32 whatever the inputs are.")
def bfloat16_blocks_with_a_float32_accumulator(fn):
    for blocks in [(256, 256, 512), (512, 128, 256)]:
        _check_vmem(fn, *blocks, jnp.bfloat16)


# ---------------------------------------------------------------- 09.fused_kernel

fused_kernel = Exercise("09.fused_kernel", "A fused SwiGLU kernel of your own")


def _run_swiglu(kernel, gate, up, out_dtype=None):
    """The learner's kernel on (8, 128) blocks; the output is `out_dtype`, the inputs' dtype by default."""
    spec = pl.BlockSpec((8, 128), lambda i, j: (i, j))
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct(gate.shape, out_dtype or gate.dtype),
        grid=(gate.shape[0] // 8, gate.shape[1] // 128),
        in_specs=[spec, spec], out_specs=spec, interpret=True,
    )(gate, up)


@fused_kernel.case(points=2, time_limit_s=KERNEL_TIME_LIMIT_S,
                   hint="A kernel reads its input blocks from the refs and stores its result into o_ref; "
                        "it returns nothing. Check which input goes through silu. See 'A fused elementwise "
                        "kernel'.")
def float32_matches_xla(kernel):
    gate, up = _normal(24, 256, seed=20), _normal(24, 256, seed=21)
    expected = jax.nn.silu(gate) * up
    expect_close(_run_swiglu(kernel, jnp.asarray(gate), jnp.asarray(up)), expected, rtol=0, atol=1e-6,
                 what="the kernel's output on (24, 256) float32, blocks (8, 128)")


def _bfloat16_inputs(seed):
    gate, up = _normal(16, 128, seed=seed), _normal(16, 128, seed=seed + 1)
    return jnp.asarray(gate, jnp.bfloat16), jnp.asarray(up, jnp.bfloat16)


def _swiglu_in_float32(gate16, up16):
    """The float32 result of bfloat16 inputs, rounded once to bfloat16, as float32 values."""
    g32, u32 = gate16.astype(jnp.float32), up16.astype(jnp.float32)
    return (jax.nn.silu(g32) * u32).astype(jnp.bfloat16).astype(jnp.float32)


@fused_kernel.case(time_limit_s=KERNEL_TIME_LIMIT_S,
                   hint="With bfloat16 inputs the kernel must still compute silu(gate) * up and store it "
                        "in the output's dtype, which is not always the inputs': bfloat16 in the first call "
                        "here, float32 in the second (a ref accepts only values of its own dtype).")
def bfloat16_inputs_work(kernel):
    gate16, up16 = _bfloat16_inputs(seed=22)
    got = _run_swiglu(kernel, gate16, up16)  # its out_shape makes the output bfloat16
    expect_close(got.astype(jnp.float32), _swiglu_in_float32(gate16, up16), rtol=2**-6, atol=1e-6,
                 what="the bfloat16 output (within a few bfloat16 roundings)")
    # The output's dtype need not be the inputs' (a mixed-precision layer may keep its activations in
    # float32): a kernel that casts to gate_ref.dtype passes every other check and fails here.
    got = _run_swiglu(kernel, gate16, up16, out_dtype=jnp.float32)
    expected = jax.nn.silu(gate16.astype(jnp.float32)) * up16.astype(jnp.float32)
    expect_close(got, expected, rtol=2**-6, atol=1e-6, what="the float32 output of bfloat16 inputs")


@fused_kernel.case(time_limit_s=KERNEL_TIME_LIMIT_S,
                   hint="Computing silu and the product in bfloat16 rounds at every step: compute in "
                        "float32 and round once, when storing.")
def bfloat16_inputs_are_computed_in_float32(kernel):
    gate16, up16 = _bfloat16_inputs(seed=24)
    got = _run_swiglu(kernel, gate16, up16)
    expect_close(got.astype(jnp.float32), _swiglu_in_float32(gate16, up16), rtol=2**-8, atol=1e-6,
                 what="the bfloat16 output (within one rounding of the float32 result)")
