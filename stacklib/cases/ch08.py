"""Chapter 08 exercises: the top op of a trace, the MFU of a training step, a roofline
prediction, and an honest step timer.

Every case is deterministic: none reads a live profiler trace or a real clock. The top op
is graded on event lists whose answers provably differ from the plausible wrong ones (the
longest single event, the first event, the most frequent op, ...), and the step timer on a
fake clock and a fake asynchronous device that the case controls, so that a wrong answer
loses the same points on every run, on any machine, under any load.
"""

import contextlib
import inspect
import itertools
import numbers
import statistics
import time
import timeit

import jax
import jax.numpy as jnp

from stacklib import profile
from stacklib.compile import cost_analysis, op_costs
from stacklib.grading import Exercise, call_on_copies, expect, expect_close
from stacklib.profile import OpEvent, op_table


@contextlib.contextmanager
def _replaced(answer, original, replacement, homes):
    """Replace `original` with `replacement` in the modules `homes` and in `answer`'s globals.

    A learner may write `time.perf_counter()` or `from time import perf_counter`; patching
    the module attribute reaches the first, rebinding the name in the learner's own
    namespace (the notebook's globals) reaches the second. Everything is put back after.
    """
    namespace = getattr(inspect.unwrap(answer), "__globals__", {})  # unwrap: the grader may wrap it
    names = [name for name, value in namespace.items() if value is original]
    saved = [(module, attribute, getattr(module, attribute)) for module, attribute in homes]
    try:
        for module, attribute, _ in saved:
            setattr(module, attribute, replacement)
        for name in names:
            namespace[name] = replacement
        yield
    finally:
        for module, attribute, value in saved:
            setattr(module, attribute, value)
        for name in names:
            namespace[name] = original


def _close(a, b):
    return abs(a - b) <= 1e-9 * abs(b)


def _expect_diagnosed(got, expected, mistakes, what, unit=" s"):
    """Fail unless `got` is `expected` (to 1e-9, relative); when it equals known mistakes' values, name them.

    `mistakes` is a list of (the value a mistake gives, what the mistake is). Several mistakes
    can give the same value on one input; the message then names each of them.
    """
    expect(isinstance(got, numbers.Real) or getattr(got, "shape", None) == (),
           f"{what}: expected a number, got {type(got).__name__}")
    got = float(got)
    if _close(got, expected):
        return
    named = [why for value, why in mistakes if _close(got, value) and not _close(value, expected)]
    diagnosis = f": {'; or '.join(named)}" if named else ""
    expect(False, f"{what}: expected {expected:.6g}{unit}, got {got:.6g}{unit}{diagnosis}")


# ---------------------------------------------------------------- 08.top_op

top_op = Exercise("08.top_op", "The op that takes the most time in a trace")


def _event(name, duration, module="jit_step", run="1", start=0.0, thread="t"):
    return OpEvent(name=name, module=module, start_us=start, duration_us=duration, thread=thread, run_id=run)


def _totals(events, module, key=lambda event: event.name):
    totals = {}
    for event in events:
        if event.module == module:
            totals[key(event)] = totals.get(key(event), 0.0) + event.duration_us
    return totals


def _known_mistakes(events, module):
    """(the op a plausible wrong rule picks, what it picks by), computed by the case from the events."""
    mine = [event for event in events if event.module == module]
    calls = {}
    for event in mine:
        calls[event.name] = calls.get(event.name, 0) + 1
    totals = _totals(events, module)
    every_module = {}
    for event in events:
        every_module[event.name] = every_module.get(event.name, 0.0) + event.duration_us
    per_run = _totals(events, module, key=lambda event: (event.name, event.run_id))
    return [
        (max(mine, key=lambda event: event.duration_us).name, "the longest single execution"),
        (mine[0].name, "the module's first event"),
        (max(calls, key=calls.get), "the most executions"),
        (max(totals, key=lambda name: totals[name] / calls[name]), "the longest mean execution"),
        (max(every_module, key=every_module.get), "the most time over all modules together"),
        (max(per_run, key=per_run.get)[0], "the most time within one run"),
        (max(totals), "the name that sorts last"),
    ]


def _expect_top(top_fn, events, module, why):
    expected = op_table(events, module=module)[0].key  # before the learner's code runs
    mistakes = _known_mistakes(events, module)
    calls = []

    def watched_op_table(*args, **kwargs):
        calls.append(1)
        return op_table(*args, **kwargs)

    with _replaced(top_fn, op_table, watched_op_table, [(profile, "op_table"), (profile.ops, "op_table")]):
        got = call_on_copies(top_fn, events, module, what="top_op")
    expect(not calls, f"top_op called stacklib.profile.op_table {len(calls)} time(s): the exercise asks you "
                      "to add up the durations yourself")
    expect(isinstance(got, str), f"expected the op's name, a str such as 'multiply.5' (an event's `name`), "
                                 f"got {type(got).__name__} {got!r:.60}")
    if got == expected:
        return
    # The op that was expected is not named: it is the whole answer. The rule the answer seems to
    # follow is named instead, and what the expected op is (`why`) in words.
    named = [rule for name, rule in mistakes if name == got and name != expected]
    diagnosis = f": that is the op picked by {'; '.join(named)}" if named else ""
    totals = _totals(events, module)
    if got in totals:
        found = f"{got!r} has {totals[got]:g} us in total in {module}; another op has more"
    else:
        found = f"{got!r} is not an op of {module} in this trace"
    expect(False, f"{found}{diagnosis} ({why})")


_OP_TABLE = "the chapter's section 'From a trace to an op table'"


@top_op.case(points=2, hint=f"An op's time is the total over all its executions, wherever they fall in the "
                            f"list. See {_OP_TABLE}.")
def adds_up_every_execution(top_fn):
    durations = [("copy.3", 1.0), ("dot.2", 4.0), ("copy.3", 1.0), ("dot.2", 4.0), ("copy.3", 1.0),
                 ("fusion.1", 10.0), ("dot.2", 4.0), ("copy.3", 1.0), ("copy.3", 1.0)]  # as a loop runs them
    # XLA's CPU runtime runs ops on a pool of threads: one op's executions land on several.
    events = [_event(name, duration, start=10.0 * i, thread=f"tf_XLAEigen/{i % 3}")
              for i, (name, duration) in enumerate(durations)]
    _expect_top(top_fn, events, "jit_step", "3 executions of 4 us = 12 us, more than fusion.1's one of 10 us "
                                            "and copy.3's 5 of 1 us")


@top_op.case(points=2, hint="Only the events whose module is the one asked for count (that very name, not "
                            "one that contains it), wherever they are in the list.")
def only_the_module_asked_for(top_fn):
    events = [_event("dot.2", 3.0), _event("big_init", 500.0, module="jit_init"), _event("add.4", 5.0),
              _event("log_fusion", 400.0, module="jit_step_and_log")]
    _expect_top(top_fn, events, "jit_step", "the ops of jit_init and jit_step_and_log do not count")


# A capture laid out as a real one on CPU: modules, threads, run ids and start times as
# load_trace returns them for an init function and two calls of a training step whose
# layers run in a loop. The durations are chosen so that the op with the most time in
# total, the loop body's ynn_fusion.3, is none of: the first event of the module or its
# longest single event (ynn_fusion.1, slow on the cold first call), the op with the most
# calls (copy.7), the op with the longest mean (ynn_fusion), or the top op of all modules
# together (jit_init's while.56). An evaluation step runs between the two training steps.
_PJRT, _EIGEN = "tf_XLAPjRtCpuClient/170789732367070308", "tf_XLAEigen/-3709514324815259980"
_RECORDED = [
    ("slice_bitcast_fusion.1", "jit_init", 655.852, 1.503, _PJRT, "1837837475"),
    ("broadcast_add_fusion.6", "jit_init", 817.412, 295.508, _PJRT, "1837837475"),
    ("while.56", "jit_init", 1356.061, 1014.845, _EIGEN, "1837837475"),
]
for _run, _start in (("-795199565", 3231.172), ("-795199564", 5023.066)):
    _slow = 543.015 if _run.endswith("5") else 120.0
    _RECORDED += [("ynn_fusion.1", "jit_train_step", _start, _slow, _PJRT, _run)]
    _RECORDED += [("copy.7", "jit_train_step", _start + 550 + 10 * i, 1.0, _PJRT, _run) for i in range(6)]
    _RECORDED += [("ynn_fusion.3", "jit_train_step", _start + 620 + 110 * i, 100.0, _EIGEN, _run)
                  for i in range(4)]
    _RECORDED += [("broadcast_maximum_fusion", "jit_train_step", _start + 1070, 13.89, _PJRT, _run),
                  ("ynn_fusion", "jit_train_step", _start + 1090, 350.0, _PJRT, _run)]
    if _run.endswith("5"):  # an evaluation step runs between the two training steps
        _RECORDED += [("reduce_fusion.2", "jit_eval_step", _start + 1520, 230.0, _PJRT, "-795199566")]
del _run, _start, _slow


def _recorded_capture():
    return [OpEvent(name, module, start, duration, thread, run)
            for name, module, start, duration, thread, run in _RECORDED]


@top_op.case(points=2, hint=f"A real capture: several modules, threads and runs, interleaved. The rule "
                            f"is the same. See {_OP_TABLE}.")
def agrees_with_op_table_on_a_recorded_capture(top_fn):
    _expect_top(top_fn, _recorded_capture(), "jit_train_step", "the first row of op_table: 4 loop "
                "iterations x 2 steps x 100 us")


# ---------------------------------------------------------------- 08.mlp_mfu

mlp_mfu = Exercise("08.mlp_mfu", "The MFU of an MLP's training step, from its shapes")


def _matmul_flops_of_training_step(batch, d_in, d_hidden, d_out):
    def loss(w1, w2, x):  # its gradient with respect to the output is the output: no matmul simplifies away
        return 0.5 * jnp.sum((jax.nn.relu(x @ w1) @ w2) ** 2)

    shapes = [jax.ShapeDtypeStruct(s, jnp.float32)
              for s in ((d_in, d_hidden), (d_hidden, d_out), (batch, d_in))]
    cost = cost_analysis(jax.grad(loss, argnums=(0, 1)), *shapes)
    return cost.by_primitive["dot_general"][0]


def _expect_mfu(mfu_fn, batch, d_in, d_hidden, d_out, step_seconds, peak_flops):
    """Compare with the step's matmul FLOPs as XLA counts them, naming a known miscount."""
    flops = _matmul_flops_of_training_step(batch, d_in, d_hidden, d_out)  # before the learner's code runs
    forward = 2 * batch * (d_in * d_hidden + d_hidden * d_out)
    expected = flops / (step_seconds * peak_flops)
    mistakes = [
        (3 * forward / (step_seconds * peak_flops), "that counts 6 x parameters x tokens: a backward pass "
         "with the gradient into the data x too, which nothing needs"),
        (forward / (step_seconds * peak_flops), "that counts the forward pass only"),
        (2 * forward / (step_seconds * peak_flops), "that counts the forward pass and the weights' "
         "gradients, but not the gradient that flows from the second layer back into the first"),
        (100 * expected, "that is a percentage: return the fraction"),
        (flops * step_seconds / peak_flops, "that multiplies by the step time: MFU divides by it"),
    ]
    got = mfu_fn(batch, d_in, d_hidden, d_out, step_seconds=step_seconds, peak_flops=peak_flops)
    _expect_diagnosed(got, expected, mistakes, f"MFU for B={batch}, D_in={d_in}, H={d_hidden}, "
                                               f"D_out={d_out}, {step_seconds} s, {peak_flops:.0e} FLOP/s",
                      unit="")


@mlp_mfu.case(points=2, hint="Count every matmul of the forward and the backward pass; in the backward pass "
                             "a layer needs its weights' gradient, and its input's only where something "
                             "upstream needs it. See the chapter's section 'Model FLOPs utilization'.")
def counts_the_matmuls_of_forward_and_backward(mfu_fn):
    for shapes in [(32, 64, 128, 10), (16, 1024, 64, 32)]:
        _expect_mfu(mfu_fn, *shapes, step_seconds=0.25, peak_flops=2e12)


@mlp_mfu.case(hint="MFU is the step's FLOPs over what the peak could do in the step's time.")
def scales_with_time_and_peak(mfu_fn):
    base = mfu_fn(64, 256, 256, 16, step_seconds=0.01, peak_flops=1e11)
    expect_close(mfu_fn(64, 256, 256, 16, step_seconds=0.02, peak_flops=1e11), base / 2, rtol=1e-9,
                 what="MFU with twice the step time")
    expect_close(mfu_fn(64, 256, 256, 16, step_seconds=0.01, peak_flops=2e11), base / 2, rtol=1e-9,
                 what="MFU with twice the peak")


# ---------------------------------------------------------------- 08.roofline_time

roofline_time = Exercise("08.roofline_time", "Predict a program's time with the roofline")


def _expect_roofline(predict_fn, costs, peak_flops, peak_bandwidth, what):
    """Compare with the sum of the ops' bounds, naming the mistake when the answer is a known one."""
    terms = [(f / peak_flops, b / peak_bandwidth) for f, b in costs.values()]
    expected = sum(max(t) for t in terms)  # before the learner's code runs
    mistakes = [
        (sum(sum(t) for t in terms), "you added each op's compute time and memory time; an op moves "
         "its bytes while it computes, so it takes the larger of the two, "
         "max(F / peak_flops, B / peak_bandwidth)"),
        (max(sum(c for c, _ in terms), sum(m for _, m in terms)), "you took the max of the summed FLOPs' "
         "time and the summed bytes' time, as if a compute-bound op could hide a memory-bound one; ops run "
         "one after another, so add up each op's own bound"),
        (sum(c for c, _ in terms), "you left out the bytes: a memory-bound op takes B / peak_bandwidth"),
        (sum(m for _, m in terms), "you left out the FLOPs: a compute-bound op takes F / peak_flops"),
        (sum(min(t) for t in terms), "you took each op's faster resource (min); an op waits for the slower"),
        (sum(max(t) for t, (f, _) in zip(terms, costs.values(), strict=True) if f),
         "you left out the ops without FLOPs: a copy computes nothing but still moves its bytes"),
        (1e3 * expected, "that is milliseconds: return seconds"),
    ]
    got = call_on_copies(predict_fn, costs, peak_flops, peak_bandwidth, what="predict_seconds")
    _expect_diagnosed(got, expected, mistakes, what)


@roofline_time.case(hint="One op is held back by whichever of its two resources, arithmetic or memory, "
                         "takes longer. See the chapter's section 'The roofline'.")
def one_op_is_limited_by_the_slower_resource(predict_fn):
    _expect_roofline(predict_fn, {"matmul": (2e9, 1e6)}, 1e11, 1e10, "a compute-bound op")
    _expect_roofline(predict_fn, {"add": (1e6, 1.2e7)}, 1e11, 1e10, "a memory-bound op")
    _expect_roofline(predict_fn, {"fusion": (1e9, 1e8)}, 1e11, 1e10, "an op at the ridge")


@roofline_time.case(points=2, hint="Ops run one after another, each with its own bound: a compute-bound op "
                                   "cannot hide a memory-bound one.")
def ops_add_their_own_bounds(predict_fn):
    costs = {"matmul": (2e9, 1e6), "add": (1e6, 1.2e7), "copy": (0.0, 4e6)}
    _expect_roofline(predict_fn, costs, 1e11, 1e10, "three ops in sequence")


@roofline_time.case(hint="Use it on a real program: the (flops, bytes) of every kernel from "
                         "stacklib.compile.op_costs.")
def agrees_with_the_roofline_on_a_compiled_program(predict_fn):
    program = jax.jit(lambda x, w: jax.nn.softmax(x @ w))
    compiled = program.lower(jnp.ones((64, 128)), jnp.ones((128, 256))).compile()
    costs = {name: (c.flops, c.bytes_accessed) for name, c in op_costs(compiled).items()}
    _expect_roofline(predict_fn, costs, 5e10, 2e10, "the predicted seconds of jit(softmax(x @ w))")


# ---------------------------------------------------------------- 08.step_time

step_time = Exercise("08.step_time", "An honest step timer")


class _FakeDevice:
    """A clock and an asynchronous device that the case controls: time passes only when they say.

    `step(x)` stands in for a jitted training step: its first call compiles (the caller waits
    `compile_s`), every call queues `work_s[i]` seconds of work on the device and returns
    after `dispatch_s` with results that are ready when the work is done. A result's
    `block_until_ready()` (what `jax.block_until_ready` calls) moves the clock to that moment.
    The timer under test reads the clock through `time.perf_counter`, which the case replaces
    with `perf_counter` below, so every timing is exact.
    """

    dispatch_s = 1e-4

    def __init__(self, work_s, compile_s=0.0):
        self.work_s, self.compile_s = list(work_s), compile_s
        self.now = self.device_free_at = 0.0
        self.calls = self.clock_reads = 0

    def perf_counter(self):
        self.clock_reads += 1
        return self.now

    def perf_counter_ns(self):
        return int(self.perf_counter() * 1e9)

    def step(self, x):
        if self.calls == 0:
            self.now += self.compile_s  # tracing and compiling happen on the caller
        work = self.work_s[min(self.calls, len(self.work_s) - 1)]
        self.calls += 1
        self.now += self.dispatch_s
        self.device_free_at = max(self.now, self.device_free_at) + work  # queued after earlier work
        return {"loss": _Pending(self, self.device_free_at), "state": [_Pending(self, self.device_free_at)]}

    def timed_calls(self, repeats):
        """What an honest timer measures: each call after the warm-up, from dispatch to result."""
        return [self.dispatch_s + work for work in self.work_s[1:1 + repeats]]


class _Pending:
    """A result still being computed on the fake device."""

    def __init__(self, device, ready_at):
        self.device, self.ready_at = device, ready_at

    def block_until_ready(self):
        self.device.now = max(self.device.now, self.ready_at)
        return self


def _expect_timer(timer_fn, device, repeats, what):
    """Time `device.step` with the learner's timer on the fake clock; name the mistake if it is known."""
    honest = device.timed_calls(repeats)  # before the learner's code runs
    expected = statistics.median(honest)
    # timeit.default_timer is time.perf_counter under another name: a timer may read either.
    with _replaced(timer_fn, time.perf_counter, device.perf_counter,
                   [(time, "perf_counter"), (timeit, "default_timer")]), \
            _replaced(timer_fn, time.perf_counter_ns, device.perf_counter_ns, [(time, "perf_counter_ns")]):
        got = timer_fn(device.step, 1.0, repeats=repeats)
    expect(device.clock_reads > 0, "the timer never read time.perf_counter(): the check times your "
                                   "function on a clock it controls, through time.perf_counter, so use that")
    expect(device.calls == repeats + 1, f"{what}: expected 1 warm-up call and {repeats} timed calls, got "
                                        f"{device.calls} calls" + (": the first call (compilation) is in "
                                        "the timing" if device.calls == repeats else ""))
    mistakes = [
        (1e3 * expected, "1000 times the right answer: that is milliseconds, and the timer should return "
                         "seconds (time.perf_counter() counts seconds)"),
        (device.dispatch_s, "that is the time to dispatch the call: the timer stops before the work is "
                            "done. Wait for the result with jax.block_until_ready(out) before reading "
                            "the clock"),
        (statistics.mean(honest), "that is the mean: return the median, which one slow call cannot move"),
        (min(honest), "that is the fastest call: return the median"),
        (sum(honest), "that is the total of the timed calls: return the median of the per-call times"),
        (statistics.median_high(honest), "that is the higher of the two middle times: the median of an even "
                                         "number of times is the mean of the two"),
        (statistics.median_low(honest), "that is the lower of the two middle times: the median of an even "
                                        "number of times is the mean of the two"),
        (statistics.median(itertools.accumulate(honest)), "that is the median of the times since the clock "
                                                          "started before the loop: start it again before "
                                                          "each call"),
    ]
    _expect_diagnosed(got, expected, mistakes, what)


_TIMING = "the chapter's section 'Timing a step honestly'"


@step_time.case(points=2, hint=f"The function returns before its work is done (asynchronous dispatch): the "
                               f"clock must stop when the result is ready. See {_TIMING}.")
def waits_for_each_result(timer_fn):
    _expect_timer(timer_fn, _FakeDevice([0.02] * 6), 5, "5 calls of 20 ms of work")


@step_time.case(hint=f"The first call compiles: it must not be among the timed ones. See {_TIMING}.")
def leaves_the_compilation_out(timer_fn):
    _expect_timer(timer_fn, _FakeDevice([0.02] * 6, compile_s=0.4), 5, "a first call that compiles for 0.4 s")


@step_time.case(points=2, hint="One slow call, from a busy neighbour or a garbage collection, moves the mean "
                               "but not the median: keep each call's time and return their median.")
def returns_the_median(timer_fn):
    device = _FakeDevice([0.0, 0.022, 0.018, 0.120, 0.020, 0.024])
    _expect_timer(timer_fn, device, 5, "5 calls, one of them slow")


@step_time.case(hint="The median of an even number of times is the mean of the two middle ones.")
def the_median_of_an_even_number_of_calls(timer_fn):
    device = _FakeDevice([0.0, 0.018, 0.030, 0.021, 0.050])
    _expect_timer(timer_fn, device, 4, "repeats=4")


@step_time.case(hint="Time `repeats` calls, however many that is.")
def times_as_many_calls_as_asked(timer_fn):
    device = _FakeDevice([0.03] * 8)
    _expect_timer(timer_fn, device, 7, "repeats=7")


@step_time.case(points=2, hint="The warm-up call's work must be finished before the clock starts, or it runs "
                               "into the first timed call.")
def the_warm_up_finishes_before_the_clock_starts(timer_fn):
    device = _FakeDevice([0.3, 0.02])  # a slow first run (e.g. autotuning), then a normal one
    _expect_timer(timer_fn, device, 1, "one timed call after a warm-up that runs for 0.3 s")
