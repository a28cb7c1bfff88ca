"""Chapter 06 exercises: a layer's cost from its shapes, kernels in HLO text, shape buckets,
and arithmetic intensity.

Expected answers are computed before the learner's code runs; arrays are handed over as
copies (`call_on_copies`), so an answer that changes its input in place is named as such.
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np

from stacklib.compile import count_fusions, hlo, track_compiles
from stacklib.grading import CaseFailure, Exercise, call_on_copies, expect, expect_close

# ---------------------------------------------------------------- 06.dense_cost

dense_cost = Exercise("06.dense_cost", "The FLOPs and bytes of a dense layer, from its shapes")


def _xla_dense_flops(batch, d_in, d_out, dtype):
    x = jax.ShapeDtypeStruct((batch, d_in), dtype)
    w = jax.ShapeDtypeStruct((d_in, d_out), dtype)
    b = jax.ShapeDtypeStruct((d_out,), dtype)
    return jax.jit(lambda x, w, b: x @ w + b).lower(x, w, b).compile().cost_analysis()["flops"]


@dense_cost.case(points=2, hint="A matmul of (B, D_in) by (D_in, D_out) does B·D_out dot products of "
                                "length D_in, each D_in multiplies and D_in adds; the bias adds one "
                                "FLOP per output element.")
def flops_match_xla(cost_fn):
    for batch, d_in, d_out in [(8, 16, 32), (1, 100, 7), (64, 256, 512)]:
        got = cost_fn(batch, d_in, d_out, 4)
        expect(isinstance(got, dict) and "flops" in got,
               f"expected a dict with keys 'flops' and 'bytes', got {got!r:.80}")
        expect_close(got["flops"], _xla_dense_flops(batch, d_in, d_out, jnp.float32),
                     what=f"flops for batch={batch}, d_in={d_in}, d_out={d_out}")


@dense_cost.case(hint="With perfect fusion the layer reads x, W and b once and writes y once: "
                      "(B·D_in + D_in·D_out + D_out + B·D_out) elements, times the bytes per element.")
def bytes_count_inputs_and_output_once(cost_fn):
    got = cost_fn(8, 16, 32, 4)
    expect_close(got["bytes"], 4 * (8 * 16 + 16 * 32 + 32 + 8 * 32), what="bytes for float32 (8, 16, 32)")


@dense_cost.case(hint="bfloat16 takes 2 bytes per element: the bytes halve, the FLOPs do not change.")
def bfloat16_halves_the_bytes_not_the_flops(cost_fn):
    f32, bf16 = cost_fn(64, 256, 512, 4), cost_fn(64, 256, 512, 2)
    expect_close(bf16["flops"], f32["flops"], what="flops in bfloat16")
    expect_close(bf16["bytes"], f32["bytes"] / 2, what="bytes in bfloat16")


# ---------------------------------------------------------------- 06.count_kernels

count_kernels = Exercise("06.count_kernels", "Count the fused kernels in optimized HLO text")

# A module shaped like a GPU's: the fused computations come first (one holds a nested
# fusion, which is part of its parent's kernel), metadata mentions "fusion", and the
# entry launches four fusions and one unfused copy. The last fusion has two outputs, so
# its shape is a tuple with a space in it, and it is the ROOT.
_HAND_WRITTEN_HLO = "HloModule jit_step, entry_computation_layout={(f32[4,8]{1,0})->(f32[4,8]{1,0}, " + """\
f32[4,8]{1,0})}

%fused_inner (p.0: f32[4,8]) -> f32[4,8] {
  %p.0 = f32[4,8]{1,0} parameter(0)
  ROOT %neg.1 = f32[4,8]{1,0} negate(%p.0)
}

%fused_computation (param_0: f32[4,8]) -> f32[4,8] {
  %param_0 = f32[4,8]{1,0} parameter(0)
  %inner = f32[4,8]{1,0} fusion(%param_0), kind=kLoop, calls=%fused_inner
  ROOT %exp.1 = f32[4,8]{1,0} exponential(%inner)
}

%fused_computation.1 (param_0.1: f32[4,8]) -> f32[4,8] {
  %param_0.1 = f32[4,8]{1,0} parameter(0)
  ROOT %add.1 = f32[4,8]{1,0} add(%param_0.1, %param_0.1)
}

%fused_computation.2 (param_0.2: f32[4,8]) -> f32[4,8] {
  %param_0.2 = f32[4,8]{1,0} parameter(0)
  ROOT %mul.1 = f32[4,8]{1,0} multiply(%param_0.2, %param_0.2)
}

%fused_computation.3 (param_0.3: f32[4,8]) -> (f32[4,8], f32[4,8]) {
  %param_0.3 = f32[4,8]{1,0} parameter(0)
  %neg.2 = f32[4,8]{1,0} negate(%param_0.3)
  %abs.1 = f32[4,8]{1,0} abs(%param_0.3)
  ROOT %tuple.1 = (f32[4,8]{1,0}, f32[4,8]{1,0}) tuple(%neg.2, %abs.1)
}

ENTRY %main.5 (x.1: f32[4,8]) -> (f32[4,8], f32[4,8]) {
  %x.1 = f32[4,8]{1,0} parameter(0), metadata={op_name="x"}
  %exp_fusion = f32[4,8]{1,0} fusion(%x.1), kind=kLoop, calls=%fused_computation, metadata={op_name="fusion"}
  %copy.1 = f32[4,8]{1,0} copy(%exp_fusion), metadata={op_name="jit(step)/fusion_demo/copy"}
  %add_fusion = f32[4,8]{1,0} fusion(%copy.1), kind=kLoop, calls=%fused_computation.1
  %mul_fusion = f32[4,8]{1,0} fusion(%add_fusion), kind=kOutput, calls=%fused_computation.2
  ROOT %fusion.4 = (f32[4,8]{1,0}, f32[4,8]{1,0}) fusion(%mul_fusion), kind=kLoop, calls=%fused_computation.3
}
"""
HAND_WRITTEN_KERNELS = 4


def _compiled_text(fn, *args):
    return jax.jit(fn).lower(*args).compile().as_text()


@contextlib.contextmanager
def _hlo_parser_refused():
    """The exercise asks for string methods or `re`: stacklib.compile's HLO parser refuses meanwhile.

    Every public entry point (`parse_hlo`, `count_fusions`, `fusions`, `op_costs`) parses
    lines with `hlo._parse_instruction`, which is looked up at call time, so replacing it
    refuses them all, however they were imported.
    """

    def refuse(line):
        raise CaseFailure("count_kernels used stacklib.compile's HLO parser; the exercise asks you to read "
                          "the text yourself, with string methods or re")

    original = hlo._parse_instruction
    hlo._parse_instruction = refuse
    try:
        yield
    finally:
        hlo._parse_instruction = original


def _count(count_fn, text):
    with _hlo_parser_refused():
        return count_fn(text)


@count_kernels.case(hint="Find the line starting with ENTRY; count the instruction lines after it "
                         "(until the closing '}') whose opcode, the word before '(', is `fusion`.")
def one_kernel_for_an_elementwise_chain(count_fn):
    text = _compiled_text(lambda v: jnp.tanh(v * 2.0 + 1.0) - v, jnp.ones((64, 64)))
    expect_close(_count(count_fn, text), 1, what="kernels for tanh(v * 2 + 1) - v")


@count_kernels.case(points=2, hint="Only the ENTRY computation launches kernels: a fusion inside a "
                                   "fused computation is part of its parent's kernel, and the words "
                                   "'fusion' or 'fused' in names, `calls=` and metadata are not "
                                   "instructions. Count the ROOT line too, and allow a tuple shape "
                                   "such as (f32[4,8]{1,0}, f32[4,8]{1,0}) before the opcode.")
def only_entry_fusions_count(count_fn):
    expect_close(_count(count_fn, _HAND_WRITTEN_HLO), HAND_WRITTEN_KERNELS,
                 what="kernels in a hand-written module with a nested fusion and a two-output ROOT fusion")


@count_kernels.case(hint="Check your count against stacklib.compile.count_fusions(text) in a cell of your "
                         "own (count_kernels itself must read the text).")
def agrees_on_a_compiled_mlp(count_fn):
    def mlp(x, w1, w2):
        return jax.nn.softmax(jax.nn.relu(x @ w1) @ w2)

    text = _compiled_text(mlp, jnp.ones((32, 64)), jnp.ones((64, 128)), jnp.ones((128, 10)))
    expected = count_fusions(text)
    expect_close(_count(count_fn, text), expected, what="kernels of an MLP with a softmax")


# ---------------------------------------------------------------- 06.pad_to_bucket

pad_to_bucket = Exercise("06.pad_to_bucket", "Pad to a few bucket sizes so a function compiles a few times")


def _masked_mean(x, mask):
    return jnp.sum(jnp.where(mask, x, 0.0)) / jnp.sum(mask)


def _padded(pad_fn, x, buckets):
    """The learner's (padded, mask) for a copy of the NumPy array `x`."""
    got = call_on_copies(pad_fn, x, buckets, what="pad_to_bucket")
    expect(isinstance(got, tuple | list) and len(got) == 2,
           f"pad_to_bucket should return a pair (padded, mask), got {type(got).__name__} {got!r:.60}")
    return got


@pad_to_bucket.case(hint="Pad x with zeros up to the smallest bucket >= len(x) (jnp.pad); the mask is "
                         "True for the first len(x) positions: jnp.arange(bucket) < len(x).")
def pads_to_the_smallest_bucket_that_fits(pad_fn):
    expected = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 0.0, 0.0, 0.0], np.float32)
    padded, mask = _padded(pad_fn, np.arange(1.0, 6.0, dtype=np.float32), (4, 8, 16))
    expect_close(padded, expected, what="padded x for length 5, buckets (4, 8, 16)")
    expect_close(np.asarray(mask, dtype=bool), np.array([True] * 5 + [False] * 3), what="the mask")
    exact, _ = _padded(pad_fn, np.ones(8, np.float32), (4, 8, 16))
    expect(exact.shape == (8,), f"a length equal to a bucket needs no padding: expected shape (8,), "
                                f"got {exact.shape}")


@pad_to_bucket.case(hint="A comparison gives a boolean array: jnp.arange(bucket) < len(x). Do not convert "
                         "it to integers or floats.")
def the_mask_is_boolean(pad_fn):
    _, mask = _padded(pad_fn, np.arange(5, dtype=np.float32), (4, 8, 16))
    dtype = np.asarray(mask).dtype
    expect(dtype == np.bool_, f"the mask should be a boolean array, got dtype {dtype}")


@pad_to_bucket.case(points=2, hint="If every call is padded to one of the buckets, a jitted function sees "
                                   "at most len(buckets) shapes, so it compiles at most that many times.")
def compiles_at_most_once_per_bucket(pad_fn):
    buckets = (16, 64, 256)
    masked_mean = track_compiles(_masked_mean)
    for n in [3, 17, 200, 16, 64, 65, 1, 250, 40, 129]:
        x = np.arange(n, dtype=np.float32)
        expected = float(np.mean(x))
        got = masked_mean(*_padded(pad_fn, x, buckets))
        expect_close(got, expected, rtol=1e-5, what=f"masked mean of a length-{n} input")
    expect(masked_mean.compile_count <= len(buckets),
           f"expected at most {len(buckets)} compilations for buckets {buckets}, got "
           f"{masked_mean.compile_count}: " + "; ".join(c.reason for c in masked_mean.compilations))


@pad_to_bucket.case(hint="When len(x) is larger than every bucket, raise ValueError with a message "
                         "that names the length and the largest bucket.")
def too_long_an_input_is_a_clear_error(pad_fn):
    try:
        _padded(pad_fn, np.ones(300, np.float32), (16, 64, 256))
    except ValueError as error:
        expect("300" in str(error) and "256" in str(error),
               f"the message should name the length (300) and the largest bucket (256), got: {error}")
    else:
        expect(False, "expected a ValueError for an input of length 300 with buckets up to 256")


# ---------------------------------------------------------------- 06.matmul_intensity

matmul_intensity = Exercise("06.matmul_intensity", "The arithmetic intensity of a matmul")


@matmul_intensity.case(hint="Intensity = FLOPs / bytes = 2·M·K·N / (bytes per element · (M·K + K·N + M·N)).")
def square_float32_is_n_over_six(intensity_fn):
    for n in (6, 96, 1024):
        expect_close(intensity_fn(n, n, n, 4), n / 6, rtol=1e-9,
                     what=f"intensity of a float32 {n}x{n} matmul")


@matmul_intensity.case(hint="A matrix-vector product (N = 1) does 2 FLOPs per element of the matrix "
                            "it reads: about 2 / bytes per element, whatever the size.")
def a_matrix_vector_product_is_memory_bound(intensity_fn):
    got = intensity_fn(4096, 4096, 1, 4)
    expect_close(got, 2 * 4096 * 4096 / (4 * (4096 * 4096 + 4096 + 4096)), rtol=1e-9,
                 what="intensity of a 4096x4096 matrix times a vector")


@matmul_intensity.case(hint="Halving the bytes per element (bfloat16) doubles the intensity.")
def bfloat16_doubles_it(intensity_fn):
    expect_close(intensity_fn(128, 512, 256, 2), 2 * intensity_fn(128, 512, 256, 4), rtol=1e-9,
                 what="bfloat16 intensity of a (128, 512) @ (512, 256) matmul")
