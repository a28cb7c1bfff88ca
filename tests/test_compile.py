"""stacklib.compile: the counting rules, the HLO reader and the recompile tracker behave as documented."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from stacklib.compile import (
    CompileWatcher,
    cost_analysis,
    count_fusions,
    fusions,
    op_costs,
    parse_hlo,
    track_compiles,
)

# ---------------------------------------------------------------- counting from the jaxpr


def test_a_matmul_costs_two_flops_per_multiply_add():
    M, K, N = 8, 16, 4
    cost = cost_analysis(jnp.matmul, jnp.ones((M, K)), jnp.ones((K, N)))
    assert cost.flops == 2 * M * K * N
    assert cost.transcendentals == 0
    assert cost.bytes_min == 4 * (M * K + K * N + M * N)


def test_a_batched_einsum_counts_the_batch_dimension():
    def batched(a, b):
        return jnp.einsum("bik,bkj->bij", a, b)

    cost = cost_analysis(batched, jnp.ones((3, 5, 7)), jnp.ones((3, 7, 2)))
    assert cost.flops == 2 * 3 * 5 * 7 * 2


def test_elementwise_ops_cost_one_flop_per_element_and_transcendentals_apart():
    x = jnp.ones((10, 20))
    cost = cost_analysis(lambda v: jnp.exp(v * 2.0 + 1.0), x)
    assert cost.flops == 2 * x.size  # the multiply and the add
    assert cost.transcendentals == x.size  # the exp


def test_unfused_bytes_count_every_intermediate_and_bytes_min_only_the_boundary():
    x = jnp.ones((100,), jnp.float32)
    cost = cost_analysis(lambda v: jnp.sin(v) * 2.0 + 1.0, x)
    assert cost.bytes_min == 2 * x.nbytes
    # sin: read + write; mul and add: read + write + a 4-byte scalar literal each
    assert cost.bytes_accessed == 3 * 2 * x.nbytes + 2 * 4
    assert cost.bytes_accessed > cost.bytes_min


def test_a_reduction_costs_one_flop_per_element_beyond_the_first_of_each_output():
    cost = cost_analysis(lambda v: v.sum(axis=1), jnp.ones((10, 100)))
    assert cost.flops == 10 * 99


@pytest.mark.parametrize("y, multiplies",
                         [(0, 0), (1, 0), (2, 1), (3, 2), (4, 2), (7, 4), (8, 3), (-1, 1), (-3, 3)])
def test_integer_pow_counts_the_multiplies_of_square_and_multiply(y, multiplies):
    x = jnp.ones((5,))
    assert cost_analysis(lambda v: lax.integer_pow(v, y), x).flops == multiplies * x.size


def test_a_scan_body_is_counted_once_per_iteration():
    x = jnp.ones((16, 16))
    body = cost_analysis(lambda c: c @ x, x).flops

    def loop(c):
        return lax.scan(lambda carry, _: (carry @ x, None), c, None, length=7)[0]

    assert cost_analysis(loop, x).flops == 7 * body


def test_a_cond_is_charged_its_most_expensive_branch():
    x = jnp.ones((16, 16))
    cost = cost_analysis(lambda a, p: lax.cond(p, lambda v: v @ v, lambda v: v + 1, a), x, True)
    assert cost.flops == 2 * 16**3 + 1  # + converting the bool predicate to an index


def test_nested_jit_and_custom_jvp_functions_are_entered():
    x = jnp.ones((4, 8))
    inner = jax.jit(lambda v: jax.nn.relu(v) * 3.0)
    assert cost_analysis(lambda v: inner(v) + 1.0, x).flops == 3 * x.size


def test_dead_code_is_not_counted():
    def f(v):
        unused = jnp.exp(v) @ v.T  # noqa: F841 -- traced, then dropped by XLA
        return v + 1.0

    cost = cost_analysis(f, jnp.ones((8, 8)))
    assert cost.flops == 64 and cost.transcendentals == 0


def test_a_same_dtype_conversion_is_free():
    cost = cost_analysis(lambda v: jnp.clip(v, 0.2, 0.8), jnp.ones((10,)))
    assert cost.flops == 2 * 10  # max and min; the weak-type conversions of 0.2, 0.8 vanish


def test_primitives_without_a_rule_are_listed_not_hidden():
    cost = cost_analysis(lambda k: jax.random.normal(k, (4,)), jax.random.key(0))
    assert cost.uncounted, "random-bit generation has no FLOP rule and must be reported"


def test_shape_dtype_structs_are_enough_nothing_runs():
    big = jax.ShapeDtypeStruct((4096, 4096), jnp.float32)
    assert cost_analysis(jnp.matmul, big, big).flops == 2 * 4096**3


def test_the_intensity_of_a_square_float32_matmul_is_n_over_six():
    n = 96
    cost = cost_analysis(jnp.matmul, jnp.ones((n, n)), jnp.ones((n, n)))
    assert cost.arithmetic_intensity == pytest.approx(n / 6)


def test_by_primitive_adds_up_to_the_totals():
    cost = cost_analysis(lambda a, b: jax.nn.softmax(a @ b), jnp.ones((8, 16)), jnp.ones((16, 32)))
    assert sum(row[0] for row in cost.by_primitive.values()) == cost.flops
    assert sum(row[2] for row in cost.by_primitive.values()) == cost.bytes_accessed
    assert cost.by_primitive["dot_general"][0] == 2 * 8 * 16 * 32


def test_cost_reads_like_xla_cost_analysis_and_names_the_keys_on_a_typo():
    cost = cost_analysis(jnp.sin, jnp.ones(3))
    assert cost["transcendentals"] == 3 and cost["bytes accessed"] == cost.bytes_accessed
    with pytest.raises(KeyError, match="bytes accessed"):
        cost["bytes"]


def test_a_non_function_is_rejected_with_what_was_passed():
    with pytest.raises(TypeError, match="ndarray"):
        cost_analysis(np.ones(3))


# ---------------------------------------------------------------- reading optimized HLO


def _compiled(fn, *args):
    return jax.jit(fn).lower(*args).compile()


def test_an_elementwise_chain_compiles_to_one_loop_fusion():
    compiled = _compiled(lambda v: jnp.exp(jnp.sin(v) * 2.0 + 1.0) / 3.0, jnp.ones((64, 64)))
    (fusion,) = fusions(compiled)
    assert fusion.kind == "kLoop"
    assert {"sine", "multiply", "add", "exponential"} <= set(fusion.opcodes)
    assert count_fusions(compiled.as_text()) == 1


def test_op_costs_lists_the_kernels_of_the_entry_computation():
    compiled = _compiled(lambda a, b: jax.nn.relu(a @ b).sum(), jnp.ones((8, 16)), jnp.ones((16, 4)))
    module = parse_hlo(compiled.as_text())
    costs = op_costs(module)
    assert costs and set(costs) <= {i.name for i in module.entry.instructions}
    assert all(module.entry.by_name[name].opcode not in ("parameter", "constant") for name in costs)
    assert sum(c.flops for c in costs.values()) >= 2 * 8 * 16 * 4


def test_parse_hlo_reads_tuple_shapes_comments_and_metadata():
    text = """HloModule jit_f, is_scheduled=true

%body (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %n = f32[4]{0} negate(%p), metadata={op_name="jit(f)/outer/neg"}
}

ENTRY %main (x: f32[4], i: s32[]) -> (f32[4], s32[]) {
  %x = f32[4]{0} parameter(0)
  %i = s32[] parameter(1)
  %f = f32[4]{0} fusion(%x), kind=kLoop, calls=%body, metadata={op_name="jit(f)/outer/neg"}
  ROOT %t = (f32[4]{0}, /*index=1*/s32[]) tuple(%f, %i)
}
"""
    module = parse_hlo(text)
    assert module.name == "jit_f" and module.entry_name == "main"
    root = module.entry.root
    assert root.opcode == "tuple" and root.arrays == [("f32", (4,)), ("s32", ())]
    assert root.nbytes == 4 * 4 + 4
    fusion = module.entry.by_name["f"]
    assert fusion.called == ("body",) and fusion.op_name == "jit(f)/outer/neg"
    assert op_costs(module)["f"].flops == 4
    assert op_costs(module)["f"].bytes_accessed == 2 * 16


def test_a_gpu_style_gemm_custom_call_is_counted_from_its_contracting_dims():
    config = ('{"gemm_backend_config":{"dot_dimension_numbers":'
              '{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}')
    target = "__cublas$gemm"
    text = f"""HloModule jit_mm

ENTRY %main (a: f32[32,64], b: f32[64,16]) -> f32[32,16] {{
  %a = f32[32,64]{{1,0}} parameter(0)
  %b = f32[64,16]{{1,0}} parameter(1)
  ROOT %gemm = f32[32,16]{{1,0}} custom-call(%a, %b), custom_call_target="{target}", backend_config={config}
}}
"""
    assert op_costs(text)["gemm"].flops == 2 * 32 * 64 * 16


def test_stablehlo_text_is_refused_with_a_pointer_to_the_right_text():
    lowered = jax.jit(jnp.sin).lower(jnp.ones(3))
    with pytest.raises(ValueError, match="compile\\(\\).as_text"):
        parse_hlo(lowered.as_text())


def test_something_that_is_not_hlo_is_refused_by_type():
    with pytest.raises(TypeError, match="int"):
        fusions(42)


# ---------------------------------------------------------------- recompilation


def test_repeat_calls_with_the_same_signature_do_not_recompile():
    f = track_compiles(lambda x: x * 2)
    for _ in range(3):
        f(jnp.ones(3))
    f(jnp.zeros(3))  # new values, same shape and dtype
    assert f.compile_count == 1 and f.calls == 4


def test_a_new_shape_recompiles_and_the_reason_names_the_argument():
    f = track_compiles(lambda x, y: x + y)
    f(jnp.ones(3), jnp.ones(3))
    f(jnp.ones(4), jnp.ones(3)[0])
    assert f.compile_count == 2
    assert f.compilations[0].reason == "first call"
    assert "at x: now f32[4], before f32[3]" in f.compilations[1].reason
    assert "at y: now f32[], before f32[3]" in f.compilations[1].reason


def test_a_new_static_value_recompiles():
    def power(x, n):
        return x**n

    f = track_compiles(power, static_argnums=1)
    f(jnp.ones(3), 2)
    f(jnp.ones(3), 2)
    f(jnp.ones(3), 3)
    assert f.compile_count == 2
    assert f.compilations[1].reason == "at n: now static 3, before static 2"


def test_a_python_scalar_and_a_float32_array_are_different_signatures():
    f = track_compiles(lambda x, s: x * s)
    f(jnp.ones(3), 2.0)
    f(jnp.ones(3), jnp.float32(2.0))
    assert f.compile_count == 2
    assert "weak_type=True" in f.compilations[1].reason


def test_a_new_pytree_key_recompiles_and_is_named():
    f = track_compiles(lambda p: sum(jax.tree.leaves(p)))
    f({"w": jnp.ones(2)})
    f({"w": jnp.ones(2), "b": jnp.ones(2)})
    assert f.compile_count == 2
    assert f.compilations[1].reason == "at p['b']: now f32[2], before not passed"


def test_functools_partial_is_tracked_under_the_wrapped_name():
    def scale(x, factor):
        return x * factor

    f = track_compiles(functools.partial(scale, factor=2.0))
    f(jnp.ones(2))
    assert f.name == "jit(scale)" and f.compile_count == 1


def test_the_watcher_counts_compilations_and_stops_listening_on_exit():
    from jax._src import monitoring  # NB: the public module has no way to list listeners

    before = len(monitoring.get_event_duration_listeners())
    with CompileWatcher() as watcher:
        jax.jit(lambda v: v - 1)(jnp.ones(5)).block_until_ready()
        assert len(monitoring.get_event_duration_listeners()) == before + 1
    assert len(monitoring.get_event_duration_listeners()) == before
    assert watcher.count("jit(<lambda>)") == 1
    assert all(event.seconds > 0 for event in watcher.events)


def test_track_compiles_rejects_a_non_function():
    with pytest.raises(TypeError, match="needs a function"):
        track_compiles("f")


def test_a_tracked_function_counts_its_own_compilations_even_if_jax_compiled_it_before():
    def double(x):
        return 2 * x

    jax.jit(double)(jnp.ones(3))  # JAX would reuse this program for another jax.jit(double)
    tracked = track_compiles(double)
    tracked(jnp.ones(3))
    assert tracked.compile_count == 1 and tracked.compilations[0].reason == "first call"
