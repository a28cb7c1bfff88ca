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

import stacklib.nn as our_nnx
from stacklib import parallel
from stacklib.parallel.mlp import MLPClassifier

AUTO = (AxisType.Auto,)


class FlaxMLPClassifier(nnx.Module):
    """stacklib.parallel.mlp.MLPClassifier written with the real flax.nnx, for comparisons."""

    def __init__(self, num_features, num_hidden, num_classes, *, rngs):
        def named(initializer, names):  # flax would shard eagerly, which needs a mesh; we build whole
            return nnx.with_partitioning(initializer, names, eager_sharding=False)

        self.fc1 = nnx.Linear(num_features, num_hidden, rngs=rngs,
                              kernel_init=named(nnx.initializers.lecun_normal(), ("features", "hidden")),
                              bias_init=named(nnx.initializers.zeros_init(), ("hidden",)))
        self.fc2 = nnx.Linear(num_hidden, num_classes, rngs=rngs,
                              kernel_init=named(nnx.initializers.lecun_normal(), ("hidden", "classes")),
                              bias_init=named(nnx.initializers.zeros_init(), ("classes",)))

    def __call__(self, x):
        return self.fc2(jax.nn.relu(self.fc1(x)))


def both_states(num_features=4, num_hidden=8, num_classes=2, seed=0):
    """(our state, flax's state) of the same classifier from the same seed."""
    ours = our_nnx.state(MLPClassifier(num_features, num_hidden, num_classes, rngs=our_nnx.Rngs(seed)))
    theirs = nnx.state(FlaxMLPClassifier(num_features, num_hidden, num_classes, rngs=nnx.Rngs(seed)))
    return ours, theirs


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


# ---- the model: our classifier (stacklib.nn) and its flax twin, from the same seed.
def test_the_flax_twin_has_the_same_weights_and_names():
    ours, theirs = both_states()
    our_vars, their_vars = our_nnx.to_flat_state(ours), nnx.to_flat_state(theirs)
    assert [path for path, _ in our_vars] == [tuple(path) for path, _ in their_vars]
    for (path, mine), (_, reference) in zip(our_vars, their_vars, strict=True):
        assert mine.out_sharding == reference.out_sharding, path
        np.testing.assert_array_equal(mine.get_value(), reference.get_value(), err_msg=str(path))


def test_missing_names_are_none_where_flax_linen_agrees_and_nnx_differs():
    # A documented difference: nnx renames by the rules and keeps unmatched names.
    ours, theirs = both_states()
    rules = (("hidden", "model"),)
    with nnx.logical_axis_rules(rules):
        their_specs = nnx.get_partition_spec(theirs)
    assert their_specs["fc1"]["kernel"].get_value() == P("features", "model")  # 'features' kept as a name
    assert parallel.get_partition_spec(ours, rules)["fc1"]["kernel"].get_value() == P(None, "model")


# ---- state: rules where every logical name has a rule, so nnx and we must agree exactly, on our
# model's state, on the flax twin's state, and on our state as a plain dict with path annotations.
STATE_RULES = [
    (("features", None), ("hidden", "data"), ("classes", None)),
    (("features", None), ("hidden", "model"), ("classes", None)),
    (("features", "model"), ("hidden", "data"), ("classes", None)),
]
ANNOTATIONS = [("fc1/kernel", ("features", "hidden")), ("fc1/bias", ("hidden",)),
               ("fc2/kernel", ("hidden", "classes")), ("fc2/bias", ("classes",))]


@pytest.mark.parametrize("rules", STATE_RULES)
def test_get_partition_spec_matches_nnx_when_every_name_has_a_rule(rules):
    ours, theirs = both_states()
    with nnx.logical_axis_rules(rules):
        reference = nnx.get_partition_spec(theirs)
    for state in [ours, theirs]:
        specs = parallel.get_partition_spec(state, rules)
        assert jax.tree.structure(specs) == jax.tree.structure(state)
        assert jax.tree.leaves(specs) == jax.tree.leaves(reference)
    pure = parallel.get_partition_spec(our_nnx.to_pure_dict(ours), rules, annotations=ANNOTATIONS)
    assert jax.tree.leaves(pure) == jax.tree.leaves(reference)


@pytest.mark.parametrize("rules", STATE_RULES)
def test_get_named_sharding_matches_nnx(rules):
    ours, theirs = both_states()
    mesh = mesh_of((4, 2), ("data", "model"))
    with nnx.logical_axis_rules(rules):
        reference = jax.tree.leaves(nnx.get_named_sharding(theirs, mesh))
    assert jax.tree.leaves(parallel.get_named_sharding(ours, mesh, rules)) == reference
    assert jax.tree.leaves(parallel.get_named_sharding(theirs, mesh, rules)) == reference


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
