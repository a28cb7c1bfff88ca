"""Chapter 08 exercises: the top op of a trace, the MFU of a training step, a roofline
prediction, and an honest step timer."""

import tempfile
import time

import jax
import jax.numpy as jnp

from stacklib.compile import cost_analysis, op_costs
from stacklib.grading import Exercise, expect, expect_close
from stacklib.profile import OpEvent, Roofline, load_trace, op_table, trace

# ---------------------------------------------------------------- 08.top_op

top_op = Exercise("08.top_op", "The op that takes the most time in a trace")


def _event(name, duration, module="jit_step", run="1"):
    return OpEvent(name=name, module=module, start_us=0.0, duration_us=duration, thread="t", run_id=run)


@top_op.case(hint="Add up the durations of all events with the same name; the longest single event "
                  "is not the op with the most time.")
def totals_not_single_events(top_fn):
    events = [_event("fusion.1", 10.0), *(_event("dot.2", 4.0, run=str(r)) for r in range(3)),
              _event("copy.3", 1.0)]
    expect(top_fn(events, "jit_step") == "dot.2",
           f"expected 'dot.2' (3 calls of 4 us = 12 us, more than fusion.1's single 10 us), "
           f"got {top_fn(events, 'jit_step')!r}")


@top_op.case(hint="Keep only the events whose `module` is the one asked for.")
def only_the_module_asked_for(top_fn):
    events = [_event("fusion.1", 5.0), _event("dot.2", 3.0), _event("big_init", 500.0, module="jit_init")]
    got = top_fn(events, "jit_step")
    expect(got == "fusion.1", f"expected 'fusion.1' (jit_init's op does not count), got {got!r}")


@top_op.case(points=2, hint="On a real capture, compare your answer with stacklib.profile.op_table.")
def agrees_on_a_real_capture(top_fn):
    @jax.jit
    def mlp(x, w1, w2):
        return jax.nn.relu(x @ w1) @ w2

    args = (jnp.ones((128, 256)), jnp.ones((256, 512)), jnp.ones((512, 64)))
    jax.block_until_ready(mlp(*args))
    with trace(tempfile.mkdtemp()) as files:
        for _ in range(3):
            jax.block_until_ready(mlp(*args))
    events = load_trace(files.perfetto_json)
    expected = op_table(events, module="jit_mlp")[0].key
    got = top_fn(events, "jit_mlp")
    expect(got == expected, f"expected {expected!r} (the first row of op_table), got {got!r}")


# ---------------------------------------------------------------- 08.mlp_mfu

mlp_mfu = Exercise("08.mlp_mfu", "The MFU of an MLP's training step, from its shapes")


def _matmul_flops_of_training_step(batch, d_in, d_hidden, d_out):
    def loss(w1, w2, x):
        return jnp.mean(jax.nn.relu(x @ w1) @ w2)

    shapes = [jax.ShapeDtypeStruct(s, jnp.float32)
              for s in ((d_in, d_hidden), (d_hidden, d_out), (batch, d_in))]
    cost = cost_analysis(jax.grad(loss, argnums=(0, 1)), *shapes)
    return cost.by_primitive["dot_general"][0]


@mlp_mfu.case(points=2, hint="Forward: 2·B·(D_in·H + H·D_out). Backward: the second layer needs the "
                             "gradient of its weights and of its input (two matmuls), the first layer "
                             "only of its weights (nothing flows back into the data x).")
def counts_the_matmuls_of_forward_and_backward(mfu_fn):
    for batch, d_in, d_hidden, d_out in [(32, 64, 128, 10), (16, 1024, 64, 32)]:
        flops = _matmul_flops_of_training_step(batch, d_in, d_hidden, d_out)
        got = mfu_fn(batch, d_in, d_hidden, d_out, step_seconds=1.0, peak_flops=1e12)
        expect_close(got, flops / 1e12, rtol=1e-9,
                     what=f"MFU for B={batch}, D_in={d_in}, H={d_hidden}, D_out={d_out}, 1 s, 1 TFLOP/s")


@mlp_mfu.case(hint="MFU = FLOPs per step / (step seconds · peak FLOP/s): twice the time or twice "
                   "the peak halves it.")
def scales_with_time_and_peak(mfu_fn):
    base = mfu_fn(64, 256, 256, 16, step_seconds=0.01, peak_flops=1e11)
    expect_close(mfu_fn(64, 256, 256, 16, step_seconds=0.02, peak_flops=1e11), base / 2, rtol=1e-9,
                 what="MFU with twice the step time")
    expect_close(mfu_fn(64, 256, 256, 16, step_seconds=0.01, peak_flops=2e11), base / 2, rtol=1e-9,
                 what="MFU with twice the peak")


# ---------------------------------------------------------------- 08.roofline_time

roofline_time = Exercise("08.roofline_time", "Predict a program's time with the roofline")


@roofline_time.case(hint="One op takes at least max(flops / peak_flops, bytes / peak_bandwidth) seconds.")
def one_op_is_limited_by_the_slower_resource(predict_fn):
    expect_close(predict_fn({"matmul": (2e9, 1e6)}, 1e11, 1e10), 2e9 / 1e11, what="a compute-bound op")
    expect_close(predict_fn({"add": (1e6, 1.2e7)}, 1e11, 1e10), 1.2e7 / 1e10, what="a memory-bound op")


@roofline_time.case(points=2, hint="Ops run one after another: add up each op's own bound. The max of the "
                                   "summed FLOPs and summed bytes assumes a compute-bound op can hide a "
                                   "memory-bound one, which sequential ops cannot.")
def ops_add_their_own_bounds(predict_fn):
    costs = {"matmul": (2e9, 1e6), "add": (1e6, 1.2e7), "copy": (0.0, 4e6)}
    expected = 2e9 / 1e11 + 1.2e7 / 1e10 + 4e6 / 1e10
    expect_close(predict_fn(costs, 1e11, 1e10), expected, rtol=1e-9, what="three ops in sequence")


@roofline_time.case(hint="Use it on a real program: the (flops, bytes) of every kernel from "
                         "stacklib.compile.op_costs.")
def agrees_with_the_roofline_on_a_compiled_program(predict_fn):
    program = jax.jit(lambda x, w: jax.nn.softmax(x @ w))
    compiled = program.lower(jnp.ones((64, 128)), jnp.ones((128, 256))).compile()
    costs = {name: (c.flops, c.bytes_accessed) for name, c in op_costs(compiled).items()}
    roof = Roofline(5e10, 2e10)
    expected = sum(roof.min_time(flops, nbytes) for flops, nbytes in costs.values())
    expect_close(predict_fn(costs, 5e10, 2e10), expected, rtol=1e-9, what="the predicted seconds")


# ---------------------------------------------------------------- 08.step_time

step_time = Exercise("08.step_time", "An honest step timer")


class _Pending:
    """Stands in for a JAX array still being computed: ready `seconds` after it was made."""

    def __init__(self, seconds):
        self._ready_at = time.perf_counter() + seconds

    def block_until_ready(self):
        time.sleep(max(0.0, self._ready_at - time.perf_counter()))
        return self


def _async_step(work_s=0.02, compile_s=0.4):
    """A function that dispatches asynchronously and 'compiles' on its first call."""
    calls = []

    def fn(x):
        if not calls:
            time.sleep(compile_s)
        calls.append(x)
        return {"loss": _Pending(work_s), "state": [_Pending(work_s / 2)]}

    return fn, calls


@step_time.case(points=2, hint="The function returns before its work is done (asynchronous dispatch): "
                               "wait for the result with jax.block_until_ready(out) before stopping "
                               "the clock.")
def waits_for_the_result(timer_fn):
    fn, _ = _async_step()
    seconds = timer_fn(fn, 1.0, repeats=5)
    expect(seconds >= 0.018, f"expected about 0.02 s per step, got {seconds:.4f} s: the timer stops "
                             "before the work is done")


@step_time.case(points=2, hint="Make one untimed call first: it pays for compilation. Then time "
                               "`repeats` calls and return their mean.")
def leaves_the_compilation_out(timer_fn):
    fn, calls = _async_step()
    seconds = timer_fn(fn, 1.0, repeats=5)
    expect(len(calls) == 6, f"expected 1 warm-up call and 5 timed calls, got {len(calls)} calls")
    expect(seconds < 0.07, f"expected about 0.02 s per step, got {seconds:.3f} s: the first call "
                           "(0.4 s of compilation) is in the timing")
