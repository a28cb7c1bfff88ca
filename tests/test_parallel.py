"""stacklib.parallel: meshes, layouts and their errors, rules, sharded state, ring collectives,
the HLO reader, the cost model, the training strategies, and real multi-process JAX."""

import json
import math
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import stacklib.nn as nnx
from stacklib import parallel
from stacklib.parallel.mlp import MLPClassifier, make_blobs, make_loss, make_sgd_step
from stacklib.parallel.multihost_step import FSDP_RULES

AUTO = (AxisType.Auto,)


def mesh_of(shape, names, axis_types=None):
    return parallel.make_mesh(shape, names, axis_types or AUTO * len(shape))


def test_the_test_session_has_eight_cpu_devices():
    assert len(jax.devices("cpu")) == 8


# ---- mesh
def test_make_mesh_uses_the_requested_number_of_devices_and_names():
    mesh = mesh_of((4, 2), ("data", "model"))
    assert dict(mesh.shape) == {"data": 4, "model": 2}
    assert mesh.devices.size == 8


def test_make_mesh_keeps_jax_default_explicit_axes():
    assert parallel.make_mesh((2,), ("data",)).axis_types == (AxisType.Explicit,)


def test_too_few_devices_error_names_the_fix():
    with pytest.raises(ValueError, match=r"simulate_cpu_devices\(16\)"):
        parallel.mesh_devices(16)


def test_make_mesh_rejects_names_that_do_not_match_the_shape():
    with pytest.raises(ValueError, match="one name per axis"):
        parallel.make_mesh((4, 2), ("data",))


# ---- layout errors
def test_an_indivisible_spec_names_the_dimension_the_axis_and_the_sizes():
    mesh = mesh_of((8,), ("data",))
    with pytest.raises(parallel.ShardingError) as error:
        parallel.shard_shape((10, 4), P("data"), mesh)
    message = str(error.value)
    assert "dimension 0 has size 10" in message and "'data' (8)" in message
    assert "multiple of 8" in message


def test_an_indivisible_spec_over_two_axes_names_both():
    mesh = mesh_of((4, 2), ("data", "model"))
    with pytest.raises(parallel.ShardingError, match=r"'data' \(4\) x 'model' \(2\)"):
        parallel.shard_shape((12, 3), P(("data", "model")), mesh)


@pytest.mark.parametrize("spec, fragment", [
    (P("nope"), "mesh axis 'nope'"),
    (P("data", "data"), "uses mesh axis 'data' for dimensions 0 and 1"),
    (P("data", None, None), "3 entries"),
])
def test_malformed_specs_say_what_is_wrong(spec, fragment):
    mesh = mesh_of((8,), ("data",))
    with pytest.raises(parallel.ShardingError, match=fragment):
        parallel.device_slices((8, 8), spec, mesh)


def test_real_jax_also_rejects_an_indivisible_spec():
    # Our check only says more (the leaf's path); JAX itself refuses to place the array.
    mesh = mesh_of((8,), ("data",))
    with pytest.raises(ValueError, match="evenly divide"):
        jax.device_put(jnp.zeros((10, 4)), NamedSharding(mesh, P("data")))


def test_every_device_holds_one_block_and_the_blocks_tile_the_array():
    mesh = mesh_of((4, 2), ("data", "model"))
    covered = np.zeros((8, 6), int)
    for rows, cols in parallel.device_slices((8, 6), P("data", "model"), mesh).values():
        covered[rows, cols] += 1
    assert (covered == 1).all()


# ---- rules
def test_rules_map_logical_names_to_mesh_axes():
    rules = (("batch", "data"), ("hidden", "model"))
    assert parallel.logical_to_mesh_axes(("batch", "hidden"), rules) == P("data", "model")
    assert parallel.logical_to_mesh_axes(None, rules) is None


def test_a_repeated_logical_name_is_rejected():
    with pytest.raises(ValueError, match=r"\['hidden'\] appear more than once"):
        parallel.logical_to_mesh_axes(("hidden", "hidden"), (("hidden", "model"),))


@pytest.mark.parametrize("rules", [{"hidden": "model"}, (("hidden",),), ((1, "model"),)])
def test_malformed_rules_get_an_example_of_the_right_form(rules):
    with pytest.raises(ValueError, match="hidden', 'model'|logical name, mesh axes"):
        parallel.logical_to_mesh_axes(("hidden",), rules)


# ---- state
@pytest.fixture
def model_state():
    return nnx.split(MLPClassifier(16, 32, 8, rngs=nnx.Rngs(0)))


def test_partition_specs_come_from_the_variables_names_and_the_rules(model_state):
    _, state = model_state
    specs = parallel.get_partition_spec(state, (("hidden", "model"),))
    assert specs["fc1"]["kernel"].get_value() == P(None, "model")
    assert specs["fc1"]["bias"].get_value() == P("model")
    assert specs["fc2"]["kernel"].get_value() == P("model", None)
    assert specs["fc2"]["bias"].get_value() == P(None)


def test_a_stacklib_nn_state_keeps_its_structure_and_variable_types(model_state):
    _, state = model_state
    names = parallel.logical_axes(state)
    assert isinstance(names, nnx.State) and isinstance(names["fc1"]["kernel"], nnx.Param)
    assert names["fc1"]["kernel"].get_value() == P("features", "hidden")  # from with_partitioning
    specs = parallel.get_partition_spec(state, (("hidden", "model"),))
    assert jax.tree.structure(specs) == jax.tree.structure(state)  # Variables, metadata and all


def test_plain_pytrees_get_their_names_from_path_annotations(model_state):
    _, state = model_state
    pure = nnx.to_pure_dict(state)
    annotations = [(r"fc\d/kernel", ("in", "out")), (r".*bias", ("out",))]
    specs = parallel.get_partition_spec(pure, (("out", "model"),), annotations=annotations)
    assert specs == {"fc1": {"kernel": P(None, "model"), "bias": P("model")},
                     "fc2": {"kernel": P(None, "model"), "bias": P("model")}}
    assert parallel.logical_axes(pure, annotations=annotations)["fc1"]["kernel"] == P("in", "out")


def test_unannotated_leaves_are_replicated():
    specs = parallel.get_partition_spec({"w": jnp.ones((4, 4))}, (("hidden", "model"),))
    assert specs == {"w": P()}


def test_names_that_do_not_match_the_rank_are_rejected_with_the_path():
    with pytest.raises(ValueError, match=r"w: logical names \('a',\) have 1 entries"):
        parallel.get_partition_spec({"w": jnp.ones((4, 4))}, (), annotations=[("w", ("a",))])


def test_shard_state_places_each_leaf_as_the_rules_say(model_state):
    _, state = model_state
    mesh = mesh_of((8,), ("data",))
    sharded = parallel.shard_state(state, mesh, FSDP_RULES)
    kernel = sharded["fc1"]["kernel"].get_value()
    assert kernel.sharding.spec == P(None, "data")
    assert kernel.addressable_shards[0].data.shape == (16, 4)
    np.testing.assert_array_equal(kernel, state["fc1"]["kernel"].get_value())


def test_shard_state_error_names_the_leaf_that_does_not_divide():
    _, state = nnx.split(MLPClassifier(16, 12, 8, rngs=nnx.Rngs(0)))  # 12 hidden units on 8 devices
    mesh = mesh_of((8,), ("data",))
    with pytest.raises(parallel.ShardingError, match=r"fc1/bias: dimension 0 has size 12"):
        parallel.shard_state(state, mesh, FSDP_RULES)


# ---- ring collectives
def test_ring_collectives_use_only_ppermute():
    mesh = mesh_of((4,), ("i",))
    fn = jax.shard_map(lambda b: parallel.ring_psum(b, "i"), mesh=mesh, in_specs=P("i"),
                       out_specs=P("i"), check_vma=False)
    text = str(jax.make_jaxpr(fn)(jnp.ones((8, 3))))
    assert "ppermute" in text
    assert not any(name in text for name in ("psum", "all_gather", "reduce_scatter"))


def test_ring_psum_scatter_rejects_a_dimension_that_does_not_match_the_axis():
    mesh = mesh_of((4,), ("i",))
    fn = jax.jit(jax.shard_map(lambda b: parallel.ring_psum_scatter(b, "i"), mesh=mesh,
                               in_specs=P("i"), out_specs=P("i")))
    with pytest.raises(ValueError, match="must be exactly 4"):
        fn(jnp.ones((12, 2)))


def test_ring_psum_has_the_gradient_of_psum():
    mesh = mesh_of((4,), ("i",))

    def total(reduce, x):
        summed = jax.shard_map(lambda b: reduce(b, "i"), mesh=mesh, in_specs=P("i"), out_specs=P("i"),
                               check_vma=False)(x)
        return jnp.sum(summed * jnp.arange(summed.size).reshape(summed.shape))

    x = jax.random.normal(jax.random.key(0), (8, 3))
    ours = jax.jit(jax.grad(lambda x: total(parallel.ring_psum, x)))(x)
    theirs = jax.jit(jax.grad(lambda x: total(jax.lax.psum, x)))(x)
    np.testing.assert_allclose(ours, theirs, rtol=1e-6)


def test_ring_psum_keeps_the_dtype():
    mesh = mesh_of((4,), ("i",))
    out = jax.jit(jax.shard_map(lambda b: parallel.ring_psum(b, "i"), mesh=mesh, in_specs=P("i"),
                                out_specs=P("i"), check_vma=False))(jnp.ones((4, 3), jnp.bfloat16))
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(out, np.full((4, 3), 4.0))


# ---- HLO reader
SYNTHETIC_HLO = "\n".join([
    "HloModule jit_step, num_partitions=8",
    "  %all-reduce.5 = (f32[256]{0}, f32[256,32]{1,0}, f32[]) all-reduce(%a, %b, %c), channel_id=1,"
    " replica_groups=[1,8]<=[8], to_apply=%add",
    "  %all-gather.1 = f32[256,10]{1,0} all-gather(%p), channel_id=2,"
    " replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_1'}, dimensions={0}",
    "  %reduce-scatter.2 = bf16[16,4]{1,0} reduce-scatter(%g), channel_id=3,"
    " replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}",
    "  %collective-permute.3 = f32[64]{0} collective-permute(%x), channel_id=4,"
    " source_target_pairs={{0,1},{1,0}}",
    "  %all-gather-start.4 = (f32[8]{0}, f32[64]{0}) all-gather-start(%q), channel_id=5,"
    " replica_groups={}, dimensions={0}",
    "  %all-gather-done.4 = f32[64]{0} all-gather-done(%all-gather-start.4)",
    "  ROOT %all-to-all.6 = s8[32]{0} all-to-all(%r), channel_id=6,"
    " replica_groups=[2,4]<=[4,2]T(1,0), dimensions={0}",
])


def test_the_hlo_reader_finds_each_collective_with_its_bytes_and_group():
    found = parallel.collectives(SYNTHETIC_HLO)
    summary = [(c.kind, c.num_bytes, c.group_size) for c in found]
    assert summary == [
        ("all-reduce", 4 * (256 + 256 * 32 + 1), 8),
        ("all-gather", 4 * 256 * 10, 2),
        ("reduce-scatter", 2 * 16 * 4 * 4, 4),
        ("collective-permute", 4 * 64, 1),
        ("all-gather", 4 * 64, 8),  # async: the result of the start, counted once
        ("all-to-all", 32 * 4, 4),
    ]
    assert parallel.bytes_by_kind(found)["all-gather"] == 4 * (2560 + 64)


def test_the_hlo_reader_rejects_unknown_element_types():
    with pytest.raises(ValueError, match="Unknown HLO element type 'q7'"):
        parallel.collectives("%x = q7[4]{0} all-reduce(%y), replica_groups={}")


def test_a_data_parallel_step_all_reduces_exactly_the_gradient_bytes(model_state):
    graphdef, state = model_state
    mesh = mesh_of((8,), ("data",))
    batch = NamedSharding(mesh, P("data"))
    x, y = make_blobs(0, 64, 16, 8)
    sharded = parallel.shard_state(state, mesh, (("batch", "data"),))
    step = jax.jit(make_sgd_step(graphdef, 0.1))
    hlo = step.lower(sharded, jax.device_put(x, batch), jax.device_put(y, batch)).compile().as_text()
    param_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(state))
    reduced = parallel.bytes_by_kind(parallel.collectives(hlo))
    assert reduced.get("all-reduce", 0) - param_bytes in (0, 4)  # + the loss, if XLA folds it in
    assert set(reduced) == {"all-reduce"}


# ---- cost model
def simulate_ring(num_bytes, n, link, chunks_per_hop):
    """Hop-by-hop: every hop moves one chunk of V / N over every link at once."""
    return chunks_per_hop * (link.latency + num_bytes / n / link.bandwidth)


@pytest.mark.parametrize("n", [1, 2, 5, 8, 64])
@pytest.mark.parametrize("bidirectional", [False, True])
def test_ring_formulas_count_the_hops_of_the_algorithm(n, bidirectional):
    link = parallel.Link(bandwidth=1e9, latency=1e-6, bidirectional=bidirectional)
    hops = math.ceil((n - 1) / 2) if bidirectional else n - 1
    v = 3e6
    assert parallel.all_gather_time(v, n, link) == pytest.approx(simulate_ring(v, n, link, hops))
    assert parallel.reduce_scatter_time(v, n, link) == pytest.approx(simulate_ring(v, n, link, hops))
    assert parallel.all_reduce_time(v, n, link) == pytest.approx(simulate_ring(v, n, link, 2 * hops))


def busiest_link_bytes(num_bytes, n, bidirectional):
    """Route every all-to-all message the short way round and count bytes per directed link."""
    load = {}
    message = num_bytes / n**2
    for source in range(n):
        for target in range(n):
            forward = (target - source) % n
            step = 1 if not bidirectional or forward <= n - forward else -1
            distance = forward if step == 1 else n - forward
            share = 0.5 if bidirectional and 2 * forward == n else 1.0  # a tie splits both ways
            for direction in ([step, -step] if share == 0.5 else [step]):
                node = source
                for _ in range(distance):
                    load[(node, direction)] = load.get((node, direction), 0) + share * message
                    node = (node + direction) % n
    return max(load.values(), default=0.0)


@pytest.mark.parametrize("n", [2, 3, 4, 8, 9])
@pytest.mark.parametrize("bidirectional", [False, True])
def test_all_to_all_formula_matches_routing_every_message(n, bidirectional):
    link = parallel.Link(bandwidth=1e9, latency=0.0, bidirectional=bidirectional)
    expected = busiest_link_bytes(8e6, n, bidirectional) / link.bandwidth
    assert parallel.all_to_all_time(8e6, n, link) == pytest.approx(expected)


def test_large_all_gathers_cost_about_bytes_over_bandwidth_whatever_the_device_count():
    link = parallel.Link(bandwidth=4.5e10, latency=1e-6, bidirectional=True)
    times = [parallel.all_gather_time(1e9, n, link) for n in (16, 64, 256)]
    assert all(t == pytest.approx(1e9 / 9e10, rel=0.1) for t in times)


def test_one_device_communicates_nothing():
    link = parallel.Link(bandwidth=1e9, latency=1e-3)
    assert parallel.all_reduce_time(1e6, 1, link) == 0.0
    assert parallel.all_to_all_time(1e6, 1, link) == 0.0


def test_fit_link_recovers_latency_and_bandwidth():
    sizes = np.array([1e4, 1e5, 1e6, 4e6])
    link = parallel.fit_link(sizes, 20e-6 + sizes / 2e9)
    assert link.bandwidth == pytest.approx(2e9, rel=1e-6)
    assert link.latency == pytest.approx(20e-6, rel=1e-6)


@pytest.mark.parametrize("sizes, times, fragment", [
    ([1e6, 1e6], [1.0, 2.0], "two different sizes"),
    ([1e3, 1e6], [2.0, 1.0], "do not grow with size"),
])
def test_fit_link_explains_unusable_measurements(sizes, times, fragment):
    with pytest.raises(ValueError, match=fragment):
        parallel.fit_link(sizes, times)


def test_a_link_needs_a_positive_bandwidth():
    with pytest.raises(ValueError, match="bandwidth > 0"):
        parallel.Link(bandwidth=0.0)


def test_collective_time_dispatches_on_the_kind():
    link = parallel.Link(bandwidth=1e9, latency=1e-6)
    gather = parallel.Collective("all-gather", 8000, 4, "")
    permute = parallel.Collective("collective-permute", 8000, 1, "")
    assert parallel.collective_time(gather, link) == parallel.all_gather_time(8000, 4, link)
    assert parallel.collective_time(permute, link) == parallel.ppermute_time(8000, link)


# ---- the model and the training strategies
def test_blobs_are_float32_features_and_int32_labels_the_same_for_the_same_seed():
    x, y = make_blobs(0, 32, 5, 3)
    assert x.shape == (32, 5) and x.dtype == np.float32
    assert y.shape == (32,) and y.dtype == np.int32 and 0 <= y.min() and y.max() < 3
    again, _ = make_blobs(0, 32, 5, 3)
    other, _ = make_blobs(1, 32, 5, 3)
    assert np.array_equal(x, again) and not np.array_equal(x, other)


def test_sgd_training_fits_the_blobs_and_does_not_recompile():
    graphdef, state = nnx.split(MLPClassifier(8, 32, 4, rngs=nnx.Rngs(0)))
    x, y = make_blobs(1, 128, 8, 4)
    step = jax.jit(make_sgd_step(graphdef, 0.3))
    losses = []
    for _ in range(40):
        state, loss = step(state, x, y)
        losses.append(float(loss))
    assert losses[-1] < 0.2 * losses[0]
    assert step._cache_size() == 1


def test_the_loss_gradient_matches_central_differences():
    graphdef, state = nnx.split(MLPClassifier(3, 4, 2, rngs=nnx.Rngs(0)))
    x, y = make_blobs(1, 6, 3, 2)
    loss = jax.jit(make_loss(graphdef))
    with jax.enable_x64():
        state64 = jax.tree.map(lambda a: a.astype(jnp.float64), state)
        x64 = x.astype(jnp.float64)
        grad = jax.grad(loss)(state64, x64, y)["fc1"]["kernel"].get_value()
        kernel = state64["fc1"]["kernel"].get_value()
        eps = 1e-6
        for index in [(0, 0), (1, 2), (2, 3)]:
            bump = jnp.zeros_like(kernel).at[index].set(eps)
            up = jax.tree.map(lambda a: a, state64)
            up["fc1"]["kernel"].set_value(kernel + bump)
            down = jax.tree.map(lambda a: a, state64)
            down["fc1"]["kernel"].set_value(kernel - bump)
            numeric = (loss(up, x64, y) - loss(down, x64, y)) / (2 * eps)
            assert float(grad[index]) == pytest.approx(float(numeric), rel=1e-5, abs=1e-8)


STRATEGIES = {
    "data parallel": ((8,), ("data",), (("batch", "data"),)),
    "fsdp": ((8,), ("data",), (("batch", "data"), ("hidden", "data"))),
    "tensor parallel": ((8,), ("model",), (("hidden", "model"),)),
    "data x tensor parallel": ((4, 2), ("data", "model"), (("batch", "data"), ("hidden", "model"))),
}


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_each_strategy_takes_the_same_step_as_one_device(name):
    mesh_shape, names, rules = STRATEGIES[name]
    mesh = mesh_of(mesh_shape, names)
    graphdef, state = nnx.split(MLPClassifier(16, 32, 8, rngs=nnx.Rngs(0)))
    x, y = make_blobs(1, 64, 16, 8)
    step = make_sgd_step(graphdef, 0.1)
    expected_state, expected_loss = jax.jit(step)(state, x, y)

    shardings = parallel.get_named_sharding(state, mesh, rules)
    batch = NamedSharding(mesh, parallel.logical_to_mesh_axes(("batch", None), rules))
    labels = NamedSharding(mesh, parallel.logical_to_mesh_axes(("batch",), rules))
    sharded_step = jax.jit(step, out_shardings=(shardings, NamedSharding(mesh, P())))
    new_state, loss = sharded_step(jax.device_put(state, shardings), jax.device_put(x, batch),
                                   jax.device_put(y, labels))
    # Sums run in a different order on 8 devices: agreement to float32 rounding.
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-6)
    for ours, reference in zip(jax.tree.leaves(new_state), jax.tree.leaves(expected_state), strict=True):
        np.testing.assert_allclose(ours, reference, rtol=1e-5, atol=1e-6)
    kernel = new_state["fc1"]["kernel"].get_value()
    assert kernel.sharding.spec == shardings["fc1"]["kernel"].get_value().spec


# ---- multi-process JAX
def reference_run(steps=3, batch=32, features=8, hidden=16, classes=4, learning_rate=0.5, seed=0):
    graphdef, state = nnx.split(MLPClassifier(features, hidden, classes, rngs=nnx.Rngs(seed)))
    x, y = make_blobs(seed + 1, batch, features, classes)
    step = jax.jit(make_sgd_step(graphdef, learning_rate))
    losses = []
    for _ in range(steps):
        state, loss = step(state, x, y)
        losses.append(float(loss))
    return losses, nnx.to_pure_dict(state)


def results_of(processes):
    lines = [line for p in processes for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    return [json.loads(line.removeprefix("RESULT ")) for line in lines]


@pytest.mark.slow
def test_two_processes_train_one_fsdp_model_together_like_one_device():
    processes = parallel.launch_local("stacklib.parallel.multihost_step", 2, local_device_count=2,
                                      timeout_s=240)
    first, second = results_of(processes)
    assert [first["process_index"], second["process_index"]] == [0, 1]
    assert first["device_count"] == 4 and first["process_count"] == 2
    assert set(first["local_device_ids"]).isdisjoint(second["local_device_ids"])
    assert first["batch_rows_held"] == [[0, 8], [8, 16]]
    assert second["batch_rows_held"] == [[16, 24], [24, 32]]
    assert first["kernel_shard_shape"] == [8, 4]  # 16 hidden units over 4 devices in 2 processes
    losses, params = reference_run()
    # Float32 sums in a different order across devices and processes: rounding-level differences.
    np.testing.assert_allclose(first["losses"], losses, rtol=1e-5)
    assert first["losses"] == second["losses"]
    gathered = jax.tree.leaves(first["params"], is_leaf=lambda x: isinstance(x, list))
    for ours, reference in zip(gathered, jax.tree.leaves(params), strict=True):
        np.testing.assert_allclose(ours, reference, rtol=1e-4, atol=1e-6)


@pytest.fixture
def module_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{':'.join(sys.path)}")
    return tmp_path


@pytest.mark.slow
def test_a_failing_process_is_reported_with_its_error_and_the_others_are_stopped(module_dir):
    (module_dir / "fails_on_one.py").write_text(textwrap.dedent("""
        import os, time
        if os.environ["STACKLIB_PROCESS_ID"] == "1":
            raise SystemExit("process 1 cannot find its data shard")
        time.sleep(300)
    """))
    with pytest.raises(parallel.LaunchError) as error:
        parallel.launch_local("fails_on_one", 2, timeout_s=120)
    message = str(error.value)
    assert "cannot find its data shard" in message
    assert "process 0: killed because another process failed" in message


@pytest.mark.slow
def test_a_hanging_job_is_killed_at_the_timeout_even_if_it_ignores_sigterm(module_dir):
    (module_dir / "hangs.py").write_text(textwrap.dedent("""
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as JAX's preemption notifier does
        time.sleep(300)
    """))
    processes = parallel.launch_local("hangs", 2, timeout_s=2, check=False)
    assert all(p.timed_out and p.returncode == -9 for p in processes)


def test_initialize_from_env_outside_a_launch_explains_itself(monkeypatch):
    monkeypatch.delenv("STACKLIB_PROCESS_ID", raising=False)
    with pytest.raises(RuntimeError, match="launch_local"):
        parallel.initialize_from_env()
