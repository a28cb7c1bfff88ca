"""Chapter 07: scaling out. An all-reduce's cost, an all-gather from ppermute, a data-parallel
step with collectives, and a tensor-parallel MLP.

The multi-device cases need 8 devices; the exercise notebook creates 8 simulated CPU
devices in its first cells (`stacklib.hw.simulate_cpu_devices(8)`).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from stacklib import parallel
from stacklib.grading import Exercise, expect, expect_close


def _mesh(num_devices: int, axis: str):
    """A 1-D Auto mesh, or a case failure that says how to get enough devices."""
    try:
        return parallel.make_mesh((num_devices,), (axis,), (AxisType.Auto,))
    except ValueError:
        expect(False, f"this case needs {num_devices} devices and JAX has {jax.device_count()}: run "
                      "stacklib.hw.simulate_cpu_devices(8) at the top of the notebook, before any "
                      "other JAX operation, then restart and run all")


# ---- 07.all_reduce_time
all_reduce_time = Exercise("07.all_reduce_time", "The time of a ring all-reduce, from first principles")


def _ring_all_reduce(num_bytes, num_devices, bandwidth, latency):
    return 2 * (num_devices - 1) * (latency + num_bytes / num_devices / bandwidth)


@all_reduce_time.case(hint="With one device there is nobody to talk to: N - 1 = 0 hops.")
def one_device_communicates_nothing(time_fn):
    expect_close(time_fn(1e9, 1, 4.5e10, 1e-6), 0.0, atol=1e-12, what="all_reduce_time(1 GB, 1 device)")


@all_reduce_time.case(points=2, hint="A reduce-scatter and then an all-gather, each N - 1 hops "
                                     "carrying V / N bytes: 2 (N - 1) V / (N W) when latency is 0.")
def matches_the_ring_model_when_bandwidth_dominates(time_fn):
    for num_devices in (2, 4, 16, 256):
        expect_close(time_fn(2e9, num_devices, 4.5e10, 0.0), _ring_all_reduce(2e9, num_devices, 4.5e10, 0.0),
                     rtol=1e-6, what=f"all_reduce_time(2 GB, {num_devices} devices, latency 0)")


@all_reduce_time.case(hint="Every hop pays the latency once, and an all-reduce has 2 (N - 1) hops.")
def counts_the_latency_of_every_hop(time_fn):
    expect_close(time_fn(0.0, 8, 4.5e10, 1e-6), 14e-6, rtol=1e-6,
                 what="all_reduce_time(0 bytes, 8 devices, latency 1 µs)")
    expect_close(time_fn(8e6, 8, 1e9, 1e-5), _ring_all_reduce(8e6, 8, 1e9, 1e-5), rtol=1e-6,
                 what="all_reduce_time(8 MB, 8 devices, 1 GB/s, latency 10 µs)")


# ---- 07.ring_all_gather
ring_all_gather = Exercise("07.ring_all_gather", "An all-gather built from ppermute")

# Primitives that would do the gathering for you.
_COLLECTIVES = ("all_gather", "psum", "reduce_scatter", "all_to_all", "pmax", "pmin", "pbroadcast")


def _gather_with(answer, num_devices):
    mesh = _mesh(num_devices, "i")
    x = jnp.arange(num_devices * 2 * 3, dtype=jnp.float32).reshape(num_devices * 2, 3) ** 1.5
    # Every device gets all N blocks of shape (2, 3); out_specs=P("i") glues the N results.
    expected = np.tile(np.asarray(x).reshape(num_devices, 2, 3), (num_devices, 1, 1))
    run = jax.jit(jax.shard_map(lambda block: answer(block, "i"), mesh=mesh, in_specs=P("i"),
                                out_specs=P("i"), check_vma=False))
    return run, x, expected


def _expect_gathered(answer, num_devices):
    run, x, expected = _gather_with(answer, num_devices)
    got = np.asarray(run(x))
    per_device = (got.shape[0] // num_devices, *got.shape[1:])
    expect(got.shape == expected.shape,
           f"each device returned shape {per_device}, expected ({num_devices}, 2, 3): one row per device "
           "holding that device's (2, 3) block, as jax.lax.all_gather(x, axis_name) returns it (stacked, "
           "not concatenated)")
    expect_close(got, expected, rtol=0, atol=0, what="every device's gathered blocks")


def _primitives(jaxpr) -> set[str]:
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for value in eqn.params.values():
            for inner in value if isinstance(value, list | tuple) else [value]:
                inner = getattr(inner, "jaxpr", inner)  # a ClosedJaxpr wraps a Jaxpr
                if hasattr(inner, "eqns"):
                    names |= _primitives(inner)
    return names


@ring_all_gather.case(points=2, hint="Row d of the result is device d's block. Keep a buffer of N "
                                     "rows, put your own block at axis_index, then N - 1 times "
                                     "ppermute the block you received last to your right-hand "
                                     "neighbour; after k hops it came from device (me - k) mod N.")
def matches_all_gather_on_4_devices(gather):
    _expect_gathered(gather, 4)


@ring_all_gather.case(hint="Use jax.lax.axis_size(axis_name) rather than a fixed device count.")
def matches_all_gather_on_8_devices(gather):
    _expect_gathered(gather, 8)


@ring_all_gather.case(hint="Build it from jax.lax.ppermute only: no all_gather, psum or other collective.")
def uses_only_ppermute(gather):
    run, x, _ = _gather_with(gather, 4)
    used = _primitives(jax.make_jaxpr(run)(x).jaxpr)
    forbidden = sorted(name for name in used if any(c in name for c in _COLLECTIVES))
    expect(not forbidden, f"the function uses {forbidden}")
    expect("ppermute" in used, "the function never calls jax.lax.ppermute")


# ---- 07.dp_step
dp_step = Exercise("07.dp_step", "A data-parallel SGD step with collectives")
_LEARNING_RATE = 0.05


def _regression(num_rows=32, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(num_rows, 5)).astype(np.float32)
    y = (x @ rng.normal(size=(5,)) + 0.3).astype(np.float32)
    params = {"w": rng.normal(size=(5,)).astype(np.float32), "b": np.zeros((), np.float32)}
    return params, x, y


def _reference_step(params, x, y):
    """One SGD step on the whole batch, in float64 NumPy (no accelerator rounding)."""
    x, y = x.astype(np.float64), y.astype(np.float64)
    error = x @ params["w"] + params["b"] - y  # (rows,)
    grads = {"w": 2 * x.T @ error / len(y), "b": 2 * error.mean()}  # d/dp mean(error^2)
    new = {name: params[name] - _LEARNING_RATE * grads[name] for name in params}
    return new, np.mean(error**2)


def _dp_run(step_fn, num_devices):
    mesh = _mesh(num_devices, "data")
    params, x, y = _regression()
    expected = _reference_step(params, x, y)  # before the learner's code runs
    run = jax.jit(jax.shard_map(functools.partial(step_fn, learning_rate=_LEARNING_RATE), mesh=mesh,
                                in_specs=(P(), P("data"), P("data")), out_specs=(P(), P())))
    return run(params, x, y), expected


@dp_step.case(points=2, hint="Differentiate the *global* loss: jax.lax.pmean(local mean loss, "
                             "'data'). Averaging gradients of the local loss afterwards gives N "
                             "times the gradient, because shard_map already sums the gradient "
                             "of a replicated parameter over devices.")
def matches_one_device_sgd_on_8_devices(step_fn):
    (new_params, _), (expected, _) = _dp_run(step_fn, 8)
    expect_close(new_params, expected, rtol=1e-5, atol=1e-6, what="the new parameters")


@dp_step.case(hint="Nothing may depend on there being 8 devices: use pmean, not psum / 8.")
def matches_one_device_sgd_on_2_devices(step_fn):
    (new_params, _), (expected, _) = _dp_run(step_fn, 2)
    expect_close(new_params, expected, rtol=1e-5, atol=1e-6, what="the new parameters")


@dp_step.case(hint="Return the mean loss over the whole batch, the same on every device.")
def returns_the_global_mean_loss(step_fn):
    (_, loss), (_, expected) = _dp_run(step_fn, 8)
    expect_close(loss, expected, rtol=1e-5, what="the loss")


# ---- 07.tp_mlp
tp_mlp = Exercise("07.tp_mlp", "A tensor-parallel MLP with shard_map")


def _mlp_inputs(seed=0, batch=8, features=6, hidden=16, classes=3):
    rng = np.random.default_rng(seed)
    shapes = [(batch, features), (features, hidden), (hidden,), (hidden, classes), (classes,)]
    return [rng.normal(size=shape).astype(np.float32) for shape in shapes]


def _mlp_reference(x, w1, b1, w2, b2):
    return np.maximum(x @ w1 + b1, 0.0) @ w2 + b2


def _tp_run(mlp_fn, num_devices):
    mesh = _mesh(num_devices, "model")
    inputs = _mlp_inputs()
    run = jax.jit(functools.partial(mlp_fn, mesh=mesh))
    return run, inputs, _mlp_reference(*inputs)


@tp_mlp.case(points=2, hint="Cut w1 by columns and b1 with it, w2 by rows; x and b2 stay whole. "
                            "Each device's h @ w2 is a partial sum of the output: psum it over "
                            "'model', then add b2 once.")
def matches_one_device_on_2_devices(mlp_fn):
    run, inputs, expected = _tp_run(mlp_fn, 2)
    expect_close(run(*inputs), expected, rtol=1e-5, atol=1e-5, what="the output")


@tp_mlp.case(hint="The same specs must work on any size of the 'model' axis that divides hidden.")
def matches_one_device_on_8_devices(mlp_fn):
    run, inputs, expected = _tp_run(mlp_fn, 8)
    expect_close(run(*inputs), expected, rtol=1e-5, atol=1e-5, what="the output")


@tp_mlp.case(points=2, hint="Tensor parallelism never gathers the weights: the only message is "
                            "one all-reduce (psum) of the (batch, classes) output.")
def communicates_one_all_reduce_of_the_output(mlp_fn):
    run, inputs, _ = _tp_run(mlp_fn, 8)
    found = parallel.collectives(run.lower(*inputs).compile().as_text())
    summary = [(c.kind, c.num_bytes) for c in found]
    output_bytes = inputs[0].shape[0] * inputs[4].shape[0] * 4
    expect(summary == [("all-reduce", output_bytes)],
           f"expected one all-reduce of {output_bytes} bytes, the compiled program has {summary or 'none'}")
