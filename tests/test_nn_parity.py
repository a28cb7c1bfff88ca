"""stacklib.nn agrees with flax.nnx: same seeds give the same weights, outputs and gradients,
and `with_partitioning` attaches the same sharding metadata.

Each case builds the same layer or model against both APIs from the same `Rngs` seed.
Because our layers draw their keys in flax's order and use JAX's initializers, the
initial states are bit-identical, so no weights need copying. The outputs then agree to
1e-6 (float32; measured 0.0 for most cases: the same XLA ops in the same order), and so
do the gradients with respect to every Param. The state trees correspond one to one:
the same paths, shapes, dtypes and Variable types.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx as flax_nnx
from jax.sharding import PartitionSpec as P

import stacklib.nn as our_nnx

X = jax.random.normal(jax.random.key(42), (2, 5, 8))
IDS = (jnp.arange(10).reshape(2, 5) * 3) % 11


def _mlp(nnx, rngs):
    class MLP(nnx.Module):
        def __init__(self, *, rngs):
            self.hidden = nnx.Linear(8, 16, rngs=rngs)
            self.norm = nnx.LayerNorm(16, rngs=rngs)
            self.dropout = nnx.Dropout(0.25, rngs=rngs)
            self.out = nnx.Linear(16, 3, rngs=rngs)

        def __call__(self, x):
            return self.out(self.dropout(nnx.gelu(self.norm(self.hidden(x)))))

    return MLP(rngs=rngs)


def _decoder_block(nnx, rngs):
    class Block(nnx.Module):
        def __init__(self, *, rngs):
            self.embed = nnx.Embed(11, 8, rngs=rngs)
            self.norm = nnx.RMSNorm(8, rngs=rngs)
            self.attention = nnx.MultiHeadAttention(2, 8, decode=False, rngs=rngs)
            self.head = nnx.Linear(8, 11, use_bias=False, rngs=rngs)

        def __call__(self, ids):
            h = self.embed(ids)
            h = h + self.attention(self.norm(h), is_causal=True)
            return self.head(h)

    return Block(rngs=rngs)


# (name, build(nnx, rngs) -> module, call(module) -> output). Calls run in training mode,
# so the dropout cases compare random masks too.
CASES = [
    ("linear", lambda nnx, r: nnx.Linear(8, 4, rngs=r), lambda m: m(X)),
    ("linear_no_bias", lambda nnx, r: nnx.Linear(8, 4, use_bias=False, rngs=r), lambda m: m(X)),
    ("linear_general", lambda nnx, r: nnx.LinearGeneral(8, (2, 3), rngs=r), lambda m: m(X)),
    ("embed", lambda nnx, r: nnx.Embed(11, 4, rngs=r), lambda m: m(IDS)),
    ("embed_attend", lambda nnx, r: nnx.Embed(11, 8, rngs=r), lambda m: m.attend(X)),
    ("layer_norm", lambda nnx, r: nnx.LayerNorm(8, rngs=r), lambda m: m(X * 3 + 1)),
    ("layer_norm_no_scale", lambda nnx, r: nnx.LayerNorm(8, use_scale=False, epsilon=1e-3, rngs=r),
     lambda m: m(X)),
    ("rms_norm", lambda nnx, r: nnx.RMSNorm(8, rngs=r), lambda m: m(X * 3 + 1)),
    ("dropout", lambda nnx, r: nnx.Dropout(0.5, rngs=r), lambda m: (m(X), m(X))),
    ("dropout_broadcast", lambda nnx, r: nnx.Dropout(0.3, broadcast_dims=(1,), rngs=r), lambda m: m(X)),
    ("attention_causal", lambda nnx, r: nnx.MultiHeadAttention(2, 8, decode=False, rngs=r),
     lambda m: m(X, is_causal=True)),
    ("attention_mask", lambda nnx, r: nnx.MultiHeadAttention(4, 8, 16, 6, decode=False, rngs=r),
     lambda m: m(X, mask=jnp.tril(jnp.ones((5, 5), bool)))),
    ("attention_grouped_query",
     lambda nnx, r: nnx.MultiHeadAttention(4, 8, num_kv_heads=2, decode=False, rngs=r),
     lambda m: m(X, is_causal=True)),
    ("attention_dropout", lambda nnx, r: nnx.MultiHeadAttention(
        2, 8, dropout_rate=0.5, deterministic=False, decode=False, rngs=r), lambda m: m(X)),
    ("sequential",
     lambda nnx, r: nnx.Sequential(nnx.Linear(8, 6, rngs=r), nnx.relu, nnx.Linear(6, 2, rngs=r)),
     lambda m: m(X)),
    ("mlp", _mlp, lambda m: m(X)),
    ("decoder_block", _decoder_block, lambda m: m(IDS)),
]
IDS_ = [case[0] for case in CASES]


def _flat(nnx, state):
    """{path: (variable type name, array)} with typed keys turned into their raw data."""
    flat = {}
    for path, variable in nnx.to_flat_state(state):
        value = variable.get_value()
        if jnp.issubdtype(value.dtype, jax.dtypes.prng_key):
            value = jax.random.key_data(value)
        flat[tuple(path)] = (type(variable).__name__, np.asarray(value))
    return flat


def _pair(build):
    return build(our_nnx, our_nnx.Rngs(0, dropout=1)), build(flax_nnx, flax_nnx.Rngs(0, dropout=1))


@pytest.mark.parametrize("name, build, call", CASES, ids=IDS_)
def test_the_same_seed_gives_the_same_state_tree_bit_for_bit(name, build, call):
    ours, theirs = _pair(build)
    ours_state, their_state = _flat(our_nnx, our_nnx.state(ours)), _flat(flax_nnx, flax_nnx.state(theirs))
    assert list(ours_state) == list(their_state)  # same paths, in the same order
    for path, (kind, value) in their_state.items():
        assert ours_state[path][0] == kind, path
        assert ours_state[path][1].dtype == value.dtype, path
        np.testing.assert_array_equal(ours_state[path][1], value, err_msg=str(path))


@pytest.mark.parametrize("name, build, call", CASES, ids=IDS_)
def test_outputs_agree_to_1e_6(name, build, call):
    ours, theirs = _pair(build)
    for mine, reference in zip(jax.tree.leaves(call(ours)), jax.tree.leaves(call(theirs)), strict=True):
        assert mine.shape == reference.shape and mine.dtype == reference.dtype
        # float32 activations of size ~1: 1e-6 absolute is a few ulps.
        np.testing.assert_allclose(mine, reference, rtol=1e-6, atol=1e-6)
    # Mutations during the call (dropout counters) left the states equal too.
    assert _flat(our_nnx, our_nnx.state(ours)).keys() == _flat(flax_nnx, flax_nnx.state(theirs)).keys()
    for path, (_, value) in _flat(flax_nnx, flax_nnx.state(theirs)).items():
        np.testing.assert_array_equal(_flat(our_nnx, our_nnx.state(ours))[path][1], value)


def _param_gradients(nnx, module, call):
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)

    def loss(params):
        # copy=True: `rest` (dropout counters) comes from outside this trace; see merge's docstring.
        output = call(nnx.merge(graphdef, params, rest, copy=True))
        return sum(jnp.sum(jnp.sin(leaf)) for leaf in jax.tree.leaves(output))

    grads = jax.jit(jax.grad(loss))(params)  # jitted: eager flax ops take seconds here
    return {path: np.asarray(v.get_value()) for path, v in nnx.to_flat_state(grads)}


@pytest.mark.parametrize("name, build, call", [c for c in CASES if not c[0].startswith("dropout")],
                         ids=[i for i in IDS_ if not i.startswith("dropout")])
def test_param_gradients_agree_to_1e_6(name, build, call):
    ours, theirs = _pair(build)
    mine, reference = _param_gradients(our_nnx, ours, call), _param_gradients(flax_nnx, theirs, call)
    assert mine.keys() == reference.keys()
    for path in reference:
        # Sums of up to ~100 float32 products: 1e-5 relative is float32 rounding.
        np.testing.assert_allclose(mine[path], reference[path], rtol=1e-5, atol=1e-6, err_msg=str(path))


def test_a_flax_state_loads_into_our_model_through_pure_dicts():
    ours = _mlp(our_nnx, our_nnx.Rngs(5))
    theirs = _mlp(flax_nnx, flax_nnx.Rngs(0, dropout=1))
    params = flax_nnx.to_pure_dict(flax_nnx.state(theirs, flax_nnx.Param))
    our_params = our_nnx.state(ours, our_nnx.Param)
    our_nnx.replace_by_pure_dict(our_params, params)
    ours.eval()
    theirs.eval()
    np.testing.assert_allclose(ours(X), theirs(X), rtol=1e-6, atol=1e-6)


def test_rng_streams_hand_out_the_same_keys():
    ours, theirs = our_nnx.Rngs(3, dropout=7), flax_nnx.Rngs(3, dropout=7)
    for stream in ["params", "dropout", "default", "params", "noise"]:
        np.testing.assert_array_equal(
            jax.random.key_data(ours[stream]()), jax.random.key_data(theirs[stream]())
        )
    np.testing.assert_array_equal(
        jax.random.key_data(ours.fork().dropout()), jax.random.key_data(theirs.fork().dropout())
    )


# -- sharding metadata: `with_partitioning` attaches the same names in both libraries. Flax
# would also shard each array as it is made (eager sharding, which needs a mesh); we build
# its models with that off, so both hold whole arrays and differ only in what we compare.

def _named(nnx, initializer, *names):
    """`initializer` (a factory in nnx.initializers, by name) with logical names attached."""
    return nnx.with_partitioning(getattr(nnx.initializers, initializer)(), names)


def _named_mlp(nnx, rngs):
    # The shape of chapter 07's classifier (stacklib.parallel.mlp), written once for both.
    class NamedMLP(nnx.Module):
        def __init__(self, *, rngs):
            self.fc1 = nnx.Linear(8, 16, rngs=rngs,
                                  kernel_init=_named(nnx, "lecun_normal", "features", "hidden"),
                                  bias_init=_named(nnx, "zeros_init", "hidden"))
            self.fc2 = nnx.Linear(16, 3, rngs=rngs,
                                  kernel_init=_named(nnx, "lecun_normal", "hidden", "classes"),
                                  bias_init=_named(nnx, "zeros_init", "classes"))

        def __call__(self, x):
            return self.fc2(nnx.relu(self.fc1(x)))

    return NamedMLP(rngs=rngs)


NAMED_CASES = [
    ("mlp", _named_mlp, lambda m: m(X)),
    ("linear_general", lambda nnx, r: nnx.LinearGeneral(
        8, (2, 3), kernel_init=_named(nnx, "lecun_normal", "embed", "heads", "kv"),
        bias_init=_named(nnx, "zeros_init", "heads", "kv"), rngs=r), lambda m: m(X)),
    ("embed", lambda nnx, r: nnx.Embed(11, 4, embedding_init=_named(nnx, "normal", "vocab", "embed"), rngs=r),
     lambda m: m(IDS)),
    ("layer_norm", lambda nnx, r: nnx.LayerNorm(8, scale_init=_named(nnx, "ones_init", "embed"),
                                                bias_init=_named(nnx, "zeros_init", "embed"), rngs=r),
     lambda m: m(X)),
    ("attention", lambda nnx, r: nnx.MultiHeadAttention(
        2, 8, decode=False, kernel_init=_named(nnx, "lecun_normal", "embed", "heads", "kv"),
        out_kernel_init=_named(nnx, "lecun_normal", "heads", "kv", "embed"), rngs=r), lambda m: m(X)),
]
NAMED_IDS = [case[0] for case in NAMED_CASES]


def _named_pair(build):
    with flax_nnx.use_eager_sharding(False):
        theirs = build(flax_nnx, flax_nnx.Rngs(0))
    return build(our_nnx, our_nnx.Rngs(0)), theirs


@pytest.mark.parametrize("name, build, call", NAMED_CASES, ids=NAMED_IDS)
def test_with_partitioning_gives_the_same_metadata_and_weights(name, build, call):
    ours, theirs = _named_pair(build)
    our_vars = dict(our_nnx.to_flat_state(our_nnx.state(ours)))
    their_vars = {tuple(p): v for p, v in flax_nnx.to_flat_state(flax_nnx.state(theirs))}
    assert list(our_vars) == list(their_vars)
    for path, theirs_var in their_vars.items():
        # flax adds required entries (hijax, ref, eager_sharding) to every Variable; we have none.
        assert our_vars[path].get_metadata() == theirs_var.get_metadata(exclude_required=True), path
        np.testing.assert_array_equal(our_vars[path].get_value(), theirs_var.get_value(), err_msg=str(path))
    assert any(v.get_metadata("out_sharding", None) for v in our_vars.values())
    np.testing.assert_allclose(call(ours), call(theirs), rtol=1e-6, atol=1e-6)  # as in the cases above


@pytest.mark.parametrize("name, build, call", NAMED_CASES, ids=NAMED_IDS)
def test_our_names_are_what_flax_get_partition_spec_reads(name, build, call):
    ours, theirs = _named_pair(build)
    specs = jax.tree.leaves(flax_nnx.get_partition_spec(flax_nnx.state(theirs)))
    names = [P(*v.get_metadata("out_sharding", ())) for _, v in our_nnx.to_flat_state(our_nnx.state(ours))]
    assert names == specs
