"""Chapter 06 exercises: a layer's cost from its shapes, kernels in HLO text, shape buckets,
and arithmetic intensity.

Expected answers are computed before the learner's code runs; arrays are handed over as
copies (`call_on_copies`), so an answer that changes its input in place is named as such.
"""

import contextlib
import re

import jax
import jax.numpy as jnp
import numpy as np

from stacklib.compile import DEFAULT_CPU_PIPELINE, count_fusions, hlo, track_compiles
from stacklib.grading import CaseFailure, Exercise, call_on_copies, expect, expect_close

# ---------------------------------------------------------------- 06.dense_cost

dense_cost = Exercise("06.dense_cost", "The FLOPs and bytes of a dense layer, from its shapes")


def _xla_dense_flops(batch, d_in, d_out, dtype):
    x = jax.ShapeDtypeStruct((batch, d_in), dtype)
    w = jax.ShapeDtypeStruct((d_in, d_out), dtype)
    b = jax.ShapeDtypeStruct((d_out,), dtype)
    return jax.jit(lambda x, w, b: x @ w + b).lower(x, w, b).compile().cost_analysis()["flops"]


@dense_cost.case(points=2, hint="XLA counts a multiply and an add as two FLOPs, and the bias add once per "
                                "output element: see the chapter's section 'Counting FLOPs from a jaxpr'.")
def flops_match_xla(cost_fn):
    for batch, d_in, d_out in [(8, 16, 32), (1, 100, 7), (64, 256, 512)]:
        got = cost_fn(batch, d_in, d_out, 4)
        expect(isinstance(got, dict) and "flops" in got,
               f"expected a dict with keys 'flops' and 'bytes', got {got!r:.80}")
        expect_close(got["flops"], _xla_dense_flops(batch, d_in, d_out, jnp.float32),
                     what=f"flops for batch={batch}, d_in={d_in}, d_out={d_out}")


@dense_cost.case(hint="With perfect fusion the layer reads each input once and writes its output once, "
                      "and the bias is an input too: see the chapter's section 'What fusion does'.")
def bytes_count_inputs_and_output_once(cost_fn):
    got = cost_fn(8, 16, 32, 4)
    expect(isinstance(got, dict) and "bytes" in got,
           f"expected a dict with keys 'flops' and 'bytes', got {got!r:.80}")
    expect_close(got["bytes"], 4 * (8 * 16 + 16 * 32 + 32 + 8 * 32), what="bytes for float32 (8, 16, 32)")


@dense_cost.case(hint="The bytes depend on bytes_per_element; the FLOPs do not.")
def bfloat16_halves_the_bytes_not_the_flops(cost_fn):
    f32, bf16 = cost_fn(64, 256, 512, 4), cost_fn(64, 256, 512, 2)
    expect_close(bf16["flops"], f32["flops"], what="flops in bfloat16")
    expect_close(bf16["bytes"], f32["bytes"] / 2, what="bytes in bfloat16")
    expect_close(cost_fn(3, 5, 7, 2)["bytes"], 2 * (3 * 5 + 5 * 7 + 7 + 3 * 7), what="bytes for bfloat16 "
                 "(3, 5, 7)")


# ---------------------------------------------------------------- 06.count_kernels

count_kernels = Exercise("06.count_kernels", "Count the fused kernels in optimized HLO text")

# Hand-written modules shaped like XLA's: each holds one trap for a count that does not
# find the ENTRY computation's instructions and read their opcodes. A module holds the
# computations its instructions call, printed before the ENTRY as XLA prints them (except
# in _ENTRY_FIRST); %fused_computation holds a nested fusion, part of its parent's kernel.
_COMPUTATIONS = {
    "fused_inner": """\
%fused_inner (p.0: f32[4,8]) -> f32[4,8] {
  %p.0 = f32[4,8]{1,0} parameter(0)
  ROOT %neg.1 = f32[4,8]{1,0} negate(%p.0)
}
""",
    "fused_computation": """\
%fused_computation (param_0: f32[4,8]) -> f32[4,8] {
  %param_0 = f32[4,8]{1,0} parameter(0)
  %inner = f32[4,8]{1,0} fusion(%param_0), kind=kLoop, calls=%fused_inner
  ROOT %exp.1 = f32[4,8]{1,0} exponential(%inner)
}
""",
    "fused_computation.1": """\
%fused_computation.1 (param_0.1: f32[4,8]) -> f32[4,8] {
  %param_0.1 = f32[4,8]{1,0} parameter(0)
  ROOT %add.1 = f32[4,8]{1,0} add(%param_0.1, %param_0.1)
}
""",
    "fused_computation.2": """\
%fused_computation.2 (param_0.2: f32[4,8]) -> f32[4,8] {
  %param_0.2 = f32[4,8]{1,0} parameter(0)
  ROOT %mul.1 = f32[4,8]{1,0} multiply(%param_0.2, %param_0.2)
}
""",
    "fused_computation.3": """\
%fused_computation.3 (param_0.3: f32[4,8]) -> (f32[4,8], f32[4,8]) {
  %param_0.3 = f32[4,8]{1,0} parameter(0)
  %neg.2 = f32[4,8]{1,0} negate(%param_0.3)
  %abs.1 = f32[4,8]{1,0} abs(%param_0.3)
  ROOT %tuple.1 = (f32[4,8]{1,0}, f32[4,8]{1,0}) tuple(%neg.2, %abs.1)
}
""",
    "fused_add_reducer": """\
%fused_add_reducer (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}
""",
}


def _called(text):
    """The computations that `text` calls, and the ones they call, callees first."""
    found = []
    for name in re.findall(r"(?:calls|to_apply)=%([\w.\-]+)", text):
        for inner in [*_called(_COMPUTATIONS[name]), name]:
            if inner not in found:
                found.append(inner)
    return found


def _module(entry_lines, entry_first=False):
    """An HLO module whose ENTRY computation holds `entry_lines`, with the computations it calls."""
    entry = "".join(f"  {line}\n" for line in entry_lines)
    entry = f"ENTRY %main.5 (x.1: f32[4,8]) -> f32[4,8] {{\n{entry}}}\n"
    called = [_COMPUTATIONS[name] for name in _called(entry)]
    parts = [entry, *called] if entry_first else [*called, entry]
    header = "HloModule jit_step, entry_computation_layout={(f32[4,8]{1,0})->f32[4,8]{1,0}}\n\n"
    return header + "\n".join(parts)


_X = '%x.1 = f32[4,8]{1,0} parameter(0), metadata={op_name="x"}'
_LOOP = "kind=kLoop, calls=%fused_computation"
# (module, the kernels its ENTRY computation launches)
_NESTED = _module([_X,
                   f"%exp_fusion = f32[4,8]{{1,0}} fusion(%x.1), {_LOOP}",
                   "ROOT %copy.1 = f32[4,8]{1,0} copy(%exp_fusion)"]), 1
_NAMES_AND_METADATA = _module([
    _X,
    f"%add_fusion = f32[4,8]{{1,0}} fusion(%x.1), {_LOOP}.1, "
    'metadata={op_name="jit(step)/fusion(demo)/add"}',
    '%fusion_copy = f32[4,8]{1,0} copy(%add_fusion), metadata={op_name="jit(step)/my fusion(demo)/copy"}',
    '%zero = f32[] constant(0), metadata={op_name="fused_zero"}',
    "%fused_sum = f32[] reduce(%fusion_copy, %zero), dimensions={0,1}, to_apply=%fused_add_reducer",
    "ROOT %fusion_out = f32[4,8]{1,0} copy(%fusion_copy)"]), 1
_ROOT = _module([_X,
                 f"%add_fusion = f32[4,8]{{1,0}} fusion(%x.1), {_LOOP}.1",
                 f"ROOT %mul_fusion = f32[4,8]{{1,0}} fusion(%add_fusion), {_LOOP}.2"]), 2
_TUPLE = _module([_X,
                  f"%pair = (f32[4,8]{{1,0}}, f32[4,8]{{1,0}}) fusion(%x.1), {_LOOP}.3",
                  "%first = f32[4,8]{1,0} get-tuple-element(%pair), index=0",
                  f"%add_fusion = f32[4,8]{{1,0}} fusion(%first), {_LOOP}.1",
                  "ROOT %copy.2 = f32[4,8]{1,0} copy(%add_fusion)"]), 2
_SHARED = _module([_X,
                   f"%add_fusion = f32[4,8]{{1,0}} fusion(%x.1), {_LOOP}.1",
                   f"%add_fusion.1 = f32[4,8]{{1,0}} fusion(%add_fusion), {_LOOP}.1",
                   f"%mul_fusion = f32[4,8]{{1,0}} fusion(%add_fusion.1), {_LOOP}.2",
                   "ROOT %copy.3 = f32[4,8]{1,0} copy(%mul_fusion)"]), 3
_ENTRY_FIRST = _module([_X,
                        f"%exp_fusion = f32[4,8]{{1,0}} fusion(%x.1), {_LOOP}",
                        "ROOT %copy.1 = f32[4,8]{1,0} copy(%exp_fusion)"], entry_first=True), 1
HAND_WRITTEN_MODULES = [_NESTED, _NAMES_AND_METADATA, _ROOT, _TUPLE, _SHARED, _ENTRY_FIRST]


def _compiled_text(fn, *args):
    """The optimized HLO of `fn`, compiled by XLA's default CPU pipeline whatever XLA_FLAGS say,
    so that a wrong answer loses the same points on every machine (see DEFAULT_CPU_PIPELINE)."""
    options = DEFAULT_CPU_PIPELINE if jax.default_backend() == "cpu" else {}
    return jax.jit(fn).lower(*args).compile(compiler_options=options).as_text()


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


def _expect_count(count_fn, module, what):
    text, expected = module
    with _hlo_parser_refused():
        got = count_fn(text)
    expect_close(got, expected, what=f"kernels in {what}")


@count_kernels.case(hint="Find the ENTRY computation and count its instructions whose opcode is fusion.")
def one_kernel_for_an_elementwise_chain(count_fn):
    text = _compiled_text(lambda v: jnp.tanh(v * 2.0 + 1.0) - v, jnp.ones((64, 64)))
    _expect_count(count_fn, (text, 1), "the compiled tanh(v * 2 + 1) - v")


@count_kernels.case(hint="Only the ENTRY computation's instructions are launched: a fusion inside a "
                         "fused computation is part of its parent's kernel.")
def fusions_inside_fused_computations_do_not_count(count_fn):
    _expect_count(count_fn, _NESTED, "a module whose one kernel holds a nested fusion")


@count_kernels.case(hint="The opcode is the word just before the first '(' after the shape; 'fusion' and "
                         "'fused' elsewhere on a line (in a name, an operand, to_apply=, metadata) are "
                         "not opcodes.")
def names_and_metadata_that_mention_fusion_do_not_count(count_fn):
    _expect_count(count_fn, _NAMES_AND_METADATA, "a module with one fusion and other instructions whose "
                                                 "names and metadata say 'fusion'")


@count_kernels.case(hint="The last instruction of a computation starts with ROOT; it is an instruction like "
                         "the others.")
def a_root_fusion_counts(count_fn):
    _expect_count(count_fn, _ROOT, "a module whose ROOT is the second of two fusions")


@count_kernels.case(hint="A fusion with several outputs has a tuple shape, spaces included, before its "
                         "opcode.")
def a_fusion_with_a_tuple_shape_counts(count_fn):
    _expect_count(count_fn, _TUPLE, "a module with a two-output fusion and a one-output one")


@count_kernels.case(hint="Count the fusion instructions, not the computations they call: two launches may "
                         "call the same fused computation.")
def two_fusions_of_one_computation_are_two_kernels(count_fn):
    _expect_count(count_fn, _SHARED, "a module with two fusions that call the same computation, and a third")


@count_kernels.case(hint="The ENTRY computation ends at its closing '}'; other computations may follow it.")
def the_entry_computation_ends_at_its_closing_brace(count_fn):
    _expect_count(count_fn, _ENTRY_FIRST, "a module printed with ENTRY first, its fused computations after")


@count_kernels.case(hint="Check your count against stacklib.compile.count_fusions(text) in a cell of your "
                         "own (count_kernels itself must read the text).")
def agrees_on_a_compiled_mlp(count_fn):
    def mlp(x, w1, w2):
        return jax.nn.softmax(jax.nn.relu(x @ w1) @ w2)

    text = _compiled_text(mlp, jnp.ones((32, 64)), jnp.ones((64, 128)), jnp.ones((128, 10)))
    _expect_count(count_fn, (text, count_fusions(text)), "an MLP with a softmax")


# ---------------------------------------------------------------- 06.pad_to_bucket

pad_to_bucket = Exercise("06.pad_to_bucket", "Pad to a few bucket sizes so a function compiles a few times")
_RECOMPILATION = "the chapter's section 'Static arguments and recompilation'"


def _masked_mean(x, mask):
    return jnp.sum(jnp.where(mask, x, 0.0)) / jnp.sum(mask)


def _padded(pad_fn, x, buckets):
    """The learner's (padded, mask) for a copy of the array `x`."""
    got = call_on_copies(pad_fn, x, buckets, what="pad_to_bucket")
    expect(isinstance(got, tuple | list) and len(got) == 2,
           f"pad_to_bucket should return a pair (padded, mask), got {type(got).__name__} {got!r:.60}")
    return got


@pad_to_bucket.case(hint=f"The padded length is the smallest bucket that holds x (a length equal to a "
                         f"bucket fits it); the zeros go after x's values. See {_RECOMPILATION}.")
def pads_to_the_smallest_bucket_that_fits(pad_fn):
    expected = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 0.0, 0.0, 0.0], np.float32)
    padded, mask = _padded(pad_fn, np.arange(1.0, 6.0, dtype=np.float32), (4, 8, 16))
    expect_close(padded, expected, what="padded x for length 5, buckets (4, 8, 16)")
    expect_close(np.asarray(mask, dtype=bool), np.array([True] * 5 + [False] * 3), what="the mask")
    exact, _ = _padded(pad_fn, np.ones(8, np.float32), (4, 8, 16))
    expect(exact.shape == (8,), f"a length equal to a bucket needs no padding: expected shape (8,), "
                                f"got {exact.shape}")


@pad_to_bucket.case(hint="The exercise asks for a mask of dtype bool.")
def the_mask_is_boolean(pad_fn):
    _, mask = _padded(pad_fn, np.arange(5, dtype=np.float32), (4, 8, 16))
    dtype = np.asarray(mask).dtype
    expect(dtype == np.bool_, f"the mask should be a boolean array, got dtype {dtype}")


@pad_to_bucket.case(hint="x may be a JAX array, and padding keeps its dtype: build the padded array from x "
                         "(or with x's dtype), not from a default float array.")
def keeps_the_dtype_of_a_jax_array(pad_fn):
    x = jnp.array([7, -2, 5], jnp.int32)
    padded, mask = _padded(pad_fn, x, (4, 8))
    expect_close(padded, np.array([7, -2, 5, 0], np.int32), check_dtype=True,
                 what="padded x for the int32 JAX array [7, -2, 5], buckets (4, 8)")
    expect_close(np.asarray(mask, dtype=bool), np.array([True, True, True, False]), what="the mask")


@pad_to_bucket.case(points=2, hint="If every call is padded to one of the buckets, a jitted function sees "
                                   "at most len(buckets) shapes, so it compiles at most that many times; and "
                                   "the mask must mark every one of x's values, zeros included.")
def compiles_at_most_once_per_bucket(pad_fn):
    buckets = (16, 64, 256)
    masked_mean = track_compiles(_masked_mean)
    for n in [3, 17, 200, 16, 64, 65, 1, 250, 40, 129]:
        x = np.arange(n, dtype=np.float32)  # starts with a 0, which the mask must count
        expected = float(np.mean(x))
        got = masked_mean(*_padded(pad_fn, x, buckets))
        expect_close(got, expected, rtol=1e-5, what=f"masked mean of a length-{n} input")
    expect(masked_mean.compile_count <= len(buckets),
           f"expected at most {len(buckets)} compilations for buckets {buckets}, got "
           f"{masked_mean.compile_count}: " + "; ".join(c.reason for c in masked_mean.compilations))


@pad_to_bucket.case(hint="Only an input longer than the largest bucket is an error (ValueError naming "
                         "the length and the largest bucket); one exactly as long fits it.")
def too_long_an_input_is_a_clear_error(pad_fn):
    padded, _ = _padded(pad_fn, np.ones(256, np.float32), (16, 64, 256))
    expect(padded.shape == (256,), f"an input as long as the largest bucket fits it: expected shape (256,), "
                                   f"got {padded.shape}")
    try:
        _padded(pad_fn, np.ones(300, np.float32), (16, 64, 256))
    except ValueError as error:
        expect("300" in str(error) and "256" in str(error),
               f"the message should name the length (300) and the largest bucket (256), got: {error}")
    else:
        expect(False, "expected a ValueError for an input of length 300 with buckets up to 256")


# ---------------------------------------------------------------- 06.matmul_intensity

matmul_intensity = Exercise("06.matmul_intensity", "The arithmetic intensity of a matmul")
_INTENSITY = "the chapter's section 'Arithmetic intensity'"


@matmul_intensity.case(hint=f"FLOPs (a multiply and an add per term of each dot product) over the bytes of "
                            f"both inputs and the output: see {_INTENSITY}.")
def square_float32_is_n_over_six(intensity_fn):
    for n in (6, 96, 1024):
        expect_close(intensity_fn(n, n, n, 4), n / 6, rtol=1e-9,
                     what=f"intensity of a float32 {n}x{n} matmul")


@matmul_intensity.case(hint="A matrix-vector product is the same formula with N = 1; count its output's "
                            "bytes too.")
def a_matrix_vector_product_is_memory_bound(intensity_fn):
    got = intensity_fn(4096, 4096, 1, 4)
    expect_close(got, 2 * 4096 * 4096 / (4 * (4096 * 4096 + 4096 + 4096)), rtol=1e-9,
                 what="intensity of a 4096x4096 matrix times a vector")


@matmul_intensity.case(hint="The bytes scale with bytes_per_element; the FLOPs do not.")
def bfloat16_doubles_it(intensity_fn):
    expect_close(intensity_fn(128, 512, 256, 2), 2 * intensity_fn(128, 512, 256, 4), rtol=1e-9,
                 what="bfloat16 intensity of a (128, 512) @ (512, 256) matmul, against float32's")


@matmul_intensity.case(hint=f"Each of the three matrices has its own shape: (M, K), (K, N) and the output "
                            f"(M, N). See {_INTENSITY}.")
def a_rectangular_matmul(intensity_fn):
    m, k, n = 128, 512, 256
    expect_close(intensity_fn(m, k, n, 2), 2 * m * k * n / (2 * (m * k + k * n + m * n)), rtol=1e-9,
                 what=f"bfloat16 intensity of a ({m}, {k}) @ ({k}, {n}) matmul")
