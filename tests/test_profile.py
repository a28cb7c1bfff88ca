"""stacklib.profile: capture, op tables, named scopes, roofline arithmetic and timing behave as documented."""

import gzip
import json
import math
import time

import jax
import jax.numpy as jnp
import matplotlib
import pytest

from stacklib.profile import (
    OpEvent,
    ProfileDirectoryError,
    Roofline,
    is_backward,
    load_trace,
    measure_bandwidth,
    measure_matmul_peak,
    mfu,
    named_scope,
    op_table,
    plot_roofline,
    runs,
    time_fn,
    trace,
)

matplotlib.use("Agg")


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    """A capture of three calls of a small jitted MLP."""

    @jax.jit
    def mlp(x, w1, w2):
        return jax.nn.softmax(jax.nn.relu(x @ w1) @ w2)

    args = (jnp.ones((64, 128)), jnp.ones((128, 256)), jnp.ones((256, 10)))
    mlp(*args).block_until_ready()
    log_dir = tmp_path_factory.mktemp("profile")
    with trace(log_dir) as files:
        for _ in range(3):
            mlp(*args).block_until_ready()
    return files


# ---------------------------------------------------------------- capture


def test_trace_writes_the_three_files_and_says_where(captured):
    assert captured.run_dir.parent == captured.log_dir / "plugins" / "profile"
    for path in (captured.xplane, captured.trace_json, captured.perfetto_json):
        assert path is not None and path.is_file() and path.stat().st_size > 0


@pytest.mark.parametrize("bad_dir", ["/dev/null/profile", "/proc/stacklib-profile"])
def test_an_unwritable_directory_fails_before_the_traced_code_runs(bad_dir):
    ran = []
    with pytest.raises(ProfileDirectoryError, match="Cannot write a profile to") as error:
        with trace(bad_dir):
            ran.append(True)
    assert not ran
    assert bad_dir in str(error.value) and "tempfile.mkdtemp()" in str(error.value)


def test_two_captures_in_one_folder_are_told_apart(tmp_path):
    with trace(tmp_path) as first:
        jnp.ones(4).block_until_ready()
    time.sleep(1.1)  # run folders are named by the second
    with trace(tmp_path) as second:
        jnp.ones(4).block_until_ready()
    assert first.run_dir != second.run_dir and second.xplane.parent == second.run_dir


# ---------------------------------------------------------------- op events and tables


def test_load_trace_finds_every_kernel_of_every_call(captured):
    events = load_trace(captured.log_dir)  # a folder works: the newest capture is used
    mine = [e for e in events if e.module == "jit_mlp"]
    assert runs(mine) == 3
    per_run = {run: sorted(e.name for e in mine if e.run_id == run) for run in {e.run_id for e in mine}}
    assert len({tuple(names) for names in per_run.values()}) == 1, "each call runs the same kernels"
    assert all(e.duration_us >= 0 for e in mine)
    assert mine == sorted(mine, key=lambda e: e.start_us)


def test_op_table_sums_per_op_sorted_with_fractions_adding_to_one(captured):
    events = load_trace(captured.perfetto_json)
    table = op_table(events, module="jit_mlp")
    assert [row.total_us for row in table] == sorted((row.total_us for row in table), reverse=True)
    assert sum(row.fraction for row in table) == pytest.approx(1.0)
    assert all(row.count == 3 for row in table)
    assert sum(row.total_us for row in table) == pytest.approx(
        sum(e.duration_us for e in events if e.module == "jit_mlp"))


def test_op_table_groups_by_any_key():
    events = [OpEvent("a", "m", 0, 5, "t", "1"), OpEvent("b", "m", 5, 3, "t", "1"),
              OpEvent("c", "m", 8, 2, "t", "1"), OpEvent("a", "other", 0, 100, "t", "2")]
    table = op_table(events, module="m", key=lambda e: "ab" if e.name in "ab" else e.name)
    assert [(row.key, row.count, row.total_us) for row in table] == [("ab", 2, 8.0), ("c", 1, 2.0)]
    assert table[0].mean_us == 4.0 and table[0].fraction == pytest.approx(0.8)


def test_a_trace_without_hlo_op_arguments_uses_the_device_op_line(tmp_path):
    # The shape of a TPU/GPU trace: ops on an "XLA Ops" line, named by the HLO instruction.
    document = {"traceEvents": [
        {"ph": "M", "pid": 3, "tid": 7, "name": "thread_name", "args": {"name": "XLA Ops"}},
        {"ph": "M", "pid": 3, "tid": 8, "name": "thread_name", "args": {"name": "Steps"}},
        {"ph": "X", "pid": 3, "tid": 7, "ts": 10.0, "dur": 4.5, "name": "fusion.3"},
        {"ph": "X", "pid": 3, "tid": 8, "ts": 10.0, "dur": 9.0, "name": "1"},
    ]}
    path = tmp_path / "device.trace.json.gz"
    with gzip.open(path, "wt") as handle:
        json.dump(document, handle)
    (event,) = load_trace(path)
    assert (event.name, event.duration_us, event.thread) == ("fusion.3", 4.5, "XLA Ops")


def test_a_missing_trace_says_where_it_looked_and_what_to_pass(tmp_path):
    with pytest.raises(FileNotFoundError, match="create_perfetto_trace=True"):
        load_trace(tmp_path)


@pytest.mark.parametrize("op_name, depth, scope, backward", [
    ("jit(step)/jvp(attention)/dot_general", 1, "attention", False),
    ("jit(step)/transpose(jvp(mlp))/dot_general", 1, "mlp", True),
    ("jit(f)/jvp(block)/attn/dot_general", 2, "block/attn", False),
    ("jit(f)/jvp(block)/attn/dot_general", 1, "block", False),
    ("jit(f)/mul;jit(f)/transpose(jvp())/broadcast_in_dim", 1, "(no scope)", False),
    ("x", 1, "(no scope)", False),
])
def test_named_scope_reads_the_name_stack_through_transformations(op_name, depth, scope, backward):
    assert named_scope(op_name, depth) == scope
    assert is_backward(op_name) == backward


# ---------------------------------------------------------------- roofline and MFU


def test_the_roofline_is_the_lower_of_two_ceilings():
    roof = Roofline(peak_flops=100e9, peak_bandwidth=10e9)
    assert roof.ridge == 10.0
    assert roof.attainable(1.0) == 10e9 and roof.attainable(1000.0) == 100e9
    assert roof.min_time(flops=100e9, nbytes=1e9) == 1.0  # compute-bound: 1 s of FLOPs
    assert roof.min_time(flops=1e9, nbytes=10e9) == 1.0  # memory-bound: 1 s of bytes
    assert roof.bound(100e9, 1e9) == "compute" and roof.bound(1e9, 10e9) == "memory"


@pytest.mark.parametrize("flops, bandwidth", [(0, 1), (1, -1), (math.nan, 1)])
def test_a_roofline_needs_positive_peaks(flops, bandwidth):
    with pytest.raises(ValueError, match="must be positive"):
        Roofline(flops, bandwidth)


def test_mfu_is_achieved_over_peak_flops():
    assert mfu(flops_per_step=50e9, step_seconds=1.0, peak_flops=100e9) == 0.5
    with pytest.raises(ValueError, match="positive"):
        mfu(1.0, 0.0, 1.0)


def test_measured_peaks_are_positive_and_finite():
    flops = measure_matmul_peak(128, repeats=2)
    bandwidth = measure_bandwidth(1 << 20, repeats=2)
    assert 0 < flops < math.inf and 0 < bandwidth < math.inf


def test_plot_roofline_places_points_and_the_ridge():
    roof = Roofline(100e9, 10e9)
    ax = plot_roofline(roof, [("matmul", 50.0, 80e9), ("add", 0.1, 0.5e9), ("copy", 0.0, 0.0)])
    assert len(ax.collections) == 2  # the zero-FLOP op cannot sit on a log axis
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"


# ---------------------------------------------------------------- timing


def test_time_fn_keeps_compilation_out_and_waits_for_the_result(monkeypatch):
    # A fake clock that only the fake step moves, so the expectations are exact on any load.
    clock = {"now": 0.0}
    monkeypatch.setattr(time, "perf_counter", lambda: clock["now"])
    calls = []

    class Pending:  # a result still being computed, as a dispatched JAX array is
        def __init__(self, seconds):
            self.ready_at = clock["now"] + seconds

        def block_until_ready(self):
            clock["now"] = max(clock["now"], self.ready_at)
            return self

    def step(x):
        clock["now"] += 0.3 if not calls else 0.0  # the first call compiles, on the caller
        calls.append(1)
        return {"loss": Pending(0.01 * len(calls))}  # the work runs after the call returns

    timing = time_fn(step, 1.0, repeats=3)
    assert len(calls) == 4
    assert timing.seconds == pytest.approx((0.02, 0.03, 0.04))  # compilation out, the work in
    assert (timing.median, timing.best) == pytest.approx((0.03, 0.02))


def test_time_fn_rejects_a_pointless_request():
    with pytest.raises(ValueError, match="repeats >= 1"):
        time_fn(lambda: None, repeats=0)
