"""stacklib.parallel against the real libraries: jax.sharding geometry, flax's logical rules,
nnx.get_partition_spec, and jax.lax collectives."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from stacklib import parallel
from stacklib.parallel.mlp import MLPClassifier

AUTO = (AxisType.Auto,)


def mesh_of(shape, names):
    return parallel.make_mesh(shape, names, AUTO * len(shape))


# ---- layout: one case table; geometry is integer arithmetic, so the match is exact.
LAYOUT_CASES = [
    ((8, 4), P("data"), (8,), ("data",)),
    ((8, 4), P(None, "data"), (2, 4), ("model", "data")),
    ((16, 6), P("data", "model"), (4, 2), ("data", "model")),
    ((16, 6), P(("data", "model")), (4, 2), ("data", "model")),
    ((16, 6), P(("model", "data")), (4, 2), ("data", "model")),
    ((8, 6, 4), P(None, "model", "data"), (2, 2, 2), ("data", "model", "x")),
    ((8,), P(), (8,), ("data",)),
]


@pytest.mark.parametrize("shape, spec, mesh_shape, names", LAYOUT_CASES)
def test_device_slices_match_named_sharding_devices_indices_map(shape, spec, mesh_shape, names):
    mesh = mesh_of(mesh_shape, names)
    real = NamedSharding(mesh, spec).devices_indices_map(shape)
    ours = parallel.device_slices(shape, spec, mesh)
    assert set(ours) == set(real)
    for device, slices in real.items():
        expected = [s.indices(n) for s, n in zip(slices, shape, strict=True)]
        assert [s.indices(n) for s, n in zip(ours[device], shape, strict=True)] == expected, device


@pytest.mark.parametrize("shape, spec, mesh_shape, names", LAYOUT_CASES)
def test_shard_shape_matches_named_sharding(shape, spec, mesh_shape, names):
    mesh = mesh_of(mesh_shape, names)
    assert parallel.shard_shape(shape, spec, mesh) == NamedSharding(mesh, spec).shard_shape(shape)


# ---- rules: (logical names, rules); the output is a PartitionSpec, compared exactly.
RULES_CASES = [
    (("batch", "hidden"), (("batch", "data"), ("hidden", "model"))),
    (("batch", "hidden"), (("hidden", "data"), ("batch", "data"))),  # first rule wins the axis
    (("batch", "length", "heads", "features"),
     (("batch", "X"), ("features", "X"), ("heads", "Y"), ("batch", "Z"))),  # Flax's docstring example
    (("batch", "embed"), (("batch", ("data", "fsdp")), ("embed", "fsdp"))),  # fsdp already used
    (("batch", "embed"), (("batch", None), ("batch", "data"), ("embed", "model"))),  # explicit None
    (("vocab", None), (("vocab", "model"),)),
    (("unknown",), (("hidden", "model"),)),
    ((), (("hidden", "model"),)),
]


@pytest.mark.parametrize("names, rules", RULES_CASES)
def test_logical_to_mesh_axes_matches_flax_linen(names, rules):
    assert parallel.logical_to_mesh_axes(names, rules) == nn.logical_to_mesh_axes(names, rules)


def test_logical_to_mesh_matches_flax_linen_on_a_pytree():
    tree = {"kernel": P("features", "hidden"), "bias": P("hidden"), "x": P("batch", None)}
    rules = (("batch", "data"), ("hidden", "model"))
    assert parallel.logical_to_mesh(tree, rules) == nn.logical_to_mesh(tree, rules)
    mesh = mesh_of((4, 2), ("data", "model"))
    ours = parallel.logical_to_mesh_sharding(tree, mesh, rules)
    theirs = nn.logical_to_mesh_sharding(tree, mesh, rules)
    assert ours == theirs


def test_missing_names_are_none_where_flax_linen_agrees_and_nnx_differs():
    # A documented difference: nnx renames by the rules and keeps unmatched names.
    state = nnx.state(MLPClassifier(4, 8, 2, rngs=nnx.Rngs(0)))
    rules = (("hidden", "model"),)
    with nnx.logical_axis_rules(rules):
        theirs = nnx.get_partition_spec(state)
    ours = parallel.get_partition_spec(state, rules)
    assert theirs["fc1"]["kernel"].get_value() == P("features", "model")  # 'features' kept as a name
    assert ours["fc1"]["kernel"].get_value() == P(None, "model")


# ---- state: rules where every logical name has a rule, so nnx and we must agree exactly.
STATE_RULES = [
    (("features", None), ("hidden", "data"), ("classes", None)),
    (("features", None), ("hidden", "model"), ("classes", None)),
    (("features", "model"), ("hidden", "data"), ("classes", None)),
]


@pytest.mark.parametrize("rules", STATE_RULES)
def test_get_partition_spec_matches_nnx_when_every_name_has_a_rule(rules):
    state = nnx.state(MLPClassifier(4, 8, 2, rngs=nnx.Rngs(0)))
    with nnx.logical_axis_rules(rules):
        theirs = nnx.get_partition_spec(state)
    ours = parallel.get_partition_spec(state, rules)
    assert jax.tree.structure(ours) == jax.tree.structure(theirs)
    assert jax.tree.leaves(ours) == jax.tree.leaves(theirs)


@pytest.mark.parametrize("rules", STATE_RULES)
def test_get_named_sharding_matches_nnx(rules):
    state = nnx.state(MLPClassifier(4, 8, 2, rngs=nnx.Rngs(0)))
    mesh = mesh_of((4, 2), ("data", "model"))
    with nnx.logical_axis_rules(rules):
        theirs = nnx.get_named_sharding(state, mesh)
    assert jax.tree.leaves(parallel.get_named_sharding(state, mesh, rules)) == jax.tree.leaves(theirs)


# ---- collectives: ring versions against jax.lax inside shard_map. Integer-valued floats for
# the gathers (moves only, so exact); random floats for sums, whose order differs: a ring adds
# in ring order, XLA in its own, so results agree to float32 rounding (rtol 1e-5).
def run(fn, mesh, x, out_spec, check_vma=True):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("i"), out_specs=out_spec,
                                 check_vma=check_vma))(x)


@pytest.mark.parametrize("n", [1, 2, 3, 8])
@pytest.mark.parametrize("axis, tiled", [(0, False), (1, False), (0, True), (1, True)])
def test_ring_all_gather_matches_lax_all_gather(n, axis, tiled):
    mesh = mesh_of((n,), ("i",))
    x = jnp.arange(n * 4 * 3, dtype=jnp.float32).reshape(n * 4, 3)
    ours = run(lambda b: parallel.ring_all_gather(b, "i", axis=axis, tiled=tiled), mesh, x, P("i"), False)
    theirs = run(lambda b: jax.lax.all_gather(b, "i", axis=axis, tiled=tiled), mesh, x, P("i"))
    np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("n", [1, 2, 3, 8])
@pytest.mark.parametrize("dim, tiled", [(0, False), (1, False), (0, True), (1, True)])
def test_ring_psum_scatter_matches_lax_psum_scatter(n, dim, tiled):
    mesh = mesh_of((n,), ("i",))
    block = [5, 3]
    block[dim] = n * (2 if tiled else 1)
    x = jax.random.normal(jax.random.key(n), (n * block[0], block[1]))
    options = {"scatter_dimension": dim, "tiled": tiled}
    ours = run(lambda b: parallel.ring_psum_scatter(b, "i", **options), mesh, x, P("i"))
    theirs = run(lambda b: jax.lax.psum_scatter(b, "i", **options), mesh, x, P("i"))
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n", [1, 2, 3, 8])
@pytest.mark.parametrize("block", [(1,), (7, 3), (2, 5, 4)])
def test_ring_psum_matches_lax_psum(n, block):
    mesh = mesh_of((n,), ("i",))
    x = jax.random.normal(jax.random.key(7), (n * block[0], *block[1:]))
    ours = run(lambda b: parallel.ring_psum(b, "i"), mesh, x, P("i"), False)
    theirs = run(lambda b: jax.lax.psum(b, "i"), mesh, x, P())
    np.testing.assert_allclose(ours[: block[0]], theirs, rtol=1e-5, atol=1e-6)
